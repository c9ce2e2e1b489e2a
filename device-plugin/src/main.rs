//! Kubernetes device plugin (foundation stage).
fn main() {}
