//! The tonic `DevicePlugin` service: it only forwards to `devices` and `allocation`.

use std::pin::Pin;

use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use super::allocation::{self, AllocationConfig};
use super::api::device_plugin_server::DevicePlugin;
use super::api::{
    AllocateRequest, AllocateResponse, ContainerPreferredAllocationResponse, DevicePluginOptions, Empty,
    ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse, PreferredAllocationRequest,
    PreferredAllocationResponse,
};
use super::devices::{device_list, Gpu};

/// The plugin's state: the GPUs (with health, updated by `health`) and where the shim is.
pub struct Plugin {
    gpus: watch::Receiver<Vec<Gpu>>,
    config: AllocationConfig,
}

impl Plugin {
    /// A plugin serving `gpus`.
    pub fn new(gpus: watch::Receiver<Vec<Gpu>>, config: AllocationConfig) -> Plugin {
        Plugin { gpus, config }
    }

    fn known(&self) -> Vec<String> {
        self.gpus.borrow().iter().map(|g| g.uuid.clone()).collect()
    }
}

type DeviceStream = Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Plugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: true,
        }))
    }

    type ListAndWatchStream = DeviceStream;

    /// The full list now, and again whenever a GPU's health changes.
    async fn list_and_watch(&self, _: Request<Empty>) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let shares = self.config.shares_per_gpu;
        let stream = tokio_stream::wrappers::WatchStream::new(self.gpus.clone())
            .map(move |gpus| Ok(ListAndWatchResponse { devices: device_list(&gpus, shares) }));
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        let known = self.known();
        let responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|c| {
                let size = usize::try_from(c.allocation_size).map_err(|_| {
                    Status::invalid_argument(format!("allocation_size {} is negative", c.allocation_size))
                })?;
                allocation::preferred(
                    &c.available_device_i_ds,
                    &c.must_include_device_i_ds,
                    size,
                    &known,
                    self.config.shares_per_gpu,
                )
                .map(|device_i_ds| ContainerPreferredAllocationResponse { device_i_ds })
                .map_err(|e| Status::invalid_argument(e.to_string()))
            })
            .collect::<Result<Vec<_>, Status>>()?;
        Ok(Response::new(PreferredAllocationResponse { container_responses: responses }))
    }

    async fn allocate(
        &self,
        request: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let known = self.known();
        let request = request.into_inner();
        if request.container_requests.is_empty() {
            return Err(Status::invalid_argument("empty request: no container"));
        }
        let responses = request
            .container_requests
            .iter()
            .map(|c| {
                let answer = allocation::allocate(&c.devices_ids, &known, &self.config).map_err(|e| {
                    tracing::warn!("refused an allocation: {e}");
                    Status::invalid_argument(e.to_string())
                })?;
                // Each GPU's own share count: what the arbiter will hold it to there.
                let counts = allocation::shares_per_gpu(&c.devices_ids, &known, self.config.shares_per_gpu)
                    .unwrap_or_default();
                for (gpu, shares) in counts {
                    tracing::info!(%gpu, shares, of = self.config.shares_per_gpu, "allocated");
                }
                Ok(answer)
            })
            .collect::<Result<Vec<_>, Status>>()?;
        Ok(Response::new(AllocateResponse { container_responses: responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse {}))
    }
}
