//! Kubernetes device plugin (in progress).
fn main() {}
