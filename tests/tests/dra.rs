//! The DRA driver end to end, on simgpu, with the real binaries: `gpufrac-device-plugin dra`
//! against a kubelet stand-in built from the official DRA and plugin-registration protos
//! (the plugin crate's generated clients) and an API-server stand-in that serves
//! ResourceClaims, pods and the node and receives ResourceSlices; the node, its folders and
//! the plugin's command line are the harness's (`gpufrac_e2e::dra_node`).
//!
//! - Registration: the plugin's registration socket answers `GetInfo` as the kubelet's
//!   plugin watcher expects, and is served again when it is removed (a kubelet restart
//!   that cleans the registry).
//! - Slices: one device per GPU with its attributes and a shared `memory` capacity; the
//!   published slices validate against the 1.34 and 1.37 schemas; a GPU with a critical
//!   XID stays in the slice, tainted; a clean stop leaves it (more in `dra_slices.rs`).
//! - Claims: preparing writes a CDI spec with the claim's request, limit, resolver and the
//!   pod's priority, and records the claim in the checkpoint; preparing again (either API
//!   version, or after a restart) answers the same and writes nothing; a bad configuration
//!   fails naming the field; unpreparing after a restart of the plugin, with the claim gone
//!   from the API server, works from the checkpoint alone.
//! - The container: a process run with the CDI spec's environment, under the arbiter, is
//!   registered with the claim's request and limit and sees the limit as its device.
//! - The arbiter's entitlement (`--kubernetes --dra-checkpoint`): a process in the pod's
//!   cgroup that declares more than its claim is held to the claim (request, limit, group),
//!   read from the plugin's checkpoint and the pods the arbiter watches; once the claim is
//!   unprepared, the pod's new process gets no guarantee and no burst.
//! - Fractions across GPUs: a claim of two devices (`count: 2`, a tensor-parallel server),
//!   validated against the 1.34 and 1.37 schemas, is prepared by the kubelet as one CDI
//!   device per GPU, each resolvable and each making both GPUs visible; the pod's process
//!   is entitled on both GPUs, each to what the claim holds of it.
//! - Without consumable capacity (`--shares`): each GPU is published as share devices, and a
//!   claim's shares on one GPU add up to its request.

use std::path::Path;

use gpufrac_device_plugin::dra::api::registration::registration_client::RegistrationClient;
use gpufrac_device_plugin::dra::api::registration::{InfoRequest, RegistrationStatus};
use gpufrac_device_plugin::dra::api::{v1, v1beta1};
use gpufrac_e2e::dra_node::{
    allocated_claim_json, as_sent, cdi_env, consumed_result, read_json, registered_process,
    registered_process_on, sent_slices, stop_cleanly, wait_until, DraNode, DRIVER, SHARE_ID, WAIT,
};
use gpufrac_e2e::kube_standins::channel;
use gpufrac_e2e::kube_standins::ClaimName;
use gpufrac_e2e::pod_cgroup::PodCgroup;
use gpufrac_e2e::{artifact, kubernetes_validate, skip_on_real_gpu, Arbiter, ChildProcess, SimGpu};
use serde_json::{json, Value};

const GIB: u64 = 1 << 30;
const NODE: &str = "node-a";
const CLAIM_UID: &str = "0f3c2a9e-1111-4222-8333-444455556666";
const BAD_CLAIM_UID: &str = "0f3c2a9e-9999-4222-8333-444455556666";
const POD_UID: &str = "7a1b2c3d-0000-4000-8000-000000000001";
/// Why this needs simgpu: it injects an XID and sizes claims against simgpu's devices.
const SIMULATED: &str = "injects XIDs into simgpu and sizes claims to its devices";

/// The node of these tests, with two simulated GPUs of 16 and 8 GiB.
async fn node() -> DraNode {
    DraNode::new(NODE, SimGpu::new("16GiB,8GiB").with_context_overhead("64MiB")).await
}

