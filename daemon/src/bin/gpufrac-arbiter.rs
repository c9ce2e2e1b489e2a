//! gpufrac-arbiter (foundation stage).
fn main() {}
