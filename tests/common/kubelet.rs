//! The kubelet's pod-resources API for tests: a server from the real v1
//! proto that answers `List` from a list the test edits.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use stepwatch_proto::podresources::v1::{
    pod_resources_lister_server::PodResourcesLister, AllocatableResourcesRequest,
    AllocatableResourcesResponse, GetPodResourcesRequest, GetPodResourcesResponse,
    ListPodResourcesRequest, ListPodResourcesResponse, PodResources,
};
use tonic::{Request, Response, Status};

/// The kubelet's pod-resources API, answering from a list the test edits.
#[derive(Clone, Default)]
pub struct FakeKubelet {
    pub pods: Arc<Mutex<Vec<PodResources>>>,
    /// While set, `List` fails (UNAVAILABLE), as a restarting kubelet does.
    pub down: Arc<AtomicBool>,
}

impl FakeKubelet {
    /// A kubelet whose pods hold these resources.
    pub fn with_pods(pods: Vec<PodResources>) -> Self {
        Self {
            pods: Arc::new(Mutex::new(pods)),
            ..Self::default()
        }
    }
}

#[tonic::async_trait]
impl PodResourcesLister for FakeKubelet {
    async fn list(
        &self,
        _: Request<ListPodResourcesRequest>,
    ) -> Result<Response<ListPodResourcesResponse>, Status> {
        if self.down.load(Ordering::SeqCst) {
            return Err(Status::unavailable("kubelet restarting"));
        }
        Ok(Response::new(ListPodResourcesResponse {
            pod_resources: self.pods.lock().unwrap().clone(),
        }))
    }

    async fn get_allocatable_resources(
        &self,
        _: Request<AllocatableResourcesRequest>,
    ) -> Result<Response<AllocatableResourcesResponse>, Status> {
        Err(Status::unimplemented("not used by the agent"))
    }

    async fn get(
        &self,
        _: Request<GetPodResourcesRequest>,
    ) -> Result<Response<GetPodResourcesResponse>, Status> {
        Err(Status::unimplemented("not used by the agent"))
    }
}
