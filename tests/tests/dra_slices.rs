//! The DRA driver's ResourceSlice kept true through a node's life, end to end: the real
//! `gpufrac-device-plugin dra` on simgpu against the harness's kubelet and API-server
//! stand-ins (`gpufrac_e2e::kube_standins`), on a node of the harness
//! (`gpufrac_e2e::dra_node`).
//!
//! - A kubelet restart wipes the node's slices: the plugin's watch of its slices puts the
//!   slice back at once, and a stray slice of the driver on the node is deleted.
//! - Every registration publishes the slice again (a new generation).
//! - A clean stop leaves the slice (a rollout's next plugin takes it over).
//! - An API server with `DRAConsumableCapacity` off drops fields: the plugin says so once
//!   in its log and in the Node condition `GpufracDRASliceComplete` (the kubelet's own
//!   conditions stay).
//! - A GPU with a critical XID stays in the slice, tainted `gpu.gpufrac.io/unhealthy`
//!   (`NoExecute`), in slices the 1.34 and 1.37 schemas accept; with `DRADeviceTaints` off
//!   it leaves the slice instead, and the plugin says why.
//! - Each GPU's place is in its attributes (the standard `resource.kubernetes.io/pcieRoot`
//!   and `numaNode` from sysfs, `nvlinkPeers` and `nvlinkDomain` from NVML), in slices the
//!   schemas accept; a bad `SIMGPU_NVLINK` or `--sysfs-root` stops the plugin, named.

use gpufrac_e2e::dra_node::{sent_slices, stop_cleanly, wait_until, DraNode, WAIT};
use gpufrac_e2e::kube_standins::{Gate, SLICES};
use gpufrac_e2e::{kubernetes_validate, skip_on_real_gpu, ChildProcess, SimGpu};
use serde_json::{json, Value};

const NODE: &str = "node-a";
const CONDITION: &str = "GpufracDRASliceComplete";
/// Why this needs simgpu: it injects XIDs into simgpu and counts its devices.
const SIMULATED: &str = "injects XIDs into simgpu and counts its devices";

/// A node of two simulated GPUs whose API server has the `disabled` gates off, and a Node
/// object with the kubelet's own condition, which the plugin's must leave alone.
async fn node(disabled: &[Gate]) -> DraNode {
    node_of(SimGpu::new("16GiB,8GiB").with_context_overhead("64MiB"), disabled).await
}

/// [`node`] with the GPUs `gpu`.
async fn node_of(gpu: SimGpu, disabled: &[Gate]) -> DraNode {
    let node = DraNode::new(NODE, gpu).await;
    for gate in disabled {
        node.api.disable_gate(*gate);
    }
    node.api.put(
        &format!("/api/v1/nodes/{NODE}"),
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "uid": "node-uid-1"},
               "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}}),
    );
    node
}

/// Starts the plugin and registers it; returns once its slice is stored.
async fn start_settled(node: &DraNode, extra: &[&str]) -> ChildProcess {
    let mut plugin = node.spawn_plugin(extra);
    // (A killed plugin's socket file may still be there: wait for the new one.)
    wait_until("the plugin serving", &mut plugin, |p| {
        p.stderr_text().contains("serving the DRA kubelet plugin")
    })
    .await;
    node.kubelet.register().await;
    // Settled: the registration's publish done, and the slices watched.
    wait_until("the slice published at registration, and watched", &mut plugin, |p| {
        let text = p.stderr_text();
        let registered = text.rfind("registered: publishing the ResourceSlice again");
        registered.is_some_and(|at| text[at..].contains("ResourceSlice published"))
            && text.contains("watching this node's ResourceSlices")
    })
    .await;
    assert!(node.api.slice(NODE).is_some());
    plugin
}

/// The generation of the node's slice's pool; -1 while there is no slice.
fn pool_generation(node: &DraNode) -> i64 {
    node.api.slice(NODE).map_or(-1, |s| s["spec"]["pool"]["generation"].as_i64().unwrap_or(-1))
}

