//! nvml
