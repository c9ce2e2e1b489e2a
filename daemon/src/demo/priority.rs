//! Act 2, priority: a production burst ends an idle lower-priority holder.

use std::time::Duration;

use super::{Act, ActKind, DemoSummary, Server, SMALL_DEVICE};

/// The second act: a notebook holding burst memory goes idle; a production server at a
/// higher priority needs that memory.
pub(super) fn act() -> Act {
    let notebook = Server {
        limit: "2560MiB",
        resolver: "wait",
        priority: 0,
        ended: true,
        ..Server::new(
            "notebook",
            &["--model", "832MiB", "--keep", "1280MiB", "--steps", "0", "--idle", "120s"],
        )
    };
    let production = Server {
        limit: "2560MiB",
        resolver: "priority",
        priority: 10,
        after: Some(("notebook".into(), "idle", Duration::from_millis(200))),
        ..Server::new(
            "production",
            &["--model", "832MiB", "--batches", "1280MiB", "--steps", "2", "--compute", "30ms"],
        )
    };
    Act {
        kind: ActKind::Priority,
        title: "priority: a production burst ends an idle lower-priority holder",
        story: &[
            "A notebook (priority 0) holds 1280 MiB of burst memory and goes idle. A production server",
            "(priority 10, resolver priority) needs 1280 MiB for its batches: the arbiter ends the notebook.",
        ],
        device_memory: SMALL_DEVICE.into(),
        servers: vec![notebook, production],
    }
}

/// Why the act did not show the priority resolver, if it did not.
pub(super) fn problems(d: &DemoSummary, problems: &mut Vec<String>) {
    if d.terminated == 0 {
        problems.push("no holder was ended for the priority burst".to_owned());
    }
}

/// What the act did, in one line.
pub(super) fn outcome(d: &DemoSummary) -> String {
    format!(
        "{} idle lower-priority holder ended, production served {} batches, {} out-of-memory errors",
        d.terminated, d.batches_served, d.out_of_memory
    )
}
