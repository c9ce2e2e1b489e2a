//! The plugin's life cycle as the kubelet expects it: serve on our socket in the device
//! plugin folder, then register with `kubelet.sock`; when the kubelet restarts (it deletes
//! every socket in the folder and recreates its own), serve again and register again; on
//! shutdown, stop and remove our socket.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{oneshot, watch};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Endpoint, Server, Uri};

use super::allocation::AllocationConfig;
use super::api::device_plugin_server::DevicePluginServer;
use super::api::registration_client::RegistrationClient;
use super::api::{DevicePluginOptions, RegisterRequest};
use super::devices::{Gpu, API_VERSION, RESOURCE_NAME};
use super::service::Plugin;

/// How often the folder is checked for a kubelet restart.
const WATCH_EVERY: Duration = Duration::from_millis(250);

/// The first wait before registering again after a failure; it doubles up to
/// [`RETRY_AT_MOST`] (a node without a kubelet would otherwise log four lines a second).
/// A kubelet.sock that appears or changes is tried at once.
const RETRY_FIRST: Duration = Duration::from_millis(250);

/// The longest wait between registration attempts.
const RETRY_AT_MOST: Duration = Duration::from_secs(10);

/// The wait after `retry`: twice as long, at most [`RETRY_AT_MOST`].
fn next_retry(retry: Duration) -> Duration {
    (retry * 2).min(RETRY_AT_MOST)
}

/// Why registering failed, as the log says it: a missing kubelet.sock is named as such.
fn registration_failure(kubelet: &Path, error: &str) -> String {
    if kubelet.exists() {
        error.to_owned()
    } else {
        format!(
            "{} does not exist (is the kubelet running, and is this its device-plugins folder?)",
            kubelet.display()
        )
    }
}

/// Where the plugin lives.
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    /// The kubelet's device plugin folder.
    pub dir: PathBuf,
    /// Our socket's file name in it.
    pub socket_name: String,
    /// What allocations give.
    pub allocation: AllocationConfig,
}

/// Why the plugin stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    /// Our socket could not be served.
    #[error("cannot serve {path}: {source}")]
    Serve {
        /// The socket.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
}

fn inode(path: &Path) -> Option<u64> {
    std::fs::metadata(path).ok().map(|m| m.ino())
}

async fn register(kubelet: &Path, socket_name: &str) -> Result<(), String> {
    let path = kubelet.to_path_buf();
    let channel = Endpoint::try_from("http://[::]:50051")
        .map_err(|e| e.to_string())?
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
        .map_err(|e| format!("connecting to {}: {e}", kubelet.display()))?;
    let request = RegisterRequest {
        version: API_VERSION.to_owned(),
        endpoint: socket_name.to_owned(),
        resource_name: RESOURCE_NAME.to_owned(),
        options: Some(DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }),
    };
    RegistrationClient::new(channel)
        .register(request)
        .await
        .map_err(|e| format!("the kubelet refused the registration: {}", e.message()))?;
    Ok(())
}

/// Serves and registers until `shutdown`, starting over whenever the kubelet restarts.
pub async fn run(
    config: RunnerConfig,
    gpus: watch::Receiver<Vec<Gpu>>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), RunnerError> {
    tokio::pin!(shutdown);
    let socket = config.dir.join(&config.socket_name);
    let kubelet = config.dir.join("kubelet.sock");
    loop {
        // Serve first: the kubelet dials us before it answers Register.
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket)
            .map_err(|source| RunnerError::Serve { path: socket.clone(), source })?;
        let (stop, stopped) = oneshot::channel::<()>();
        let plugin = Plugin::new(gpus.clone(), config.allocation.clone());
        let server = tokio::spawn(
            Server::builder().add_service(DevicePluginServer::new(plugin)).serve_with_incoming_shutdown(
                UnixListenerStream::new(listener),
                async {
                    let _ = stopped.await;
                },
            ),
        );
        let ours = inode(&socket);
        tracing::info!(socket = %socket.display(), "serving the device plugin");

        // Register (again and again until the kubelet answers), then watch the folder.
        let mut registered_with = None;
        // The wait after the next failure, and, after a failure, when to try again and
        // which kubelet.sock that failure found.
        let mut retry = RETRY_FIRST;
        let mut failed: Option<(tokio::time::Instant, Option<u64>)> = None;
        let restart = loop {
            let due = failed.is_none_or(|(again, kubelet_then)| {
                tokio::time::Instant::now() >= again || inode(&kubelet) != kubelet_then
            });
            if registered_with.is_none() && due {
                match register(&kubelet, &config.socket_name).await {
                    Ok(()) => {
                        registered_with = inode(&kubelet);
                        (retry, failed) = (RETRY_FIRST, None);
                        tracing::info!(resource = RESOURCE_NAME, "registered with the kubelet");
                    }
                    Err(e) => {
                        failed = Some((tokio::time::Instant::now() + retry, inode(&kubelet)));
                        let why = registration_failure(&kubelet, &e);
                        tracing::warn!("registration: {why}; retrying in {retry:?}");
                        retry = next_retry(retry);
                    }
                }
            }
            tokio::select! {
                _ = &mut shutdown => break false,
                _ = tokio::time::sleep(WATCH_EVERY) => {}
            }
            if inode(&socket) != ours {
                tracing::info!("our socket is gone: the kubelet restarted");
                break true;
            }
            if registered_with.is_some() && inode(&kubelet) != registered_with {
                tracing::info!("kubelet.sock was recreated: registering again");
                registered_with = None;
            }
        };
        // Open ListAndWatch streams never end by themselves: give calls in flight a moment,
        // then drop the server.
        let _ = stop.send(());
        let abort = server.abort_handle();
        if tokio::time::timeout(Duration::from_millis(500), server).await.is_err() {
            abort.abort();
        }
        if !restart {
            if inode(&socket) == ours {
                let _ = std::fs::remove_file(&socket);
            }
            tracing::info!("stopped");
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_retries_back_off_to_ten_seconds() {
        let mut waits = vec![RETRY_FIRST];
        while waits.len() < 10 {
            waits.push(next_retry(waits[waits.len() - 1]));
        }
        let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [250, 500, 1000, 2000, 4000, 8000, 10_000, 10_000, 10_000, 10_000]);
    }

    #[test]
    fn a_missing_kubelet_socket_is_named() {
        let kubelet = Path::new("/nonexistent/device-plugins/kubelet.sock");
        let why = registration_failure(kubelet, "connecting: transport error");
        assert!(why.starts_with("/nonexistent/device-plugins/kubelet.sock does not exist"), "{why}");
        assert!(!why.contains("transport error"), "{why}");
    }
}
