//! The gRPC adapter of the runtime: proto ⇄ domain, the caller's context,
//! errors → status. With `peers/`, the only place that sees protos (the
//! router in front of it, `router.rs`, sends calls on to other replicas).

use std::pin::Pin;
use std::sync::Arc;

use avm_common::auth::{Authenticated, TokenVerifier, caller};
use avm_common::config::GrpcConfig;
use avm_proto::runtime::v1 as pb;
use avm_proto::runtime::v1::runtime_service_server::{RuntimeService, RuntimeServiceServer};
use futures::Stream;
use tonic::{Request, Response, Status};

use crate::agent::AgentInfo;
use crate::error::{AgentTarget, RuntimeError};
use crate::event::{Detail, SessionEvent};
use crate::hub::Subscription;
use crate::peers::{ImageChanges, content};
use crate::pool::{AgentPool, ImageView};
use crate::router::Router;

/// Returns the runtime's gRPC server with the shared message-size limits;
/// every call's caller is verified from its bearer token.
pub fn grpc_server(
    pool: AgentPool,
    verifier: TokenVerifier,
    config: &GrpcConfig,
) -> Authenticated<RuntimeServiceServer<Router<RuntimeGrpc>>> {
    let server = RuntimeServiceServer::new(Router::new(RuntimeGrpc { pool: pool.clone() }, pool))
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);
    Authenticated::new(server, verifier)
}

/// Serves `avm.runtime.v1.RuntimeService` from an [`AgentPool`].
pub struct RuntimeGrpc {
    pool: AgentPool,
}

impl RuntimeGrpc {
    /// Returns the adapter over `pool`: what the gRPC server serves, and what
    /// `avm serve` calls in process.
    pub fn new(pool: AgentPool) -> Self {
        Self { pool }
    }
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

fn agent_pb(agent: AgentInfo) -> pb::Agent {
    pb::Agent {
        agent_id: agent.agent_id,
        container_id: agent.container_id,
        image_id: agent.image_id,
        session_id: agent.session_id,
        state: if agent.running {
            pb::AgentState::Running
        } else {
            pb::AgentState::Idle
        } as i32,
        started_at_ms: agent.started_at_ms,
    }
}

fn image_pb(view: ImageView) -> pb::ImageView {
    pb::ImageView {
        image: Some(view.image),
        agent: view.agent.map(agent_pb),
    }
}

/// Converts a hub event to its wire form.
fn event_pb(event: &SessionEvent) -> pb::Event {
    pb::Event {
        r#type: event.kind.name().to_owned(),
        cursor: event.cursor.to_string(),
        timestamp_ms: event.timestamp_ms,
        context: Some(pb::EventContext {
            container_id: event.context.container_id.clone(),
            image_id: event.context.image_id.clone(),
            agent_id: event.context.agent_id.clone(),
            session_id: event.context.session_id.clone(),
        }),
        data_json: event.data_json.clone(),
        request_id: match event.detail.as_deref() {
            Some(Detail::Request(request_id)) => request_id.to_string(),
            _ => String::new(),
        },
        group_seq: match event.detail.as_deref() {
            Some(Detail::Seq(seq)) => *seq,
            _ => 0,
        },
    }
}

/// Yields the replay, then live events; `until_turn_end` stops after the turn's last event.
/// A subscriber cut off for falling behind gets RESOURCE_EXHAUSTED, never a silent end.
fn event_stream(
    subscription: Subscription,
    until_turn_end: bool,
) -> impl Stream<Item = Result<Arc<SessionEvent>, Status>> + Send {
    let Subscription { replay, live, .. } = subscription;
    futures::stream::unfold(
        (replay.into_iter(), live, false),
        move |(mut replay, mut live, done)| async move {
            if done {
                return None;
            }
            let event = match replay.next() {
                Some(event) => event,
                None => match live.recv().await {
                    Some(event) => event,
                    None if live.was_cut() => {
                        let status = Status::from(RuntimeError::SubscriberTooSlow);
                        return Some((Err(status), (replay, live, true)));
                    }
                    None => return None,
                },
            };
            let finished = until_turn_end && event.ends_turn();
            Some((Ok(event), (replay, live, finished)))
        },
    )
}

#[tonic::async_trait]
impl RuntimeService for RuntimeGrpc {
    type SendMessageStream = EventStream<pb::SendMessageResponse>;
    type SubscribeEventsStream = EventStream<pb::SubscribeEventsResponse>;
    type SubscribeGroupEventsStream = EventStream<pb::SubscribeGroupEventsResponse>;

