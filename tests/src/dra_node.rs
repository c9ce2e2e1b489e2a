//! One Kubernetes node for the end-to-end tests of the DRA kubelet plugin (`tests/dra.rs`,
//! `tests/dra_slices.rs`, `tests/dra_claims.rs`), so that each test writes only what it
//! varies:
//!
//! - [`DraNode`]: a simulated GPU, the node's folders (the kubelet's plugin registry, the
//!   plugin's own folder with its checkpoint, the CDI folder; removed when dropped), an
//!   [`ApiServer`] stand-in already serving with a kubeconfig that points at it, and the
//!   [`Kubelet`] stand-in of the node. It starts `gpufrac-device-plugin dra` with the
//!   node's flags and a test's extra ones ([`DraNode::spawn_plugin`],
//!   [`DraNode::start_plugin`]), stops it cleanly ([`stop_cleanly`]), and starts an arbiter
//!   that entitles the node's pods to their claims ([`DraNode::entitling_arbiter`]).
//! - The objects a test puts in the API server: a pod on the node ([`pod_json`],
//!   [`DraNode::put_pod`]) and a claim the scheduler allocated on it
//!   ([`allocated_claim_json`], [`consumed_result`], [`reserved_for`],
//!   [`DraNode::put_claim`]), all in the namespace [`NAMESPACE`].
//! - Reading what the plugin wrote: [`read_json`], [`cdi_env`] (a CDI spec's environment),
//!   [`DraNode::spec_path`], [`DraNode::checkpoint`], [`sent_slices`] (the slices it sent,
//!   less what the API server added).
//! - Waiting: [`wait_until`] a condition holds while the plugin runs (its diagnostics on a
//!   timeout); [`registered_process`] until the arbiter lists a container's process.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use gpufrac_daemon::status::ProcessStatus;
use serde_json::{json, Value};

use crate::kube_standins::{ApiServer, Kubelet};
use crate::{artifact, compile_c, wait_for, Arbiter, ChildProcess, SimGpu};

/// How long a DRA test waits for the plugin (or a child) to do what it waits for.
pub const WAIT: Duration = Duration::from_secs(20);
/// The DRA driver's name: its device class, its slices' driver, its CDI vendor's domain.
pub const DRIVER: &str = "gpu.gpufrac.io";
/// The namespace of the tests' pods and claims.
pub const NAMESPACE: &str = "inference";
/// The share ID of an allocation [`consumed_result`] makes.
pub const SHARE_ID: &str = "5a1c9b7e-2f3d-4e5a-9b8c-7d6e5f4a3b2c";

/// A node of the cluster: a simulated GPU, the node's folders, the API server and the
/// kubelet. Dropping it removes the folders.
pub struct DraNode {
    /// The node's name (`--node-name`, the pool of its slice).
    pub name: String,
    /// The node's GPUs.
    pub gpu: SimGpu,
    /// The API server stand-in, serving at `address`.
    pub api: ApiServer,
    /// Where the API server serves.
    pub address: SocketAddr,
    /// A kubeconfig for the API server (the plugin's and the arbiter's `KUBECONFIG`).
    pub kubeconfig: PathBuf,
    /// The kubelet stand-in of this node, over `registry` and `cdi`.
    pub kubelet: Kubelet,
    /// The kubelet's plugin registry (`--plugins-registry`).
    pub registry: PathBuf,
    /// The plugin's folder (`--plugin-dir`): its DRA socket and its checkpoint.
    pub plugin: PathBuf,
    /// The CDI folder (`--cdi-dir`).
    pub cdi: PathBuf,
    /// The arbiter socket the plugin is told of (`--arbiter-socket`); `arbiter.sock` in the
    /// node's folder unless a test sets another.
    pub arbiter_socket: PathBuf,
    root: PathBuf,
}

