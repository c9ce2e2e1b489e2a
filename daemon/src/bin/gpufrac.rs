//! gpufrac CLI (foundation stage).
fn main() {}
