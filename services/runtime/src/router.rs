//! The runtime's gRPC face with replicas: in front of the adapter
//! (`grpc.rs`), it sends a call about an agent another replica holds to that
//! replica, asks the others for an agent named by id that is not here, and
//! adds the others' agents to a list. A call it sends on is marked, and the
//! replica that gets it answers it itself. Without replicas every call goes
//! straight to the adapter.

use std::time::Duration;

use avm_proto::runtime::v1 as pb;
use avm_proto::runtime::v1::RuntimeServiceRemote;
use avm_proto::runtime::v1::runtime_service_server::RuntimeService;
use tonic::{Request, Response, Status};

use crate::error::HOLDER_HEADER;
use crate::pool::AgentPool;
use crate::replicas::{forwarded, relay_message};

/// Routes calls between `local` (this replica's adapter) and the other replicas.
pub struct Router<L> {
    local: L,
    pool: AgentPool,
}

impl<L> Router<L> {
    pub fn new(local: L, pool: AgentPool) -> Self {
        Self { local, pool }
    }

    /// Returns whether a call may be sent on: with replicas, once.
    fn may_forward<T>(&self, request: &Request<T>) -> bool {
        self.pool.replicated() && !forwarded(request)
    }

    /// Returns the replica holding an image's agent, when another one does
    /// and the call may go there.
    async fn holder<T>(&self, request: &Request<T>, image_id: &str) -> Result<Option<RuntimeServiceRemote>, Status> {
        if !self.may_forward(request) {
            return Ok(None);
        }
        let ctx = avm_common::auth::caller(request)?;
        match self.pool.held_elsewhere(&ctx.tenant_id, image_id).await? {
            Some(addr) => Ok(Some(self.remote(&addr)?)),
            None => Ok(None),
        }
    }

    /// Returns the other live replicas, for a call that may be sent on.
    async fn others<T>(&self, request: &Request<T>) -> Result<Vec<RuntimeServiceRemote>, Status> {
        if !self.may_forward(request) {
            return Ok(Vec::new());
        }
        let addrs = self.pool.other_replicas().await?;
        addrs.iter().map(|addr| self.remote(addr)).collect()
    }

    fn remote(&self, addr: &str) -> Result<RuntimeServiceRemote, Status> {
        Ok(self.pool.remote(addr)?)
    }

    /// Asks the other replicas in turn, for an agent this one does not hold
    /// (`call` is the copy to send on): the first answer but NOT_FOUND, else `None`.
    async fn ask_others<T, U, F, Fut>(&self, call: &Request<T>, ask: F) -> Result<Option<Response<U>>, Status>
    where
        T: Clone,
        F: Fn(RuntimeServiceRemote, Request<T>) -> Fut,
        Fut: std::future::Future<Output = Result<Response<U>, Status>>,
    {
        for addr in self.pool.other_replicas().await? {
            match ask(self.remote(&addr)?, relay(call)).await {
                Err(status) if status.code() == tonic::Code::NotFound => {}
                answer => return answer.map(Some),
            }
        }
        Ok(None)
    }
}

/// Takes from a local answer the replica it says holds the agent; the name
/// is only for the router and never leaves the process.
fn take_holder<U>(answer: &mut Result<U, Status>) -> Option<String> {
    let Err(status) = answer else { return None };
    let holder = status.metadata_mut().remove(HOLDER_HEADER)?;
    holder.to_str().ok().map(str::to_owned)
}

/// Returns this replica's own answer as it leaves, without a holder's name.
fn here<U>(mut answer: Result<U, Status>) -> Result<U, Status> {
    take_holder(&mut answer);
    answer
}

/// Returns the call to send on: the caller's metadata and message.
fn relay<T: Clone>(request: &Request<T>) -> Request<T> {
    relay_message(request.metadata(), request.get_ref().clone())
}

