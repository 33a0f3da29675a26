//! Turns: a user message accepted, stored and answered, one turn at a time
//! per agent; interrupting one.

use std::sync::Arc;

use avm_common::RequestContext;
use avm_common::auth::Scopes;
use avm_common::event::data;
use avm_common::ids::new_id;
use tokio_util::sync::CancellationToken;
use tracing::instrument;

use super::{AgentPool, SendAccepted};
use crate::agent::{Agent, AgentInfo};
use crate::error::{AgentTarget, RuntimeError};
use crate::message::{Content, Message, MessageBody};
use crate::peers::Role;
use crate::replicas::TurnRecord;
use crate::turn;

impl AgentPool {
    /// Persists a user message and starts a turn; one turn at a time per agent.
    ///
    /// The acceptance is published into the session's events (`message_accepted`,
    /// with the request's id) after `message_persisted` and before the turn's
    /// own events, so a subscriber learns of it in the order of the stream.
    #[instrument(name = "runtime.send_message", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn send_message(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        content: Content,
    ) -> Result<SendAccepted, RuntimeError> {
        Ok(self.start_turn(ctx, image_id, content, None).await?.0)
    }

    /// Does what [`Self::send_message`] says, for a message of `group` when
    /// one is named; the handle ends with the turn, with the text of its
    /// last reply when it completed.
    pub(super) async fn start_turn(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        content: Content,
        group: Option<&str>,
    ) -> Result<(SendAccepted, tokio::task::JoinHandle<Option<String>>), RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        content.validate()?;
        let llm = self.inner.llm.for_tenant(ctx).await?;
        let agent = self.reserve_turn(ctx, image_id).await?;
        let cancel = agent.1;
        let agent = agent.0;
        // The previous turn's reply, kept while the session service was
        // away, is stored before the next message: never a turn on a history without it.
        let settled = self
            .inner
            .ports
            .outbox
            .settle(&ctx.tenant_id, &agent.image.session_id)
            .await;
        if let Err(err) = settled {
            agent.finish_turn(None, None);
            return Err(err);
        }
        let user_message_id = new_id("msg");
        let llm_content = content.to_llm();
        let message = Message {
            message_id: user_message_id.clone(),
            session_id: agent.image.session_id.clone(),
            // Stored with the caller's credential: the session service stamps
            // a user's message itself and refuses a time chosen for it.
            created_at_ms: 0,
            body: MessageBody::User(content),
        };
        let stored = match self.sessions().append(ctx, &message).await {
            Ok(stored) => stored,
            Err(err) => {
                agent.finish_turn(None, None);
                return Err(err);
            }
        };
        agent.emit(data::MessagePersisted {
            session_id: stored.session_id.clone(),
            message_id: stored.message_id.clone(),
            saved_at: stored.created_at_ms,
        });
        // What was said, for the session's other subscribers (a second device).
        if let Some(shown) = stored.event() {
            agent.emit(shown);
        }
        let cursor = agent.emit(data::MessageAccepted {
            request_id: ctx.request_id.clone(),
            image_id: agent.image.image_id.clone(),
            agent_id: agent.agent_id.clone(),
            user_message_id: user_message_id.clone(),
        });
        let history = agent.add_user(llm_content);
        let request = turn::request(&llm.config, &agent, history);
        let events = agent.hub.subscribe(Some(cursor));
        tracing::info!(image_id = %agent.image.image_id, message_id = %user_message_id, "turn started");
        let turn = turn::run(
            self.inner.ports.clone(),
            Arc::clone(&agent),
            ctx.clone(),
            llm,
            request,
            cancel,
        );
        // The turn outlives this call; it stays in the request's trace.
        let record = || TurnRecord {
            tenant_id: agent.tenant_id.clone(),
            container_id: agent.image.container_id.clone(),
            image_id: agent.image.image_id.clone(),
            agent_id: agent.agent_id.clone(),
            session_id: agent.image.session_id.clone(),
            user_message_id: user_message_id.clone(),
            group_id: group.unwrap_or_default().to_owned(),
        };
        let handle = self.inner.placement.run_turn(record, turn);
        let accepted = SendAccepted {
            agent: agent.info(),
            user_message_id,
            cursor,
            events,
        };
        Ok((accepted, handle))
    }

    /// Finds or starts the agent and claims its turn slot.
    pub(super) async fn reserve_turn(
        &self,
        ctx: &RequestContext,
        image_id: &str,
    ) -> Result<(Arc<Agent>, CancellationToken), RuntimeError> {
        // A runtime alone has nobody to send the turn to while it drains.
        if self.inner.placement.refuses_turns() {
            return Err(RuntimeError::Draining);
        }
        // An agent retired by the idle reaper between lookup and reservation is
        // replaced by a fresh one; twice in a row would be a bug, not a race.
        for _ in 0..2 {
            let (agent, _) = self.ensure_agent(ctx, image_id).await?;
            match agent.begin_turn() {
                None => continue,
                Some(claimed) => return claimed.map(|cancel| (agent, cancel)),
            }
        }
        Err(RuntimeError::AgentRestarting)
    }

    /// Interrupts the running turn; `false` when the agent was idle.
    #[instrument(name = "runtime.interrupt_agent", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn interrupt(
        &self,
        ctx: &RequestContext,
        target: &AgentTarget,
    ) -> Result<(AgentInfo, bool), RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        let agent = self.find(ctx, target, Some(Role::Use)).await?;
        let interrupted = agent.interrupt();
        tracing::info!(agent_id = %agent.agent_id, interrupted, "interrupt requested");
        Ok((agent.info(), interrupted))
    }
}