    async fn wake_agent(
        &self,
        request: Request<pb::WakeAgentRequest>,
    ) -> Result<Response<pb::WakeAgentResponse>, Status> {
        let ctx = caller(&request)?;
        let image_id = &request.get_ref().image_id;
        let woken = if request.get_ref().wait {
            self.pool.wake_and_read(&ctx, image_id).await
        } else {
            self.pool.wake(&ctx, image_id).await
        };
        Ok(Response::new(pb::WakeAgentResponse { woken: woken? }))
    }

    async fn pause_agent(
        &self,
        request: Request<pb::PauseAgentRequest>,
    ) -> Result<Response<pb::PauseAgentResponse>, Status> {
        let ctx = caller(&request)?;
        let image = self.pool.pause(&ctx, &request.get_ref().image_id).await?;
        Ok(Response::new(pb::PauseAgentResponse {
            image: Some(image_pb(ImageView { image, agent: None })),
        }))
    }

    async fn rewind_image(
        &self,
        request: Request<pb::RewindImageRequest>,
    ) -> Result<Response<pb::RewindImageResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let rewound = self
            .pool
            .rewind(&ctx, &request.image_id, request.after_message_id.as_deref())
            .await?;
        Ok(Response::new(pb::RewindImageResponse {
            image_id: rewound.image_id,
            session_id: rewound.session_id,
            removed_messages: rewound.removed_messages,
        }))
    }

    async fn resume_agent(
        &self,
        request: Request<pb::ResumeAgentRequest>,
    ) -> Result<Response<pb::ResumeAgentResponse>, Status> {
        let ctx = caller(&request)?;
        let image = self.pool.resume(&ctx, &request.get_ref().image_id).await?;
        let view = self
            .pool
            .get_image(&ctx, &image.image_id)
            .await
            .unwrap_or(ImageView { image, agent: None });
        Ok(Response::new(pb::ResumeAgentResponse {
            image: Some(image_pb(view)),
        }))
    }

    async fn terminate_agent(
        &self,
        request: Request<pb::TerminateAgentRequest>,
    ) -> Result<Response<pb::TerminateAgentResponse>, Status> {
        let ctx = caller(&request)?;
        let (image, terminated) = self.pool.terminate(&ctx, &request.get_ref().image_id).await?;
        Ok(Response::new(pb::TerminateAgentResponse {
            image: Some(image_pb(ImageView { image, agent: None })),
            terminated_image_ids: terminated,
        }))
    }

