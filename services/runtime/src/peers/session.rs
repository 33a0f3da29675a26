//! The session service, as the runtime reads and writes it: images,
//! history, appends, deletions.

use avm_common::RequestContext;
use avm_proto::session::v1 as pb;
use avm_proto::session::v1::SessionServiceHandle;
use futures::stream::{BoxStream, StreamExt};

use crate::error::RuntimeError;
use crate::llm::{ToolCall, ToolOutput};
use crate::message::{Content, Message, MessageBody, Part, Reply, Usage};

/// The session service's image is the runtime's: it adds nothing to it.
/// Its `agent_state` says whether its agent may run.
pub use pb::{AgentState as Lifecycle, Compaction, Image};

/// A turn a session's history leaves open: nobody stored its reply or error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenTurn {
    pub tenant_id: String,
    pub container_id: String,
    pub image_id: String,
    pub session_id: String,
    /// The turn's user message.
    pub user_message_id: String,
}

/// A child agent's image, as its parent asks for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewChild {
    pub container_id: String,
    pub parent_image_id: String,
    pub name: String,
    pub system_prompt: Option<String>,
    pub agent: Option<String>,
    pub tools: Vec<String>,
}

/// A change the session service announces, or the mark that changes flow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SessionChange {
    /// From here on every change reaches the watcher.
    Live,
    /// Images deleted (one, or all of a container's).
    Deleted { tenant_id: String, image_ids: Vec<String> },
    /// A message new in a group.
    Posted {
        tenant_id: String,
        group_id: String,
        seq: u64,
        message_id: String,
    },
    /// An image's tools changed (to `tools`), whoever changed them.
    Retooled {
        tenant_id: String,
        image_id: String,
        tools: Vec<String>,
    },
}

/// What changes in an image: its name, description (empty clears it),
/// tools or metadata (a JSON object).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageChanges {
    pub name: Option<String>,
    pub description: Option<String>,
    pub tools: Option<Vec<String>>,
    pub metadata_json: Option<String>,
}

/// The session service as the runtime uses it; cheap to clone.
#[derive(Clone)]
pub struct Sessions {
    pub(super) service: SessionServiceHandle,
}

impl Sessions {
    /// Wraps the session service (in process or remote).
    pub fn new(service: SessionServiceHandle) -> Self {
        Self { service }
    }

    /// Returns an image of the caller's tenant.
    pub async fn get_image(&self, ctx: &RequestContext, image_id: &str) -> Result<Image, RuntimeError> {
        let request = ctx.request(pb::GetImageRequest {
            image_id: image_id.to_owned(),
        });
        let image = self.service.get_image(request).await?.into_inner().image;
        image.ok_or_else(missing)
    }

    /// Returns the images of a container (after checking it exists) or of
    /// all the caller's containers, newest first.
    pub async fn list_images(
        &self,
        ctx: &RequestContext,
        container_id: Option<&str>,
    ) -> Result<Vec<Image>, RuntimeError> {
        if let Some(container_id) = container_id {
            self.check_container(ctx, container_id).await?;
        }
        let request = ctx.request(pb::ListImagesRequest {
            container_id: container_id.map(str::to_owned),
            parent_image_id: None,
        });
        let images = self.service.list_images(request).await?.into_inner().images;
        Ok(images)
    }

    /// Fails with CONTAINER_NOT_FOUND unless the caller may see the container.
    pub async fn check_container(&self, ctx: &RequestContext, container_id: &str) -> Result<(), RuntimeError> {
        self.get_container(ctx, container_id, None).await
    }

    /// Fails unless the caller may do what `need` allows in the container:
    /// its owner, admins and services may do everything, a user it is shared
    /// with what the share's role allows (`SHARE_ROLE_TOO_LOW`, decided by
    /// the session service); a container they do not see is NOT_FOUND.
    pub async fn require_role(&self, ctx: &RequestContext, container_id: &str, need: Role) -> Result<(), RuntimeError> {
        self.get_container(ctx, container_id, Some(need)).await
    }

    async fn get_container(
        &self,
        ctx: &RequestContext,
        container_id: &str,
        need: Option<Role>,
    ) -> Result<(), RuntimeError> {
        let request = ctx.request(pb::GetContainerRequest {
            container_id: container_id.to_owned(),
            need: need.map(|role| role.pb().into()),
        });
        self.service.get_container(request).await?;
        Ok(())
    }