/// A claim as the API server returns it once the scheduler allocated it: `memory` of the
/// device `device` consumed, the opaque configuration `parameters`, reserved for our pod.
fn allocated_claim(name: &str, uid: &str, device: &str, memory: &str, parameters: Value) -> Value {
    claim_with_results(name, uid, vec![consumed_result(NODE, "gpu", device, memory)], parameters)
}

/// A claim of one request `gpu` of our device class, configured with `parameters`,
/// allocated with `results` and reserved for our pod `llm-0`.
fn claim_with_results(name: &str, uid: &str, results: Vec<Value>, parameters: Value) -> Value {
    let spec = json!({
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
        "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}]
    });
    allocated_claim_json(NODE, name, uid, spec, results, &parameters, &[("llm-0", POD_UID)])
}

/// What the kubelet's plugin watcher does with a new registration socket: `GetInfo`, then
/// `NotifyRegistrationStatus`. Returns the DRA endpoint.
async fn register(node: &DraNode) -> String {
    let mut client = RegistrationClient::new(channel(node.registration_socket()).await);
    let info = client.get_info(InfoRequest {}).await.expect("GetInfo").into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gpu.gpufrac.io");
    assert_eq!(info.supported_versions, ["v1.DRAPlugin", "v1beta1.DRAPlugin"]);
    assert_eq!(Path::new(&info.endpoint), node.plugin.join("dra.sock"));
    client
        .notify_registration_status(RegistrationStatus { plugin_registered: true, error: String::new() })
        .await
        .expect("NotifyRegistrationStatus");
    info.endpoint
}

fn claim_ref(name: &str, uid: &str) -> v1::Claim {
    v1::Claim { namespace: "inference".into(), uid: uid.into(), name: name.into() }
}

async fn prepare(endpoint: &str, name: &str, uid: &str) -> v1::NodePrepareResourceResponse {
    let mut client = v1::dra_plugin_client::DraPluginClient::new(channel(endpoint.into()).await);
    let request = v1::NodePrepareResourcesRequest { claims: vec![claim_ref(name, uid)] };
    let mut answer = client.node_prepare_resources(request).await.expect("NodePrepareResources").into_inner();
    answer.claims.remove(uid).unwrap_or_else(|| panic!("no answer for claim {uid}"))
}

async fn unprepare(endpoint: &str, name: &str, uid: &str) -> String {
    let mut client = v1::dra_plugin_client::DraPluginClient::new(channel(endpoint.into()).await);
    let request = v1::NodeUnprepareResourcesRequest { claims: vec![claim_ref(name, uid)] };
    let mut answer =
        client.node_unprepare_resources(request).await.expect("NodeUnprepareResources").into_inner();
    answer.claims.remove(uid).expect("an answer for the claim").error
}

