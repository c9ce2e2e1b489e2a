//! The admission webhook (in progress).