    /// Returns the ids of the containers the caller may see.
    pub async fn visible_containers(&self, ctx: &RequestContext) -> Result<Vec<String>, RuntimeError> {
        let request = ctx.request(pb::ListContainersRequest {});
        let response = self.service.list_containers(request).await?.into_inner();
        Ok(response.containers.into_iter().map(|c| c.container_id).collect())
    }

    /// Returns the image that owns a session of the caller's tenant.
    pub async fn get_session(&self, ctx: &RequestContext, session_id: &str) -> Result<Image, RuntimeError> {
        let request = ctx.request(pb::GetSessionRequest {
            session_id: session_id.to_owned(),
        });
        let image = self.service.get_session(request).await?.into_inner().image;
        image.ok_or_else(missing)
    }

    /// Returns a session's messages in stored order.
    pub async fn list_messages(&self, ctx: &RequestContext, session_id: &str) -> Result<Vec<Message>, RuntimeError> {
        let request = ctx.request(pb::ListMessagesRequest {
            session_id: session_id.to_owned(),
            context_only: false,
        });
        let messages = self.service.list_messages(request).await?.into_inner().messages;
        Ok(messages.into_iter().map(message_of).collect())
    }

    /// Returns what the model reads of a session: its latest compaction and
    /// the messages from it on (all of them when it has none).
    pub async fn list_context(
        &self,
        ctx: &RequestContext,
        session_id: &str,
    ) -> Result<(Option<Compaction>, Vec<Message>), RuntimeError> {
        let request = ctx.request(pb::ListMessagesRequest {
            session_id: session_id.to_owned(),
            context_only: true,
        });
        let response = self.service.list_messages(request).await?.into_inner();
        Ok((
            response.compaction,
            response.messages.into_iter().map(message_of).collect(),
        ))
    }

    /// Records a compaction of a session's context (the runtime's own credential).
    pub async fn record_compaction(
        &self,
        ctx: &RequestContext,
        session_id: &str,
        compaction: Compaction,
    ) -> Result<(), RuntimeError> {
        let request = ctx.request(pb::RecordCompactionRequest {
            session_id: session_id.to_owned(),
            compaction: Some(compaction),
        });
        self.service.record_compaction(request).await?;
        Ok(())
    }

    /// Deletes a session's messages after `after_message_id` (all when
    /// `None`); returns how many.
    pub async fn truncate_messages(
        &self,
        ctx: &RequestContext,
        session_id: &str,
        after_message_id: Option<&str>,
    ) -> Result<u64, RuntimeError> {
        let request = ctx.request(pb::TruncateMessagesRequest {
            session_id: session_id.to_owned(),
            after_message_id: after_message_id.map(str::to_owned),
        });
        Ok(self
            .service
            .truncate_messages(request)
            .await?
            .into_inner()
            .removed_messages)
    }

    /// Returns, across tenants, at most `page_size` turns left open by
    /// sessions whose last message was stored before `before_ms`, by session
    /// id after `after_session_id` (the runtime's own credential only).
    pub async fn list_open_turns(
        &self,
        ctx: &RequestContext,
        before_ms: i64,
        after_session_id: &str,
        page_size: u32,
    ) -> Result<Vec<OpenTurn>, RuntimeError> {
        let request = ctx.request(pb::ListOpenTurnsRequest {
            before_ms,
            after_session_id: after_session_id.to_owned(),
            page_size,
        });
        let turns = self.service.list_open_turns(request).await?.into_inner().turns;
        Ok(turns
            .into_iter()
            .map(|turn| OpenTurn {
                tenant_id: turn.tenant_id,
                container_id: turn.container_id,
                image_id: turn.image_id,
                session_id: turn.session_id,
                user_message_id: turn.user_message_id,
            })
            .collect())
    }

    /// Appends a message and returns it as stored (with its time).
    pub async fn append(&self, ctx: &RequestContext, message: &Message) -> Result<Message, RuntimeError> {
        let request = ctx.request(pb::AppendMessageRequest {
            session_id: message.session_id.clone(),
            message: Some(message_pb(message)),
        });
        let stored = self.service.append_message(request).await?.into_inner().message;
        Ok(message_of(stored.ok_or_else(missing)?))
    }

    /// Changes an image; the session service checks the changes.
    pub async fn update_image(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        update: ImageChanges,
    ) -> Result<(), RuntimeError> {
        let request = ctx.request(pb::UpdateImageRequest {
            image_id: image_id.to_owned(),
            name: update.name,
            description: update.description,
            tools: update.tools.map(|tools| pb::ToolList { tools }),
            metadata_json: update.metadata_json,
        });
        self.service.update_image(request).await?;
        Ok(())
    }

