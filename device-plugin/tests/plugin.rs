//! The device plugin against a kubelet stand-in built from the official proto, over real
//! unix sockets, on simgpu: registration, the device list, preferred allocation packing
//! (and splitting more than one GPU's worth evenly over GPUs), Allocate's answer (shares on
//! two GPUs: both GPUs, each at its own fraction) and refusals, health change on an injected XID, re-registration
//! after a kubelet restart, clean exit on SIGTERM.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

use gpufrac_device_plugin::plugin::api::device_plugin_client::DevicePluginClient;
use gpufrac_device_plugin::plugin::api::registration_server::{Registration, RegistrationServer};
use gpufrac_device_plugin::plugin::api::{
    AllocateRequest, ContainerAllocateRequest, ContainerPreferredAllocationRequest, Empty,
    ListAndWatchResponse, PreferredAllocationRequest, RegisterRequest,
};
use hyper_util::rt::TokioIo;
use simgpu_state::env::SimGpuDir;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Endpoint, Server, Uri};
use tonic::{Request, Response, Status, Streaming};

const WAIT: Duration = Duration::from_secs(20);

struct Kubelet {
    registrations: mpsc::UnboundedSender<RegisterRequest>,
}

#[tonic::async_trait]
impl Registration for Kubelet {
    async fn register(&self, request: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let _ = self.registrations.send(request.into_inner());
        Ok(Response::new(Empty {}))
    }
}

/// Serves a kubelet stand-in on `dir/kubelet.sock`; returns the registrations it receives.
fn start_kubelet(dir: &Path) -> (mpsc::UnboundedReceiver<RegisterRequest>, tokio::task::JoinHandle<()>) {
    let socket = dir.join("kubelet.sock");
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket).expect("bind kubelet.sock");
    let (tx, rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        let _ = Server::builder()
            .add_service(RegistrationServer::new(Kubelet { registrations: tx }))
            .serve_with_incoming(UnixListenerStream::new(listener))
            .await;
    });
    (rx, task)
}

async fn connect(socket: PathBuf) -> DevicePluginClient<Channel> {
    let channel = Endpoint::try_from("http://[::]:50051")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await
        .expect("connect to the plugin");
    DevicePluginClient::new(channel)
}

fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(|d| d.parent()).unwrap().to_path_buf()
}

