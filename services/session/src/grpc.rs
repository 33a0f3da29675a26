//! The gRPC adapter: proto ⇄ domain, metadata → `RequestContext`, error → `Status`.

use avm_common::auth::{Authenticated, TokenVerifier, caller};
use avm_common::config::GrpcConfig;
use avm_proto::session::v1 as pb;
use avm_proto::session::v1::session_service_server::{SessionService as SessionApi, SessionServiceServer};
use tonic::{Request, Response, Status};

use crate::error::SessionError;
use crate::recent::preview;
use crate::record::{
    AgentState, Compaction, ContainerRecord, GroupMemberRecord, GroupMessageRecord, GroupRecord, GroupUpdate,
    ImageRecord, ImageSummary, ImageUpdate, Lifecycle, MemberKind, MemberRef, MessageBody, MessageRecord, NewGroup,
    NewGroupMessage, NewImage, NewMessage, SessionChange, ShareRole, UnreadGroup, Usage, WakeMode, WatchItem,
};
use crate::retention::{RetentionPolicy, StoredPolicy};
use crate::search::SearchRequest;
use crate::service::SessionService;

/// Returns the `avm.session.v1.SessionService` server over `service`, with the
/// configured message-size limits.
/// Every call's caller is verified from its bearer token.
pub fn grpc_server(
    service: SessionService,
    verifier: TokenVerifier,
    config: &GrpcConfig,
) -> Authenticated<SessionServiceServer<SessionGrpc>> {
    let server = SessionServiceServer::new(SessionGrpc::new(service))
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);
    Authenticated::new(server, verifier)
}

/// Serves `SessionService` over gRPC.
#[derive(Clone)]
pub struct SessionGrpc {
    service: SessionService,
}

impl SessionGrpc {
    /// Returns the adapter over `service`: what the gRPC server serves, and
    /// what `avm serve` calls in process.
    pub fn new(service: SessionService) -> Self {
        Self { service }
    }
}

#[tonic::async_trait]
impl SessionApi for SessionGrpc {
    type WatchSessionEventsStream = avm_proto::BoxStream<pb::WatchSessionEventsResponse>;
    type ExportImageStream = avm_proto::BoxStream<pb::ExportImageResponse>;
    type WatchUserEventsStream = avm_proto::BoxStream<pb::WatchUserEventsResponse>;
    type ExportContainerStream = avm_proto::BoxStream<pb::ExportContainerResponse>;