    async fn subscribe_group_events(
        &self,
        request: Request<pb::SubscribeGroupEventsRequest>,
    ) -> Result<Response<Self::SubscribeGroupEventsStream>, Status> {
        let ctx = caller(&request)?;
        let message = request.into_inner();
        let subscription = self
            .pool
            .subscribe_group(&ctx, &message.group_id, message.after_cursor.as_deref())
            .await?;
        let stream = futures::StreamExt::map(event_stream(subscription, false), |event| {
            event.map(|event| pb::SubscribeGroupEventsResponse {
                event: Some(event_pb(&event)),
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn list_workspace(
        &self,
        request: Request<pb::ListWorkspaceRequest>,
    ) -> Result<Response<pb::ListWorkspaceResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let entries = self.pool.list_workspace(&ctx, &request.image_id, &request.path).await?;
        Ok(Response::new(pb::ListWorkspaceResponse {
            entries: entries.into_iter().map(entry_pb).collect(),
        }))
    }

    async fn read_workspace_file(
        &self,
        request: Request<pb::ReadWorkspaceFileRequest>,
    ) -> Result<Response<pb::ReadWorkspaceFileResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let (entry, content) = self
            .pool
            .read_workspace_file(&ctx, &request.image_id, &request.path)
            .await?;
        Ok(Response::new(pb::ReadWorkspaceFileResponse {
            entry: Some(entry_pb(entry)),
            content,
        }))
    }

    async fn write_workspace_file(
        &self,
        request: Request<pb::WriteWorkspaceFileRequest>,
    ) -> Result<Response<pb::WriteWorkspaceFileResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let entry = self
            .pool
            .write_workspace_file(&ctx, &request.image_id, &request.path, request.content)
            .await?;
        Ok(Response::new(pb::WriteWorkspaceFileResponse {
            entry: Some(entry_pb(entry)),
        }))
    }

    async fn remove_workspace_file(
        &self,
        request: Request<pb::RemoveWorkspaceFileRequest>,
    ) -> Result<Response<pb::RemoveWorkspaceFileResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        self.pool
            .remove_workspace_file(&ctx, &request.image_id, &request.path)
            .await?;
        Ok(Response::new(pb::RemoveWorkspaceFileResponse {}))
    }

    async fn get_image(&self, request: Request<pb::GetImageRequest>) -> Result<Response<pb::GetImageResponse>, Status> {
        let ctx = caller(&request)?;
        let view = self.pool.get_image(&ctx, &request.get_ref().image_id).await?;
        Ok(Response::new(pb::GetImageResponse {
            image: Some(image_pb(view)),
        }))
    }

    async fn list_images(
        &self,
        request: Request<pb::ListImagesRequest>,
    ) -> Result<Response<pb::ListImagesResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let views = self
            .pool
            .list_images(
                &ctx,
                request.container_id.as_deref(),
                request.parent_image_id.as_deref(),
            )
            .await?;
        Ok(Response::new(pb::ListImagesResponse {
            images: views.into_iter().map(image_pb).collect(),
        }))
    }

