//! The DRA driver end to end, on simgpu, with the real binaries: `gpufrac-device-plugin dra`
//! against a kubelet stand-in built from the official DRA and plugin-registration protos
//! (the plugin crate's generated clients) and an API-server stand-in that serves
//! ResourceClaims, pods and the node and receives ResourceSlices.
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
//! - Without consumable capacity (`--shares`): each GPU is published as share devices, and a
//!   claim's shares on one GPU add up to its request.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpufrac_device_plugin::dra::api::registration::registration_client::RegistrationClient;
use gpufrac_device_plugin::dra::api::registration::{InfoRequest, RegistrationStatus};
use gpufrac_device_plugin::dra::api::{v1, v1beta1};
use gpufrac_e2e::kube_standins::{channel, ApiServer};
use gpufrac_e2e::pod_cgroup::PodCgroup;
use gpufrac_e2e::{
    artifact, compile_c, kubernetes_validate, skip_on_real_gpu, wait_for, Arbiter, ChildProcess, SimGpu,
};
use serde_json::{json, Value};

const GIB: u64 = 1 << 30;
const WAIT: Duration = Duration::from_secs(20);
const NODE: &str = "node-a";
const CLAIM_UID: &str = "0f3c2a9e-1111-4222-8333-444455556666";
const BAD_CLAIM_UID: &str = "0f3c2a9e-9999-4222-8333-444455556666";
const POD_UID: &str = "7a1b2c3d-0000-4000-8000-000000000001";
/// Why this needs simgpu: it injects an XID and sizes claims against simgpu's devices.
const SIMULATED: &str = "injects XIDs into simgpu and sizes claims to its devices";

/// The pod the claims are reserved for, running on our node.
fn pod() -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "llm-0", "namespace": "inference", "uid": POD_UID, "resourceVersion": "99"},
           "spec": {"containers": [{"name": "server", "image": "x"}], "priority": 100, "nodeName": NODE},
           "status": {"phase": "Running"}})
}

/// A claim as the API server returns it once the scheduler allocated it: `memory` of the
/// device `device` consumed, the opaque configuration `parameters`, reserved for our pod.
fn allocated_claim(name: &str, uid: &str, device: &str, memory: &str, parameters: Value) -> Value {
    let result = json!({
        "request": "gpu", "driver": "gpu.gpufrac.io", "pool": NODE, "device": device,
        "shareID": "5a1c9b7e-2f3d-4e5a-9b8c-7d6e5f4a3b2c",
        "consumedCapacity": {"memory": memory}
    });
    claim_with_results(name, uid, vec![result], parameters)
}

/// A claim allocated with `results`.
fn claim_with_results(name: &str, uid: &str, results: Vec<Value>, parameters: Value) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "inference", "uid": uid, "resourceVersion": "17"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.gpufrac.io"}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.gpufrac.io", "parameters": parameters}}]
        }},
        "status": {
            "allocation": {
                "devices": {
                    "results": results,
                    "config": [{"source": "FromClaim", "requests": ["gpu"],
                                "opaque": {"driver": "gpu.gpufrac.io", "parameters": parameters}}]
                },
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}
            },
            "reservedFor": [{"resource": "pods", "name": "llm-0", "uid": POD_UID}]
        }
    })
}

fn write_kubeconfig(dir: &Path, address: SocketAddr) -> PathBuf {
    let path = dir.join("kubeconfig");
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: stand-in\n  cluster:\n    server: http://{address}\n\
         users:\n- name: plugin\n  user:\n    token: stand-in-token\ncontexts:\n- name: stand-in\n  context:\n    \
         cluster: stand-in\n    user: plugin\ncurrent-context: stand-in\n"
    );
    std::fs::write(&path, text).unwrap();
    path
}

struct Dirs {
    _root: PathBuf,
    registry: PathBuf,
    plugin: PathBuf,
    cdi: PathBuf,
}

impl Dirs {
    fn new() -> Dirs {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let root = std::env::temp_dir().join(format!("gpufrac-dra-e2e-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dirs = Dirs {
            registry: root.join("plugins_registry"),
            plugin: root.join("plugins/gpu.gpufrac.io"),
            cdi: root.join("cdi"),
            _root: root,
        };
        std::fs::create_dir_all(&dirs.registry).unwrap();
        dirs
    }

    fn registration_socket(&self) -> PathBuf {
        self.registry.join("gpu.gpufrac.io-reg.sock")
    }
}

impl Drop for Dirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self._root);
    }
}