/// Returns a copy of a call, to send on if the local answer says the agent
/// is elsewhere (only made when it may be sent on).
fn keep<T: Clone>(may_forward: bool, request: &Request<T>) -> Option<Request<T>> {
    may_forward.then(|| relay(request))
}

/// Sends a call about one image to the replica holding its agent, else answers it here.
macro_rules! by_holder {
    ($self:ident, $request:ident, $method:ident, $image_id:expr) => {{
        let image_id = $image_id.to_owned();
        if let Some(remote) = $self.holder(&$request, &image_id).await? {
            return remote.$method(relay(&$request)).await;
        }
        here($self.local.$method($request).await)
    }};
}

/// Answers a call here, or, when this replica finds the agent elsewhere
/// (it started it nowhere), sends it to the replica holding it.
macro_rules! here_or_holder {
    ($self:ident, $request:ident, $method:ident) => {{
        let kept = keep($self.may_forward(&$request), &$request);
        let mut answer = $self.local.$method($request).await;
        match (take_holder(&mut answer), kept) {
            (Some(addr), Some(kept)) => $self.remote(&addr)?.$method(kept).await,
            _ => answer,
        }
    }};
}

/// Answers a call about an agent named by id here, or asks the other
/// replicas when it is not here.
macro_rules! here_or_others {
    ($self:ident, $request:ident, $method:ident) => {{
        let kept = keep($self.may_forward(&$request), &$request);
        match (here($self.local.$method($request).await), kept) {
            (Err(status), Some(kept)) if status.code() == tonic::Code::NotFound => {
                match $self
                    .ask_others(&kept, |remote, call| async move { remote.$method(call).await })
                    .await?
                {
                    Some(answer) => Ok(answer),
                    None => Err(status),
                }
            }
            (answer, _) => answer,
        }
    }};
}