    async fn update_image(
        &self,
        request: Request<pb::UpdateImageRequest>,
    ) -> Result<Response<pb::UpdateImageResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let changes = ImageChanges {
            name: request.name,
            description: request.description,
            tools: request.tools.map(|list| list.tools),
            metadata_json: request.metadata_json,
        };
        let stopped = self.pool.update_image(&ctx, &request.image_id, changes).await?;
        Ok(Response::new(pb::UpdateImageResponse { stopped }))
    }

    async fn run_image(&self, request: Request<pb::RunImageRequest>) -> Result<Response<pb::RunImageResponse>, Status> {
        let ctx = caller(&request)?;
        let (agent, reused) = self.pool.run_image(&ctx, &request.get_ref().image_id).await?;
        Ok(Response::new(pb::RunImageResponse {
            agent: Some(agent_pb(agent)),
            reused,
        }))
    }

    async fn stop_image(
        &self,
        request: Request<pb::StopImageRequest>,
    ) -> Result<Response<pb::StopImageResponse>, Status> {
        let ctx = caller(&request)?;
        let stopped = self.pool.stop_image(&ctx, &request.get_ref().image_id).await?;
        Ok(Response::new(pb::StopImageResponse { stopped }))
    }

    async fn send_message(
        &self,
        request: Request<pb::SendMessageRequest>,
    ) -> Result<Response<Self::SendMessageStream>, Status> {
        let ctx = caller(&request)?;
        let message = request.into_inner();
        let content = content(message.content, message.plain_text);
        let accepted = self.pool.send_message(&ctx, &message.image_id, content).await?;
        let first = pb::SendMessageResponse {
            kind: Some(pb::send_message_response::Kind::Accepted(pb::SendMessageAccepted {
                agent: Some(agent_pb(accepted.agent)),
                user_message_id: accepted.user_message_id,
                cursor: accepted.cursor.to_string(),
            })),
        };
        let events = futures::StreamExt::map(event_stream(accepted.events, true), |event| {
            event.map(|event| pb::SendMessageResponse {
                kind: Some(pb::send_message_response::Kind::Event(event_pb(&event))),
            })
        });
        let stream = futures::StreamExt::chain(futures::stream::once(async { Ok(first) }), events);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn interrupt_agent(
        &self,
        request: Request<pb::InterruptAgentRequest>,
    ) -> Result<Response<pb::InterruptAgentResponse>, Status> {
        let ctx = caller(&request)?;
        let target = match &request.get_ref().target {
            Some(pb::interrupt_agent_request::Target::ImageId(id)) => AgentTarget::Image(id.clone()),
            Some(pb::interrupt_agent_request::Target::AgentId(id)) => AgentTarget::Agent(id.clone()),
            None => return Err(RuntimeError::invalid("MISSING_ID", "image_id or agent_id is required").into()),
        };
        let (agent, interrupted) = self.pool.interrupt(&ctx, &target).await?;
        Ok(Response::new(pb::InterruptAgentResponse {
            agent: Some(agent_pb(agent)),
            interrupted,
        }))
    }

    async fn get_agent(&self, request: Request<pb::GetAgentRequest>) -> Result<Response<pb::GetAgentResponse>, Status> {
        let ctx = caller(&request)?;
        let agent = self.pool.get_agent(&ctx, &request.get_ref().agent_id).await?;
        Ok(Response::new(pb::GetAgentResponse {
            agent: Some(agent_pb(agent)),
        }))
    }

    async fn list_agents(
        &self,
        request: Request<pb::ListAgentsRequest>,
    ) -> Result<Response<pb::ListAgentsResponse>, Status> {
        let ctx = caller(&request)?;
        let agents = self
            .pool
            .list_agents(&ctx, request.get_ref().container_id.as_deref())
            .await?;
        Ok(Response::new(pb::ListAgentsResponse {
            agents: agents.into_iter().map(agent_pb).collect(),
        }))
    }

    async fn destroy_agent(
        &self,
        request: Request<pb::DestroyAgentRequest>,
    ) -> Result<Response<pb::DestroyAgentResponse>, Status> {
        let ctx = caller(&request)?;
        self.pool.destroy_agent(&ctx, &request.get_ref().agent_id).await?;
        Ok(Response::new(pb::DestroyAgentResponse { destroyed: true }))
    }

    async fn destroy_all_agents(
        &self,
        request: Request<pb::DestroyAllAgentsRequest>,
    ) -> Result<Response<pb::DestroyAllAgentsResponse>, Status> {
        let ctx = caller(&request)?;
        let destroyed = self.pool.destroy_all(&ctx, &request.get_ref().container_id).await?;
        Ok(Response::new(pb::DestroyAllAgentsResponse { destroyed }))
    }

    async fn subscribe_events(
        &self,
        request: Request<pb::SubscribeEventsRequest>,
    ) -> Result<Response<Self::SubscribeEventsStream>, Status> {
        let ctx = caller(&request)?;
        let message = request.into_inner();
        let subscription = self
            .pool
            .subscribe(&ctx, &message.session_id, message.after_cursor.as_deref())
            .await?;
        let start = subscription.start;
        let stream = futures::StreamExt::map(event_stream(subscription, false), |event| {
            event.map(|event| pb::SubscribeEventsResponse {
                event: Some(event_pb(&event)),
            })
        });
        let mut response = Response::new(Box::pin(stream) as Self::SubscribeEventsStream);
        response
            .metadata_mut()
            .insert(avm_common::context::START_CURSOR_HEADER, start.into());
        Ok(response)
    }
}

fn entry_pb(entry: crate::tools::access::Entry) -> pb::WorkspaceEntry {
    pb::WorkspaceEntry {
        path: entry.path,
        directory: entry.directory,
        size: entry.size,
        modified_at_ms: entry.modified_at_ms,
    }
}