    async fn watch_session_events(
        &self,
        request: Request<pb::WatchSessionEventsRequest>,
    ) -> Result<Response<Self::WatchSessionEventsStream>, Status> {
        let ctx = caller(&request)?;
        let items = self.service.watch(&ctx).await?;
        let stream = futures::StreamExt::filter_map(items, |item| {
            std::future::ready(Some(match item {
                Ok(WatchItem::Live) => Ok(pb::WatchSessionEventsResponse {
                    live: true,
                    ..Default::default()
                }),
                Ok(WatchItem::Changed(SessionChange::Deleted { tenant_id, image_ids })) => {
                    Ok(pb::WatchSessionEventsResponse {
                        tenant_id,
                        image_ids,
                        ..Default::default()
                    })
                }
                Ok(WatchItem::Changed(SessionChange::Posted {
                    tenant_id,
                    group_id,
                    seq,
                    message_id,
                })) => Ok(pb::WatchSessionEventsResponse {
                    tenant_id,
                    posted: Some(pb::GroupMessagePosted {
                        group_id,
                        seq,
                        message_id,
                    }),
                    ..Default::default()
                }),
                Ok(WatchItem::Changed(SessionChange::Retooled {
                    tenant_id,
                    image_id,
                    tools,
                })) => Ok(pb::WatchSessionEventsResponse {
                    tenant_id,
                    retooled: Some(pb::ImageRetooled { image_id, tools }),
                    ..Default::default()
                }),
                // Users' devices are told of these, never the runtimes (the service filters them).
                Ok(WatchItem::Changed(SessionChange::Lifecycle { .. })) => return std::future::ready(None),
                Err(err) => Err(Status::from(err)),
            }))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn watch_user_events(
        &self,
        request: Request<pb::WatchUserEventsRequest>,
    ) -> Result<Response<Self::WatchUserEventsStream>, Status> {
        let ctx = caller(&request)?;
        let items = self.service.watch_user(&ctx).await?;
        let stream = futures::StreamExt::map(items, |item| {
            let (change, origin) = match item.map_err(Status::from)? {
                None => {
                    return Ok(pb::WatchUserEventsResponse {
                        live: true,
                        ..Default::default()
                    });
                }
                Some(change) => change,
            };
            use pb::watch_user_events_response::Change;
            let summary = |image: ImageSummary| pb::ImageSummary {
                image_id: image.image_id,
                container_id: image.container_id,
                session_id: image.session_id,
                name: image.name,
                created_at_ms: image.created_at_ms,
                updated_at_ms: image.updated_at_ms,
            };
            let change = match change {
                Lifecycle::ContainerCreated {
                    container_id,
                    created_at_ms,
                } => Change::ContainerCreated(pb::ContainerCreated {
                    container_id,
                    created_at_ms,
                }),
                Lifecycle::ImageCreated(image) => Change::ImageCreated(summary(image)),
                Lifecycle::ImageUpdated(image) => Change::ImageUpdated(summary(image)),
                Lifecycle::ImageDeleted {
                    container_id,
                    image_id,
                    session_id,
                } => Change::ImageDeleted(pb::ImageDeleted {
                    container_id,
                    image_id,
                    session_id,
                }),
            };
            Ok(pb::WatchUserEventsResponse {
                live: false,
                change: Some(change),
                origin_request_id: origin,
            })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn create_container(
        &self,
        request: Request<pb::CreateContainerRequest>,
    ) -> Result<Response<pb::CreateContainerResponse>, Status> {
        let ctx = caller(&request)?;
        let (container, created) = self
            .service
            .create_container(&ctx, &request.get_ref().container_id)
            .await?;
        Ok(Response::new(pb::CreateContainerResponse {
            container: Some(container_pb(container)),
            created,
        }))
    }

    async fn get_container(
        &self,
        request: Request<pb::GetContainerRequest>,
    ) -> Result<Response<pb::GetContainerResponse>, Status> {
        let ctx = caller(&request)?;
        let need = request.get_ref().need.map(share_role).transpose()?;
        let container = self
            .service
            .get_container(&ctx, &request.get_ref().container_id, need)
            .await?;
        Ok(Response::new(pb::GetContainerResponse {
            container: Some(container_pb(container)),
        }))
    }

    async fn list_containers(
        &self,
        request: Request<pb::ListContainersRequest>,
    ) -> Result<Response<pb::ListContainersResponse>, Status> {
        let ctx = caller(&request)?;
        let containers = self.service.list_containers(&ctx).await?;
        Ok(Response::new(pb::ListContainersResponse {
            containers: containers.into_iter().map(container_pb).collect(),
        }))
    }

    async fn delete_container(
        &self,
        request: Request<pb::DeleteContainerRequest>,
    ) -> Result<Response<pb::DeleteContainerResponse>, Status> {
        let ctx = caller(&request)?;
        let deleted_image_ids = self
            .service
            .delete_container(&ctx, &request.get_ref().container_id)
            .await?;
        Ok(Response::new(pb::DeleteContainerResponse { deleted_image_ids }))
    }

    async fn share_container(
        &self,
        request: Request<pb::ShareContainerRequest>,
    ) -> Result<Response<pb::ShareContainerResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let role = share_role(request.role)?;
        self.service
            .share_container(&ctx, &request.container_id, &request.user_id, role)
            .await?;
        Ok(Response::new(pb::ShareContainerResponse {}))
    }

    async fn unshare_container(
        &self,
        request: Request<pb::UnshareContainerRequest>,
    ) -> Result<Response<pb::UnshareContainerResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        self.service
            .unshare_container(&ctx, &request.container_id, &request.user_id)
            .await?;
        Ok(Response::new(pb::UnshareContainerResponse {}))
    }

    async fn list_container_shares(
        &self,
        request: Request<pb::ListContainerSharesRequest>,
    ) -> Result<Response<pb::ListContainerSharesResponse>, Status> {
        let ctx = caller(&request)?;
        let shares = self.service.list_shares(&ctx, &request.get_ref().container_id).await?;
        Ok(Response::new(pb::ListContainerSharesResponse {
            shares: shares
                .into_iter()
                .map(|share| pb::ContainerShare {
                    user_id: share.user_id,
                    created_at_ms: share.created_at_ms,
                    role: share_role_pb(share.role).into(),
                })
                .collect(),
        }))
    }

    async fn create_image(
        &self,
        request: Request<pb::CreateImageRequest>,
    ) -> Result<Response<pb::CreateImageResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let new = NewImage {
            container_id: request.container_id,
            name: request.name,
            description: request.description,
            system_prompt: request.system_prompt,
            mcp_servers_json: request.mcp_servers_json,
            agent: request.agent,
            variables_json: request.variables_json,
            tools: request.tools,
            metadata_json: request.metadata_json,
            parent_image_id: request.parent_image_id,
        };
        let image = self.service.create_image(&ctx, new).await?;
        Ok(Response::new(pb::CreateImageResponse {
            image: Some(image_pb(image)),
        }))
    }

    async fn get_session(
        &self,
        request: Request<pb::GetSessionRequest>,
    ) -> Result<Response<pb::GetSessionResponse>, Status> {
        let ctx = caller(&request)?;
        let image = self.service.get_session(&ctx, &request.get_ref().session_id).await?;
        Ok(Response::new(pb::GetSessionResponse {
            image: Some(image_pb(image)),
        }))
    }

    async fn get_image(&self, request: Request<pb::GetImageRequest>) -> Result<Response<pb::GetImageResponse>, Status> {
        let ctx = caller(&request)?;
        let image = self.service.get_image(&ctx, &request.get_ref().image_id).await?;
        Ok(Response::new(pb::GetImageResponse {
            image: Some(image_pb(image)),
        }))
    }

    async fn list_images(
        &self,
        request: Request<pb::ListImagesRequest>,
    ) -> Result<Response<pb::ListImagesResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let container_id = request.container_id.as_deref();
        let images = match request.parent_image_id.as_deref().filter(|id| !id.is_empty()) {
            // Children live in their parent's container: naming another one too leaves none.
            Some(parent_image_id) => {
                let mut children = self.service.list_child_images(&ctx, parent_image_id).await?;
                if let Some(container_id) = container_id {
                    children.retain(|image| image.container_id == container_id);
                }
                children
            }
            None => self.service.list_images(&ctx, container_id).await?,
        };
        Ok(Response::new(pb::ListImagesResponse {
            images: images.into_iter().map(image_pb).collect(),
        }))
    }

    async fn update_image(
        &self,
        request: Request<pb::UpdateImageRequest>,
    ) -> Result<Response<pb::UpdateImageResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let update = ImageUpdate {
            name: request.name,
            description: request.description,
            tools: request.tools.map(|list| list.tools),
            metadata_json: request.metadata_json,
        };
        let image = self.service.update_image(&ctx, &request.image_id, update).await?;
        Ok(Response::new(pb::UpdateImageResponse {
            image: Some(image_pb(image)),
        }))
    }

    async fn set_agent_state(
        &self,
        request: Request<pb::SetAgentStateRequest>,
    ) -> Result<Response<pb::SetAgentStateResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let state = agent_state(request.state)?;
        let error = Some(request.error.as_str()).filter(|error| !error.is_empty());
        let change = self
            .service
            .set_agent_state(&ctx, &request.image_id, state, error)
            .await?;
        Ok(Response::new(pb::SetAgentStateResponse {
            image: Some(image_pb(change.image)),
            terminated_image_ids: change.terminated_image_ids,
        }))
    }