impl DraNode {
    /// The node `name` with the GPUs `gpu`, its folders made, its API server (empty)
    /// serving.
    pub async fn new(name: &str, gpu: SimGpu) -> DraNode {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let root = std::env::temp_dir().join(format!("gpufrac-dra-node-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let registry = root.join("plugins_registry");
        std::fs::create_dir_all(&registry).unwrap_or_else(|e| panic!("creating {}: {e}", registry.display()));
        let cdi = root.join("cdi");
        let api = ApiServer::default();
        let address = api.clone().serve().await;
        let kubeconfig = root.join("kubeconfig");
        let text = format!(
            "apiVersion: v1\nkind: Config\n\
             clusters:\n- name: stand-in\n  cluster:\n    server: http://{address}\n\
             users:\n- name: plugin\n  user:\n    token: stand-in-token\n\
             contexts:\n- name: stand-in\n  context:\n    cluster: stand-in\n    user: plugin\n\
             current-context: stand-in\n"
        );
        std::fs::write(&kubeconfig, text).unwrap_or_else(|e| panic!("writing {}: {e}", kubeconfig.display()));
        let kubelet = Kubelet::new(name, &registry, &cdi, api.clone());
        DraNode {
            name: name.to_owned(),
            gpu,
            api,
            address,
            kubeconfig,
            kubelet,
            plugin: root.join("plugins").join(DRIVER),
            arbiter_socket: root.join("arbiter.sock"),
            registry,
            cdi,
            root,
        }
    }

    /// The plugin's registration socket in the registry.
    pub fn registration_socket(&self) -> PathBuf {
        self.kubelet.registration_socket()
    }

    /// Where the plugin writes the CDI spec of the claim of UID `uid`.
    pub fn spec_path(&self, uid: &str) -> PathBuf {
        self.cdi.join(format!("gpufrac.io-claim_{uid}.json"))
    }

    /// The plugin's checkpoint of prepared claims (the arbiter's `--dra-checkpoint`).
    pub fn checkpoint_path(&self) -> PathBuf {
        self.plugin.join("prepared-claims.json")
    }

    /// The checkpoint as it is now; no claims while there is none (or it does not parse).
    pub fn checkpoint(&self) -> Value {
        std::fs::read_to_string(self.checkpoint_path())
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_else(|| json!({"claims": {}}))
    }

    /// The API server's path of the claim `name` in [`NAMESPACE`].
    pub fn claim_path(&self, name: &str) -> String {
        format!("/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/{name}")
    }

    /// Stores the claim `claim` (a [`allocated_claim_json`]) at its path.
    pub fn put_claim(&self, claim: Value) {
        let name = claim["metadata"]["name"].as_str().expect("a claim's name").to_owned();
        self.api.put(&self.claim_path(&name), claim);
    }

    /// Stores the pod `name` of UID `uid`, running on this node ([`pod_json`]).
    pub fn put_pod(&self, name: &str, uid: &str) {
        self.api.put(&format!("/api/v1/namespaces/{NAMESPACE}/pods/{name}"), pod_json(&self.name, name, uid));
    }

    /// Starts `gpufrac-device-plugin dra` for this node (its registry, folders and
    /// [`DraNode::arbiter_socket`], the shim's folder of the build, logging at `info`)
    /// with the flags `extra` added, and returns at once.
    pub fn spawn_plugin(&self, extra: &[&str]) -> ChildProcess {
        let shim_dir = artifact("libgpufrac.so").parent().expect("the shim lives in a folder").to_path_buf();
        let mut cmd = self.gpu.command(artifact("gpufrac-device-plugin"));
        cmd.env("KUBECONFIG", &self.kubeconfig)
            .env("GPUFRAC_LOG", "info")
            .arg("--shim-dir")
            .arg(&shim_dir)
            .arg("--arbiter-socket")
            .arg(&self.arbiter_socket)
            .args(["dra", "--node-name", self.name.as_str(), "--plugins-registry"])
            .arg(&self.registry)
            .arg("--plugin-dir")
            .arg(&self.plugin)
            .arg("--cdi-dir")
            .arg(&self.cdi)
            .args(extra);
        ChildProcess::spawn(&mut cmd)
    }

    /// [`DraNode::spawn_plugin`], then waits for its registration socket (not registered
    /// yet: the test registers it, with the kubelet or by hand).
    pub async fn start_plugin(&self, extra: &[&str]) -> ChildProcess {
        let mut plugin = self.spawn_plugin(extra);
        wait_until("the registration socket", &mut plugin, |_| self.registration_socket().exists()).await;
        plugin
    }

    /// An arbiter on [`DraNode::arbiter_socket`] that entitles the node's pods to their
    /// prepared claims: `--kubernetes --node-name <node> --dra-checkpoint <checkpoint>`,
    /// with the node's kubeconfig.
    pub fn entitling_arbiter(&self) -> Arbiter {
        let checkpoint = self.checkpoint_path();
        let kubeconfig = self.kubeconfig.clone().into_os_string();
        Arbiter::start_with_env(
            &self.gpu,
            self.arbiter_socket.clone(),
            &[
                "--kubernetes",
                "--node-name",
                self.name.as_str(),
                "--dra-checkpoint",
                checkpoint.to_str().expect("a UTF-8 temporary folder"),
            ],
            &[("KUBECONFIG", kubeconfig.as_os_str())],
        )
    }

    /// A container of a claim on this node: `alloc_paths` (its `dlsym` path) with the CDI
    /// spec's environment `env`, allocating 256 MiB. Add to its environment what the
    /// container changes.
    pub fn container(&self, env: &BTreeMap<String, String>) -> Command {
        let program = compile_c("alloc_paths.c", &["MODE_DLSYM"], false);
        let mut cmd = self.gpu.command(&program);
        cmd.envs(env).args(["alloc", &(256u64 << 20).to_string()]);
        cmd
    }

    /// Marks GPU `index` unhealthy with XID 79 (fallen off the bus).
    pub fn inject_xid(&self, index: usize) {
        let sizes: Vec<u64> = (0..self.gpu.device_count()).map(|i| self.gpu.device_total(i)).collect();
        let state = self.gpu.state_path();
        let machine = simgpu_state::Machine::open(state.to_str().expect("a UTF-8 temporary folder"), &sizes)
            .unwrap_or_else(|e| panic!("opening {}: {e:?}", state.display()));
        assert!(machine.inject_xid(index, 79));
    }
}

impl Drop for DraNode {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Waits until `cond` holds of the running `plugin`, polling; fails the test with the
/// plugin's diagnostics after [`WAIT`].
pub async fn wait_until(what: &str, plugin: &mut ChildProcess, mut cond: impl FnMut(&ChildProcess) -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond(plugin) {
        assert!(Instant::now() < deadline, "timed out waiting for {what}\n{}", plugin.diagnostics());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Stops the plugin with SIGTERM and asserts that it exits cleanly.
pub fn stop_cleanly(plugin: &mut ChildProcess) {
    // SAFETY: kill(2) on our own child's PID, with a valid signal.
    assert_eq!(unsafe { libc::kill(plugin.pid() as i32, libc::SIGTERM) }, 0);
    let stopped = plugin.wait(WAIT);
    assert!(stopped.success(), "a clean exit: {}", plugin.diagnostics());
}

/// The JSON file at `path`; panics naming it if it cannot be read or parsed.
pub fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The environment a CDI spec's first device sets, by name; panics on an entry that is
/// not `NAME=value`.
pub fn cdi_env(spec: &Value) -> BTreeMap<String, String> {
    let env = spec["devices"][0]["containerEdits"]["env"].as_array().expect("the spec's env");
    env.iter()
        .map(|e| {
            let (k, v) = e.as_str().and_then(|e| e.split_once('=')).expect("NAME=value");
            (k.to_owned(), v.to_owned())
        })
        .collect()
}

/// The pod `name` of UID `uid` in [`NAMESPACE`], running on `node` at priority 100.
pub fn pod_json(node: &str, name: &str, uid: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid},
           "spec": {"containers": [{"name": "server", "image": "x"}], "priority": 100, "nodeName": node},
           "status": {"phase": "Running"}})
}

/// An allocation's result: the device `device` of `node`'s pool for the request `request`
/// (`gpu`, or a sub-request `gpu/small`), `memory` of its capacity consumed, as the share
/// [`SHARE_ID`].
pub fn consumed_result(node: &str, request: &str, device: &str, memory: &str) -> Value {
    json!({"request": request, "driver": DRIVER, "pool": node, "device": device, "shareID": SHARE_ID,
           "consumedCapacity": {"memory": memory}})
}

/// A claim's `reservedFor`: the pods `pods` (name, UID).
pub fn reserved_for(pods: &[(&str, &str)]) -> Value {
    pods.iter().map(|(name, uid)| json!({"resource": "pods", "name": name, "uid": uid})).collect()
}

/// The ResourceClaim `name` of UID `uid` in [`NAMESPACE`] as the API server returns it once
/// the scheduler allocated it on `node`: its spec's `devices` as `spec_devices`, the
/// allocation's `results`, the driver's opaque configuration `parameters` for the request
/// `gpu` (from the claim), reserved for the pods `pods` (name, UID).
pub fn allocated_claim_json(
    node: &str,
    name: &str,
    uid: &str,
    spec_devices: Value,
    results: Vec<Value>,
    parameters: &Value,
    pods: &[(&str, &str)],
) -> Value {
    json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid},
        "spec": {"devices": spec_devices},
        "status": {
            "allocation": {
                "devices": {
                    "results": results,
                    "config": [{"source": "FromClaim", "requests": ["gpu"],
                                "opaque": {"driver": DRIVER, "parameters": parameters}}]
                },
                "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]}
            },
            "reservedFor": reserved_for(pods)
        }
    })
}

