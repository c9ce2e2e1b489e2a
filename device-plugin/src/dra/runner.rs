//! The DRA plugin's life: serve the DRA API on `dra.sock` in the plugin's folder and the
//! registration API on `gpu.gpufrac.io-reg.sock` in the kubelet's plugin registry (the
//! kubelet's plugin watcher finds it there, at once or when the kubelet restarts, and asks
//! `GetInfo`); serve a socket again if it is removed; publish the ResourceSlice and keep
//! it true: again at every registration, whenever a GPU's health changes, and whenever a
//! watch of the driver's slices on this node shows it deleted (a kubelet restart wipes
//! them) or changed; on a clean stop, remove the sockets and leave the slice (a rollout's
//! new plugin takes it over; the kubelet deletes the slices of a plugin that stays gone),
//! and prepared claims stay in the checkpoint: their pods keep running.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt as _;
use kube::{Api, ResourceExt as _};
use tokio::net::UnixListener;
use tokio::sync::{oneshot, watch, Notify};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;

use super::api::registration::registration_server::RegistrationServer;
use super::api::{v1, v1beta1};
use super::cdi::CdiConfig;
use super::driver::Driver;
use super::gpus::GpuInfo;
use super::service::{DraService, RegistrationService};
use super::slices::{time_now, Publisher, Sharing};
use super::{registration_socket_name, DRA_SOCKET, DRIVER};
use crate::plugin::devices::Gpu;

/// How often the sockets are checked for removal.
const WATCH_EVERY: Duration = Duration::from_millis(250);
/// The first wait before publishing the slice again after a failure; it doubles up to
/// [`PUBLISH_RETRY_AT_MOST`].
const PUBLISH_RETRY_FIRST: Duration = Duration::from_millis(500);
/// The longest wait between attempts to publish.
const PUBLISH_RETRY_AT_MOST: Duration = Duration::from_secs(30);

/// How long a clean stop waits for a publish under way.
const STOP_WITHIN: Duration = Duration::from_secs(5);

/// Where the DRA plugin lives and what it gives containers.
#[derive(Debug, Clone)]
pub struct DraConfig {
    /// This node's name: the slice's node and pool.
    pub node_name: String,
    /// The kubelet's plugin registry folder.
    pub registry_dir: PathBuf,
    /// The plugin's own folder (DRA socket, checkpoint).
    pub plugin_dir: PathBuf,
    /// How each GPU is advertised.
    pub sharing: Sharing,
    /// What prepared claims' containers get.
    pub cdi: CdiConfig,
    /// How often prepared claims are checked for staleness against the API server.
    pub stale_claims_every: Duration,
}