    async fn delete_image(
        &self,
        request: Request<pb::DeleteImageRequest>,
    ) -> Result<Response<pb::DeleteImageResponse>, Status> {
        let ctx = caller(&request)?;
        self.service.delete_image(&ctx, &request.get_ref().image_id).await?;
        Ok(Response::new(pb::DeleteImageResponse {}))
    }

    async fn append_message(
        &self,
        request: Request<pb::AppendMessageRequest>,
    ) -> Result<Response<pb::AppendMessageResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let message = request
            .message
            .ok_or_else(|| SessionError::invalid("MESSAGE_REQUIRED", "append message needs a message"))?;
        // The session may be named on the request, on the message or on both,
        // but not as two different ones.
        let session_id = match (request.session_id.is_empty(), message.session_id.is_empty()) {
            (false, false) if request.session_id != message.session_id => {
                return Err(SessionError::invalid(
                    "SESSION_ID_MISMATCH",
                    "the request and its message name different sessions",
                )
                .into());
            }
            (true, _) => message.session_id.clone(),
            (false, _) => request.session_id,
        };
        let stored = self
            .service
            .append_message(&ctx, &session_id, new_message(message)?)
            .await?;
        Ok(Response::new(pb::AppendMessageResponse {
            message: Some(message_pb(stored)),
        }))
    }

    async fn list_messages(
        &self,
        request: Request<pb::ListMessagesRequest>,
    ) -> Result<Response<pb::ListMessagesResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        if request.context_only {
            let (compaction, messages) = self.service.list_context(&ctx, &request.session_id).await?;
            return Ok(Response::new(pb::ListMessagesResponse {
                messages: messages.into_iter().map(message_pb).collect(),
                compaction: compaction.map(compaction_pb),
            }));
        }
        let messages = self.service.list_messages(&ctx, &request.session_id).await?;
        Ok(Response::new(pb::ListMessagesResponse {
            messages: messages.into_iter().map(message_pb).collect(),
            compaction: None,
        }))
    }

    async fn record_compaction(
        &self,
        request: Request<pb::RecordCompactionRequest>,
    ) -> Result<Response<pb::RecordCompactionResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let compaction = request.compaction.unwrap_or_default();
        let recorded = self
            .service
            .record_compaction(
                &ctx,
                &request.session_id,
                Compaction {
                    from_seq: 0,
                    from_message_id: compaction.from_message_id,
                    method: compaction.method,
                    summary: compaction.summary,
                    compacted_messages: compaction.compacted_messages,
                    tokens_before: compaction.tokens_before,
                    tokens_after: compaction.tokens_after,
                    created_at_ms: 0,
                },
            )
            .await?;
        Ok(Response::new(pb::RecordCompactionResponse {
            compaction: Some(compaction_pb(recorded)),
        }))
    }

    async fn truncate_messages(
        &self,
        request: Request<pb::TruncateMessagesRequest>,
    ) -> Result<Response<pb::TruncateMessagesResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let truncated = self
            .service
            .truncate_messages(&ctx, &request.session_id, request.after_message_id.as_deref())
            .await?;
        Ok(Response::new(pb::TruncateMessagesResponse {
            removed_messages: truncated.removed_messages,
            last_seq: truncated.last_seq,
        }))
    }

    async fn search_messages(
        &self,
        request: Request<pb::SearchMessagesRequest>,
    ) -> Result<Response<pb::SearchMessagesResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let page = self
            .service
            .search(
                &ctx,
                SearchRequest {
                    query: request.query,
                    container_id: request.container_id,
                    image_id: request.image_id,
                    role: request.role,
                    from_ms: request.from_ms,
                    to_ms: request.to_ms,
                    page_size: request.page_size,
                    page_token: request.page_token,
                },
            )
            .await?;
        Ok(Response::new(pb::SearchMessagesResponse {
            hits: page
                .hits
                .into_iter()
                .map(|hit| pb::SearchHit {
                    container_id: hit.container_id,
                    image_id: hit.image_id,
                    session_id: hit.session_id,
                    image_name: hit.image_name,
                    score: hit.score,
                    at_ms: hit.at_ms,
                    message_id: hit.message_id,
                    seq: hit.seq,
                    role: hit.role.map(str::to_owned),
                    snippet: hit.snippet,
                })
                .collect(),
            next_page_token: page.next_page_token,
        }))
    }

    async fn list_recent_conversations(
        &self,
        request: Request<pb::ListRecentConversationsRequest>,
    ) -> Result<Response<pb::ListRecentConversationsResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let page = self
            .service
            .list_recent(&ctx, request.page_size, &request.page_token)
            .await?;
        Ok(Response::new(pb::ListRecentConversationsResponse {
            conversations: page
                .conversations
                .into_iter()
                .map(|row| pb::RecentConversation {
                    unread_count: row.unread(),
                    image_id: row.image_id,
                    container_id: row.container_id,
                    session_id: row.session_id,
                    name: row.name,
                    agent_state: agent_state_pb(row.agent_state).into(),
                    created_at_ms: row.created_at_ms,
                    last_active_at_ms: row.last_active_at_ms,
                    last_seq: row.last_seq,
                    read_seq: row.read_seq,
                    preview: row.last_message.as_ref().map(preview).unwrap_or_default(),
                    last_message: row.last_message.map(message_pb),
                })
                .collect(),
            next_page_token: page.next_page_token,
        }))
    }

    async fn get_retention_policy(
        &self,
        request: Request<pb::GetRetentionPolicyRequest>,
    ) -> Result<Response<pb::GetRetentionPolicyResponse>, Status> {
        let ctx = caller(&request)?;
        let stored = self.service.get_retention_policy(&ctx).await?;
        Ok(Response::new(pb::GetRetentionPolicyResponse {
            policy: Some(policy_to_pb(stored)),
        }))
    }

    async fn set_retention_policy(
        &self,
        request: Request<pb::SetRetentionPolicyRequest>,
    ) -> Result<Response<pb::SetRetentionPolicyResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let policy = RetentionPolicy {
            message_days: request.message_days,
            idle_conversation_days: request.idle_conversation_days,
            max_conversations_per_container: request.max_conversations_per_container,
        };
        let stored = self.service.set_retention_policy(&ctx, policy).await?;
        Ok(Response::new(pb::SetRetentionPolicyResponse {
            policy: Some(policy_to_pb(stored)),
        }))
    }

    async fn sweep_retention(
        &self,
        request: Request<pb::SweepRetentionRequest>,
    ) -> Result<Response<pb::SweepRetentionResponse>, Status> {
        let ctx = caller(&request)?;
        let report = self.service.sweep_retention(&ctx, request.get_ref().dry_run).await?;
        Ok(Response::new(pb::SweepRetentionResponse {
            dry_run: report.dry_run,
            deleted_messages: report.messages,
            deleted_conversations: report.conversations,
            image_ids: report.image_ids,
            limit_reached: report.limit_reached,
        }))
    }

    async fn mark_image_read(
        &self,
        request: Request<pb::MarkImageReadRequest>,
    ) -> Result<Response<pb::MarkImageReadResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let read_seq = self.service.mark_read(&ctx, &request.image_id, request.seq).await?;
        Ok(Response::new(pb::MarkImageReadResponse { read_seq }))
    }

    async fn export_image(
        &self,
        request: Request<pb::ExportImageRequest>,
    ) -> Result<Response<Self::ExportImageStream>, Status> {
        let ctx = caller(&request)?;
        let pieces = self.service.export_image(&ctx, &request.get_ref().image_id).await?;
        let stream = futures::StreamExt::map(pieces, |piece| {
            piece.map(|data| pb::ExportImageResponse { data }).map_err(Status::from)
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn export_container(
        &self,
        request: Request<pb::ExportContainerRequest>,
    ) -> Result<Response<Self::ExportContainerStream>, Status> {
        let ctx = caller(&request)?;
        let pieces = self
            .service
            .export_container(&ctx, &request.get_ref().container_id)
            .await?;
        let stream = futures::StreamExt::map(pieces, |piece| {
            piece
                .map(|data| pb::ExportContainerResponse { data })
                .map_err(Status::from)
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn import_conversations(
        &self,
        request: Request<pb::ImportConversationsRequest>,
    ) -> Result<Response<pb::ImportConversationsResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let imported = self
            .service
            .import(&ctx, &request.container_id, &request.document)
            .await?;
        Ok(Response::new(pb::ImportConversationsResponse {
            conversations: imported
                .into_iter()
                .map(|item| pb::ImportedConversation {
                    document_id: item.document_id,
                    image: Some(image_pb(item.image)),
                    created: item.created,
                })
                .collect(),
        }))
    }

    async fn list_open_turns(
        &self,
        request: Request<pb::ListOpenTurnsRequest>,
    ) -> Result<Response<pb::ListOpenTurnsResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let turns = self
            .service
            .list_open_turns(&ctx, request.before_ms, &request.after_session_id, request.page_size)
            .await?;
        Ok(Response::new(pb::ListOpenTurnsResponse {
            turns: turns
                .into_iter()
                .map(|turn| pb::OpenTurn {
                    tenant_id: turn.tenant_id,
                    container_id: turn.container_id,
                    image_id: turn.image_id,
                    session_id: turn.session_id,
                    user_message_id: turn.user_message_id,
                })
                .collect(),
        }))
    }

    async fn create_group(
        &self,
        request: Request<pb::CreateGroupRequest>,
    ) -> Result<Response<pb::CreateGroupResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let new = NewGroup {
            container_id: request.container_id,
            name: request.name,
            wake_mode: wake_mode(request.wake_mode)?,
            members: request
                .members
                .into_iter()
                .map(|member| member_ref(Some(member)))
                .collect::<Result<_, _>>()?,
        };
        let group = self.service.create_group(&ctx, new).await?;
        Ok(Response::new(pb::CreateGroupResponse {
            group: Some(group_pb(group)),
        }))
    }

    async fn get_group(&self, request: Request<pb::GetGroupRequest>) -> Result<Response<pb::GetGroupResponse>, Status> {
        let ctx = caller(&request)?;
        let group = self.service.get_group(&ctx, &request.get_ref().group_id).await?;
        Ok(Response::new(pb::GetGroupResponse {
            group: Some(group_pb(group)),
        }))
    }

    async fn list_groups(
        &self,
        request: Request<pb::ListGroupsRequest>,
    ) -> Result<Response<pb::ListGroupsResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let page = self
            .service
            .list_groups(&ctx, &request.container_id, request.page_size, &request.page_token)
            .await?;
        Ok(Response::new(pb::ListGroupsResponse {
            groups: page.groups.into_iter().map(group_pb).collect(),
            next_page_token: page.next_page_token.unwrap_or_default(),
        }))
    }

    async fn update_group(
        &self,
        request: Request<pb::UpdateGroupRequest>,
    ) -> Result<Response<pb::UpdateGroupResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let update = GroupUpdate {
            name: request.name,
            wake_mode: request.wake_mode.map(wake_mode).transpose()?.flatten(),
        };
        let group = self.service.update_group(&ctx, &request.group_id, update).await?;
        Ok(Response::new(pb::UpdateGroupResponse {
            group: Some(group_pb(group)),
        }))
    }

    async fn delete_group(
        &self,
        request: Request<pb::DeleteGroupRequest>,
    ) -> Result<Response<pb::DeleteGroupResponse>, Status> {
        let ctx = caller(&request)?;
        self.service.delete_group(&ctx, &request.get_ref().group_id).await?;
        Ok(Response::new(pb::DeleteGroupResponse {}))
    }

    async fn add_group_member(
        &self,
        request: Request<pb::AddGroupMemberRequest>,
    ) -> Result<Response<pb::AddGroupMemberResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let member = member_ref(request.member)?;
        let member = self.service.add_group_member(&ctx, &request.group_id, member).await?;
        Ok(Response::new(pb::AddGroupMemberResponse {
            member: Some(group_member_pb(member)),
        }))
    }

    async fn remove_group_member(
        &self,
        request: Request<pb::RemoveGroupMemberRequest>,
    ) -> Result<Response<pb::RemoveGroupMemberResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let member = member_ref(request.member)?;
        self.service
            .remove_group_member(&ctx, &request.group_id, member)
            .await?;
        Ok(Response::new(pb::RemoveGroupMemberResponse {}))
    }

    async fn list_group_members(
        &self,
        request: Request<pb::ListGroupMembersRequest>,
    ) -> Result<Response<pb::ListGroupMembersResponse>, Status> {
        let ctx = caller(&request)?;
        let members = self
            .service
            .list_group_members(&ctx, &request.get_ref().group_id)
            .await?;
        Ok(Response::new(pb::ListGroupMembersResponse {
            members: members.into_iter().map(group_member_pb).collect(),
        }))
    }

    async fn post_group_message(
        &self,
        request: Request<pb::PostGroupMessageRequest>,
    ) -> Result<Response<pb::PostGroupMessageResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let message = NewGroupMessage {
            message_id: Some(request.message_id).filter(|id| !id.is_empty()),
            sender: member_ref(request.sender)?,
            content: request.content,
            mentions: request.mentions,
            created_at_ms: 0,
            read_seq: request.read_seq,
        };
        let posted = self
            .service
            .post_group_message(&ctx, &request.group_id, message)
            .await?;
        Ok(Response::new(pb::PostGroupMessageResponse {
            message: Some(group_message_pb(posted.message)),
            created: posted.created,
            sender_read_seq: posted.sender_read_seq,
        }))
    }

    async fn list_group_messages(
        &self,
        request: Request<pb::ListGroupMessagesRequest>,
    ) -> Result<Response<pb::ListGroupMessagesResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let messages = self
            .service
            .list_group_messages(&ctx, &request.group_id, request.after_seq, request.limit)
            .await?;
        Ok(Response::new(pb::ListGroupMessagesResponse {
            messages: messages.into_iter().map(group_message_pb).collect(),
        }))
    }

    async fn list_unread(
        &self,
        request: Request<pb::ListUnreadRequest>,
    ) -> Result<Response<pb::ListUnreadResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let member = member_ref(request.member)?;
        let groups = self.service.list_unread(&ctx, member, request.message_limit).await?;
        Ok(Response::new(pb::ListUnreadResponse {
            groups: groups.into_iter().map(unread_group_pb).collect(),
        }))
    }

    async fn advance_read_cursor(
        &self,
        request: Request<pb::AdvanceReadCursorRequest>,
    ) -> Result<Response<pb::AdvanceReadCursorResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let member = member_ref(request.member)?;
        let member = self
            .service
            .advance_read_cursor(&ctx, &request.group_id, member, request.seq)
            .await?;
        Ok(Response::new(pb::AdvanceReadCursorResponse {
            member: Some(group_member_pb(member)),
        }))
    }
}