/// The Node condition `kind`.
fn node_condition(node: &DraNode, kind: &str) -> Option<Value> {
    let object = node.api.get(&format!("/api/v1/nodes/{NODE}"))?;
    object["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == kind).cloned()
}

fn devices(slice: &Value) -> Vec<Value> {
    slice["spec"]["devices"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kubelet_restart_gets_the_slice_back_at_once() {
    skip_on_real_gpu!(SIMULATED);
    let node = node(&[]).await;
    let mut plugin = start_settled(&node, &[]).await;

    // The node's slices wiped, no registration: the watch alone brings the slice back.
    let generation = pool_generation(&node);
    assert_eq!(node.api.delete_collection(SLICES, &format!("spec.nodeName={NODE}")), 1);
    wait_until("the slice back after a wipe", &mut plugin, |_| node.api.slice(NODE).is_some()).await;
    assert!(pool_generation(&node) > generation);
    assert_eq!(devices(&node.api.slice(NODE).unwrap()).len(), 2);

    // The kubelet restarts: wipe, then registration.
    let generation = pool_generation(&node);
    node.kubelet.restart().await;
    wait_until("the slice back after a kubelet restart", &mut plugin, |_| {
        pool_generation(&node) > generation
    })
    .await;

    // A stray slice of this driver on this node (an older plugin's) is deleted; another
    // driver's slice is not the plugin's business.
    let stray = |name: &str, driver: &str| {
        json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name},
               "spec": {"driver": driver, "nodeName": NODE,
                        "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1}, "devices": []}})
    };
    node.api.put(&format!("{SLICES}/old-gpufrac"), stray("old-gpufrac", "gpu.gpufrac.io"));
    node.api.put(&format!("{SLICES}/someone-else"), stray("someone-else", "gpu.example.com"));
    wait_until("the stray slice deleted", &mut plugin, |_| {
        node.api.get(&format!("{SLICES}/old-gpufrac")).is_none()
    })
    .await;
    assert!(node.api.get(&format!("{SLICES}/someone-else")).is_some());
    assert!(node.api.slice(NODE).is_some());

    // Someone else's change to the slice is undone.
    let generation = pool_generation(&node);
    node.api.update(&format!("{SLICES}/{NODE}-gpu.gpufrac.io"), |s| {
        s["spec"]["devices"] = json!([]);
    });
    wait_until("the slice true again", &mut plugin, |_| {
        node.api.slice(NODE).is_some_and(|s| devices(&s).len() == 2) && pool_generation(&node) > generation
    })
    .await;
    plugin.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_registration_publishes_the_slice_again() {
    skip_on_real_gpu!(SIMULATED);
    let node = node(&[]).await;
    let mut plugin = start_settled(&node, &[]).await;
    for _ in 0..2 {
        let (sent, generation) = (node.api.slices_received().len(), pool_generation(&node));
        node.kubelet.register().await;
        wait_until("the slice published again", &mut plugin, |_| {
            node.api.slices_received().len() > sent && pool_generation(&node) > generation
        })
        .await;
    }
    plugin.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_leaves_the_slice_to_the_next_plugin() {
    skip_on_real_gpu!(SIMULATED);
    let node = node(&[]).await;
    let mut plugin = start_settled(&node, &[]).await;
    let generation = pool_generation(&node);
    stop_cleanly(&mut plugin);
    assert!(!node.kubelet.registration_socket().exists());
    let slice = node.api.slice(NODE).expect("the slice stays at a clean stop");
    assert_eq!(devices(&slice).len(), 2);
    assert!(!node.api.requests().iter().any(|(method, _)| method == "DELETE"), "{:?}", node.api.requests());

    // The next plugin (a rollout) takes the same slice over.
    let mut next = start_settled(&node, &[]).await;
    wait_until("the slice taken over", &mut next, |_| pool_generation(&node) > generation).await;
    let ours: Vec<Value> = node.api.list(SLICES);
    assert_eq!(ours.len(), 1, "{ours:?}");
    next.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_consumable_capacity_the_operator_is_told() {
    skip_on_real_gpu!(SIMULATED);
    let node = node(&[Gate::ConsumableCapacity]).await;
    let mut plugin = start_settled(&node, &[]).await;
    let said = "the API server dropped allowMultipleAllocations, requestPolicy from ResourceSlice node-a-gpu.gpufrac.io";
    wait_until("the log line", &mut plugin, |p| p.stderr_text().contains(said)).await;
    let line = plugin.stderr_text().lines().find(|l| l.contains(said)).unwrap().to_owned();
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("DRAConsumableCapacity") && line.contains("whole GPU"), "{line}");
    assert!(line.contains("--shares N"), "{line}");
    wait_until("the Node condition", &mut plugin, |_| node_condition(&node, CONDITION).is_some()).await;
    let condition = node_condition(&node, CONDITION).unwrap();
    assert_eq!(condition["status"], "False", "{condition}");
    assert_eq!(condition["reason"], "FieldsDropped", "{condition}");
    let message = condition["message"].as_str().unwrap();
    assert!(message.contains("allowMultipleAllocations") && message.contains("--shares N"), "{message}");
    assert!(condition["lastTransitionTime"].is_string(), "{condition}");
    assert_eq!(node_condition(&node, "Ready").unwrap()["status"], "True", "the kubelet's conditions stay");

    // Published again (a registration), nothing new to say: said once.
    let sent = node.api.slices_received().len();
    node.kubelet.register().await;
    wait_until("the slice published again", &mut plugin, |_| node.api.slices_received().len() > sent).await;
    assert_eq!(plugin.stderr_text().matches(said).count(), 1, "{}", plugin.diagnostics());
    plugin.kill();

    // With --shares, nothing is dropped: the condition says so.
    let mut shares = start_settled(&node, &["--shares", "4"]).await;
    wait_until("the condition True", &mut shares, |_| {
        node_condition(&node, CONDITION).is_some_and(|c| c["status"] == "True")
    })
    .await;
    assert!(!shares.stderr_text().contains("the API server dropped"), "{}", shares.diagnostics());
    shares.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unhealthy_gpu_is_tainted() {
    skip_on_real_gpu!(SIMULATED);
    let node = node(&[]).await;
    let mut plugin = start_settled(&node, &[]).await;
    wait_until("the Node condition", &mut plugin, |_| node_condition(&node, CONDITION).is_some()).await;
    assert_eq!(node_condition(&node, CONDITION).unwrap()["status"], "True");
    node.inject_xid(1);
    wait_until("gpu-1 tainted", &mut plugin, |_| {
        node.api.slice(NODE).is_some_and(|s| devices(&s).get(1).is_some_and(|d| d.get("taints").is_some()))
    })
    .await;
    let slice = node.api.slice(NODE).unwrap();
    let devices = devices(&slice);
    assert_eq!(devices.len(), 2, "the GPU stays in the slice: {slice}");
    assert!(devices[0].get("taints").is_none(), "{slice}");
    let taints = devices[1]["taints"].as_array().unwrap();
    assert_eq!(taints.len(), 1, "{slice}");
    assert_eq!(taints[0]["key"], "gpu.gpufrac.io/unhealthy");
    assert_eq!(taints[0]["effect"], "NoExecute");
    assert_eq!(taints[0]["value"], "CriticalXID");
    assert!(taints[0]["timeAdded"].as_str().is_some_and(|t| t.ends_with('Z')), "{slice}");
    let sent = sent_slices(&node.api);
    kubernetes_validate::validate_objects(&sent, &["1.34", "1.37"]).unwrap_or_else(|e| panic!("{e}"));
    // Published again, the taint keeps its time.
    let before = pool_generation(&node);
    node.kubelet.register().await;
    wait_until("published again", &mut plugin, |_| pool_generation(&node) > before).await;
    assert_eq!(devices_of(&node)[1]["taints"], json!(taints));
    assert_eq!(node_condition(&node, CONDITION).unwrap()["status"], "True");
    plugin.kill();
}

fn devices_of(node: &DraNode) -> Vec<Value> {
    devices(&node.api.slice(NODE).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_device_taints_an_unhealthy_gpu_leaves_the_slice() {
    skip_on_real_gpu!(SIMULATED);
    let node = node(&[Gate::DeviceTaints]).await;
    let mut plugin = start_settled(&node, &[]).await;
    node.inject_xid(1);
    wait_until("gpu-1 removed", &mut plugin, |_| {
        node.api.slice(NODE).is_some_and(|s| devices(&s).len() == 1)
    })
    .await;
    assert_eq!(devices_of(&node)[0]["name"], "gpu-0");
    let said = "the API server dropped taints from ResourceSlice node-a-gpu.gpufrac.io";
    wait_until("the log line", &mut plugin, |p| p.stderr_text().contains(said)).await;
    let text = plugin.stderr_text();
    let line = text.lines().find(|l| l.contains(said)).unwrap();
    assert!(line.contains("WARN") && line.contains("DRADeviceTaints"), "{line}");
    wait_until("the Node condition False", &mut plugin, |_| {
        node_condition(&node, CONDITION).is_some_and(|c| c["status"] == "False")
    })
    .await;
    let condition = node_condition(&node, CONDITION).unwrap();
    assert!(condition["message"].as_str().unwrap().contains("not evicted"), "{condition}");
    // Published again (a registration): still without the GPU, nothing new said.
    let before = pool_generation(&node);
    node.kubelet.register().await;
    wait_until("published again", &mut plugin, |_| pool_generation(&node) > before).await;
    assert_eq!(devices_of(&node).len(), 1);
    assert_eq!(plugin.stderr_text().matches(said).count(), 1, "{}", plugin.diagnostics());
    plugin.kill();
}

/// Puts the GPU `bus` (simgpu's bus number) in the fake sysfs under `root` as the kernel
/// does: below its root complex `complex` behind a bridge, linked relatively from
/// `sys/bus/pci/devices`, with its `numa_node`.
fn fake_sysfs_gpu(root: &std::path::Path, complex: &str, bus: u32, numa: &str) {
    let bdf = format!("0000:{bus:02x}:00.0");
    let device = root.join("sys/devices").join(complex).join("0000:00:03.1").join(&bdf);
    std::fs::create_dir_all(&device).unwrap();
    std::fs::write(device.join("numa_node"), format!("{numa}\n")).unwrap();
    let links = root.join("sys/bus/pci/devices");
    std::fs::create_dir_all(&links).unwrap();
    std::os::unix::fs::symlink(format!("../../../devices/{complex}/0000:00:03.1/{bdf}"), links.join(&bdf))
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slice_says_where_each_gpu_sits() {
    skip_on_real_gpu!("sets simgpu's NVLink pairs and reads a fake sysfs for simgpu's bus IDs");
    // Four GPUs NVLinked in pairs, two under each of two PCIe roots; GPU 3 has no NUMA
    // affinity.
    let gpu = SimGpu::new("8GiB,8GiB,8GiB,8GiB").with_context_overhead("64MiB").with_nvlink("0-1,2-3");
    let node = node_of(gpu, &[]).await;
    let sysfs = node.gpu.lib_dir().join("sysfs");
    for (index, complex, numa) in
        [(0, "pci0000:00", "0"), (1, "pci0000:00", "0"), (2, "pci0000:80", "1"), (3, "pci0000:80", "-1")]
    {
        fake_sysfs_gpu(&sysfs, complex, 0x10 + index, numa);
    }
    let mut plugin = start_settled(&node, &["--sysfs-root", sysfs.to_str().unwrap()]).await;
    let devices = devices_of(&node);
    assert_eq!(devices.len(), 4);
    let attribute = |gpu: usize, name: &str| devices[gpu]["attributes"].get(name).cloned();
    for (gpu, root, numa, peers, domain) in [
        (0, "pci0000:00", Some(0), "1", 0),
        (1, "pci0000:00", Some(0), "0", 0),
        (2, "pci0000:80", Some(1), "3", 2),
        (3, "pci0000:80", None, "2", 2),
    ] {
        let attributes = &devices[gpu]["attributes"];
        assert_eq!(
            attribute(gpu, "resource.kubernetes.io/pcieRoot"),
            Some(json!({"string": root})),
            "{attributes}"
        );
        assert_eq!(
            attribute(gpu, "resource.kubernetes.io/numaNode"),
            numa.map(|n| json!({"int": n})),
            "{attributes}"
        );
        assert_eq!(attribute(gpu, "nvlinkPeers"), Some(json!({"string": peers})), "{attributes}");
        assert_eq!(attribute(gpu, "nvlinkDomain"), Some(json!({"int": domain})), "{attributes}");
    }
    let sent = sent_slices(&node.api);
    kubernetes_validate::validate_objects(&sent, &["1.34", "1.37"]).unwrap_or_else(|e| panic!("{e}"));
    plugin.kill();

    // Without NVLink, and with a sysfs that lacks the GPUs: no such attribute at all.
    let plain = node_of(SimGpu::new("8GiB,8GiB").with_context_overhead("64MiB"), &[]).await;
    let empty = plain.gpu.lib_dir().join("empty-sysfs");
    std::fs::create_dir_all(&empty).unwrap();
    let mut plugin = start_settled(&plain, &["--sysfs-root", empty.to_str().unwrap()]).await;
    for device in devices_of(&plain) {
        let attributes = device["attributes"].as_object().unwrap();
        for name in [
            "resource.kubernetes.io/pcieRoot",
            "resource.kubernetes.io/numaNode",
            "nvlinkPeers",
            "nvlinkDomain",
        ] {
            assert!(!attributes.contains_key(name), "{name}: {attributes:?}");
        }
    }
    plugin.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_nvlink_setting_or_sysfs_root_stops_the_plugin_named() {
    skip_on_real_gpu!("SIMGPU_NVLINK is simgpu's setting");
    let node = node_of(SimGpu::new("8GiB,8GiB").with_nvlink("0-2"), &[]).await;
    let mut plugin = node.spawn_plugin(&[]);
    assert!(!plugin.wait(WAIT).success());
    let said = plugin.diagnostics();
    assert!(
        said.contains("simgpu: invalid SIMGPU_NVLINK=\"0-2\": device 2 in \"0-2\" does not exist"),
        "{said}"
    );
    assert!(said.contains("finding the GPUs"), "{said}");

    let node = node_of(SimGpu::new("8GiB"), &[]).await;
    let mut plugin = node.spawn_plugin(&["--sysfs-root", "/no/such/root"]);
    assert!(!plugin.wait(WAIT).success());
    let said = plugin.diagnostics();
    assert!(said.contains("--sysfs-root /no/such/root is not a folder"), "{said}");
}
