//! Prometheus metrics (`--metrics ADDR`): memory per GPU and group, grants, waits and
//! their durations, timeouts, refusals, terminations, swaps (count, bytes, durations). Memory gauges are read from the ledger at each
//! scrape; counters are bumped by the server as things happen.
//!
//! Every label set is bounded by what is registered: GPU series exist only for the GPUs
//! the arbiter manages (the server counts nothing for other device IDs), group series
//! are rebuilt from the ledger at each scrape (a group gone is gone from them), and
//! refusal and termination reasons are a fixed set. A group's series carry the pod its
//! processes declared (`GPUFRAC_POD`) as a `workload_pod` label: one value per group at each
//! scrape (see [`pod_label`]), so the label adds no series, only a name to join on.

use gpufrac_common::protocol::Denial;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::document::{ProcessStatus, Status};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuKind {
    gpu: String,
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GroupKind {
    gpu: String,
    group: String,
    /// The pod its processes declared (`GPUFRAC_POD`, see [`pod_label`]). Not `pod`:
    /// Prometheus's Kubernetes discovery gives every series of a target the label `pod`,
    /// naming the arbiter's own pod, and would rename ours `exported_pod`.
    workload_pod: String,
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct GpuLabel {
    pub gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct SwapLabel {
    pub gpu: String,
    pub direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct Refusal {
    pub reason: String,
}

/// The arbiter's metrics.
pub struct Metrics {
    gpu_memory: Family<GpuKind, Gauge>,
    /// Debts owed to guarantees, paid back, by how (`given_back`, `swapped`, `ended`).
    reclaimed: Family<GpuKind, Counter>,
    group_memory: Family<GroupKind, Gauge>,
    /// Shares of a GPU's time (0 to 1): per GPU `requested` and `outside`; per group
    /// `request`, `limit`, `held` and `allowance`.
    gpu_compute: Family<GpuKind, Gauge<f64, AtomicU64>>,
    group_compute: Family<GroupKind, Gauge<f64, AtomicU64>>,
    pub(crate) grants: Family<GpuLabel, Counter>,
    pub(crate) granted_bytes: Family<GpuLabel, Counter>,
    pub(crate) waits: Family<GpuLabel, Counter>,
    pub(crate) wait_seconds: Family<GpuLabel, Histogram>,
    pub(crate) timeouts: Family<GpuLabel, Counter>,
    pub(crate) refusals: Family<Refusal, Counter>,
    pub(crate) terminations: Family<Refusal, Counter>,
    /// Groups ended by `--enforce-limits end`.
    pub(crate) groups_ended_over_limit: Counter,
    swaps: Family<SwapLabel, Counter>,
    swap_bytes: Family<SwapLabel, Counter>,
    swap_seconds: Family<SwapLabel, Histogram>,
    pub(crate) parks: Family<GpuLabel, Counter>,
    pub(crate) park_bytes: Family<GpuLabel, Counter>,
    pub(crate) park_seconds: Family<GpuLabel, Histogram>,
    pub(crate) wakes: Family<GpuLabel, Counter>,
    pub(crate) wake_seconds: Family<GpuLabel, Histogram>,
    pub(crate) wake_timeouts: Family<GpuLabel, Counter>,
    registry: Registry,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("gpufrac");
        let gpu_memory = Family::<GpuKind, Gauge>::default();
        let reclaimed = Family::<GpuKind, Counter>::default();
        let group_memory = Family::<GroupKind, Gauge>::default();
        let grants = Family::<GpuLabel, Counter>::default();
        let granted_bytes = Family::<GpuLabel, Counter>::default();
        let waits = Family::<GpuLabel, Counter>::default();
        let wait_seconds = Family::<GpuLabel, Histogram>::new_with_constructor(|| {
            Histogram::new([0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0])
        });
        let timeouts = Family::<GpuLabel, Counter>::default();
        let refusals = Family::<Refusal, Counter>::default();
        let terminations = Family::<Refusal, Counter>::default();
        // Every fixed reason starts at 0, so its series exists from the first scrape: a
        // dashboard shows 0 rather than "No data", and `increase()` counts the first event.
        let denials = [
            Denial::Timeout,
            Denial::OverLimit,
            Denial::UnknownDevice,
            Denial::Deadlock,
            Denial::NeverFits,
            Denial::NotSwapped,
        ];
        let refusal_reasons = ["admission", "bad-frame", "connections-per-uid"]
            .into_iter()
            .map(str::to_owned)
            .chain(denials.iter().map(|d| format!("{d:?}")));
        for reason in refusal_reasons {
            let _ = refusals.get_or_create(&Refusal { reason });
        }
        for reason in ["lower-priority", "idle", "guarantee", "over-limit"] {
            let _ = terminations.get_or_create(&Refusal { reason: reason.into() });
        }
        let swaps = Family::<SwapLabel, Counter>::default();
        let swap_bytes = Family::<SwapLabel, Counter>::default();
        let swap_seconds = Family::<SwapLabel, Histogram>::new_with_constructor(|| {
            Histogram::new([0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0])
        });
        registry.register(
            "gpu_memory_bytes",
            "GPU memory: total, guaranteed, burst, free, outside (used by processes not registered), headroom (the rest of the GPU, left unmanaged to processes outside gpufrac), reclaiming (lent memory being taken back for the guarantees), parkable_requests (requests of parkable groups, parked or not); swapped_to_host and parked_to_host are in host RAM",
            gpu_memory.clone(),
        );
        registry.register(
            "reclaimed_bytes",
            "Lent memory taken back for the guarantees since the arbiter started, by how (kind): given_back by borrowers, swapped to host, ended (holders ended once the reclaim grace was over)",
            reclaimed.clone(),
        );
        registry.register(
            "group_memory_bytes",
            "A group's request, limit, held and granted bytes, what it keeps in host RAM (swapped_to_host, parked_to_host), and uncounted: what the device's own count shows it holding beyond what its shims counted (charged to it)",
            group_memory.clone(),
        );
        let gpu_compute = Family::<GpuKind, Gauge<f64, AtomicU64>>::default();
        let group_compute = Family::<GroupKind, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "gpu_compute_share",
            "Shares of a GPU's time (0 to 1): requested (sum of the compute requests); open (1 while the GPU is open to one group, no leases)",
            gpu_compute.clone(),
        );
        registry.register(
            "group_compute_share",
            "A group's compute request, limit, held (the share of the last second it held the GPU's lease) and allowance (its planned part of a lease period now), 0 to 1",
            group_compute.clone(),
        );
        registry.register("grants", "Burst grants", grants.clone());
        registry.register("granted_bytes", "Bytes granted as bursts", granted_bytes.clone());
        registry.register("waits", "Bursts that had to wait", waits.clone());
        registry.register("wait_seconds", "How long waiting bursts waited", wait_seconds.clone());
        registry.register("timeouts", "Bursts that waited until their timeout", timeouts.clone());
        registry.register("refusals", "Registrations and bursts refused", refusals.clone());
        registry.register(
            "terminations",
            "Processes ended by the arbiter, by reason: lower-priority or idle (priority bursts), guarantee (loans taken back), over-limit (past the limit by the device's count, enforce-limits end)",
            terminations.clone(),
        );
        let groups_ended_over_limit = Counter::default();
        registry.register(
            "groups_ended_over_limit",
            "Groups ended for being past their limit by the device's own count (memory held beyond what their shims counted) for the grace (arbiter flags enforce-limits end, enforce-grace)",
            groups_ended_over_limit.clone(),
        );
        registry.register("swaps", "Swaps of burst memory to host RAM (out) and back (in)", swaps.clone());
        registry.register("swap_bytes", "Bytes moved by swaps, by direction", swap_bytes.clone());
        registry.register("swap_seconds", "How long swaps took, by direction", swap_seconds.clone());
        let parks = Family::<GpuLabel, Counter>::default();
        let park_bytes = Family::<GpuLabel, Counter>::default();
        let wakes = Family::<GpuLabel, Counter>::default();
        let wake_timeouts = Family::<GpuLabel, Counter>::default();
        let park_seconds = Family::<GpuLabel, Histogram>::new_with_constructor(|| {
            Histogram::new([0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0])
        });
        let wake_seconds = Family::<GpuLabel, Histogram>::new_with_constructor(|| {
            Histogram::new([0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0])
        });
        registry.register(
            "parks",
            "Members of idle parkable groups parked (memory moved to host RAM)",
            parks.clone(),
        );
        registry.register("park_bytes", "Bytes moved to host RAM by parks", park_bytes.clone());
        registry.register("park_seconds", "How long parks took", park_seconds.clone());
        registry.register("wakes", "Parked members woken", wakes.clone());
        registry.register(
            "wake_seconds",
            "How long wakes took, from the call that waited to its memory back (waiting for room included)",
            wake_seconds.clone(),
        );
        registry.register("wake_timeouts", "Wakes refused after GPUFRAC_WAIT_TIMEOUT", wake_timeouts.clone());
        Metrics {
            parks,
            park_bytes,
            park_seconds,
            wakes,
            wake_seconds,
            wake_timeouts,
            swaps,
            swap_bytes,
            swap_seconds,
            gpu_memory,
            reclaimed,
            group_memory,
            gpu_compute,
            group_compute,
            grants,
            granted_bytes,
            waits,
            wait_seconds,
            timeouts,
            refusals,
            terminations,
            groups_ended_over_limit,
            registry,
        }
    }

    /// Makes every per-GPU counter and histogram of `gpu` exist, at 0 until something
    /// happens: the series a dashboard queries are there from the first scrape of a fresh
    /// arbiter (zeros, not "No data"), and `increase()` counts the first event. Called for
    /// the GPUs the arbiter manages only, so the series stay per GPU.
    fn start_at_zero(&self, gpu: &str) {
        let label = GpuLabel { gpu: gpu.to_owned() };
        for counter in [
            &self.grants,
            &self.granted_bytes,
            &self.waits,
            &self.timeouts,
            &self.parks,
            &self.park_bytes,
            &self.wakes,
            &self.wake_timeouts,
        ] {
            let _ = counter.get_or_create(&label);
        }
        for histogram in [&self.wait_seconds, &self.park_seconds, &self.wake_seconds] {
            let _ = histogram.get_or_create(&label);
        }
        for direction in ["out", "in"] {
            let label = SwapLabel { gpu: gpu.to_owned(), direction: direction.to_owned() };
            let _ = self.swaps.get_or_create(&label);
            let _ = self.swap_bytes.get_or_create(&label);
            let _ = self.swap_seconds.get_or_create(&label);
        }
    }

    /// Counts one swap of `bytes` that took `took`, `direction` `out` or `in`.
    pub(crate) fn count_swap(&self, gpu: &GpuLabel, direction: &str, bytes: u64, took: std::time::Duration) {
        let label = SwapLabel { gpu: gpu.gpu.clone(), direction: direction.to_owned() };
        self.swaps.get_or_create(&label).inc();
        self.swap_bytes.get_or_create(&label).inc_by(bytes);
        self.swap_seconds.get_or_create(&label).observe(took.as_secs_f64());
    }

    /// The text exposition, with memory gauges taken from `status`.
    pub fn render(&self, status: &Status) -> String {
        self.gpu_memory.clear();
        self.group_memory.clear();
        self.gpu_compute.clear();
        self.group_compute.clear();
        let ratio = |per_mille: u32| f64::from(per_mille) / 1000.0;
        for g in &status.gpus {
            self.start_at_zero(&g.uuid);
            if g.compute_requested_pm > 0 || g.processes.iter().any(|p| p.compute_limit_pm > 0) {
                for (kind, v) in
                    [("requested", g.compute_requested_pm), ("open", u32::from(g.compute_open) * 1000)]
                {
                    self.gpu_compute
                        .get_or_create(&GpuKind { gpu: g.uuid.clone(), kind: kind.into() })
                        .set(ratio(v));
                }
            }
            for (kind, v) in [
                ("total", g.total),
                ("guaranteed", g.guaranteed),
                ("burst", g.burst),
                ("free", g.free),
                ("outside", g.outside),
                ("headroom", g.headroom),
                ("reclaiming", g.reclaiming),
                ("swapped_to_host", g.swapped),
                ("parked_to_host", g.parked),
                ("parkable_requests", g.parkable_requests),
            ] {
                self.gpu_memory
                    .get_or_create(&GpuKind { gpu: g.uuid.clone(), kind: kind.into() })
                    .set(gauge(v));
            }
            for (kind, v) in [
                ("given_back", g.repaid_given_back),
                ("swapped", g.repaid_swapped),
                ("ended", g.repaid_ended),
            ] {
                // The arbiter's totals only grow: the counter catches up with them.
                let counter =
                    self.reclaimed.get_or_create(&GpuKind { gpu: g.uuid.clone(), kind: kind.into() });
                counter.inc_by(v.saturating_sub(counter.get()));
            }
            // Series are per group as the ledger keys it, so tenants never merge: two users
            // naming one group, a derived group and a host client naming its own group
            // after it, processes that are not entitled (each a group of its own).
            type Sums = (u64, u64, u64, u64, u64, u64, u64);
            let mut groups: std::collections::BTreeMap<String, (&ProcessStatus, Sums)> = Default::default();
            for p in &g.processes {
                let key = group_key(p);
                // Request, limit and uncounted are the group's, the same for every member.
                let e = groups.entry(key).or_insert((p, (p.request, p.limit, 0, 0, 0, 0, p.uncounted)));
                e.1 .2 = e.1 .2.saturating_add(p.held);
                e.1 .3 = e.1 .3.saturating_add(p.granted);
                e.1 .4 = e.1 .4.saturating_add(p.host_bytes);
                e.1 .5 = e.1 .5.saturating_add(p.parked_bytes);
            }
            let mut keys_of: std::collections::HashMap<&str, usize> = Default::default();
            for (_, (p, _)) in groups.iter() {
                *keys_of.entry(p.group.as_str()).or_default() += 1;
            }
            if groups.is_empty() {
                // A GPU without groups: one series per kind with no group (Prometheus reads
                // the empty label as absent), at 0, so the group panels show zeros rather
                // than "No data". Per GPU, and gone once a group is there.
                for kind in GROUP_MEMORY_KINDS {
                    let labels = GroupKind {
                        gpu: g.uuid.clone(),
                        group: String::new(),
                        workload_pod: String::new(),
                        kind: kind.into(),
                    };
                    self.group_memory.get_or_create(&labels).set(0);
                }
            }
            for (key, (p, (request, limit, held, granted, host, parked, uncounted))) in &groups {
                let group = group_label(key, &p.group, keys_of[p.group.as_str()] > 1);
                let pod =
                    pod_label(g.processes.iter().filter(|m| group_key(m) == *key).map(|m| m.pod.as_str()));
                let (request, limit, held, granted, host) = (*request, *limit, *held, *granted, *host);
                let values = [request, limit, held, granted, host, *parked, *uncounted];
                for (kind, v) in GROUP_MEMORY_KINDS.into_iter().zip(values) {
                    let labels = GroupKind {
                        gpu: g.uuid.clone(),
                        group: group.clone(),
                        workload_pod: pod.clone(),
                        kind: kind.into(),
                    };
                    self.group_memory.get_or_create(&labels).set(gauge(v));
                }
                if p.compute_limit_pm > 0 {
                    for (kind, v) in [
                        ("request", p.compute_request_pm),
                        ("limit", p.compute_limit_pm),
                        ("held", p.compute_held_pm),
                        ("allowance", p.compute_allowance_pm),
                    ] {
                        let labels = GroupKind {
                            gpu: g.uuid.clone(),
                            group: group.clone(),
                            workload_pod: pod.clone(),
                            kind: kind.into(),
                        };
                        self.group_compute.get_or_create(&labels).set(ratio(v));
                    }
                }
            }
        }
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The kinds of `gpufrac_group_memory_bytes`, in the order `render` gives their values.
const GROUP_MEMORY_KINDS: [&str; 7] =
    ["request", "limit", "held", "granted", "swapped_to_host", "parked_to_host", "uncounted"];

/// The key a process's group is kept under in the ledger (the status's `group_key`, or
/// for a status without one, its user and group name).
fn group_key(p: &ProcessStatus) -> String {
    if p.group_key.is_empty() {
        format!("{}/{}", p.uid, p.group)
    } else {
        p.group_key.clone()
    }
}

/// The `workload_pod` label of a group whose processes declared `pods` (`GPUFRAC_POD`, empty when
/// unset): the pod they name; empty when none names one (Prometheus reads an empty label
/// as absent); `(several)` when they name different ones, which a process may do outside
/// Kubernetes, where the pod is what the process says (a pod has no parentheses, so this
/// is never a pod's name). One value per group: the label never multiplies its series.
fn pod_label<'a>(pods: impl Iterator<Item = &'a str>) -> String {
    let mut named = pods.filter(|pod| !pod.is_empty());
    let Some(first) = named.next() else { return String::new() };
    if named.all(|pod| pod == first) {
        first.to_owned()
    } else {
        "(several)".to_owned()
    }
}

/// The `group` label of the group with ledger key `key`, shown as `shown`: a derived group
/// (`@name`) is its name; a client's own group (`<uid>/<name>`) its name, with its user
/// where another group is shown under that name too; a process that is not entitled
/// (`<uid>:<pid>/<name>`, a group of its own) always says so: `name (uid U, pid P)`.
/// Group names have no spaces nor parentheses, so a qualified label is never a name.
fn group_label(key: &str, shown: &str, shared_name: bool) -> String {
    if key.starts_with('@') {
        return shown.to_owned();
    }
    let owner = key.split_once('/').map_or("", |(owner, _)| owner);
    match owner.split_once(':') {
        Some((uid, pid)) => format!("{shown} (uid {uid}, pid {pid})"),
        None if shared_name => format!("{shown} (uid {owner})"),
        None => shown.to_owned(),
    }
}

/// A gauge's value: prometheus-client's gauges are `i64`, so bytes past `i64::MAX` (a
/// report of 2^63 bytes or more) show as the largest value rather than as negative.
fn gauge(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// Serves `GET /metrics` on `listener`; `status` gives the ledger's state at each scrape.
pub async fn serve(
    listener: TcpListener,
    metrics: std::sync::Arc<Metrics>,
    status: impl Fn() -> Status + Send + Sync + Clone + 'static,
) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else { continue };
        let (metrics, status) = (metrics.clone(), status.clone());
        tokio::spawn(async move {
            // Read the request head (bounded), answer, close.
            let mut head = Vec::with_capacity(1024);
            let mut buf = [0u8; 1024];
            let read = tokio::time::timeout(std::time::Duration::from_secs(5), async {
                while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
            })
            .await;
            if read.is_err() {
                return;
            }
            let line = String::from_utf8_lossy(&head);
            let response = if line.starts_with("GET /metrics ") || line.starts_with("GET /metrics?") {
                let body = metrics.render(&status());
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                )
            } else {
                "HTTP/1.1 404 Not Found\r\nContent-Length: 22\r\nConnection: close\r\n\r\nonly GET /metrics here".to_owned()
            };
            let _ = stream.write_all(response.as_bytes()).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arbiter::document::GpuStatus;

    /// The sample lines of `text` whose name starts with the family `name` (its `_total`,
    /// `_bucket`, ...).
    fn samples<'a>(text: &'a str, name: &str) -> Vec<&'a str> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with(['_', '{', ' '])))
            .collect()
    }

    #[test]
    fn a_fresh_arbiter_has_every_series_per_gpu_at_zero() {
        let gpu = |uuid: &str| GpuStatus { uuid: uuid.into(), total: 1 << 30, ..GpuStatus::default() };
        let status = Status { gpus: vec![gpu("GPU-1"), gpu("GPU-2")], swap_limit: 0 };
        let text = Metrics::new().render(&status);
        let families: Vec<(&str, &str)> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE gpufrac_"))
            .filter_map(|l| l.split_once(' '))
            .collect();
        assert!(families.len() >= 20, "{text}");
        for (name, kind) in families {
            // Compute shares are shown only where compute shares are in use.
            if name.ends_with("compute_share") {
                continue;
            }
            let samples = samples(&text, &format!("gpufrac_{name}"));
            assert!(!samples.is_empty(), "gpufrac_{name} has no series:\n{text}");
            let per_gpu = samples.iter().any(|s| s.contains("gpu=\""));
            for uuid in ["GPU-1", "GPU-2"] {
                let gpu = format!("gpu=\"{uuid}\"");
                assert!(
                    !per_gpu || samples.iter().any(|s| s.contains(&gpu)),
                    "gpufrac_{name} has no series for {uuid}:\n{text}"
                );
            }
            if kind == "counter" || kind == "histogram" {
                assert!(
                    samples.iter().all(|s| matches!(s.rsplit(' ').next(), Some("0" | "0.0"))),
                    "gpufrac_{name} is not 0:\n{text}"
                );
            }
        }
        for direction in ["out", "in"] {
            let series = format!(r#"gpufrac_swaps_total{{gpu="GPU-2",direction="{direction}"}} 0"#);
            assert!(text.contains(&series), "{series} missing:\n{text}");
        }
        // The groups' zeros are per GPU and kind, without a group.
        let held: Vec<&str> = text.lines().filter(|l| l.contains(r#"kind="held""#)).collect();
        assert_eq!(held.len(), 2, "{held:?}");
        assert!(held.iter().all(|l| l.contains(r#"group="""#) && l.ends_with(" 0")), "{held:?}");
        // Once a GPU has a group, its group-less series are gone.
        let mut busy = status.clone();
        busy.gpus[0].processes =
            vec![ProcessStatus { group: "g".into(), held: 5, ..ProcessStatus::default() }];
        let text = Metrics::new().render(&busy);
        let held: Vec<&str> = text.lines().filter(|l| l.contains(r#"kind="held""#)).collect();
        assert_eq!(held.len(), 2, "{held:?}");
        assert!(held.iter().any(|l| l.contains(r#"gpu="GPU-1",group="g""#) && l.ends_with(" 5")), "{held:?}");
        assert!(held.iter().any(|l| l.contains(r#"gpu="GPU-2",group="""#)), "{held:?}");
    }

    #[test]
    fn loans_taken_back_for_guarantees_are_counted_by_how() {
        let metrics = Metrics::new();
        let status = |given_back| Status {
            gpus: vec![GpuStatus {
                uuid: "GPU-1".into(),
                repaid_given_back: given_back,
                repaid_ended: 7,
                ..GpuStatus::default()
            }],
            swap_limit: 0,
        };
        let text = metrics.render(&status(5));
        assert!(text.contains("# TYPE gpufrac_reclaimed_bytes counter"), "{text}");
        assert!(text.contains(r#"gpufrac_reclaimed_bytes_total{gpu="GPU-1",kind="given_back"} 5"#), "{text}");
        assert!(text.contains(r#"gpufrac_reclaimed_bytes_total{gpu="GPU-1",kind="ended"} 7"#), "{text}");
        // Rendered again with more given back: the counter follows the total, once.
        let text = metrics.render(&status(9));
        assert!(text.contains(r#"gpufrac_reclaimed_bytes_total{gpu="GPU-1",kind="given_back"} 9"#), "{text}");
        assert!(text.contains(r#"gpufrac_reclaimed_bytes_total{gpu="GPU-1",kind="ended"} 7"#), "{text}");
    }

    #[test]
    fn bytes_past_i64_max_show_as_the_largest_gauge_not_negative() {
        let status = Status {
            gpus: vec![GpuStatus {
                uuid: "GPU-1".into(),
                total: u64::MAX,
                processes: vec![ProcessStatus {
                    group: "g".into(),
                    held: 1 << 63,
                    ..ProcessStatus::default()
                }],
                ..GpuStatus::default()
            }],
            swap_limit: 0,
        };
        let text = Metrics::new().render(&status);
        assert!(!text.contains(" -"), "{text}");
        assert!(text.contains(r#"kind="total"} 9223372036854775807"#), "{text}");
        assert!(text.contains(r#"kind="held"} 9223372036854775807"#), "{text}");
    }

    #[test]
    fn two_users_naming_one_group_have_two_series() {
        let p = |uid, held| ProcessStatus { uid, group: "g".into(), held, ..ProcessStatus::default() };
        let status = Status {
            gpus: vec![GpuStatus {
                uuid: "GPU-1".into(),
                processes: vec![p(0, 1), p(7, 2), p(7, 3)],
                ..GpuStatus::default()
            }],
            swap_limit: 0,
        };
        let text = Metrics::new().render(&status);
        assert!(text.contains(r#"group="g (uid 0)",workload_pod="",kind="held"} 1"#), "{text}");
        assert!(text.contains(r#"group="g (uid 7)",workload_pod="",kind="held"} 5"#), "{text}");
        let alone = Status {
            gpus: vec![GpuStatus { processes: vec![p(7, 2)], ..status.gpus[0].clone() }],
            swap_limit: 0,
        };
        assert!(Metrics::new().render(&alone).contains(r#"group="g",workload_pod="",kind="held"} 2"#));
    }

    #[test]
    fn groups_shown_under_one_name_never_merge() {
        let p = |key: &str, uid, held| ProcessStatus {
            uid,
            group: crate::entitlement::shown_group(key).to_owned(),
            group_key: key.into(),
            held,
            ..ProcessStatus::default()
        };
        let status = Status {
            gpus: vec![GpuStatus {
                uuid: "GPU-1".into(),
                processes: vec![
                    // A pod's derived group, and a host client of root naming its own after it.
                    p("@k8s-0f3c-c", 0, 1),
                    p("@k8s-0f3c-c", 0, 2),
                    p("0/k8s-0f3c-c", 0, 4),
                    // Two processes of one user that are not entitled: a group each.
                    p("1000:41/a", 1000, 8),
                    p("1000:42/a", 1000, 16),
                    // The same user's own group of that name, apart from both.
                    p("1000/b", 1000, 32),
                ],
                ..GpuStatus::default()
            }],
            swap_limit: 0,
        };
        let text = Metrics::new().render(&status);
        for series in [
            r#"group="k8s-0f3c-c",workload_pod="",kind="held"} 3"#,
            r#"group="k8s-0f3c-c (uid 0)",workload_pod="",kind="held"} 4"#,
            r#"group="a (uid 1000, pid 41)",workload_pod="",kind="held"} 8"#,
            r#"group="a (uid 1000, pid 42)",workload_pod="",kind="held"} 16"#,
            r#"group="b",workload_pod="",kind="held"} 32"#,
        ] {
            assert!(text.contains(series), "{series} missing:\n{text}");
        }
    }

    #[test]
    fn a_groups_series_name_the_pod_its_processes_declared() {
        let p = |pid, group: &str, pod: &str| ProcessStatus {
            pid,
            group: group.into(),
            pod: pod.into(),
            held: 1,
            ..ProcessStatus::default()
        };
        let status = Status {
            gpus: vec![GpuStatus {
                uuid: "GPU-1".into(),
                processes: vec![
                    p(1, "web", "prod/web-0"),
                    p(2, "web", "prod/web-0"),
                    p(3, "batch", ""),
                    p(4, "mixed", "a/one"),
                    p(5, "mixed", ""),
                    p(6, "mixed", "b/two"),
                ],
                ..GpuStatus::default()
            }],
            swap_limit: 0,
        };
        let text = Metrics::new().render(&status);
        for series in [
            r#"group="web",workload_pod="prod/web-0",kind="held"} 2"#,
            r#"group="web",workload_pod="prod/web-0",kind="request"} 0"#,
            r#"group="batch",workload_pod="",kind="held"} 1"#,
            r#"group="mixed",workload_pod="(several)",kind="held"} 3"#,
        ] {
            assert!(text.contains(series), "{series} missing:\n{text}");
        }
        // One value per group: the label adds no series.
        assert_eq!(text.matches(r#"kind="held""#).count(), 3, "{text}");
    }
}