/// Returns the role a share request names; unset means `use`.
fn share_role(value: i32) -> Result<ShareRole, SessionError> {
    match pb::ShareRole::try_from(value) {
        Ok(pb::ShareRole::Unspecified | pb::ShareRole::Use) => Ok(ShareRole::Use),
        Ok(pb::ShareRole::Read) => Ok(ShareRole::Read),
        Ok(pb::ShareRole::Manage) => Ok(ShareRole::Manage),
        Err(_) => Err(SessionError::invalid(
            "INVALID_SHARE_ROLE",
            "share role must be SHARE_ROLE_READ, SHARE_ROLE_USE or SHARE_ROLE_MANAGE",
        )),
    }
}

fn share_role_pb(role: ShareRole) -> pb::ShareRole {
    match role {
        ShareRole::Read => pb::ShareRole::Read,
        ShareRole::Use => pb::ShareRole::Use,
        ShareRole::Manage => pb::ShareRole::Manage,
    }
}

/// Returns the agent state a request names; it must name one.
fn agent_state(value: i32) -> Result<AgentState, SessionError> {
    match pb::AgentState::try_from(value) {
        Ok(pb::AgentState::Active) => Ok(AgentState::Active),
        Ok(pb::AgentState::Paused) => Ok(AgentState::Paused),
        Ok(pb::AgentState::Terminated) => Ok(AgentState::Terminated),
        Ok(pb::AgentState::Error) => Ok(AgentState::Error),
        Ok(pb::AgentState::Unspecified) | Err(_) => Err(SessionError::invalid(
            "INVALID_AGENT_STATE",
            "an agent state is active, paused or terminated",
        )),
    }
}