/// `slice` as the plugin sent it: less what the API server stand-in added
/// (`metadata.resourceVersion`, `metadata.uid`), for validation against a schema.
pub fn as_sent(mut slice: Value) -> Value {
    if let Some(meta) = slice["metadata"].as_object_mut() {
        meta.remove("resourceVersion");
        meta.remove("uid");
    }
    slice
}

/// Every slice the plugin sent to `api`, [`as_sent`].
pub fn sent_slices(api: &ApiServer) -> Vec<Value> {
    api.slices_received().into_iter().map(as_sent).collect()
}

/// Waits until the arbiter lists the process `pid` on GPU 0 (`what` names it in the
/// failure) and returns it as listed.
pub fn registered_process(arbiter: &Arbiter, what: &str, pid: u32) -> ProcessStatus {
    registered_process_on(arbiter, 0, what, pid)
}

/// Waits until the arbiter lists the process `pid` on its GPU of index `gpu` (`what` names
/// it in the failure) and returns it as listed there.
pub fn registered_process_on(arbiter: &Arbiter, gpu: usize, what: &str, pid: u32) -> ProcessStatus {
    let on = |s: &gpufrac_daemon::status::Status| {
        s.gpus.get(gpu).and_then(|g| g.processes.iter().find(|p| p.pid == pid).cloned())
    };
    let seen = wait_for(arbiter, what, |s| on(s).is_some());
    on(&seen).expect("the process just seen")
}