struct Plugin(Child);

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn next_list(stream: &mut Streaming<ListAndWatchResponse>) -> ListAndWatchResponse {
    tokio::time::timeout(WAIT, stream.message())
        .await
        .expect("a device list in time")
        .unwrap()
        .expect("stream open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_serves_the_kubelet() {
    let sim = SimGpuDir::new(&std::env::temp_dir(), &target_dir(), "16GiB,8GiB").expect("simgpu");
    let dir = sim.lib_dir().join("device-plugins");
    std::fs::create_dir(&dir).unwrap();
    let (mut registrations, kubelet) = start_kubelet(&dir);

    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gpufrac-device-plugin"));
    cmd.arg("--device-plugin-dir").arg(&dir).args([
        "--shares-per-gpu",
        "10",
        "--shim-dir",
        "/opt/gpufrac/lib",
        "--arbiter-socket",
        "/run/gpufrac/arbiter.sock",
    ]);
    sim.apply(&mut cmd);
    let mut plugin = Plugin(cmd.spawn().expect("start the plugin"));

    // Registration: serve first, then register, with the v1beta1 API and our resource.
    let reg = tokio::time::timeout(WAIT, registrations.recv()).await.expect("registration in time").unwrap();
    assert_eq!(reg.version, "v1beta1");
    assert_eq!(reg.resource_name, "gpufrac.io/gpu");
    assert_eq!(reg.endpoint, "gpufrac.sock");
    assert!(reg.options.expect("options").get_preferred_allocation_available);
    let socket = dir.join(&reg.endpoint);
    let mut client = connect(socket.clone()).await;

    // The device list: 10 shares per GPU, healthy, IDs <UUID>::<n>.
    let mut stream = client.list_and_watch(Empty {}).await.unwrap().into_inner();
    let list = next_list(&mut stream).await;
    assert_eq!(list.devices.len(), 20);
    assert!(list.devices.iter().all(|d| d.health == "Healthy" && d.id.len() <= 63));
    let gpu0 = simgpu_state::device_uuid(0);
    let gpu1 = simgpu_state::device_uuid(1);
    assert!(list.devices.iter().any(|d| d.id == format!("{gpu0}::0")));
    assert!(list.devices.iter().any(|d| d.id == format!("{gpu1}::9")));
    let id = |gpu: &str, n: u32| format!("{gpu}::{n}");

    // Preferred allocation packs onto the fullest GPU that fits.
    let mut available: Vec<String> = (7..10).map(|n| id(&gpu0, n)).collect();
    available.extend((0..10).map(|n| id(&gpu1, n)));
    let ask = |size: i32, must: Vec<String>| PreferredAllocationRequest {
        container_requests: vec![ContainerPreferredAllocationRequest {
            available_device_i_ds: available.clone(),
            must_include_device_i_ds: must,
            allocation_size: size,
        }],
    };
    let r = client.get_preferred_allocation(ask(2, vec![])).await.unwrap().into_inner();
    assert_eq!(r.container_responses[0].device_i_ds, vec![id(&gpu0, 7), id(&gpu0, 8)]);
    let r = client.get_preferred_allocation(ask(4, vec![])).await.unwrap().into_inner();
    assert!(r.container_responses[0].device_i_ds.iter().all(|d| d.starts_with(&gpu1)));
    let r = client.get_preferred_allocation(ask(2, vec![id(&gpu1, 5)])).await.unwrap().into_inner();
    assert_eq!(r.container_responses[0].device_i_ds[0], id(&gpu1, 5));

    // Allocate: one GPU, the shim and its settings.
    let alloc = |ids: Vec<String>| AllocateRequest {
        container_requests: vec![ContainerAllocateRequest { devices_ids: ids }],
    };
    let r = client.allocate(alloc((0..3).map(|n| id(&gpu1, n)).collect())).await.unwrap().into_inner();
    let c = &r.container_responses[0];
    assert_eq!(c.envs["NVIDIA_VISIBLE_DEVICES"], gpu1);
    assert_eq!(c.envs["GPUFRAC_MEMORY_REQUEST"], "0.3");
    assert_eq!(c.envs["LD_PRELOAD"], "/opt/gpufrac/lib/libgpufrac.so");
    assert_eq!(c.envs["GPUFRAC_ARBITER_SOCKET"], "/run/gpufrac/arbiter.sock");
    assert!(c.envs["GPUFRAC_GROUP"].starts_with("gpufrac-"));
    assert!(c.mounts.iter().any(|m| m.host_path == "/opt/gpufrac/lib" && m.read_only));
    assert!(c.mounts.iter().any(|m| m.host_path == "/run/gpufrac" && !m.read_only));
    // More than one GPU's worth (the webhook's num-devices: 2 × 0.6 = 12 of 10 per GPU):
    // split evenly, 6 on each GPU.
    let mut both: Vec<String> = (3..10).map(|n| id(&gpu0, n)).collect();
    both.extend((0..10).map(|n| id(&gpu1, n)));
    let r = client
        .get_preferred_allocation(PreferredAllocationRequest {
            container_requests: vec![ContainerPreferredAllocationRequest {
                available_device_i_ds: both,
                must_include_device_i_ds: vec![],
                allocation_size: 12,
            }],
        })
        .await
        .unwrap()
        .into_inner();
    let chosen = &r.container_responses[0].device_i_ds;
    let on = |gpu: &str| chosen.iter().filter(|d| d.starts_with(gpu)).count();
    assert_eq!((on(&gpu0), on(&gpu1)), (6, 6), "{chosen:?}");
    // Allocate: shares on two GPUs give both GPUs, each at its own fraction (the arbiter
    // reads each GPU's share count from the kubelet; the shim declares the largest).
    let mut two: Vec<String> = (0..6).map(|n| id(&gpu0, n)).collect();
    two.extend((0..4).map(|n| id(&gpu1, n)));
    let r = client.allocate(alloc(two)).await.unwrap().into_inner();
    let c = &r.container_responses[0];
    assert_eq!(c.envs["NVIDIA_VISIBLE_DEVICES"], format!("{gpu0},{gpu1}"), "both GPUs, in NVML's order");
    assert_eq!(c.envs["GPUFRAC_MEMORY_REQUEST"], "0.6", "the largest of 0.6 and 0.4");
    // Refusals, with clear messages.
    let err = client.allocate(alloc(vec!["GPU-nope::1".into()])).await.unwrap_err();
    assert!(err.message().contains("GPU-nope::1"), "{}", err.message());
    let err = client.allocate(alloc(vec![])).await.unwrap_err();
    assert!(err.message().contains("empty"), "{}", err.message());

    // Health: an application XID changes nothing; a critical one marks the GPU unhealthy.
    let machine =
        simgpu_state::Machine::open(sim.state_path().to_str().unwrap(), &[16 << 30, 8 << 30]).unwrap();
    assert!(machine.inject_xid(1, 13));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(machine.inject_xid(1, 79));
    let list = next_list(&mut stream).await;
    let unhealthy: Vec<_> = list.devices.iter().filter(|d| d.health == "Unhealthy").collect();
    assert_eq!(unhealthy.len(), 10, "all of GPU 1's shares, and only those");
    assert!(unhealthy.iter().all(|d| d.id.starts_with(&gpu1)));

    // A kubelet restart deletes every socket and recreates kubelet.sock: we register again.
    kubelet.abort();
    let _ = std::fs::remove_file(dir.join("kubelet.sock"));
    let _ = std::fs::remove_file(&socket);
    let (mut registrations, _kubelet) = start_kubelet(&dir);
    let again =
        tokio::time::timeout(WAIT, registrations.recv()).await.expect("re-registration in time").unwrap();
    assert_eq!(again.resource_name, "gpufrac.io/gpu");
    let mut client = connect(socket.clone()).await;
    let list = next_list(&mut client.list_and_watch(Empty {}).await.unwrap().into_inner()).await;
    assert_eq!(list.devices.len(), 20);

    // SIGTERM: a clean exit that removes the socket.
    // SAFETY: signalling our own child.
    unsafe { libc::kill(plugin.0.id() as i32, libc::SIGTERM) };
    let status = plugin.0.wait().unwrap();
    assert!(status.success(), "{status}");
    assert!(!socket.exists(), "the plugin removed its socket");
}