#[tonic::async_trait]
impl<L> RuntimeService for Router<L>
where
    L: RuntimeService<
            SendMessageStream = avm_proto::BoxStream<pb::SendMessageResponse>,
            SubscribeEventsStream = avm_proto::BoxStream<pb::SubscribeEventsResponse>,
            SubscribeGroupEventsStream = avm_proto::BoxStream<pb::SubscribeGroupEventsResponse>,
        >,
{
    type SendMessageStream = avm_proto::BoxStream<pb::SendMessageResponse>;
    type SubscribeEventsStream = avm_proto::BoxStream<pb::SubscribeEventsResponse>;
    type SubscribeGroupEventsStream = avm_proto::BoxStream<pb::SubscribeGroupEventsResponse>;

    async fn wake_agent(
        &self,
        request: Request<pb::WakeAgentRequest>,
    ) -> Result<Response<pb::WakeAgentResponse>, Status> {
        here_or_holder!(self, request, wake_agent)
    }

    async fn pause_agent(
        &self,
        request: Request<pb::PauseAgentRequest>,
    ) -> Result<Response<pb::PauseAgentResponse>, Status> {
        by_holder!(self, request, pause_agent, request.get_ref().image_id)
    }

    async fn rewind_image(
        &self,
        request: Request<pb::RewindImageRequest>,
    ) -> Result<Response<pb::RewindImageResponse>, Status> {
        by_holder!(self, request, rewind_image, request.get_ref().image_id)
    }

    async fn resume_agent(
        &self,
        request: Request<pb::ResumeAgentRequest>,
    ) -> Result<Response<pb::ResumeAgentResponse>, Status> {
        here(self.local.resume_agent(request).await)
    }

    async fn terminate_agent(
        &self,
        request: Request<pb::TerminateAgentRequest>,
    ) -> Result<Response<pb::TerminateAgentResponse>, Status> {
        let others = self.others(&request).await?;
        let metadata = request.metadata().clone();
        let answer = here(self.local.terminate_agent(request).await)?;
        // The agents terminated run wherever they run.
        for remote in others {
            for image_id in &answer.get_ref().terminated_image_ids {
                let stop = relay_message(
                    &metadata,
                    pb::StopImageRequest {
                        image_id: image_id.clone(),
                    },
                );
                if let Err(status) = remote.clone().stop_image(stop).await {
                    tracing::warn!(image_id, error = %status.message(), "a terminated agent may still run on another replica");
                }
            }
        }
        Ok(answer)
    }

    async fn subscribe_group_events(
        &self,
        request: Request<pb::SubscribeGroupEventsRequest>,
    ) -> Result<Response<Self::SubscribeGroupEventsStream>, Status> {
        here(self.local.subscribe_group_events(request).await)
    }

    async fn list_workspace(
        &self,
        request: Request<pb::ListWorkspaceRequest>,
    ) -> Result<Response<pb::ListWorkspaceResponse>, Status> {
        by_holder!(self, request, list_workspace, request.get_ref().image_id)
    }

    async fn read_workspace_file(
        &self,
        request: Request<pb::ReadWorkspaceFileRequest>,
    ) -> Result<Response<pb::ReadWorkspaceFileResponse>, Status> {
        by_holder!(self, request, read_workspace_file, request.get_ref().image_id)
    }

    async fn write_workspace_file(
        &self,
        request: Request<pb::WriteWorkspaceFileRequest>,
    ) -> Result<Response<pb::WriteWorkspaceFileResponse>, Status> {
        by_holder!(self, request, write_workspace_file, request.get_ref().image_id)
    }

    async fn remove_workspace_file(
        &self,
        request: Request<pb::RemoveWorkspaceFileRequest>,
    ) -> Result<Response<pb::RemoveWorkspaceFileResponse>, Status> {
        by_holder!(self, request, remove_workspace_file, request.get_ref().image_id)
    }

    async fn get_image(&self, request: Request<pb::GetImageRequest>) -> Result<Response<pb::GetImageResponse>, Status> {
        by_holder!(self, request, get_image, request.get_ref().image_id)
    }

    async fn list_images(
        &self,
        request: Request<pb::ListImagesRequest>,
    ) -> Result<Response<pb::ListImagesResponse>, Status> {
        here(self.local.list_images(request).await)
    }

    async fn update_image(
        &self,
        request: Request<pb::UpdateImageRequest>,
    ) -> Result<Response<pb::UpdateImageResponse>, Status> {
        by_holder!(self, request, update_image, request.get_ref().image_id)
    }

    async fn run_image(&self, request: Request<pb::RunImageRequest>) -> Result<Response<pb::RunImageResponse>, Status> {
        here_or_holder!(self, request, run_image)
    }

    async fn stop_image(
        &self,
        request: Request<pb::StopImageRequest>,
    ) -> Result<Response<pb::StopImageResponse>, Status> {
        by_holder!(self, request, stop_image, request.get_ref().image_id)
    }

    async fn send_message(
        &self,
        request: Request<pb::SendMessageRequest>,
    ) -> Result<Response<Self::SendMessageStream>, Status> {
        if !self.may_forward(&request) {
            return here(self.local.send_message(request).await);
        }
        // The holder may have just died: its lease lapses with its
        // heartbeat, then this replica claims the agent.
        let deadline = tokio::time::Instant::now() + crate::replicas::HEARTBEAT_TTL + Duration::from_secs(2);
        loop {
            let mut answer = self.local.send_message(relay_unmarked(&request)).await;
            let Some(addr) = take_holder(&mut answer) else {
                return answer;
            };
            match self.remote(&addr)?.send_message(relay(&request)).await {
                Err(status) if status.code() == tonic::Code::Unavailable && tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                sent => return sent,
            }
        }
    }

    async fn interrupt_agent(
        &self,
        request: Request<pb::InterruptAgentRequest>,
    ) -> Result<Response<pb::InterruptAgentResponse>, Status> {
        use pb::interrupt_agent_request::Target;
        match &request.get_ref().target {
            Some(Target::ImageId(image_id)) => {
                let image_id = image_id.clone();
                by_holder!(self, request, interrupt_agent, image_id)
            }
            _ => here_or_others!(self, request, interrupt_agent),
        }
    }

    async fn get_agent(&self, request: Request<pb::GetAgentRequest>) -> Result<Response<pb::GetAgentResponse>, Status> {
        here_or_others!(self, request, get_agent)
    }

    async fn list_agents(
        &self,
        request: Request<pb::ListAgentsRequest>,
    ) -> Result<Response<pb::ListAgentsResponse>, Status> {
        let others = self.others(&request).await?;
        let kept = (!others.is_empty()).then(|| relay(&request));
        let mut answer = here(self.local.list_agents(request).await)?;
        if let Some(kept) = kept {
            let agents = &mut answer.get_mut().agents;
            for remote in others {
                agents.extend(remote.list_agents(relay(&kept)).await?.into_inner().agents);
            }
            agents.sort_by(|a, b| {
                a.started_at_ms
                    .cmp(&b.started_at_ms)
                    .then_with(|| a.agent_id.cmp(&b.agent_id))
            });
        }
        Ok(answer)
    }

    async fn destroy_agent(
        &self,
        request: Request<pb::DestroyAgentRequest>,
    ) -> Result<Response<pb::DestroyAgentResponse>, Status> {
        here_or_others!(self, request, destroy_agent)
    }

    async fn destroy_all_agents(
        &self,
        request: Request<pb::DestroyAllAgentsRequest>,
    ) -> Result<Response<pb::DestroyAllAgentsResponse>, Status> {
        let others = self.others(&request).await?;
        let kept = (!others.is_empty()).then(|| relay(&request));
        let mut answer = here(self.local.destroy_all_agents(request).await)?;
        if let Some(kept) = kept {
            for remote in others {
                answer.get_mut().destroyed += remote.destroy_all_agents(relay(&kept)).await?.into_inner().destroyed;
            }
        }
        Ok(answer)
    }

    async fn subscribe_events(
        &self,
        request: Request<pb::SubscribeEventsRequest>,
    ) -> Result<Response<Self::SubscribeEventsStream>, Status> {
        here(self.local.subscribe_events(request).await)
    }
}