fn agent_state_pb(state: AgentState) -> pb::AgentState {
    match state {
        AgentState::Active => pb::AgentState::Active,
        AgentState::Paused => pb::AgentState::Paused,
        AgentState::Terminated => pb::AgentState::Terminated,
        AgentState::Error => pb::AgentState::Error,
    }
}

/// Returns the wake mode a request names; `None` when it names none.
fn wake_mode(value: i32) -> Result<Option<WakeMode>, SessionError> {
    match pb::GroupWakeMode::try_from(value) {
        Ok(pb::GroupWakeMode::Unspecified) => Ok(None),
        Ok(pb::GroupWakeMode::All) => Ok(Some(WakeMode::All)),
        Ok(pb::GroupWakeMode::Mentions) => Ok(Some(WakeMode::Mentions)),
        Err(_) => Err(SessionError::invalid(
            "INVALID_WAKE_MODE",
            format!("unknown group wake mode {value}"),
        )),
    }
}

fn wake_mode_pb(mode: WakeMode) -> pb::GroupWakeMode {
    match mode {
        WakeMode::All => pb::GroupWakeMode::All,
        WakeMode::Mentions => pb::GroupWakeMode::Mentions,
    }
}

/// Returns the member a request names; its kind is required.
fn member_ref(member: Option<pb::GroupMemberRef>) -> Result<MemberRef, SessionError> {
    let member =
        member.ok_or_else(|| SessionError::invalid("GROUP_MEMBER_REQUIRED", "the request needs a group member"))?;
    let kind = match pb::GroupMemberKind::try_from(member.kind) {
        Ok(pb::GroupMemberKind::Agent) => MemberKind::Agent,
        Ok(pb::GroupMemberKind::User) => MemberKind::User,
        Ok(pb::GroupMemberKind::Unspecified) | Err(_) => {
            return Err(SessionError::invalid(
                "INVALID_MEMBER_KIND",
                "a group member is an agent or a user",
            ));
        }
    };
    Ok(MemberRef {
        kind,
        member_id: member.member_id,
    })
}