fn inode(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(path).ok().map(|m| m.ino())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dra_plugin_serves_the_kubelet_and_the_api_server() {
    skip_on_real_gpu!(SIMULATED);
    let mut node = node().await;
    node.api.put(
        &format!("/api/v1/nodes/{NODE}"),
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "uid": "node-uid-1"}}),
    );
    node.put_pod("llm-0", POD_UID);
    let swap = json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig",
                      "limit": "4Gi", "resolver": "swap"});
    node.put_claim(allocated_claim("llm-gpu", CLAIM_UID, "gpu-0", "2Gi", swap));
    node.put_claim(allocated_claim(
        "bad",
        BAD_CLAIM_UID,
        "gpu-1",
        "1Gi",
        json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "resolver": "fastest"}),
    ));
    let arbiter = Arbiter::start(&node.gpu);
    node.arbiter_socket = arbiter.socket().to_owned();
    let api = &node.api;

    // Registration and the slice.
    let mut plugin = node.start_plugin(&[]).await;
    let endpoint = register(&node).await;
    wait_until("a ResourceSlice", &mut plugin, |_| api.slice(NODE).is_some()).await;
    let slice = api.slice(NODE).unwrap();
    let spec = &slice["spec"];
    assert_eq!(spec["driver"], "gpu.gpufrac.io");
    assert_eq!(spec["nodeName"], NODE);
    assert_eq!(spec["pool"]["name"], NODE);
    assert_eq!(slice["metadata"]["ownerReferences"][0]["uid"], "node-uid-1", "owned by the Node: {slice}");
    let devices = spec["devices"].as_array().expect("devices");
    assert_eq!(devices.len(), 2, "{slice}");
    for (index, (device, total)) in devices.iter().zip([16 * GIB, 8 * GIB]).enumerate() {
        assert_eq!(device["name"], format!("gpu-{index}"));
        assert_eq!(device["allowMultipleAllocations"], true);
        assert_eq!(device["capacity"]["memory"]["value"], total.to_string());
        let policy = &device["capacity"]["memory"]["requestPolicy"];
        assert_eq!(policy["validRange"]["min"], "256Mi", "{policy}");
        assert_eq!(policy["validRange"]["step"], "256Mi", "{policy}");
        let attributes = &device["attributes"];
        assert!(attributes["uuid"]["string"].as_str().unwrap().starts_with("GPU-"), "{attributes}");
        for name in ["productName", "driverVersion", "pciBusID"] {
            assert!(
                attributes[name]["string"].as_str().is_some_and(|s| !s.is_empty()),
                "{name}: {attributes}"
            );
        }
        assert_eq!(attributes["index"]["int"], index);
        for name in ["computeCapability", "cudaVersion"] {
            assert!(
                attributes[name]["version"].as_str().is_some_and(|v| v.split('.').count() == 3),
                "{attributes}"
            );
        }
    }
    let gpu0_uuid = devices[0]["attributes"]["uuid"]["string"].as_str().unwrap().to_owned();

    // Preparing: the CDI spec, the answer and the checkpoint.
    let answer = prepare(&endpoint, "llm-gpu", CLAIM_UID).await;
    assert_eq!(answer.error, "", "{}", plugin.diagnostics());
    assert_eq!(answer.devices.len(), 1);
    let device = &answer.devices[0];
    assert_eq!((device.pool_name.as_str(), device.device_name.as_str()), (NODE, "gpu-0"));
    assert_eq!(device.request_names, ["gpu"]);
    assert_eq!(device.share_id.as_deref(), Some(SHARE_ID));
    let cdi_id = format!("gpufrac.io/claim={CLAIM_UID}-gpu-0");
    assert_eq!(device.cdi_device_ids, std::slice::from_ref(&cdi_id));
    let spec_path = node.spec_path(CLAIM_UID);
    let spec = read_json(&spec_path);
    assert_eq!(spec["kind"], "gpufrac.io/claim");
    assert_eq!(spec["devices"][0]["name"], format!("{CLAIM_UID}-gpu-0"));
    let env = cdi_env(&spec);
    assert_eq!(env["GPUFRAC_MEMORY_REQUEST"], (2 * GIB).to_string());
    assert_eq!(env["GPUFRAC_MEMORY_LIMIT"], (4 * GIB).to_string());
    assert_eq!(env["GPUFRAC_RESOLVER"], "swap");
    assert_eq!(env["GPUFRAC_PRIORITY"], "100", "the pod's priority, as the claim names none");
    assert_eq!(env["GPUFRAC_GROUP"], format!("dra-{CLAIM_UID}"));
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], gpu0_uuid);
    assert_eq!(Path::new(&env["GPUFRAC_ARBITER_SOCKET"]), arbiter.socket());
    assert_eq!(Path::new(&env["LD_PRELOAD"]), artifact("libgpufrac.so"));
    let mounts = spec["devices"][0]["containerEdits"]["mounts"].as_array().unwrap();
    let shim_dir = artifact("libgpufrac.so").parent().unwrap().display().to_string();
    assert!(mounts.iter().any(|m| m["hostPath"] == shim_dir && m["options"][0] == "ro"), "{mounts:?}");
    let socket_dir = arbiter.socket().parent().unwrap().display().to_string();
    assert!(mounts.iter().any(|m| m["hostPath"] == socket_dir && m["options"][0] == "rw"), "{mounts:?}");
    let checkpoint = read_json(&node.checkpoint_path());
    let recorded = &checkpoint["claims"][CLAIM_UID];
    assert_eq!(recorded["podUids"], json!([POD_UID]), "{checkpoint}");
    assert_eq!(recorded["devices"][0]["requestBytes"], 2 * GIB);
    assert_eq!(recorded["devices"][0]["limitBytes"], 4 * GIB);

    // Prepared once: again, in either API version, the same answer and nothing rewritten.
    let written = inode(&spec_path);
    let again = prepare(&endpoint, "llm-gpu", CLAIM_UID).await;
    assert_eq!(again.devices, answer.devices);
    let mut beta = v1beta1::dra_plugin_client::DraPluginClient::new(channel(endpoint.clone().into()).await);
    let beta_request = v1beta1::NodePrepareResourcesRequest {
        claims: vec![v1beta1::Claim {
            namespace: "inference".into(),
            uid: CLAIM_UID.into(),
            name: "llm-gpu".into(),
        }],
    };
    let beta_answer = beta.node_prepare_resources(beta_request).await.expect("v1beta1 prepare").into_inner();
    let beta_device = &beta_answer.claims[CLAIM_UID].devices[0];
    assert_eq!(beta_device.cdi_device_ids, std::slice::from_ref(&cdi_id));
    assert_eq!(inode(&spec_path), written, "the CDI spec was not written twice");

    // A bad configuration fails preparation, naming the field; nothing is left behind.
    let bad = prepare(&endpoint, "bad", BAD_CLAIM_UID).await;
    assert!(bad.devices.is_empty());
    assert!(bad.error.contains("parameters.resolver") && bad.error.contains("fastest"), "{}", bad.error);
    assert!(!node.spec_path(BAD_CLAIM_UID).exists());
    // A malformed request from the kubelet is refused, naming what is wrong.
    let odd = prepare(&endpoint, "../llm-gpu", "0f3c2a9e-7777-4222-8333-444455556666").await;
    assert!(odd.error.contains("not a Kubernetes name"), "{}", odd.error);
    let odd = prepare(&endpoint, "llm-gpu", "../../etc").await;
    assert!(odd.error.contains("not a Kubernetes UID"), "{}", odd.error);

    // The container: a process with the CDI spec's environment runs under the arbiter with
    // the claim's request and limit, and sees the limit as its device.
    let mut container = ChildProcess::spawn(&mut node.container(&env));
    let ready = container.ready();
    assert_eq!(ready[2], 4 * GIB, "the limit is the device: {ready:?}\n{}", container.diagnostics());
    assert!(ready[0] <= 4 * GIB, "held to the limit: {ready:?}");
    let process = registered_process(&arbiter, "the container's process registered", container.pid());
    assert_eq!((process.request, process.limit), (2 * GIB, 4 * GIB), "{process:?}");
    assert_eq!(process.group, format!("dra-{CLAIM_UID}"), "{process:?}");
    container.kill();

    // A GPU with a critical XID stays in the slice, tainted.
    let generation = api.slice(NODE).unwrap()["spec"]["pool"]["generation"].as_i64().unwrap();
    node.inject_xid(1);
    wait_until("gpu-1 tainted", &mut plugin, |_| {
        api.slice(NODE).is_some_and(|s| !s["spec"]["devices"][1]["taints"].is_null())
    })
    .await;
    let slice = api.slice(NODE).unwrap();
    assert_eq!(slice["spec"]["devices"][1]["name"], "gpu-1");
    assert_eq!(slice["spec"]["devices"][1]["taints"][0]["key"], "gpu.gpufrac.io/unhealthy", "{slice}");
    assert!(slice["spec"]["pool"]["generation"].as_i64().unwrap() > generation, "{slice}");

    // Every slice the plugin sent is one the API server of 1.34 and of 1.37 accepts.
    let sent = sent_slices(api);
    assert!(sent.len() >= 2);
    kubernetes_validate::validate_objects(&sent, &["1.34", "1.37"]).unwrap_or_else(|e| panic!("{e}"));

    // The kubelet restarts and cleans its registry: the plugin serves its socket again.
    std::fs::remove_file(node.registration_socket()).unwrap();
    wait_until("the registration socket again", &mut plugin, |p| {
        p.stderr_text().contains("the registration socket was removed: serving it again")
            && node.registration_socket().exists()
    })
    .await;
    register(&node).await;

    // The plugin crashes and comes back: the claim is still prepared (nothing written),
    // and, the claim gone from the API server, it is unprepared from the checkpoint.
    plugin.kill();
    let _ = plugin.wait(WAIT);
    let mut plugin = node.spawn_plugin(&[]);
    wait_until("the restarted plugin serving", &mut plugin, |p| {
        p.stderr_text().contains("serving the DRA kubelet plugin")
    })
    .await;
    let endpoint = register(&node).await;
    let after_restart = prepare(&endpoint, "llm-gpu", CLAIM_UID).await;
    assert_eq!(after_restart.devices, answer.devices);
    assert_eq!(inode(&spec_path), written, "prepared claims survive a restart without being prepared again");
    api.remove(&node.claim_path("llm-gpu"));
    assert_eq!(unprepare(&endpoint, "llm-gpu", CLAIM_UID).await, "");
    assert!(!spec_path.exists(), "the CDI spec is removed");
    let checkpoint = read_json(&node.checkpoint_path());
    assert_eq!(checkpoint["claims"], json!({}), "{checkpoint}");
    assert_eq!(unprepare(&endpoint, "llm-gpu", CLAIM_UID).await, "", "unpreparing twice is fine");

    // A clean stop removes the sockets and leaves the slice (a rollout's next plugin).
    stop_cleanly(&mut plugin);
    assert!(api.slice(NODE).is_some(), "the slice stays at a clean stop");
    assert!(!node.registration_socket().exists());
    assert!(!node.plugin.join("dra.sock").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_consumable_capacity_gpus_are_published_as_shares() {
    skip_on_real_gpu!(SIMULATED);
    let node = node().await;
    let api = &node.api;
    let shares: Vec<Value> = ["gpu-1-0", "gpu-1-2"]
        .iter()
        .map(|device| json!({"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}))
        .collect();
    node.put_claim(claim_with_results(
        "two-shares",
        CLAIM_UID,
        shares,
        json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig"}),
    ));

    // More shares than a slice holds are refused, naming the flag.
    let mut refused = node.spawn_plugin(&["--shares", "100"]);
    let status = refused.wait(WAIT);
    assert!(!status.success());
    // (diagnostics() waits for the reader of its stderr to reach the end.)
    let said = refused.diagnostics();
    assert!(refused.stderr_text().contains("--shares 100"), "{said}");

    let mut plugin = node.start_plugin(&["--shares", "4"]).await;
    let endpoint = register(&node).await;
    wait_until("a ResourceSlice", &mut plugin, |_| api.slice(NODE).is_some()).await;
    let slice = api.slice(NODE).unwrap();
    let devices = slice["spec"]["devices"].as_array().unwrap();
    let names: Vec<&str> = devices.iter().map(|d| d["name"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        ["gpu-0-0", "gpu-0-1", "gpu-0-2", "gpu-0-3", "gpu-1-0", "gpu-1-1", "gpu-1-2", "gpu-1-3"]
    );
    assert_eq!(devices[4]["capacity"]["memory"]["value"], (2 * GIB).to_string());
    assert_eq!(devices[4]["attributes"]["uuid"], devices[7]["attributes"]["uuid"]);
    assert!(devices.iter().all(|d| d.get("allowMultipleAllocations").is_none()));
    kubernetes_validate::validate_objects(&[as_sent(slice.clone())], &["1.34", "1.37"])
        .unwrap_or_else(|e| panic!("{e}"));

    // Two shares of GPU 1: one fraction of 4 GiB, both devices answered with one CDI device.
    let answer = prepare(&endpoint, "two-shares", CLAIM_UID).await;
    assert_eq!(answer.error, "", "{}", plugin.diagnostics());
    let names: Vec<&str> = answer.devices.iter().map(|d| d.device_name.as_str()).collect();
    assert_eq!(names, ["gpu-1-0", "gpu-1-2"]);
    let cdi_id = format!("gpufrac.io/claim={CLAIM_UID}-gpu-1");
    assert!(answer.devices.iter().all(|d| d.cdi_device_ids == [cdi_id.clone()]), "{:?}", answer.devices);
    let spec = read_json(&node.spec_path(CLAIM_UID));
    let env = spec["devices"][0]["containerEdits"]["env"].as_array().unwrap();
    assert!(env.contains(&json!(format!("GPUFRAC_MEMORY_REQUEST={}", 4 * GIB))), "{env:?}");
    assert!(env.contains(&json!(format!("GPUFRAC_MEMORY_LIMIT={}", 4 * GIB))), "{env:?}");
    assert!(env.contains(&json!("GPUFRAC_RESOLVER=wait")), "the default resolver, spelt out: {env:?}");
    plugin.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_arbiter_entitles_a_pods_process_to_its_prepared_claim() {
    skip_on_real_gpu!(SIMULATED);
    let Some(cgroup) = PodCgroup::make_or_skip(POD_UID) else { return };
    let node = node().await;
    node.put_pod("llm-0", POD_UID);
    node.put_claim(allocated_claim(
        "llm-gpu",
        CLAIM_UID,
        "gpu-0",
        "2Gi",
        json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": "4Gi"}),
    ));
    let arbiter = node.entitling_arbiter();

    let mut plugin = node.start_plugin(&[]).await;
    let endpoint = register(&node).await;
    let answer = prepare(&endpoint, "llm-gpu", CLAIM_UID).await;
    assert_eq!(answer.error, "", "{}", plugin.diagnostics());
    let spec = read_json(&node.spec_path(CLAIM_UID));
    let env = cdi_env(&spec);

    // The pod's process asks for more than its claim (its environment is its own to
    // change): the arbiter believes the claim.
    let mut cmd = node.container(&env);
    cmd.env("GPUFRAC_MEMORY_REQUEST", (6 * GIB).to_string())
        .env("GPUFRAC_MEMORY_LIMIT", (8 * GIB).to_string())
        .env("GPUFRAC_GROUP", "someone-elses-group");
    cgroup.enter(&mut cmd);
    let mut container = ChildProcess::spawn(&mut cmd);
    let ready = container.ready();
    let process = registered_process(&arbiter, "the pod's process registered", container.pid());
    assert_eq!(
        (process.request, process.limit),
        (2 * GIB, 4 * GIB),
        "the claim's, not the process's: {process:?}"
    );
    assert_eq!(process.group, format!("dra-{CLAIM_UID}"), "{process:?}");
    assert!(ready[0] <= 4 * GIB, "held to the claim's limit: {ready:?}\n{}", arbiter.log_text());
    container.kill();
    let _ = container.wait(WAIT);

    // Unprepared, the claim entitles nobody: a new process of the pod gets no guarantee.
    assert_eq!(unprepare(&endpoint, "llm-gpu", CLAIM_UID).await, "");
    let mut cmd = node.container(&env);
    cgroup.enter(&mut cmd);
    let mut late = ChildProcess::spawn(&mut cmd);
    let _ = late.next_line(WAIT);
    let registered = registered_process(&arbiter, "the late process registered", late.pid());
    assert!(registered.request == 0, "no claim, no guarantee: {registered:?}\n{}", arbiter.log_text());
    late.kill();
    let _ = late.wait(WAIT);
    plugin.kill();
}

const TP_CLAIM_UID: &str = "0f3c2a9e-2222-4222-8333-444455556666";
/// The tensor-parallel pod: a pod of its own (tests run at once, and a pod's cgroup is
/// removed when its test ends).
const TP_POD_UID: &str = "7a1b2c3d-0000-4000-8000-000000000002";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_of_two_gpus_entitles_the_pod_on_both() {
    skip_on_real_gpu!(SIMULATED);
    let Some(cgroup) = PodCgroup::make_or_skip(TP_POD_UID) else { return };
    let node = node().await;
    node.put_pod("tp-0", TP_POD_UID);
    // What a tensor-parallel server asks: 2 GPUs, each a different one, each its own memory
    // (the scheduler gave 3 GiB of the 16 GiB GPU and 1 GiB of the 8 GiB one).
    let spec = json!({
        "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER, "count": 2,
                      "capacity": {"requests": {"memory": "1Gi"}}}}],
        "constraints": [{"requests": ["gpu"], "distinctAttribute": "gpu.gpufrac.io/uuid"}],
        "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": "0.25"}}}]
    });
    let parameters = json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": "0.25"});
    let results =
        vec![consumed_result(NODE, "gpu", "gpu-0", "3Gi"), consumed_result(NODE, "gpu", "gpu-1", "1Gi")];
    let claim = allocated_claim_json(
        NODE,
        "tp-gpus",
        TP_CLAIM_UID,
        spec,
        results,
        &parameters,
        &[("tp-0", TP_POD_UID)],
    );
    kubernetes_validate::validate_objects(std::slice::from_ref(&claim), &["1.34", "1.37"])
        .unwrap_or_else(|e| panic!("{e}"));
    node.put_claim(claim);
    let arbiter = node.entitling_arbiter();
    let mut plugin = node.start_plugin(&[]).await;
    node.kubelet.register().await;

    let answer =
        node.kubelet.start_pod(TP_POD_UID, &ClaimName::new("inference", "tp-gpus", TP_CLAIM_UID)).await;
    assert_eq!(answer.error, "", "{}", plugin.diagnostics());
    let devices: Vec<&str> = answer.devices.iter().map(|d| d.device_name.as_str()).collect();
    assert_eq!(devices, ["gpu-0", "gpu-1"], "one device per GPU");
    for device in &answer.devices {
        for id in &device.cdi_device_ids {
            let (kind, name) = id.split_once('=').expect("kind=name");
            let spec = read_json(&node.spec_path(TP_CLAIM_UID));
            assert!(
                spec["kind"] == kind
                    && spec["devices"].as_array().is_some_and(|d| d.iter().any(|d| d["name"] == name)),
                "{id} resolves in {spec}"
            );
        }
    }
    let spec = read_json(&node.spec_path(TP_CLAIM_UID));
    let env = cdi_env(&spec);
    let uuids = [simgpu_state::device_uuid(0), simgpu_state::device_uuid(1)];
    assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], uuids.join(","), "both GPUs, in NVML's order");
    assert_eq!(env["GPUFRAC_MEMORY_REQUEST"], (3 * GIB).to_string(), "the largest request");
    assert_eq!(env["GPUFRAC_MEMORY_LIMIT"], (4 * GIB).to_string(), "the largest limit: 0.25 of 16 GiB");
    assert_eq!(env["GPUFRAC_GROUP"], format!("dra-{TP_CLAIM_UID}"));

    // The pod's process sees both GPUs and registers on each: the arbiter holds each GPU
    // to the claim's fraction of it, in the claim's one group.
    let mut cmd = node.container(&env);
    cgroup.enter(&mut cmd);
    let mut container = ChildProcess::spawn(&mut cmd);
    let _ = container.ready();
    for (gpu, request, limit) in [(0, 3 * GIB, 4 * GIB), (1, GIB, 2 * GIB)] {
        let process = registered_process_on(&arbiter, gpu, "the pod's process registered", container.pid());
        assert_eq!(
            (process.request, process.limit),
            (request, limit),
            "GPU {gpu}: {process:?}\n{}",
            arbiter.log_text()
        );
        assert_eq!(process.group, format!("dra-{TP_CLAIM_UID}"), "{process:?}");
    }
    container.kill();
    let _ = container.wait(WAIT);
    plugin.kill();
}
