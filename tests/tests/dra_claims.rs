//! Prepared DRA claims through a node's life, end to end: the real
//! `gpufrac-device-plugin dra` on simgpu, driven by the kubelet stand-in (a claim prepared
//! once per node, a reboot that empties the CDI folder) and the API-server stand-in, on a
//! node of the harness (`gpufrac_e2e::dra_node`).
//!
//! - A reboot: the kubelet prepares its claims again with the CDI folder (a tmpfs) empty;
//!   the plugin answers from its checkpoint and writes each spec again, so the returned
//!   CDI ID resolves. A plugin started on a node whose CDI folder lost its specs writes
//!   them again before the kubelet asks.
//! - The CDI spec declares the smallest version it needs; sub-request names reach the
//!   kubelet as their parent request.
//! - A shared claim: a second pod joins the claim's `reservedFor` without the plugin being
//!   asked; the plugin's checkpoint follows, and the arbiter entitles the second pod's
//!   process to the claim; a pod removed from `reservedFor` loses it.
//! - Stale claims (deleted, replaced, no longer allocated to this node) are unprepared
//!   after a second check; a claim still allocated here stays.

use std::path::Path;

use gpufrac_e2e::dra_node::{
    allocated_claim_json, cdi_env, consumed_result, read_json, registered_process, reserved_for, wait_until,
    DraNode, DRIVER, WAIT,
};
use gpufrac_e2e::kube_standins::ClaimName;
use gpufrac_e2e::pod_cgroup::PodCgroup;
use gpufrac_e2e::{skip_on_real_gpu, ChildProcess, SimGpu};
use serde_json::{json, Value};

const GIB: u64 = 1 << 30;
const NODE: &str = "node-b";
/// Starts with a digit: its CDI device names need CDI 0.5.0.
const CLAIM_UID: &str = "1e4d3b0f-1111-4222-8333-444455556666";
/// Starts with a letter: its spec needs nothing past CDI 0.3.0.
const LETTER_UID: &str = "ae4d3b0f-2222-4222-8333-444455556666";
const POD_UID: &str = "8b2c3d4e-0000-4000-8000-000000000001";
const POD2_UID: &str = "8b2c3d4e-0000-4000-8000-000000000002";
const SIMULATED: &str = "sizes claims to simgpu's devices";

/// The node of these tests, with one simulated GPU of 16 GiB.
async fn node() -> DraNode {
    DraNode::new(NODE, SimGpu::new("16GiB").with_context_overhead("64MiB")).await
}

/// A claim allocated `memory` of `gpu-0` on this node for the request `request` (`gpu`, or
/// a sub-request `gpu/small`), limit 4Gi, reserved for the pods `pods` (name, UID).
fn claim(name: &str, uid: &str, request: &str, memory: &str, pods: &[(&str, &str)]) -> Value {
    let parameters = json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": "4Gi"});
    let spec = json!({"requests": [{"name": "gpu", "firstAvailable": [
        {"name": "small", "deviceClassName": DRIVER}]}]});
    let results = vec![consumed_result(NODE, request, "gpu-0", memory)];
    allocated_claim_json(NODE, name, uid, spec, results, &parameters, pods)
}

/// Starts the plugin and registers it with the node's kubelet.
async fn start_registered(node: &DraNode, extra: &[&str]) -> ChildProcess {
    let plugin = node.start_plugin(extra).await;
    node.kubelet.register().await;
    plugin
}