    /// Creates the image of a child agent in its parent's container.
    pub async fn create_child_image(&self, ctx: &RequestContext, child: NewChild) -> Result<Image, RuntimeError> {
        let request = ctx.request(pb::CreateImageRequest {
            container_id: child.container_id,
            name: Some(child.name),
            description: None,
            system_prompt: child.system_prompt,
            mcp_servers_json: String::new(),
            agent: child.agent,
            variables_json: String::new(),
            tools: child.tools,
            metadata_json: String::new(),
            parent_image_id: Some(child.parent_image_id),
        });
        let image = self.service.create_image(request).await?.into_inner().image;
        image.ok_or_else(missing)
    }

    /// Returns the images of the agents an image's agent started, newest first.
    pub async fn children(&self, ctx: &RequestContext, image_id: &str) -> Result<Vec<Image>, RuntimeError> {
        let request = ctx.request(pb::ListImagesRequest {
            container_id: None,
            parent_image_id: Some(image_id.to_owned()),
        });
        let images = self.service.list_images(request).await?.into_inner().images;
        Ok(images)
    }

    /// Sets whether an image's agent may run; returns the image and, when
    /// it was terminated by this call, every image terminated with it.
    pub async fn set_lifecycle(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        lifecycle: Lifecycle,
    ) -> Result<(Image, Vec<String>), RuntimeError> {
        self.set_state(ctx, image_id, lifecycle, String::new()).await
    }

    /// Puts an image's agent in the `Error` state, with the failure.
    pub async fn set_error(&self, ctx: &RequestContext, image_id: &str, error: String) -> Result<Image, RuntimeError> {
        Ok(self.set_state(ctx, image_id, Lifecycle::Error, error).await?.0)
    }

    async fn set_state(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        lifecycle: Lifecycle,
        error: String,
    ) -> Result<(Image, Vec<String>), RuntimeError> {
        let request = ctx.request(pb::SetAgentStateRequest {
            image_id: image_id.to_owned(),
            state: lifecycle.into(),
            error,
        });
        let changed = self.service.set_agent_state(request).await?.into_inner();
        let image = changed.image.ok_or_else(missing)?;
        Ok((image, changed.terminated_image_ids))
    }

    /// Follows the deletions, group posts and tool changes of every tenant
    /// (as a service principal).
    pub async fn watch_changes(
        &self,
        ctx: &RequestContext,
    ) -> Result<BoxStream<'static, Result<SessionChange, RuntimeError>>, RuntimeError> {
        let request = ctx.request(pb::WatchSessionEventsRequest {});
        let stream = self.service.watch_session_events(request).await?.into_inner();
        Ok(stream
            .map(|item| {
                let event = item?;
                Ok(match (event.posted, event.retooled) {
                    _ if event.live => SessionChange::Live,
                    (Some(posted), _) => SessionChange::Posted {
                        tenant_id: event.tenant_id,
                        group_id: posted.group_id,
                        seq: posted.seq,
                        message_id: posted.message_id,
                    },
                    (None, Some(retooled)) => SessionChange::Retooled {
                        tenant_id: event.tenant_id,
                        image_id: retooled.image_id,
                        tools: retooled.tools,
                    },
                    (None, None) => SessionChange::Deleted {
                        tenant_id: event.tenant_id,
                        image_ids: event.image_ids,
                    },
                })
            })
            .boxed())
    }
}

fn missing() -> RuntimeError {
    RuntimeError::Api(avm_common::ApiError::internal("the session service returned nothing"))
}

/// Returns content parts as the protos carry them.
pub(crate) fn parts_pb(content: &Content) -> Vec<pb::ContentPart> {
    use pb::content_part::Part as Wire;
    content
        .parts
        .iter()
        .map(|part| pb::ContentPart {
            part: Some(match part {
                Part::Text(text) => Wire::Text(pb::TextPart { text: text.clone() }),
                Part::Image { media_type, data } => Wire::Image(pb::ImagePart {
                    data: data.clone(),
                    media_type: media_type.clone(),
                }),
                Part::File {
                    media_type,
                    data,
                    filename,
                } => Wire::File(pb::FilePart {
                    data: data.clone(),
                    media_type: media_type.clone(),
                    filename: filename.clone(),
                }),
            }),
        })
        .collect()
}

