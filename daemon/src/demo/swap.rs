//! Act 3, swap: two servers take turns with the same memory, a sleeping holder's cache
//! moved to host RAM and back, verified intact at the end.

use std::time::Duration;

use super::{Act, ActKind, DemoSummary, Server, SMALL_DEVICE};

/// The third act: chat-a keeps a cache and sleeps; chat-b needs that memory.
pub(super) fn act() -> Act {
    let sleeper = Server {
        resolver: "swap",
        limit: "2560MiB",
        ..Server::new("chat-a", &["--model", "832MiB", "--keep", "1280MiB", "--steps", "0", "--idle", "10s"])
    };
    let busy = Server {
        resolver: "swap",
        limit: "2560MiB",
        // At once: chat-b's burst waits out chat-a's quantum if it comes sooner, and a
        // slow start of chat-b (a loaded machine) still finds chat-a asleep.
        after: Some(("chat-a".into(), "idle", Duration::from_millis(200))),
        ..Server::new(
            "chat-b",
            &["--model", "832MiB", "--batches", "1280MiB", "--steps", "3", "--compute", "30ms"],
        )
    };
    Act {
        kind: ActKind::Swap,
        title: "swap: two servers take turns with the same memory",
        story: &[
            "chat-a keeps a 1280 MiB KV cache and sleeps. chat-b needs 1280 MiB for its batches: the arbiter",
            "has chat-a's cache moved to host RAM (same addresses, nothing lost) and chat-b runs. The cache",
            "comes back when memory is free again (should chat-a need it sooner, the two take turns, 2 s each:",
            "--swap-quantum); chat-a verifies every byte of its cache at the end.",
        ],
        device_memory: SMALL_DEVICE.into(),
        servers: vec![sleeper, busy],
    }
}

/// Why the act did not show the swap resolver, if it did not.
pub(super) fn problems(d: &DemoSummary, problems: &mut Vec<String>) {
    if d.swapped_out == 0 || d.swapped_in == 0 {
        problems.push(format!(
            "nothing was swapped out and back in ({} out, {} in)",
            d.swapped_out, d.swapped_in
        ));
    }
    if d.kept_intact < d.kept_expected {
        problems.push(format!("{} of {} kept caches verified intact", d.kept_intact, d.kept_expected));
    }
}

/// What the act did, in one line.
pub(super) fn outcome(d: &DemoSummary) -> String {
    format!(
        "{} swapped out and {} back in, chat-b served {} batches, {} of {} kept caches verified intact, {} out-of-memory errors",
        d.swapped_out, d.swapped_in, d.batches_served, d.kept_intact, d.kept_expected, d.out_of_memory
    )
}
