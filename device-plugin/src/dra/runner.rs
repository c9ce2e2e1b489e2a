//! The DRA plugin's life: serve the DRA API on `dra.sock` in the plugin's folder and the
//! registration API on `gpu.gpufrac.io-reg.sock` in the kubelet's plugin registry (the
//! kubelet's plugin watcher finds it there, at once or when the kubelet restarts, and asks
//! `GetInfo`); serve a socket again if it is removed; publish the ResourceSlice and keep
//! it current with the GPUs' health; on a clean stop, remove the sockets and the slice
//! (prepared claims stay in the checkpoint: their pods keep running).

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;

use super::api::registration::registration_server::RegistrationServer;
use super::api::{v1, v1beta1};
use super::cdi::CdiConfig;
use super::driver::Driver;
use super::gpus::GpuInfo;
use super::service::{DraService, RegistrationService};
use super::slices::{Publisher, Sharing};
use super::{registration_socket_name, DRA_SOCKET};
use crate::plugin::devices::Gpu;

/// How often the sockets are checked for removal.
const WATCH_EVERY: Duration = Duration::from_millis(250);
/// The first wait before publishing the slice again after a failure; it doubles up to
/// [`PUBLISH_RETRY_AT_MOST`].
const PUBLISH_RETRY_FIRST: Duration = Duration::from_millis(500);
/// The longest wait between attempts to publish.
const PUBLISH_RETRY_AT_MOST: Duration = Duration::from_secs(30);

/// How long a clean stop waits for the API server to delete the slice.
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

fn serve(path: &Path, router: tonic::transport::server::Router) -> Result<Served, DraError> {
    let _ = std::fs::remove_file(path);
    let listener =
        UnixListener::bind(path).map_err(|source| DraError::Serve { path: path.to_owned(), source })?;
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
    // Publishing never holds up serving: the API server may be slow or away.
    let publisher = {
        let (node, sharing) = (config.node_name.clone(), config.sharing);
        tokio::spawn(async move {
            let publisher = Publisher::new(client, &node, sharing).await;
            keep_published(publisher, gpus, health, publishing_stopped).await
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
        let service = RegistrationService { endpoint: dra_socket.display().to_string() };
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
    // The slice goes with the plugin, unless the API server cannot be reached in time: a
    // stop is never held up for long.
    let removed = tokio::time::timeout(STOP_WITHIN, async {
        match publisher.await {
            Ok(publisher) => publisher.remove().await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
    match removed {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!("removing the ResourceSlice at stop: {e}"),
        Err(_) => tracing::warn!("removing the ResourceSlice at stop: no answer within {STOP_WITHIN:?}"),
    }
    tracing::info!("stopped");
    Ok(())
}

/// Publishes the slice, again whenever a GPU's health changes, retrying failures with a
/// backoff, until `stopped`; hands the publisher back for the final removal.
async fn keep_published(
    mut publisher: Publisher,
    gpus: Vec<GpuInfo>,
    mut health: watch::Receiver<Vec<Gpu>>,
    mut stopped: oneshot::Receiver<()>,
) -> Publisher {
    let mut retry = PUBLISH_RETRY_FIRST;
    loop {
        let healthy: Vec<String> =
            health.borrow_and_update().iter().filter(|g| g.healthy).map(|g| g.uuid.clone()).collect();
        let wait = match publisher.publish(&gpus, |uuid| healthy.iter().any(|h| h == uuid)).await {
            Ok(()) => {
                retry = PUBLISH_RETRY_FIRST;
                None
            }
            Err(e) => {
                tracing::warn!("publishing the ResourceSlice: {e}; retrying in {retry:?}");
                let wait = retry;
                retry = (retry * 2).min(PUBLISH_RETRY_AT_MOST);
                Some(wait)
            }
        };
        tokio::select! {
            _ = &mut stopped => return publisher,
            changed = health.changed() => {
                if changed.is_err() {
                    // The health watcher is gone: nothing will change again.
                    let _ = (&mut stopped).await;
                    return publisher;
                }
            }
            _ = tokio::time::sleep(wait.unwrap_or(PUBLISH_RETRY_AT_MOST)), if wait.is_some() => {}
        }
    }
}
