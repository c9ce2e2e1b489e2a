//! Act 1, wait: servers whose bursts collide wait for each other (and its bare run, the
//! same servers without gpufrac, to compare). Its GPU is sized from the number of servers
//! so that only some bursts fit at once.

use gpufrac_common::size::format_size;

use super::{Act, ActKind, DemoConfig, DemoError, DemoSummary, Server, GIB, MIB};

/// The fewest servers of the first act: bursts wait for each other only when two collide.
pub const MIN_SERVERS: usize = 2;
/// The most servers of the first act.
pub const MAX_SERVERS: usize = 16;
/// What each server of the first act is guaranteed (GPUFRAC_MEMORY_REQUEST).
const REQUEST: u64 = 1088 * MIB;
/// What each server of the first act may burst to (GPUFRAC_MEMORY_LIMIT).
const LIMIT: u64 = 2176 * MIB;
/// Room the largest burst of the first act needs beside every request (a 1 GiB batch).
const LARGEST_BURST: u64 = GIB;
/// Memory no request reserves, when the device is sized from `--servers`: one 1 GiB
/// burst and one 256 MiB burst at a time, so that the others wait.
const SPARE: u64 = 1344 * MIB;

/// The memory of the first act's GPU sized for `servers`: their requests, one 1 GiB
/// burst and one 256 MiB burst (4.5 GiB for 3 servers).
pub fn device_memory_for(servers: usize) -> u64 {
    servers as u64 * REQUEST + SPARE
}

/// The memory of the first act's GPU: `device_memory` if given, else sized from
/// `servers`; refuses at once what cannot show bursts waiting for each other, with a hint.
pub fn first_act_device(servers: usize, device_memory: Option<&str>) -> Result<u64, DemoError> {
    if !(MIN_SERVERS..=MAX_SERVERS).contains(&servers) {
        let hint = if servers < MIN_SERVERS {
            " (hint: bursts wait for each other only when two servers collide)"
        } else {
            ""
        };
        return Err(DemoError::Impossible(format!(
            "--servers must be between {MIN_SERVERS} and {MAX_SERVERS}, not {servers}{hint}"
        )));
    }
    let sized = device_memory_for(servers);
    let Some(given) = device_memory else { return Ok(sized) };
    let device = gpufrac_common::parse_bytes("--device-memory", given)
        .map_err(|e| DemoError::Impossible(e.to_string()))?;
    let requests = servers as u64 * REQUEST;
    let hint =
        format!("or leave --device-memory out to size it for {servers} servers ({})", format_size(sized));
    if device < requests + LARGEST_BURST {
        return Err(DemoError::Impossible(format!(
            "--device-memory {given} is too small for {servers} servers: their requests take {servers} × {} = {} \
             and a 1 GiB batch needs {} beside them (hint: give at least {}, {hint})",
            format_size(REQUEST),
            format_size(requests),
            format_size(LARGEST_BURST),
            format_size(requests + LARGEST_BURST),
        )));
    }
    if device >= servers as u64 * LIMIT {
        return Err(DemoError::Impossible(format!(
            "--device-memory {given} is too large for {servers} servers: all of them fit at their limit ({}) \
             at once, so no burst would ever wait (hint: give less than {}, {hint})",
            format_size(LIMIT),
            format_size(servers as u64 * LIMIT),
        )));
    }
    Ok(device)
}

/// The first act, on a GPU of `device` bytes (bare, to compare, without the arbiter).
pub(super) fn act(config: &DemoConfig, device: u64) -> Act {
    let steps = config.steps.to_string();
    let mut first = Act {
        kind: ActKind::Wait,
        title: "wait: colliding bursts wait for each other",
        story: &[
            "Each server loads a 768 MiB model, then serves batches whose activations swing between 256 MiB",
            "and 1 GiB. Each is guaranteed 1088 MiB (request) and may burst to 2176 MiB (limit); the arbiter",
            "lends what no request reserves, and a burst that collides waits until memory is given back.",
        ],
        device_memory: format!("{}MiB", device.div_ceil(MIB)),
        servers: Vec::new(),
    };
    if !config.arbiter {
        first.kind = ActKind::Bare;
        first.title = "without gpufrac: first come, first served";
        first.story = &["The same servers, bare: a colliding burst is an out-of-memory error."];
    }
    for i in 0..config.servers {
        let batches = ["256MiB,1GiB,512MiB", "512MiB,256MiB,1GiB", "1GiB,512MiB,256MiB"][i % 3];
        first.servers.push(Server::new(
            &format!("server-{}", i + 1),
            &["--model", "768MiB", "--steps", &steps, "--batches", batches, "--compute", "30ms"],
        ));
    }
    first
}

/// Why the act did not show bursts waiting for each other, if it did not.
pub(super) fn problems(d: &DemoSummary, problems: &mut Vec<String>) {
    if d.granted_after_wait == 0 {
        problems.push("no burst waited and was granted: the bursts never collided".to_owned());
    }
    if d.denied > 0 {
        problems.push(format!("{} bursts timed out waiting", d.denied));
    }
}

/// What the act did, in one line.
pub(super) fn outcome(d: &DemoSummary) -> String {
    format!(
        "{} batches served, {} bursts waited and were granted, {} denied, {} out-of-memory errors",
        d.batches_served, d.granted_after_wait, d.denied, d.out_of_memory
    )
}

/// What the bare run did, in one line.
pub(super) fn bare_outcome(d: &DemoSummary) -> String {
    format!("{} batches served, {} out-of-memory errors", d.batches_served, d.out_of_memory)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_device_is_sized_from_the_servers() {
        assert_eq!(device_memory_for(3), 4608 * MIB, "the 4.5 GiB of the default");
        assert_eq!(first_act_device(5, None).expect("sized"), 5 * 1088 * MIB + 1344 * MIB);
        for n in MIN_SERVERS..=MAX_SERVERS {
            let sized = first_act_device(n, None).expect("sized");
            // Every request fits with room for the largest burst, and not all at their limit.
            assert!(sized >= n as u64 * REQUEST + LARGEST_BURST && sized < n as u64 * LIMIT, "{n}");
        }
        assert_eq!(first_act_device(5, Some("7GiB")).expect("given"), 7 * GIB);
    }

    #[test]
    fn impossible_combinations_are_refused_with_a_hint() {
        let err = first_act_device(5, Some("4.5GiB")).unwrap_err().to_string();
        assert!(err.contains("too small for 5 servers") && err.contains("at least 6.31 GiB"), "{err}");
        assert!(err.contains("leave --device-memory out"), "{err}");
        let err = first_act_device(3, Some("16GiB")).unwrap_err().to_string();
        assert!(err.contains("too large") && err.contains("no burst would ever wait"), "{err}");
        for n in [0, 1] {
            let err = first_act_device(n, None).unwrap_err().to_string();
            assert!(
                err.contains("--servers must be between 2 and 16") && err.contains("two servers collide"),
                "{err}"
            );
        }
        let err = first_act_device(MAX_SERVERS + 1, None).unwrap_err().to_string();
        assert!(err.contains("--servers must be between 2 and 16, not 17"), "{err}");
        let err = first_act_device(3, Some("lots")).unwrap_err().to_string();
        assert!(err.contains("--device-memory"), "{err}");
    }
}