/// Whether the CDI ID `id` (`kind=name`) is defined by a spec in `dir`, as a container
/// runtime resolves it: a spec of that kind with a device of that name.
fn resolvable(dir: &Path, id: &str) -> bool {
    let Some((kind, name)) = id.split_once('=') else { return false };
    let Ok(entries) = std::fs::read_dir(dir) else { return false };
    entries.flatten().filter(|e| e.path().extension().is_some_and(|x| x == "json")).any(|e| {
        let spec = read_json(&e.path());
        spec["kind"] == kind
            && spec["devices"].as_array().is_some_and(|d| d.iter().any(|d| d["name"] == name))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reboot_writes_the_cdi_specs_again_and_specs_declare_what_they_need() {
    skip_on_real_gpu!(SIMULATED);
    let node = node().await;
    let (api, kubelet) = (&node.api, &node.kubelet);
    node.put_pod("llm-0", POD_UID);
    node.put_claim(claim("llm-gpu", CLAIM_UID, "gpu", "2Gi", &[("llm-0", POD_UID)]));
    node.put_claim(claim("small", LETTER_UID, "gpu/small", "1Gi", &[("llm-0", POD_UID)]));
    let mut plugin = start_registered(&node, &[]).await;
    let llm = ClaimName::new("inference", "llm-gpu", CLAIM_UID);
    let small = ClaimName::new("inference", "small", LETTER_UID);
    let first = kubelet.start_pod(POD_UID, &llm).await;
    assert_eq!(first.error, "", "{}", plugin.diagnostics());
    let id = first.devices[0].cdi_device_ids[0].clone();
    assert!(resolvable(&node.cdi, &id), "{id} after prepare");

    // The smallest CDI version each spec needs: device names that start with the claim's
    // UID need 0.5.0 when it starts with a digit, nothing past 0.3.0 otherwise.
    assert_eq!(read_json(&node.spec_path(CLAIM_UID))["cdiVersion"], "0.5.0");
    let answer = kubelet.start_pod(POD_UID, &small).await;
    assert_eq!(answer.error, "", "{}", plugin.diagnostics());
    assert_eq!(read_json(&node.spec_path(LETTER_UID))["cdiVersion"], "0.3.0");
    // A sub-request (firstAvailable) is answered under its parent, the name containers use.
    assert_eq!(answer.devices[0].request_names, ["gpu"], "{:?}", answer.devices);
    let checkpoint = node.checkpoint();
    assert_eq!(
        checkpoint["claims"][LETTER_UID]["devices"][0]["requestNames"],
        json!(["gpu/small"]),
        "the checkpoint keeps the allocation's own name"
    );

    // A reboot with the plugin up: the CDI folder is empty, the kubelet prepares again.
    let spec_before = std::fs::read(node.spec_path(CLAIM_UID)).unwrap();
    wait_until("the slice published", &mut plugin, |_| api.slice(NODE).is_some()).await;
    let answers = kubelet.reboot().await;
    for answer in &answers {
        assert_eq!(answer.error, "", "{}", plugin.diagnostics());
    }
    assert!(answers.iter().any(|a| a.devices == first.devices), "the same devices: {answers:?}");
    assert!(resolvable(&node.cdi, &id), "{id} after the reboot\n{}", plugin.diagnostics());
    assert_eq!(std::fs::read(node.spec_path(CLAIM_UID)).unwrap(), spec_before, "the same spec");
    assert!(node.spec_path(LETTER_UID).exists());

    // The plugin restarts on a node whose CDI folder lost its specs: they are back before
    // the kubelet asks for anything.
    plugin.kill();
    let _ = plugin.wait(WAIT);
    for uid in [CLAIM_UID, LETTER_UID] {
        std::fs::remove_file(node.spec_path(uid)).unwrap();
    }
    let mut plugin = node.spawn_plugin(&[]);
    wait_until("the specs written again at start", &mut plugin, |_| {
        node.spec_path(CLAIM_UID).exists() && node.spec_path(LETTER_UID).exists()
    })
    .await;
    // Written whole (atomically), with the pod's priority read again.
    wait_until("the spec as before", &mut plugin, |_| {
        std::fs::read(node.spec_path(CLAIM_UID)).is_ok_and(|s| s == spec_before)
    })
    .await;
    assert!(resolvable(&node.cdi, &id));
    plugin.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_pod_on_a_shared_claim_is_entitled_and_a_pod_that_leaves_is_not() {
    skip_on_real_gpu!(SIMULATED);
    let Some(cgroup) = PodCgroup::make_or_skip(POD2_UID) else { return };
    let node = node().await;
    let (api, kubelet) = (&node.api, &node.kubelet);
    node.put_pod("llm-0", POD_UID);
    node.put_pod("llm-1", POD2_UID);
    let claim_path = node.claim_path("shared");
    node.put_claim(claim("shared", CLAIM_UID, "gpu", "2Gi", &[("llm-0", POD_UID)]));
    let arbiter = node.entitling_arbiter();
    let mut plugin = start_registered(&node, &[]).await;
    let shared = ClaimName::new("inference", "shared", CLAIM_UID);
    assert_eq!(kubelet.start_pod(POD_UID, &shared).await.error, "", "{}", plugin.diagnostics());
    let env = cdi_env(&read_json(&node.spec_path(CLAIM_UID)));

    // The second pod joins: the scheduler adds it to reservedFor, the kubelet only records
    // it (no prepare call); the plugin's checkpoint follows.
    api.update(&claim_path, |c| {
        c["status"]["reservedFor"] = reserved_for(&[("llm-0", POD_UID), ("llm-1", POD2_UID)]);
    });
    let joined = kubelet.start_pod(POD2_UID, &shared).await;
    assert_eq!(joined.error, "");
    wait_until("the checkpoint lists the second pod", &mut plugin, |_| {
        node.checkpoint()["claims"][CLAIM_UID]["podUids"] == json!([POD_UID, POD2_UID])
    })
    .await;

    // The second pod's process asks for more than the claim: the arbiter holds it to the
    // claim, as it does the first pod's.
    let mut cmd = node.container(&env);
    cmd.env("GPUFRAC_MEMORY_REQUEST", (6 * GIB).to_string())
        .env("GPUFRAC_MEMORY_LIMIT", (8 * GIB).to_string())
        .env("GPUFRAC_GROUP", "someone-elses-group");
    cgroup.enter(&mut cmd);
    let mut container = ChildProcess::spawn(&mut cmd);
    let _ = container.ready();
    let process = registered_process(&arbiter, "the second pod's process registered", container.pid());
    assert_eq!(
        (process.request, process.limit),
        (2 * GIB, 4 * GIB),
        "the claim's: {process:?}\n{}",
        arbiter.log_text()
    );
    assert_eq!(process.group, format!("dra-{CLAIM_UID}"), "{process:?}");
    container.kill();
    let _ = container.wait(WAIT);

    // The second pod leaves the claim: its new process is entitled to nothing.
    api.update(&claim_path, |c| c["status"]["reservedFor"] = reserved_for(&[("llm-0", POD_UID)]));
    assert_eq!(kubelet.stop_pod(POD2_UID, &shared).await, None, "the first pod still holds it");
    wait_until("the checkpoint drops the second pod", &mut plugin, |_| {
        node.checkpoint()["claims"][CLAIM_UID]["podUids"] == json!([POD_UID])
    })
    .await;
    let mut cmd = node.container(&env);
    cgroup.enter(&mut cmd);
    let mut late = ChildProcess::spawn(&mut cmd);
    let _ = late.next_line(WAIT);
    let registered = registered_process(&arbiter, "the late process registered", late.pid());
    assert!(
        registered.request == 0,
        "out of reservedFor, no guarantee: {registered:?}\n{}",
        arbiter.log_text()
    );
    late.kill();
    let _ = late.wait(WAIT);
    plugin.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_claims_are_unprepared_after_a_second_check() {
    skip_on_real_gpu!(SIMULATED);
    let node = node().await;
    let (api, kubelet) = (&node.api, &node.kubelet);
    node.put_pod("llm-0", POD_UID);
    let uids = [
        ("kept", "1e4d3b0f-0000-4222-8333-000000000001"),
        ("deleted", "1e4d3b0f-0000-4222-8333-000000000002"),
        ("replaced", "1e4d3b0f-0000-4222-8333-000000000003"),
        ("moved", "1e4d3b0f-0000-4222-8333-000000000004"),
    ];
    for (name, uid) in uids {
        node.put_claim(claim(name, uid, "gpu", "1Gi", &[("llm-0", POD_UID)]));
    }
    let mut plugin = start_registered(&node, &["--stale-claims-every", "1s"]).await;
    for (name, uid) in uids {
        let answer = kubelet.start_pod(POD_UID, &ClaimName::new("inference", name, uid)).await;
        assert_eq!(answer.error, "", "{}", plugin.diagnostics());
    }

    // Gone from the API server, replaced by another claim of the same name, and moved off
    // this node (deallocated and allocated elsewhere), while the kubelet never unprepares
    // them (a node that was down, a kubelet that lost its state).
    api.remove(&node.claim_path("deleted"));
    api.remove(&node.claim_path("replaced"));
    node.put_claim(claim("replaced", "1e4d3b0f-9999-4222-8333-000000000003", "gpu", "1Gi", &[]));
    api.update(&node.claim_path("moved"), |c| {
        c["status"]["allocation"]["devices"]["results"][0]["pool"] = json!("node-z");
        c["status"]["reservedFor"] = json!([]);
    });
    let line_of = |log: &str, name: &str, what: &str| {
        let claim = format!("inference/{name} ");
        log.lines().position(|l| l.contains(&claim) && l.contains(what))
    };
    for (name, uid) in &uids[1..] {
        wait_until(&format!("claim {name} unprepared"), &mut plugin, |p| {
            line_of(&p.stderr_text(), name, "stale claim unprepared").is_some()
        })
        .await;
        assert!(!node.spec_path(uid).exists(), "{name}: its spec removed");
        assert!(node.checkpoint()["claims"].get(uid).is_none(), "{name}: its entry dropped");
    }
    let log = plugin.stderr_text();
    for (name, _) in &uids[1..] {
        // Found stale first, unprepared at a later check: never at the first sight.
        let first = line_of(&log, name, "looks stale");
        let done = line_of(&log, name, "stale claim unprepared");
        assert!(matches!((first, done), (Some(a), Some(b)) if a < b), "{name}: {first:?} {done:?}\n{log}");
    }
    assert!(
        log.contains("no longer allocated to this node") && log.contains("another ResourceClaim"),
        "{log}"
    );
    let (_, kept) = uids[0];
    assert!(node.spec_path(kept).exists(), "the claim still allocated here stays\n{log}");
    assert!(node.checkpoint()["claims"].get(kept).is_some());
    plugin.kill();
}
