//! The tonic services the kubelet calls: the DRA plugin API in both versions the kubelet
//! may speak (the same messages under two packages, so one macro writes both), and plugin
//! registration. Each forwards to the [`Driver`].

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::api::registration::{self, registration_server};
use super::driver::{ClaimRef, Driver};
use super::{api, SERVED_VERSIONS};

/// The DRA plugin service, for either API version.
#[derive(Clone)]
pub struct DraService {
    driver: Arc<Driver>,
}

impl DraService {
    /// The service over `driver`.
    pub fn new(driver: Arc<Driver>) -> DraService {
        DraService { driver }
    }
}

/// Implements one version's `DRAPlugin` service: each claim of a request is prepared (or
/// unprepared) on its own, and its error reported in its own entry, as the API asks.
macro_rules! dra_service {
    ($version:ident) => {
        // `v1beta1`'s Device has every field set here; `v1`'s has one more (`share_id`).
        #[allow(clippy::needless_update)]
        #[tonic::async_trait]
        impl api::$version::dra_plugin_server::DraPlugin for DraService {
            async fn node_prepare_resources(
                &self,
                request: Request<api::$version::NodePrepareResourcesRequest>,
            ) -> Result<Response<api::$version::NodePrepareResourcesResponse>, Status> {
                use api::$version::{Device, NodePrepareResourceResponse};
                let mut claims = std::collections::HashMap::new();
                for claim in request.into_inner().claims {
                    let claim = ClaimRef { namespace: claim.namespace, uid: claim.uid, name: claim.name };
                    let answer = match self.driver.prepare(&claim).await {
                        Ok(devices) => NodePrepareResourceResponse {
                            devices: devices
                                .iter()
                                .flat_map(|d| {
                                    // Each slice device allocated (the shares, or the GPU).
                                    let names = if d.shares.is_empty() { vec![d.device.clone()] } else { d.shares.clone() };
                                    names.into_iter().map(move |name| (d, name))
                                })
                                .map(|(d, name)| {
                                    let mut device = Device {
                                        request_names: parent_requests(&d.request_names),
                                        pool_name: d.pool.clone(),
                                        device_name: name,
                                        cdi_device_ids: self.driver.cdi_device_ids(d),
                                        ..Default::default()
                                    };
                                    device.set_share_id(d.share_id.clone());
                                    device
                                })
                                .collect(),
                            error: String::new(),
                        },
                        Err(e) => {
                            tracing::warn!(%claim, "preparing the claim failed: {e}");
                            NodePrepareResourceResponse { devices: Vec::new(), error: e.to_string() }
                        }
                    };
                    claims.insert(claim.uid, answer);
                }
                Ok(Response::new(api::$version::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                request: Request<api::$version::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<api::$version::NodeUnprepareResourcesResponse>, Status> {
                use api::$version::NodeUnprepareResourceResponse;
                let mut claims = std::collections::HashMap::new();
                for claim in request.into_inner().claims {
                    let claim = ClaimRef { namespace: claim.namespace, uid: claim.uid, name: claim.name };
                    let error = match self.driver.unprepare(&claim).await {
                        Ok(()) => String::new(),
                        Err(e) => {
                            tracing::warn!(%claim, "unpreparing the claim failed: {e}");
                            e.to_string()
                        }
                    };
                    claims.insert(claim.uid, NodeUnprepareResourceResponse { error });
                }
                Ok(Response::new(api::$version::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
}

/// The requests a device answers for, as containers name them: a sub-request of a
/// `firstAvailable` request (`gpu/small`) is named by its parent (`gpu`), as the kubelet
/// matches a container's claim `request` against these names.
pub fn parent_requests(names: &[String]) -> Vec<String> {
    let mut parents: Vec<String> = Vec::with_capacity(names.len());
    for name in names {
        let parent = name.split_once('/').map_or(name.as_str(), |(parent, _)| parent);
        if !parents.iter().any(|p| p == parent) {
            parents.push(parent.to_owned());
        }
    }
    parents
}

/// The allocation's share ID, which only `v1` answers with.
trait ShareId {
    fn set_share_id(&mut self, share_id: Option<String>);
}

impl ShareId for api::v1::Device {
    fn set_share_id(&mut self, share_id: Option<String>) {
        self.share_id = share_id;
    }
}

impl ShareId for api::v1beta1::Device {
    fn set_share_id(&mut self, _share_id: Option<String>) {}
}

dra_service!(v1);
dra_service!(v1beta1);

/// The registration service the kubelet's plugin watcher calls on our registration socket.
#[derive(Debug, Clone)]
pub struct RegistrationService {
    /// The DRA socket's absolute path, given to the kubelet as the endpoint.
    pub endpoint: String,
    /// Told of every successful registration: the slice is published again then (a
    /// kubelet that registers the plugin may just have wiped its node's slices).
    pub registered: Arc<tokio::sync::Notify>,
}

#[tonic::async_trait]
impl registration_server::Registration for RegistrationService {
    async fn get_info(
        &self,
        _request: Request<registration::InfoRequest>,
    ) -> Result<Response<registration::PluginInfo>, Status> {
        Ok(Response::new(registration::PluginInfo {
            r#type: "DRAPlugin".into(),
            name: super::DRIVER.into(),
            endpoint: self.endpoint.clone(),
            supported_versions: SERVED_VERSIONS.iter().map(|v| (*v).to_owned()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        request: Request<registration::RegistrationStatus>,
    ) -> Result<Response<registration::RegistrationStatusResponse>, Status> {
        let status = request.into_inner();
        if status.plugin_registered {
            tracing::info!(endpoint = %self.endpoint, "registered with the kubelet");
            // A permit is kept if the publisher is busy: the signal is never lost.
            self.registered.notify_one();
        } else {
            tracing::error!(error = %status.error, "the kubelet refused the registration");
        }
        Ok(Response::new(registration::RegistrationStatusResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::parent_requests;

    #[test]
    fn sub_requests_are_named_by_their_parent() {
        let names = |n: &[&str]| n.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(parent_requests(&names(&["gpu/small"])), names(&["gpu"]));
        assert_eq!(parent_requests(&names(&["gpu/small", "gpu/large", "nic"])), names(&["gpu", "nic"]));
        assert_eq!(parent_requests(&names(&["gpu"])), names(&["gpu"]));
    }
}