/// Why the plugin could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum DraError {
    /// A socket could not be served.
    #[error("cannot serve {path}: {source}")]
    Serve {
        /// The socket.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// A folder could not be made.
    #[error("cannot create {path}: {source}")]
    Folder {
        /// The folder.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The checkpoint left by a previous run cannot be read.
    #[error(transparent)]
    Checkpoint(#[from] gpufrac_common::dra::CheckpointError),
}

fn inode(path: &Path) -> Option<u64> {
    std::fs::metadata(path).ok().map(|m| m.ino())
}

/// One socket being served.
struct Served {
    path: PathBuf,
    inode: Option<u64>,
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Served {
    async fn stop(self) {
        let _ = self.stop.send(());
        let abort = self.task.abort_handle();
        if tokio::time::timeout(Duration::from_millis(500), self.task).await.is_err() {
            abort.abort();
        }
        if inode(&self.path) == self.inode {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Serves `router` on the Unix socket `path`. The socket is bound and listening under a
/// hidden name first, then renamed into place (replacing an old one): whoever watches the
/// folder (the kubelet's plugin watcher, which skips names that start with a dot) never
/// finds a socket that refuses connections, as one between its bind and its listen does.
fn serve(path: &Path, router: tonic::transport::server::Router) -> Result<Served, DraError> {
    let failed = |source| DraError::Serve { path: path.to_owned(), source };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let hidden = path.with_file_name(format!(".{name}.binding"));
    let _ = std::fs::remove_file(&hidden);
    let listener = UnixListener::bind(&hidden).map_err(failed)?;
    if let Err(source) = std::fs::rename(&hidden, path) {
        let _ = std::fs::remove_file(&hidden);
        return Err(failed(source));
    }
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(router.serve_with_incoming_shutdown(UnixListenerStream::new(listener), async {
        let _ = stopped.await;
    }));
    Ok(Served { path: path.to_owned(), inode: inode(path), stop, task })
}

/// Runs the plugin until `shutdown`. `health` carries the GPUs' health (NVML XID events).
pub async fn run(
    config: DraConfig,
    client: kube::Client,
    gpus: Vec<GpuInfo>,
    health: watch::Receiver<Vec<Gpu>>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), DraError> {
    tokio::pin!(shutdown);
    for dir in [&config.plugin_dir, &config.cdi.dir] {
        std::fs::create_dir_all(dir).map_err(|source| DraError::Folder { path: dir.clone(), source })?;
    }
    let checkpoint = config.plugin_dir.join(gpufrac_common::dra::CHECKPOINT_FILE);
    let driver = Arc::new(Driver::new(
        client.clone(),
        config.node_name.clone(),
        gpus.clone(),
        config.sharing,
        config.cdi.clone(),
        checkpoint,
    )?);
    // Prepared claims kept true (specs after a reboot, shared claims' pods, stale claims).
    let keeping_claims = tokio::spawn(driver.clone().keep_claims(config.stale_claims_every));
    let dra_socket = config.plugin_dir.join(DRA_SOCKET);
    let registration_socket = config.registry_dir.join(registration_socket_name());

    let (stop_publishing, publishing_stopped) = oneshot::channel::<()>();
    let registered = Arc::new(Notify::new());
    // Publishing never holds up serving: the API server may be slow or away.
    let publisher = {
        let (node, sharing, registered) = (config.node_name.clone(), config.sharing, registered.clone());
        tokio::spawn(async move {
            let slices = Api::<ResourceSlice>::all(client.clone());
            let publisher = Publisher::new(client, &node, sharing).await;
            let triggers = Triggers { health, registered, slices, stopped: publishing_stopped };
            keep_published(publisher, gpus, triggers).await;
        })
    };

    let serve_dra = || {
        let service = DraService::new(driver.clone());
        serve(
            &dra_socket,
            Server::builder()
                .add_service(v1::dra_plugin_server::DraPluginServer::new(service.clone()))
                .add_service(v1beta1::dra_plugin_server::DraPluginServer::new(service)),
        )
    };
    let serve_registration = || {
        let service = RegistrationService {
            endpoint: dra_socket.display().to_string(),
            registered: registered.clone(),
        };
        serve(&registration_socket, Server::builder().add_service(RegistrationServer::new(service)))
    };
    // The DRA socket first: the kubelet dials it as soon as it has the registration.
    let mut dra = serve_dra()?;
    let mut registration = serve_registration()?;
    tracing::info!(
        dra = %dra_socket.display(),
        registration = %registration_socket.display(),
        "serving the DRA kubelet plugin"
    );
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tokio::time::sleep(WATCH_EVERY) => {}
        }
        if inode(&dra_socket) != dra.inode {
            tracing::info!(socket = %dra_socket.display(), "the DRA socket was removed: serving it again");
            dra.stop().await;
            dra = serve_dra()?;
        }
        if inode(&registration_socket) != registration.inode {
            tracing::info!(socket = %registration_socket.display(), "the registration socket was removed: serving it again");
            registration.stop().await;
            registration = serve_registration()?;
        }
    }
    registration.stop().await;
    dra.stop().await;
    keeping_claims.abort();
    let _ = stop_publishing.send(());
    // The slice stays: a rollout's next plugin takes it over at once, and the kubelet
    // deletes the slices of a plugin that does not come back.
    let abort = publisher.abort_handle();
    if tokio::time::timeout(STOP_WITHIN, publisher).await.is_err() {
        tracing::warn!("the ResourceSlice publisher did not stop within {STOP_WITHIN:?}");
        abort.abort();
    }
    tracing::info!("stopped");
    Ok(())
}

/// What makes the publisher look at the slice again.
struct Triggers {
    /// The GPUs' health.
    health: watch::Receiver<Vec<Gpu>>,
    /// A successful registration with the kubelet.
    registered: Arc<Notify>,
    /// The ResourceSlices, watched for this node and driver.
    slices: Api<ResourceSlice>,
    /// The plugin stops.
    stopped: oneshot::Receiver<()>,
}

/// Why the slice is looked at again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sync {
    /// Written whatever is stored (start, registration).
    Force,
    /// Written if missing or not what the plugin wants.
    IfChanged,
}

impl Sync {
    fn or(self, other: Option<Sync>) -> Sync {
        if other == Some(Sync::Force) {
            Sync::Force
        } else {
            self
        }
    }
}

/// Keeps the slice true until `stopped`: published at start and at every registration,
/// synchronised whenever a GPU's health changes or the watch of this node's slices of
/// this driver shows a change that is not the publisher's own write, retrying failures
/// with a backoff. Unhealthy GPUs are tainted (or removed where taints are dropped).
async fn keep_published(mut publisher: Publisher, gpus: Vec<GpuInfo>, triggers: Triggers) {
    let Triggers { mut health, registered, slices, mut stopped } = triggers;
    let selector = format!("spec.nodeName={},spec.driver={DRIVER}", publisher.node());
    let config = watcher::Config::default().fields(&selector);
    let watch = watcher(slices, config).default_backoff();
    tokio::pin!(watch);
    let mut unhealthy = BTreeMap::new();
    let mut pending = Some(Sync::Force);
    let mut retry = PUBLISH_RETRY_FIRST;
    // When the next attempt after a failure may be made.
    let mut retry_at: Option<tokio::time::Instant> = None;
    loop {
        // Since when each GPU is unhealthy (the taint's time), kept across writes. A change
        // read here is published even when the loop woke for something else: marked seen,
        // it would not wake `changed()` below (an XID just after a registration's publish
        // stayed unpublished so).
        let (changed, now_healthy): (bool, Vec<(String, bool)>) = {
            let seen = health.borrow_and_update();
            (seen.has_changed(), seen.iter().map(|g| (g.uuid.clone(), g.healthy)).collect())
        };
        if changed {
            pending = Some(Sync::IfChanged.or(pending));
        }
        for (uuid, healthy) in now_healthy {
            if healthy {
                unhealthy.remove(&uuid);
            } else {
                unhealthy.entry(uuid).or_insert_with(time_now);
            }
        }
        if let Some(sync) = pending.filter(|_| retry_at.is_none()) {
            match publisher.sync(&gpus, &unhealthy, sync == Sync::Force).await {
                Ok(_) => {
                    retry = PUBLISH_RETRY_FIRST;
                    pending = None;
                }
                Err(e) => {
                    tracing::warn!("publishing the ResourceSlice: {e}; retrying in {retry:?}");
                    retry_at = Some(tokio::time::Instant::now() + retry);
                    retry = (retry * 2).min(PUBLISH_RETRY_AT_MOST);
                }
            }
        }
        tokio::select! {
            _ = &mut stopped => return,
            changed = health.changed() => {
                if changed.is_err() {
                    // The health watcher is gone: nothing will change again.
                    let _ = (&mut stopped).await;
                    return;
                }
                pending = Some(Sync::IfChanged.or(pending));
            }
            () = registered.notified() => {
                tracing::info!("registered: publishing the ResourceSlice again");
                pending = Some(Sync::Force);
            }
            event = watch.next() => match event {
                Some(Ok(event)) => {
                    if let Some(sync) = watched(&publisher, event).await {
                        pending = Some(sync.or(pending));
                    }
                }
                Some(Err(e)) => tracing::warn!("watching this node's ResourceSlices: {e}"),
                None => {}
            },
            _ = tokio::time::sleep_until(retry_at.unwrap_or_else(tokio::time::Instant::now)), if retry_at.is_some() => {
                retry_at = None;
            }
        }
    }
}

/// What a watch event of this node's slices of this driver asks for.
async fn watched(publisher: &Publisher, event: watcher::Event<ResourceSlice>) -> Option<Sync> {
    let ours = publisher.name();
    match event {
        watcher::Event::Apply(slice) | watcher::Event::InitApply(slice) if slice.name_any() != ours => {
            publisher.delete_stray(&slice.name_any()).await;
            None
        }
        // The publisher's own write, seen again.
        watcher::Event::Apply(slice) if publisher.wrote(&slice) => None,
        watcher::Event::Apply(_) => {
            tracing::info!(slice = %ours, "the ResourceSlice was changed by someone else: publishing it again");
            Some(Sync::IfChanged)
        }
        watcher::Event::Delete(slice) if slice.name_any() == ours => {
            tracing::info!(slice = %ours, "the ResourceSlice was deleted (a kubelet restart wipes them): publishing it again");
            Some(Sync::IfChanged)
        }
        // A (re)listing is complete: what is stored now is known.
        watcher::Event::InitDone => {
            tracing::info!(slice = %ours, "watching this node's ResourceSlices");
            Some(Sync::IfChanged)
        }
        watcher::Event::Delete(_) | watcher::Event::Init | watcher::Event::InitApply(_) => None,
    }
}