fn member_ref_pb(member: MemberRef) -> pb::GroupMemberRef {
    let kind = match member.kind {
        MemberKind::Agent => pb::GroupMemberKind::Agent,
        MemberKind::User => pb::GroupMemberKind::User,
    };
    pb::GroupMemberRef {
        kind: kind.into(),
        member_id: member.member_id,
    }
}

fn group_pb(group: GroupRecord) -> pb::Group {
    pb::Group {
        group_id: group.group_id,
        container_id: group.container_id,
        name: group.name,
        wake_mode: wake_mode_pb(group.wake_mode).into(),
        last_seq: group.last_seq,
        consecutive_agent_messages: group.consecutive_agent_messages,
        created_at_ms: group.created_at_ms,
        updated_at_ms: group.updated_at_ms,
    }
}

fn group_member_pb(member: GroupMemberRecord) -> pb::GroupMember {
    pb::GroupMember {
        group_id: member.group_id,
        member: Some(member_ref_pb(member.member)),
        joined_at_ms: member.joined_at_ms,
        read_seq: member.read_seq,
    }
}

fn group_message_pb(message: GroupMessageRecord) -> pb::GroupMessage {
    pb::GroupMessage {
        group_id: message.group_id,
        message_id: message.message_id,
        seq: message.seq,
        sender: Some(member_ref_pb(message.sender)),
        content: message.content,
        mentions: message.mentions,
        consecutive_agent_messages: message.consecutive_agent_messages,
        created_at_ms: message.created_at_ms,
    }
}