fn start_plugin(
    gpu: &SimGpu,
    dirs: &Dirs,
    kubeconfig: &Path,
    arbiter_socket: &Path,
    extra: &[&str],
) -> ChildProcess {
    let shim_dir = artifact("libgpufrac.so").parent().unwrap().to_path_buf();
    let mut cmd = gpu.command(artifact("gpufrac-device-plugin"));
    cmd.env("KUBECONFIG", kubeconfig)
        .env("GPUFRAC_LOG", "info")
        .arg("--shim-dir")
        .arg(&shim_dir)
        .arg("--arbiter-socket")
        .arg(arbiter_socket)
        .args(["dra", "--node-name", NODE, "--plugins-registry"])
        .arg(&dirs.registry)
        .arg("--plugin-dir")
        .arg(&dirs.plugin)
        .arg("--cdi-dir")
        .arg(&dirs.cdi)
        .args(extra);
    ChildProcess::spawn(&mut cmd)
}

async fn wait_until(what: &str, plugin: &mut ChildProcess, mut cond: impl FnMut(&ChildProcess) -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond(plugin) {
        assert!(Instant::now() < deadline, "timed out waiting for {what}\n{}", plugin.diagnostics());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What the kubelet's plugin watcher does with a new registration socket: `GetInfo`, then
/// `NotifyRegistrationStatus`. Returns the DRA endpoint.
async fn register(dirs: &Dirs) -> String {
    let mut client = RegistrationClient::new(channel(dirs.registration_socket()).await);
    let info = client.get_info(InfoRequest {}).await.expect("GetInfo").into_inner();
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "gpu.gpufrac.io");
    assert_eq!(info.supported_versions, ["v1.DRAPlugin", "v1beta1.DRAPlugin"]);
    assert_eq!(Path::new(&info.endpoint), dirs.plugin.join("dra.sock"));
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

/// The environment a CDI spec's first device sets, by name.
fn cdi_env(spec: &Value) -> BTreeMap<String, String> {
    let env = spec["devices"][0]["containerEdits"]["env"].as_array().expect("the spec's env");
    env.iter()
        .map(|e| {
            let (k, v) = e.as_str().and_then(|e| e.split_once('=')).expect("NAME=value");
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn inode(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::metadata(path).ok().map(|m| m.ino())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dra_plugin_serves_the_kubelet_and_the_api_server() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new("16GiB,8GiB").with_context_overhead("64MiB");
    let dirs = Dirs::new();
    let api = ApiServer::default();
    api.put(
        &format!("/api/v1/nodes/{NODE}"),
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "uid": "node-uid-1"}}),
    );
    api.put("/api/v1/namespaces/inference/pods/llm-0", pod());
    let claim_path = "/apis/resource.k8s.io/v1/namespaces/inference/resourceclaims/llm-gpu";
    api.put(
        claim_path,
        allocated_claim(
            "llm-gpu",
            CLAIM_UID,
            "gpu-0",
            "2Gi",
            json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": "4Gi", "resolver": "swap"}),
        ),
    );
    api.put(
        "/apis/resource.k8s.io/v1/namespaces/inference/resourceclaims/bad",
        allocated_claim(
            "bad",
            BAD_CLAIM_UID,
            "gpu-1",
            "1Gi",
            json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "resolver": "fastest"}),
        ),
    );
    let address = api.clone().serve().await;
    let kubeconfig = write_kubeconfig(&dirs._root, address);
    let arbiter = Arbiter::start(&gpu);

    // Registration and the slice.
    let mut plugin = start_plugin(&gpu, &dirs, &kubeconfig, arbiter.socket(), &[]);
    wait_until("the registration socket", &mut plugin, |_| dirs.registration_socket().exists()).await;
    let endpoint = register(&dirs).await;
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
    assert_eq!(device.share_id.as_deref(), Some("5a1c9b7e-2f3d-4e5a-9b8c-7d6e5f4a3b2c"));
    let cdi_id = format!("gpufrac.io/claim={CLAIM_UID}-gpu-0");
    assert_eq!(device.cdi_device_ids, std::slice::from_ref(&cdi_id));
    let spec_path = dirs.cdi.join(format!("gpufrac.io-claim_{CLAIM_UID}.json"));
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
    let checkpoint = read_json(&dirs.plugin.join("prepared-claims.json"));
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
    assert!(!dirs.cdi.join(format!("gpufrac.io-claim_{BAD_CLAIM_UID}.json")).exists());
    // A malformed request from the kubelet is refused, naming what is wrong.
    let odd = prepare(&endpoint, "../llm-gpu", "0f3c2a9e-7777-4222-8333-444455556666").await;
    assert!(odd.error.contains("not a Kubernetes name"), "{}", odd.error);
    let odd = prepare(&endpoint, "llm-gpu", "../../etc").await;
    assert!(odd.error.contains("not a Kubernetes UID"), "{}", odd.error);

    // The container: a process with the CDI spec's environment runs under the arbiter with
    // the claim's request and limit, and sees the limit as its device.
    let program = compile_c("alloc_paths.c", &["MODE_DLSYM"], false);
    let mut cmd = gpu.command(&program);
    cmd.envs(&env).args(["alloc", &(256u64 << 20).to_string()]);
    let mut container = ChildProcess::spawn(&mut cmd);
    let ready = container.ready();
    assert_eq!(ready[2], 4 * GIB, "the limit is the device: {ready:?}\n{}", container.diagnostics());
    assert!(ready[0] <= 4 * GIB, "held to the limit: {ready:?}");
    let pid = container.pid();
    let seen = wait_for(&arbiter, "the container's process registered", |s| {
        s.gpus[0].processes.iter().any(|p| p.pid == pid)
    });
    let process = seen.gpus[0].processes.iter().find(|p| p.pid == pid).unwrap();
    assert_eq!((process.request, process.limit), (2 * GIB, 4 * GIB), "{process:?}");
    assert_eq!(process.group, format!("dra-{CLAIM_UID}"), "{process:?}");
    container.kill();

    // A GPU with a critical XID stays in the slice, tainted.
    let generation = api.slice(NODE).unwrap()["spec"]["pool"]["generation"].as_i64().unwrap();
    let machine =
        simgpu_state::Machine::open(gpu.state_path().to_str().unwrap(), &[16 * GIB, 8 * GIB]).unwrap();
    assert!(machine.inject_xid(1, 79));
    wait_until("gpu-1 tainted", &mut plugin, |_| {
        api.slice(NODE).is_some_and(|s| !s["spec"]["devices"][1]["taints"].is_null())
    })
    .await;
    let slice = api.slice(NODE).unwrap();
    assert_eq!(slice["spec"]["devices"][1]["name"], "gpu-1");
    assert_eq!(slice["spec"]["devices"][1]["taints"][0]["key"], "gpu.gpufrac.io/unhealthy", "{slice}");
    assert!(slice["spec"]["pool"]["generation"].as_i64().unwrap() > generation, "{slice}");

    // Every slice the plugin sent is one the API server of 1.34 and of 1.37 accepts.
    let sent: Vec<Value> = api
        .slices_received()
        .into_iter()
        .map(|mut s| {
            // What the stand-in added is the server's, not the plugin's.
            let meta = s["metadata"].as_object_mut().unwrap();
            meta.remove("resourceVersion");
            meta.remove("uid");
            s
        })
        .collect();
    assert!(sent.len() >= 2);
    kubernetes_validate::validate_objects(&sent, &["1.34", "1.37"]).unwrap_or_else(|e| panic!("{e}"));

    // The kubelet restarts and cleans its registry: the plugin serves its socket again.
    std::fs::remove_file(dirs.registration_socket()).unwrap();
    wait_until("the registration socket again", &mut plugin, |p| {
        p.stderr_text().contains("the registration socket was removed: serving it again")
            && dirs.registration_socket().exists()
    })
    .await;
    register(&dirs).await;

    // The plugin crashes and comes back: the claim is still prepared (nothing written),
    // and, the claim gone from the API server, it is unprepared from the checkpoint.
    plugin.kill();
    let _ = plugin.wait(WAIT);
    let mut plugin = start_plugin(&gpu, &dirs, &kubeconfig, arbiter.socket(), &[]);
    wait_until("the restarted plugin serving", &mut plugin, |p| {
        p.stderr_text().contains("serving the DRA kubelet plugin")
    })
    .await;
    let endpoint = register(&dirs).await;
    let after_restart = prepare(&endpoint, "llm-gpu", CLAIM_UID).await;
    assert_eq!(after_restart.devices, answer.devices);
    assert_eq!(inode(&spec_path), written, "prepared claims survive a restart without being prepared again");
    api.remove(claim_path);
    assert_eq!(unprepare(&endpoint, "llm-gpu", CLAIM_UID).await, "");
    assert!(!spec_path.exists(), "the CDI spec is removed");
    let checkpoint = read_json(&dirs.plugin.join("prepared-claims.json"));
    assert_eq!(checkpoint["claims"], json!({}), "{checkpoint}");
    assert_eq!(unprepare(&endpoint, "llm-gpu", CLAIM_UID).await, "", "unpreparing twice is fine");

    // A clean stop removes the sockets and leaves the slice (a rollout's next plugin).
    // SAFETY: kill(2) on our own child's PID, with a valid signal.
    assert_eq!(unsafe { libc::kill(plugin.pid() as i32, libc::SIGTERM) }, 0);
    let stopped = plugin.wait(WAIT);
    assert!(stopped.success(), "a clean exit: {}", plugin.diagnostics());
    assert!(api.slice(NODE).is_some(), "the slice stays at a clean stop");
    assert!(!dirs.registration_socket().exists());
    assert!(!dirs.plugin.join("dra.sock").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_consumable_capacity_gpus_are_published_as_shares() {
    skip_on_real_gpu!(SIMULATED);
    let gpu = SimGpu::new("16GiB,8GiB").with_context_overhead("64MiB");
    let dirs = Dirs::new();
    let api = ApiServer::default();
    let shares: Vec<Value> = ["gpu-1-0", "gpu-1-2"]
        .iter()
        .map(|device| json!({"request": "gpu", "driver": "gpu.gpufrac.io", "pool": NODE, "device": device}))
        .collect();
    api.put(
        "/apis/resource.k8s.io/v1/namespaces/inference/resourceclaims/two-shares",
        claim_with_results(
            "two-shares",
            CLAIM_UID,
            shares,
            json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig"}),
        ),
    );
    let address = api.clone().serve().await;
    let kubeconfig = write_kubeconfig(&dirs._root, address);
    let socket = dirs._root.join("arbiter.sock");

    // More shares than a slice holds are refused, naming the flag.
    let mut refused = start_plugin(&gpu, &dirs, &kubeconfig, &socket, &["--shares", "100"]);
    let status = refused.wait(WAIT);
    assert!(!status.success());
    // (diagnostics() waits for the reader of its stderr to reach the end.)
    let said = refused.diagnostics();
    assert!(refused.stderr_text().contains("--shares 100"), "{said}");

    let mut plugin = start_plugin(&gpu, &dirs, &kubeconfig, &socket, &["--shares", "4"]);
    wait_until("the registration socket", &mut plugin, |_| dirs.registration_socket().exists()).await;
    let endpoint = register(&dirs).await;
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
    let mut published = slice.clone();
    let meta = published["metadata"].as_object_mut().unwrap();
    meta.remove("resourceVersion");
    meta.remove("uid");
    kubernetes_validate::validate_objects(&[published], &["1.34", "1.37"]).unwrap_or_else(|e| panic!("{e}"));

    // Two shares of GPU 1: one fraction of 4 GiB, both devices answered with one CDI device.
    let answer = prepare(&endpoint, "two-shares", CLAIM_UID).await;
    assert_eq!(answer.error, "", "{}", plugin.diagnostics());
    let names: Vec<&str> = answer.devices.iter().map(|d| d.device_name.as_str()).collect();
    assert_eq!(names, ["gpu-1-0", "gpu-1-2"]);
    let cdi_id = format!("gpufrac.io/claim={CLAIM_UID}-gpu-1");
    assert!(answer.devices.iter().all(|d| d.cdi_device_ids == [cdi_id.clone()]), "{:?}", answer.devices);
    let spec = read_json(&dirs.cdi.join(format!("gpufrac.io-claim_{CLAIM_UID}.json")));
    let env = spec["devices"][0]["containerEdits"]["env"].as_array().unwrap();
    assert!(env.contains(&json!(format!("GPUFRAC_MEMORY_REQUEST={}", 4 * GIB))), "{env:?}");
    assert!(env.contains(&json!(format!("GPUFRAC_MEMORY_LIMIT={}", 4 * GIB))), "{env:?}");
    assert!(env.contains(&json!("GPUFRAC_RESOLVER=wait")), "the default resolver, spelt out: {env:?}");
    plugin.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_arbiter_entitles_a_pods_process_to_its_prepared_claim() {
    skip_on_real_gpu!(SIMULATED);
    let cgroup = match PodCgroup::make(POD_UID) {
        Ok(cgroup) => cgroup,
        Err(why) => {
            gpufrac_e2e::report_skip(
                gpufrac_e2e::Skip::ThisMachine,
                &format!("this machine does not let the test make a pod's cgroup ({why})"),
            );
            return;
        }
    };
    let gpu = SimGpu::new("16GiB,8GiB").with_context_overhead("64MiB");
    let dirs = Dirs::new();
    let api = ApiServer::default();
    api.put("/api/v1/namespaces/inference/pods/llm-0", pod());
    api.put(
        "/apis/resource.k8s.io/v1/namespaces/inference/resourceclaims/llm-gpu",
        allocated_claim(
            "llm-gpu",
            CLAIM_UID,
            "gpu-0",
            "2Gi",
            json!({"apiVersion": "gpufrac.io/v1", "kind": "GpuFractionConfig", "limit": "4Gi"}),
        ),
    );
    let address = api.clone().serve().await;
    let kubeconfig = write_kubeconfig(&dirs._root, address);
    let checkpoint = dirs.plugin.join("prepared-claims.json");
    let socket = dirs._root.join("arbiter.sock");
    let kubeconfig_os = kubeconfig.clone().into_os_string();
    let arbiter = Arbiter::start_with_env(
        &gpu,
        socket.clone(),
        &["--kubernetes", "--node-name", NODE, "--dra-checkpoint", checkpoint.to_str().unwrap()],
        &[("KUBECONFIG", kubeconfig_os.as_os_str())],
    );

    let mut plugin = start_plugin(&gpu, &dirs, &kubeconfig, &socket, &[]);
    wait_until("the registration socket", &mut plugin, |_| dirs.registration_socket().exists()).await;
    let endpoint = register(&dirs).await;
    let answer = prepare(&endpoint, "llm-gpu", CLAIM_UID).await;
    assert_eq!(answer.error, "", "{}", plugin.diagnostics());
    let spec = read_json(&dirs.cdi.join(format!("gpufrac.io-claim_{CLAIM_UID}.json")));
    let env = cdi_env(&spec);

    // The pod's process asks for more than its claim (its environment is its own to
    // change): the arbiter believes the claim.
    let program = compile_c("alloc_paths.c", &["MODE_DLSYM"], false);
    let mut cmd = gpu.command(&program);
    cmd.envs(&env)
        .env("GPUFRAC_MEMORY_REQUEST", (6 * GIB).to_string())
        .env("GPUFRAC_MEMORY_LIMIT", (8 * GIB).to_string())
        .env("GPUFRAC_GROUP", "someone-elses-group")
        .args(["alloc", &(256u64 << 20).to_string()]);
    cgroup.enter(&mut cmd);
    let mut container = ChildProcess::spawn(&mut cmd);
    let ready = container.ready();
    let pid = container.pid();
    let seen = wait_for(&arbiter, "the pod's process registered", |s| {
        s.gpus[0].processes.iter().any(|p| p.pid == pid)
    });
    let process = seen.gpus[0].processes.iter().find(|p| p.pid == pid).unwrap();
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
    let mut cmd = gpu.command(&program);
    cmd.envs(&env).args(["alloc", &(256u64 << 20).to_string()]);
    cgroup.enter(&mut cmd);
    let mut late = ChildProcess::spawn(&mut cmd);
    let late_pid = late.pid();
    let _ = late.next_line(WAIT);
    let seen = wait_for(&arbiter, "the late process registered", |s| {
        s.gpus[0].processes.iter().any(|p| p.pid == late_pid)
    });
    let registered = seen.gpus[0].processes.iter().find(|p| p.pid == late_pid);
    assert!(
        registered.is_none_or(|p| p.request == 0),
        "no claim, no guarantee: {registered:?}\n{}",
        arbiter.log_text()
    );
    late.kill();
    let _ = late.wait(WAIT);
    plugin.kill();
}