/// Returns content of parts as the protos carry them; a part of no known
/// kind (from a newer peer) is refused by [`Content::validate`] as empty.
pub(crate) fn content(parts: Vec<pb::ContentPart>, plain_text: bool) -> Content {
    use pb::content_part::Part as Wire;
    Content {
        parts: parts
            .into_iter()
            .map(|part| match part.part {
                Some(Wire::Text(text)) => Part::Text(text.text),
                Some(Wire::Image(image)) => Part::Image {
                    media_type: image.media_type,
                    data: image.data,
                },
                Some(Wire::File(file)) => Part::File {
                    media_type: file.media_type,
                    data: file.data,
                    filename: file.filename,
                },
                None => Part::Text(String::new()),
            })
            .collect(),
        plain_text,
    }
}

/// Returns a message in the session service's wire form, for keeping it
/// outside this process (the outbox in Redis).
pub(crate) fn encode_message(message: &Message) -> Vec<u8> {
    prost::Message::encode_to_vec(&message_pb(message))
}

/// Reads a message [`encode_message`] wrote; `None` when it cannot.
pub(crate) fn decode_message(wire: &[u8]) -> Option<Message> {
    <pb::Message as prost::Message>::decode(wire).ok().map(message_of)
}

fn message_of(message: pb::Message) -> Message {
    use pb::message::Body;
    let body = match message.body {
        Some(Body::User(user)) => MessageBody::User(content(user.content, user.plain_text)),
        Some(Body::Assistant(assistant)) => MessageBody::Assistant(Reply {
            text: assistant.text,
            usage: assistant.usage.map(|usage| Usage {
                input_tokens: usage.input_tokens,
                output_tokens: usage.output_tokens,
            }),
            interrupted: assistant.interrupted,
            model: assistant.model,
            stop_reason: assistant.stop_reason,
            resources: assistant.resources,
        }),
        Some(Body::Error(error)) => MessageBody::Error {
            text: error.text,
            error_code: error.error_code,
        },
        Some(Body::ToolCall(call)) => MessageBody::ToolCall {
            call: ToolCall {
                id: call.tool_call_id,
                name: call.tool_name,
                // Stored by this runtime as JSON; anything else reads as no input.
                input: serde_json::from_str(&call.input_json).unwrap_or_else(|_| serde_json::json!({})),
            },
            parent_id: call.parent_id,
        },
        Some(Body::ToolResult(result)) => MessageBody::ToolResult {
            output: ToolOutput {
                tool_call_id: result.tool_call_id,
                text: result.output,
                is_error: result.is_error,
            },
            tool_name: result.tool_name,
        },
        None => MessageBody::Other,
    };
    Message {
        message_id: message.message_id,
        session_id: message.session_id,
        created_at_ms: message.created_at_ms,
        body,
    }
}

fn message_pb(message: &Message) -> pb::Message {
    use pb::message::Body;
    let body = match &message.body {
        MessageBody::User(content) => Some(Body::User(pb::UserMessage {
            content: parts_pb(content),
            plain_text: content.plain_text,
        })),
        MessageBody::Assistant(reply) => Some(Body::Assistant(pb::AssistantMessage {
            text: reply.text.clone(),
            usage: reply.usage.map(|usage| pb::Usage {
                input_tokens: usage.input_tokens,
                output_tokens: usage.output_tokens,
            }),
            interrupted: reply.interrupted,
            model: reply.model.clone(),
            stop_reason: reply.stop_reason.clone(),
            resources: reply.resources.clone(),
        })),
        MessageBody::Error { text, error_code } => Some(Body::Error(pb::ErrorMessage {
            text: text.clone(),
            error_code: error_code.clone(),
        })),
        MessageBody::ToolCall { call, parent_id } => Some(Body::ToolCall(pb::ToolCallMessage {
            tool_call_id: call.id.clone(),
            tool_name: call.name.clone(),
            input_json: call.input.to_string(),
            parent_id: parent_id.clone(),
        })),
        MessageBody::ToolResult { output, tool_name } => Some(Body::ToolResult(pb::ToolResultMessage {
            tool_call_id: output.tool_call_id.clone(),
            tool_name: tool_name.clone(),
            output: output.text.clone(),
            is_error: output.is_error,
        })),
        MessageBody::Other => None,
    };
    pb::Message {
        message_id: message.message_id.clone(),
        session_id: message.session_id.clone(),
        created_at_ms: message.created_at_ms,
        seq: 0,
        body,
    }
}

/// What a member needs a container to be shared with them as, for an
/// operation the runtime serves (the session service decides the rest).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Talk to its agents: run them, interrupt a turn, write their files.
    Use,
    /// Stop, destroy and delete.
    Manage,
}

impl Role {
    fn pb(self) -> pb::ShareRole {
        match self {
            Role::Use => pb::ShareRole::Use,
            Role::Manage => pb::ShareRole::Manage,
        }
    }
}
