//! Rewinding a conversation to after one of its messages, or clearing it:
//! the later messages are deleted (not kept as a hidden branch), the agent's
//! context is rebuilt from what is kept, and the session's subscribers hear
//! of it. Usage records live with the observability service and are never
//! touched.

use std::sync::Arc;

use avm_common::auth::Scopes;
use avm_common::event::data;
use avm_common::{ApiError, Code, RequestContext};
use tracing::instrument;

use super::{AgentPool, lifecycle, validate_id};
use crate::error::RuntimeError;
use crate::event::EventContext;
use crate::peers::Role;

/// What a rewind removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rewound {
    pub image_id: String,
    pub session_id: String,
    pub removed_messages: u64,
}

impl AgentPool {
    /// Deletes the messages of an image's conversation after
    /// `after_message_id` (every message when `None`) and rebuilds its
    /// agent's context. Refused (`TURN_RUNNING`) while a turn runs: the
    /// turn slot is held throughout, so no turn starts or writes meanwhile.
    #[instrument(name = "runtime.rewind_image", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn rewind(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        after_message_id: Option<&str>,
    ) -> Result<Rewound, RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        validate_id("IMAGE_NOT_FOUND", "image", image_id)?;
        // Rewinding deletes what everyone said: it takes managing the image.
        let image = self.image_with_role(ctx, image_id, Some(Role::Manage)).await?;
        // An agent that may not run (paused, terminated, in error) is in no
        // pool and runs no turn: its history is truncated alone.
        let slot = match self.reserve_turn(ctx, image_id).await {
            Ok((agent, _)) => Some(agent),
            Err(err) if lifecycle::not_runnable(&err) => None,
            Err(RuntimeError::AgentBusy) => {
                return Err(RuntimeError::Api(ApiError::new(
                    Code::FailedPrecondition,
                    "TURN_RUNNING",
                    format!("a turn is running in image {image_id}; interrupt it or wait for it to end, then rewind"),
                )));
            }
            Err(err) => return Err(err),
        };
        let truncated = async {
            // What the last turn left in the outbox is stored first, so it
            // is truncated with the rest rather than written after.
            self.inner
                .ports
                .outbox
                .settle_before_loading(&ctx.tenant_id, &image.session_id)
                .await?;
            self.sessions()
                .truncate_messages(ctx, &image.session_id, after_message_id)
                .await
        }
        .await;
        let event = data::ConversationRewound {
            image_id: image.image_id.clone(),
            session_id: image.session_id.clone(),
            after_message_id: after_message_id.map(str::to_owned),
            removed_messages: truncated.as_ref().copied().unwrap_or_default(),
        };
        match &slot {
            Some(agent) => {
                if truncated.is_ok() {
                    agent.emit(event);
                    // The next message starts an agent from what is kept.
                    self.retire(agent, "rewound");
                }
                agent.finish_turn(None, None);
            }
            None if truncated.is_ok() => {
                let context = Arc::new(EventContext {
                    container_id: image.container_id.clone(),
                    image_id: image.image_id.clone(),
                    agent_id: String::new(),
                    session_id: image.session_id.clone(),
                });
                self.inner.hubs.open(&image.session_id).await.publish(&context, event);
            }
            None => {}
        }
        let removed_messages = truncated?;
        tracing::info!(
            image_id,
            removed_messages,
            cleared = after_message_id.is_none(),
            "conversation rewound"
        );
        Ok(Rewound {
            image_id: image.image_id,
            session_id: image.session_id,
            removed_messages,
        })
    }
}