/// Returns a copy of a call for this replica's adapter: the same metadata
/// and message, not marked as sent on.
fn relay_unmarked<T: Clone>(request: &Request<T>) -> Request<T> {
    let mut copy = Request::new(request.get_ref().clone());
    *copy.metadata_mut() = request.metadata().clone();
    *copy.extensions_mut() = request.extensions().clone();
    copy
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::RuntimeError;

    /// The holder's address an answer carries is for the router alone: it
    /// takes it when it may send the call on, and it never leaves.
    #[test]
    fn a_holders_address_never_leaves_the_replica() {
        let elsewhere = || -> Result<(), Status> { Err(RuntimeError::Elsewhere("http://10.0.0.7:7000".into()).into()) };
        let answer = elsewhere();
        assert!(
            answer
                .as_ref()
                .is_err_and(|status| status.metadata().contains_key(HOLDER_HEADER)),
            "the adapter names the holder"
        );
        let left = here(answer).expect_err("still an error");
        assert!(!left.metadata().contains_key(HOLDER_HEADER));
        assert_eq!(avm_common::ApiError::from_status(&left).reason, "AGENT_MOVING");

        let mut answer = elsewhere();
        assert_eq!(take_holder(&mut answer).as_deref(), Some("http://10.0.0.7:7000"));
        assert!(answer.is_err_and(|status| !status.metadata().contains_key(HOLDER_HEADER)));
        // A call that was sent on keeps no copy, so it is not sent again.
        let sent_on = relay_message(&tonic::metadata::MetadataMap::new(), ());
        assert!(forwarded(&sent_on));
        assert!(keep(false, &sent_on).is_none(), "a call sent on is not sent again");
    }
}