fn unread_group_pb(unread: UnreadGroup) -> pb::UnreadGroup {
    pb::UnreadGroup {
        group: Some(group_pb(unread.group)),
        read_seq: unread.read_seq,
        unread_count: unread.unread_count,
        messages: unread.messages.into_iter().map(group_message_pb).collect(),
    }
}

fn container_pb(container: ContainerRecord) -> pb::Container {
    pb::Container {
        container_id: container.container_id,
        created_at_ms: container.created_at_ms,
        owner_user_id: container.owner_id,
    }
}

fn image_pb(image: ImageRecord) -> pb::Image {
    pb::Image {
        image_id: image.image_id,
        container_id: image.container_id,
        session_id: image.session_id,
        name: image.name,
        description: image.description,
        system_prompt: image.system_prompt,
        mcp_servers_json: image.mcp_servers_json,
        agent: image.agent,
        variables_json: image.variables_json,
        tools: image.tools,
        metadata_json: image.metadata_json,
        created_at_ms: image.created_at_ms,
        updated_at_ms: image.updated_at_ms,
        agent_state: agent_state_pb(image.agent_state).into(),
        agent_error: image.agent_error,
        parent_image_id: image.parent_image_id,
        depth: image.depth,
    }
}

fn new_message(message: pb::Message) -> Result<NewMessage, SessionError> {
    use pb::message::Body;
    let body = match message.body {
        None => {
            return Err(SessionError::invalid("MESSAGE_BODY_REQUIRED", "message needs a body"));
        }
        Some(Body::User(user)) => MessageBody::User {
            content_json: content_json(&user.content, user.plain_text),
        },
        Some(Body::Assistant(assistant)) => MessageBody::Assistant {
            text: assistant.text,
            usage: assistant.usage.map(|usage| Usage {
                input_tokens: usage.input_tokens,
                output_tokens: usage.output_tokens,
            }),
            interrupted: assistant.interrupted,
            model: assistant.model,
            stop_reason: assistant.stop_reason,
            resources: assistant.resources,
        },
        Some(Body::ToolCall(call)) => MessageBody::ToolCall {
            tool_call_id: call.tool_call_id,
            tool_name: call.tool_name,
            input_json: call.input_json,
            parent_id: call.parent_id,
        },
        Some(Body::ToolResult(result)) => MessageBody::ToolResult {
            tool_call_id: result.tool_call_id,
            tool_name: result.tool_name,
            output: result.output,
            is_error: result.is_error,
        },
        Some(Body::Error(error)) => MessageBody::Error {
            text: error.text,
            error_code: error.error_code,
        },
    };
    Ok(NewMessage {
        message_id: message.message_id,
        created_at_ms: message.created_at_ms,
        body,
    })
}

