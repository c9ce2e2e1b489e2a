//! Property tests of the policy (filled in below).
