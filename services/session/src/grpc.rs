//! The gRPC adapter: proto ⇄ domain, metadata → `RequestContext`, error → `Status`.

use avm_common::auth::{Authenticated, TokenVerifier, caller};
use avm_common::config::GrpcConfig;
use avm_proto::session::v1 as pb;
use avm_proto::session::v1::session_service_server::{SessionService as SessionApi, SessionServiceServer};
use tonic::{Request, Response, Status};

use crate::error::SessionError;
use crate::record::{
    ContainerRecord, ImageRecord, ImageUpdate, MessageBody, MessageRecord, NewImage, NewMessage, Usage,
};
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
        let container = self
            .service
            .get_container(&ctx, &request.get_ref().container_id)
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
        self.service
            .share_container(&ctx, &request.container_id, &request.user_id)
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
        let images = self
            .service
            .list_images(&ctx, request.get_ref().container_id.as_deref())
            .await?;
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
        };
        let image = self.service.update_image(&ctx, &request.image_id, update).await?;
        Ok(Response::new(pb::UpdateImageResponse {
            image: Some(image_pb(image)),
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
        let messages = self.service.list_messages(&ctx, &request.get_ref().session_id).await?;
        Ok(Response::new(pb::ListMessagesResponse {
            messages: messages.into_iter().map(message_pb).collect(),
        }))
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
        created_at_ms: image.created_at_ms,
        updated_at_ms: image.updated_at_ms,
    }
}

fn new_message(message: pb::Message) -> Result<NewMessage, SessionError> {
    use pb::message::Body;
    let body = match message.body {
        None => {
            return Err(SessionError::invalid("MESSAGE_BODY_REQUIRED", "message needs a body"));
        }
        Some(Body::User(user)) => MessageBody::User {
            content_json: user.content_json,
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
        MessageBody::User { content_json } => Body::User(pb::UserMessage { content_json }),
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