fn message_pb(message: MessageRecord) -> pb::Message {
    use pb::message::Body;
    let body = match message.body {
        MessageBody::User { content_json } => {
            let (content, plain_text) = content_parts(&content_json);
            Body::User(pb::UserMessage { content, plain_text })
        }
        MessageBody::Assistant {
            text,
            usage,
            interrupted,
            model,
            stop_reason,
            resources,
        } => Body::Assistant(pb::AssistantMessage {
            text,
            usage: usage.map(|usage| pb::Usage {
                input_tokens: usage.input_tokens,
                output_tokens: usage.output_tokens,
            }),
            interrupted,
            model,
            stop_reason,
            resources,
        }),
        MessageBody::ToolCall {
            tool_call_id,
            tool_name,
            input_json,
            parent_id,
        } => Body::ToolCall(pb::ToolCallMessage {
            tool_call_id,
            tool_name,
            input_json,
            parent_id,
        }),
        MessageBody::ToolResult {
            tool_call_id,
            tool_name,
            output,
            is_error,
        } => Body::ToolResult(pb::ToolResultMessage {
            tool_call_id,
            tool_name,
            output,
            is_error,
        }),
        MessageBody::Error { text, error_code } => Body::Error(pb::ErrorMessage { text, error_code }),
    };
    pb::Message {
        message_id: message.message_id,
        session_id: message.session_id,
        created_at_ms: message.created_at_ms,
        seq: message.seq,
        body: Some(body),
    }
}

/// Returns user content as the store keeps it: the protocol's JSON (a
/// string for plain text, else a list of parts), written once here.
fn content_json(parts: &[pb::ContentPart], plain_text: bool) -> String {
    use pb::content_part::Part;
    if plain_text
        && let [
            pb::ContentPart {
                part: Some(Part::Text(text)),
            },
        ] = parts
    {
        return serde_json::Value::String(text.text.clone()).to_string();
    }
    let parts: Vec<serde_json::Value> = parts
        .iter()
        .filter_map(|part| match part.part.as_ref()? {
            Part::Text(text) => Some(serde_json::json!({"type": "text", "text": text.text})),
            Part::Image(image) => {
                Some(serde_json::json!({"type": "image", "data": image.data, "mediaType": image.media_type}))
            }
            Part::File(file) => {
                let mut part = serde_json::json!({"type": "file", "data": file.data, "mediaType": file.media_type});
                if let Some(filename) = &file.filename {
                    part["filename"] = serde_json::Value::String(filename.clone());
                }
                Some(part)
            }
        })
        .collect();
    serde_json::Value::Array(parts).to_string()
}

/// Returns the parts of stored user content, and whether it was plain text.
fn content_parts(content_json: &str) -> (Vec<pb::ContentPart>, bool) {
    use pb::content_part::Part;
    let text = |text: String| pb::ContentPart {
        part: Some(Part::Text(pb::TextPart { text })),
    };
    let field = |part: &serde_json::Value, name: &str| part[name].as_str().unwrap_or_default().to_owned();
    match serde_json::from_str::<serde_json::Value>(content_json) {
        Ok(serde_json::Value::String(plain)) => (vec![text(plain)], true),
        Ok(serde_json::Value::Array(parts)) => {
            let parts = parts
                .iter()
                .filter_map(|part| {
                    let part = match part["type"].as_str()? {
                        "text" => Part::Text(pb::TextPart {
                            text: field(part, "text"),
                        }),
                        "image" => Part::Image(pb::ImagePart {
                            data: field(part, "data"),
                            media_type: field(part, "mediaType"),
                        }),
                        "file" => Part::File(pb::FilePart {
                            data: field(part, "data"),
                            media_type: field(part, "mediaType"),
                            filename: part["filename"].as_str().map(str::to_owned),
                        }),
                        _ => return None,
                    };
                    Some(pb::ContentPart { part: Some(part) })
                })
                .collect();
            (parts, false)
        }
        // What the store holds was checked on the way in; anything else is shown as text.
        _ => (vec![text(content_json.to_owned())], true),
    }
}

/// Returns a compaction as the API carries it.
fn compaction_pb(compaction: Compaction) -> pb::Compaction {
    pb::Compaction {
        from_message_id: compaction.from_message_id,
        from_seq: compaction.from_seq,
        method: compaction.method,
        summary: compaction.summary,
        compacted_messages: compaction.compacted_messages,
        tokens_before: compaction.tokens_before,
        tokens_after: compaction.tokens_after,
        created_at_ms: compaction.created_at_ms,
    }
}

fn policy_to_pb(stored: StoredPolicy) -> pb::RetentionPolicy {
    pb::RetentionPolicy {
        message_days: stored.policy.message_days,
        idle_conversation_days: stored.policy.idle_conversation_days,
        max_conversations_per_container: stored.policy.max_conversations_per_container,
        updated_at_ms: stored.updated_at_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_content_keeps_its_shape_through_the_store() {
        let plain = r#""hello""#;
        let (parts, plain_text) = content_parts(plain);
        assert!(plain_text);
        assert_eq!(content_json(&parts, plain_text), plain);
        let listed = r#"[{"type":"text","text":"look"},{"type":"image","data":"AAA=","mediaType":"image/png"},{"type":"file","data":"JVBE","mediaType":"application/pdf","filename":"a.pdf"}]"#;
        let (parts, plain_text) = content_parts(listed);
        assert!(!plain_text);
        assert_eq!(parts.len(), 3);
        let back: serde_json::Value = serde_json::from_str(&content_json(&parts, plain_text)).unwrap_or_default();
        let original: serde_json::Value = serde_json::from_str(listed).unwrap_or_default();
        assert_eq!(back, original);
    }
}
