//! cuda
