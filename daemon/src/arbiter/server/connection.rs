//! What the server knows of one connection: who is on it (from the kernel), what it
//! declared and has said so far, and its count against its UID. The session and the
//! request handlers both take these types, so they live apart from either.

use std::sync::Arc;

use gpufrac_common::ComputeSpec;

use super::Shared;
use crate::arbiter::policy::ConnId;

/// Who is on a connection, from the kernel.
#[derive(Debug, Clone, Copy)]
pub(super) struct Who {
    pub(super) conn: ConnId,
    pub(super) pid: u32,
    pub(super) uid: u32,
    pub(super) gid: u32,
}

/// What a client declared at `Hello`, kept to apply a later verdict to.
pub(super) struct Declared {
    pub(super) group: String,
    pub(super) resolver: gpufrac_common::Resolver,
    pub(super) priority: i32,
    pub(super) compute: Option<ComputeSpec>,
}

/// Counts a connection against its UID until dropped.
pub(super) struct Counted {
    pub(super) shared: Arc<Shared>,
    pub(super) who: Who,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.shared.admissions.leave(self.who);
    }
}

/// What one connection has said so far.
pub(super) struct Connection {
    pub(super) who: Who,
    /// Said `Hello`.
    pub(super) greeted: bool,
    /// Registered on a GPU at least once.
    pub(super) registered: bool,
    /// What it may have, asked when its `Hello` came (and again before a registration
    /// while it is unknown).
    pub(super) verdict: Option<crate::entitlement::Verdict>,
    /// What it declared at `Hello`.
    pub(super) hello: Option<Declared>,
    /// A cut registration was logged already (once per connection).
    pub(super) capped_logged: bool,
    /// May see every tenant in `gpufrac status` (root or `--admin-group`).
    pub(super) admin: bool,
    /// Its verdict was looked up again and answered: what it declared is believed again
    /// at its registration.
    pub(super) believe_again: bool,
}

/// Whether a connection goes on after a frame.
pub(super) enum Flow {
    /// Read the next frame.
    Continue,
    /// Close it (the reply to `Status` was its last).
    Close,
}
