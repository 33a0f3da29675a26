//! Lost turns: those a crash cut, ended as soon as the runtime starts
//! again, and those of a dead replica, ended by a survivor.
//!
//! A runtime that runs alone (without replicas, so without Redis to record
//! its turns in flight as replicas do) already leaves a durable record of
//! every turn in the session service: the user's message is stored when the
//! turn starts, and its reply or error when it ends. A history whose last
//! message is the user's (or a tool call without its result) is a turn
//! nobody ended. When the runtime starts, it lists those whose last message
//! is older than this process, and ends each one as a dead replica's turn is
//! ended: `TURN_LOST` stored after the user's message (under the id
//! `<user_message_id>.lost`, so the hydration that also finds it cut stores
//! no second one), and `error_received → error_message → error_occurred`
//! published on the session's events. Hub cursors keep rising across
//! restarts, so a client that resumes with the last cursor it saw gets them;
//! the hubs are kept for the event retention period although no agent holds
//! them. Nothing is added to a turn's own path.
//!
//! Agents do not start until this is done (for at most [`RECOVERY_WAIT`]),
//! so no new turn runs on a history whose marker is still to come.

use avm_common::backoff::Backoff;
use std::sync::Arc;
use std::time::Duration;

use avm_common::event::data;
use avm_common::ids::new_id;
use tokio_util::sync::CancellationToken;

use crate::error::RuntimeError;
use crate::event::EventContext;
use crate::hub::SessionHub;
use crate::message::{Message, MessageBody};
use crate::replicas::{Replicas, TurnRecord};

use super::AgentPool;
use crate::hub::OpenHub;
use crate::peers::OpenTurn;

/// Open turns read per call to the session service.
const OPEN_TURNS_PAGE: u32 = 500;

/// How long a new agent waits for the turns the previous process left open
/// to be ended; past it, its hydration records its own (as it did before).
pub(super) const RECOVERY_WAIT: Duration = Duration::from_secs(10);

/// What a lost turn's error says.
pub(super) const CUT_TURN_TEXT: &str =
    "the server stopped while this turn ran; the reply was lost. Send the message again.";

impl AgentPool {
    /// Ends the turns the previous process left open, retrying while the
    /// session service is away, until `shutdown`; then lets agents start.
    pub(super) async fn end_turns_left_open(self, shutdown: CancellationToken) {
        let mut backoff = Backoff::default();
        let mut kept = Vec::new();
        loop {
            match self.end_open_turns(&mut kept).await {
                Ok(()) => break,
                Err(err) => tracing::warn!(error = %err, "cannot list the turns left open; retrying"),
            }
            if !backoff.wait(&shutdown).await {
                break;
            }
        }
        self.inner.recovered.send_replace(true);
        if kept.is_empty() {
            return;
        }
        tracing::warn!(turns = kept.len(), "turns cut by the previous process recorded as lost");
        // Their events stay for resuming clients as long as any event does.
        tokio::select! {
            () = shutdown.cancelled() => {}
            () = tokio::time::sleep(self.inner.config.event_retention_period) => {}
        }
        drop(kept);
    }

    /// Ends every open turn older than this process, a page at a time; the
    /// hubs their events went to are added to `kept`.
    pub(super) async fn end_open_turns(&self, kept: &mut Vec<OpenHub>) -> Result<(), RuntimeError> {
        let ctx = self.inner.ports.identity.own_context().await?;
        let mut after = String::new();
        loop {
            let turns = self
                .sessions()
                .list_open_turns(&ctx, self.inner.started_at_ms, &after, OPEN_TURNS_PAGE)
                .await?;
            let full = turns.len() == OPEN_TURNS_PAGE as usize;
            for turn in turns {
                after.clone_from(&turn.session_id);
                if let Some(hub) = self.end_open_turn(turn).await {
                    kept.push(hub);
                }
            }
            if !full {
                return Ok(());
            }
        }
    }

    /// Records one open turn as lost and tells its session's events;
    /// returns the hub, `None` when the turn was recorded already.
    pub(super) async fn end_open_turn(&self, turn: OpenTurn) -> Option<OpenHub> {
        tracing::warn!(
            session_id = %turn.session_id,
            user_message_id = %turn.user_message_id,
            "a turn was cut by a crash; recording it"
        );
        metrics::counter!("avm_runtime_turns_lost_total").increment(1);
        let stored = self
            .store_lost_turn(
                &turn.tenant_id,
                &turn.session_id,
                &turn.user_message_id,
                "TURN_LOST",
                CUT_TURN_TEXT,
            )
            .await
            // Told to the session's subscribers anyway, as it happened.
            .unwrap_or_else(Some)?;
        let hub = self.inner.hubs.open(&turn.session_id).await;
        let context = Arc::new(EventContext {
            container_id: turn.container_id,
            image_id: turn.image_id,
            agent_id: String::new(),
            session_id: turn.session_id,
        });
        publish_lost_turn(&hub, &context, "TURN_LOST", CUT_TURN_TEXT, Some(stored));
        Some(hub)
    }

    /// Returns what keeps this runtime from being ready while it starts:
    /// the turns the previous process left open, not yet ended (no agent
    /// starts before, or for at most [`RECOVERY_WAIT`]); the session
    /// service's changes, not yet followed (a group message would wake nobody).
    pub fn starting(&self) -> Vec<avm_common::auth::Unready> {
        let mut unready = Vec::new();
        if !*self.inner.recovered.borrow() {
            unready.push(avm_common::auth::Unready {
                dependency: "runtime.recovery",
                reason: "STARTING",
                message: "ending the turns the previous process left open (the session service must answer)",
            });
        }
        if !*self.inner.sessions_followed.borrow() {
            unready.push(avm_common::auth::Unready {
                dependency: "runtime.sessions",
                reason: "STARTING",
                message: "following the session service's changes (deletions, group messages)",
            });
        }
        unready
    }

    /// Waits (at most `within`) until the session service's changes reach
    /// this runtime; `false` if they did not in time.
    pub async fn following_sessions(&self, within: Duration) -> bool {
        let mut followed = self.inner.sessions_followed.subscribe();
        matches!(
            tokio::time::timeout(within, followed.wait_for(|live| *live)).await,
            Ok(Ok(_))
        )
    }

    /// Waits (at most [`RECOVERY_WAIT`]) until the turns the previous
    /// process left open are ended.
    pub(super) async fn recovered(&self) {
        let mut recovered = self.inner.recovered.subscribe();
        let _ = tokio::time::timeout(RECOVERY_WAIT, recovered.wait_for(|done| *done)).await;
    }
}

impl AgentPool {
    /// Keeps this replica registered, takes over wakes left unread, and ends
    /// the turns of replicas that died, until `shutdown`.
    pub(super) async fn keep_replica(self, replicas: Replicas, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(crate::replicas::HEARTBEAT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut beat = 0_u64;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            beat += 1;
            match replicas.heartbeat().await {
                Ok(true) => {}
                Ok(false) => {
                    // Survivors may hold this replica's images now.
                    tracing::error!("this runtime replica's heartbeat lapsed; dropping its agents");
                    for agent in self.live_agents() {
                        self.retire(&agent, "lease lapsed");
                    }
                }
                Err(_) => continue,
            }
            self.reclaim_wakes(&replicas, beat).await;
            let Ok(dead) = replicas.dead_replicas().await else {
                continue;
            };
            for replica in dead {
                let Ok(turns) = replicas.lost_turns(&replica).await else {
                    continue;
                };
                let mut undecided = false;
                for (field, record) in turns {
                    let open = match self.lost_turn_open(&record).await {
                        Ok(open) => open,
                        Err(err) => {
                            // Decided on a later beat, once history answers.
                            tracing::debug!(replica, image_id = %record.image_id, error = %err, "cannot tell yet whether a dead replica's turn ended");
                            undecided = true;
                            continue;
                        }
                    };
                    if replicas.take_lost_turn(&replica, &field).await && open {
                        self.end_lost_turn(&replica, record).await;
                    }
                }
                if !undecided {
                    replicas.forget(&replica).await;
                }
            }
        }
    }

    /// Ends the turn the dead replica `dead` ran for an image, if it ran
    /// one that is still open, before the image's agent starts here.
    /// Undecided (a peer is down): the record stays for the heartbeat to
    /// end, and this start is refused.
    pub(super) async fn end_turn_of_dead_holder(
        &self,
        dead: &str,
        tenant_id: &str,
        image_id: &str,
    ) -> Result<(), RuntimeError> {
        let Some(replicas) = self.inner.placement.replicas() else {
            return Ok(());
        };
        let field = format!("{tenant_id}/{image_id}");
        let lost = replicas.lost_turns(dead).await?;
        if let Some((_, record)) = lost.into_iter().find(|(name, _)| *name == field) {
            let open = self.lost_turn_open(&record).await?;
            if replicas.take_lost_turn(dead, &field).await && open {
                self.end_lost_turn(dead, record).await;
            }
        }
        Ok(())
    }

    /// Returns whether a dead replica's turn is still open: nothing answers
    /// its user message in history once the outbox has stored what it kept.
    /// A replica dies between a turn's end and the removal of its record, so
    /// the record alone does not say the turn was cut. An error while a peer
    /// is down is transient; a conversation or tenant since deleted has no
    /// open turn.
    pub(super) async fn lost_turn_open(&self, record: &TurnRecord) -> Result<bool, RuntimeError> {
        let read = async {
            let ctx = self.inner.ports.identity.tenant_context(&record.tenant_id).await?;
            self.inner
                .ports
                .outbox
                .settle_before_loading(&record.tenant_id, &record.session_id)
                .await?;
            self.sessions().list_messages(&ctx, &record.session_id).await
        };
        let history = match read.await {
            Ok(history) => history,
            Err(err) if err.transient() => return Err(err),
            Err(_) => return Ok(false),
        };
        Ok(match cut_turn(&history) {
            // Records of older replicas do not name the message.
            Some(_) if record.user_message_id.is_empty() => true,
            Some(open) => open == record.user_message_id,
            None => false,
        })
    }

    /// Ends a turn a dead replica was running: an error message in history
    /// (the user's message stays) and `RUNTIME_LOST` on the session's events.
    pub(super) async fn end_lost_turn(&self, replica: &str, record: TurnRecord) {
        tracing::warn!(
            replica,
            image_id = %record.image_id,
            session_id = %record.session_id,
            "a turn was lost with its runtime replica"
        );
        metrics::counter!("avm_runtime_turns_lost_total").increment(1);
        let text = "the runtime running this turn stopped; the reply was lost. Send the message again.";
        let stored = self
            .store_lost_turn(
                &record.tenant_id,
                &record.session_id,
                &record.user_message_id,
                "RUNTIME_LOST",
                text,
            )
            .await
            // Told to the session's subscribers anyway, as it happened.
            .unwrap_or_else(Some);
        let hub = self.inner.hubs.open(&record.session_id).await;
        let (tenant_id, group_id) = (record.tenant_id.clone(), record.group_id.clone());
        let context = Arc::new(EventContext {
            container_id: record.container_id,
            image_id: record.image_id,
            agent_id: record.agent_id,
            session_id: record.session_id,
        });
        // A hydration that found the turn cut may have recorded it first
        // (`TURN_LOST`, the same message id): the turn's watchers still learn
        // that it ended, but history keeps the one message.
        publish_lost_turn(&hub, &context, "RUNTIME_LOST", text, stored);
        // A group turn's messages are still unread (the cursor moves after
        // the reply): the agent, woken again, answers them. Its reply is
        // named after them, so one posted before the crash is not posted twice.
        if !group_id.is_empty() {
            tokio::spawn(self.clone().wake_again(tenant_id, context.image_id.clone(), group_id));
        }
    }

    /// Stores `TURN_LOST` after the user message of a turn that a crash cut
    /// (found when its image's agent starts again); returns the stored
    /// message, `None` when it could not be stored or was already.
    pub(super) async fn record_cut_turn(
        &self,
        tenant_id: &str,
        session_id: &str,
        user_message_id: &str,
    ) -> Option<Message> {
        tracing::warn!(session_id, user_message_id, "a turn was cut by a crash; recording it");
        metrics::counter!("avm_runtime_turns_lost_total").increment(1);
        self.store_lost_turn(tenant_id, session_id, user_message_id, "TURN_LOST", CUT_TURN_TEXT)
            .await
            .unwrap_or(None)
    }

    /// Stores the error message of a lost turn under an id made of the
    /// turn's user message id, so of a survivor ending a dead replica's turn
    /// (`RUNTIME_LOST`) and the hydration that finds it cut (`TURN_LOST`),
    /// only the first stores one (appends are idempotent on the id).
    /// Returns the message when this call stored it, `None` when it was
    /// there already, and the unstored message when it could not be stored
    /// (logged).
    pub(super) async fn store_lost_turn(
        &self,
        tenant_id: &str,
        session_id: &str,
        user_message_id: &str,
        code: &str,
        text: &str,
    ) -> Result<Option<Message>, Message> {
        let message_id = if user_message_id.is_empty() {
            new_id("msg")
        } else {
            format!("{user_message_id}.lost")
        };
        let message = Message {
            message_id,
            session_id: session_id.to_owned(),
            created_at_ms: avm_common::now_ms(),
            body: MessageBody::Error {
                text: text.to_owned(),
                error_code: code.to_owned(),
            },
        };
        let stored = match self.inner.ports.identity.tenant_context(tenant_id).await {
            Ok(ctx) => self.sessions().append(&ctx, &message).await,
            Err(err) => Err(err.into()),
        };
        match stored {
            Ok(stored) if stored.body == message.body => Ok(Some(stored)),
            Ok(_) => Ok(None),
            Err(err) => {
                tracing::error!(session_id, code, error = %err, "cannot store the lost turn's error");
                Err(message)
            }
        }
    }
}

/// Publishes the end of a lost turn on its session's events: its error
/// message (`error_received → error_message`) when `stored` holds it, and
/// `error_occurred` with `code`, which ends the turn for its watchers.
pub(super) fn publish_lost_turn(
    hub: &SessionHub,
    context: &Arc<EventContext>,
    code: &str,
    text: &str,
    stored: Option<Message>,
) {
    if let Some(message) = stored {
        hub.publish(
            context,
            data::ErrorReceived {
                message: text.to_owned(),
                error_code: code.to_owned(),
            },
        );
        if let Some(event) = message.event() {
            hub.publish(context, event);
        }
    }
    hub.publish(
        context,
        data::ErrorOccurred {
            code: code.to_owned(),
            message: text.to_owned(),
            recoverable: true,
        },
    );
}

/// Returns the user message id of the turn the history ends in when that
/// turn never ended: its last message is the user's (or a tool call without
/// its result), where every turn that ended stored a reply or an error.
pub(super) fn cut_turn(history: &[Message]) -> Option<&str> {
    let last = history.last()?;
    if !matches!(last.body, MessageBody::User(_) | MessageBody::ToolCall { .. }) {
        return None;
    }
    history
        .iter()
        .rev()
        .find(|message| matches!(message.body, MessageBody::User(_)))
        .map(|message| message.message_id.as_str())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::llm::ToolCall;
    use crate::message::Content;
    use crate::message::{Part, Reply};

    pub(super) fn message(id: &str, body: MessageBody) -> Message {
        Message {
            message_id: id.into(),
            session_id: "sess_1".into(),
            created_at_ms: 0,
            body,
        }
    }

    pub(super) fn user(id: &str) -> Message {
        message(
            id,
            MessageBody::User(Content {
                parts: vec![Part::Text("hi".into())],
                plain_text: true,
            }),
        )
    }

    #[test]
    pub(super) fn only_a_turn_that_never_ended_is_cut() {
        let reply = message("a", MessageBody::Assistant(Reply::default()));
        let error = message(
            "e",
            MessageBody::Error {
                text: "boom".into(),
                error_code: "LLM_TIMEOUT".into(),
            },
        );
        let call = message(
            "c",
            MessageBody::ToolCall {
                call: ToolCall {
                    id: "t1".into(),
                    name: "read_file".into(),
                    input: json!({}),
                },
                parent_id: "a".into(),
            },
        );
        assert_eq!(cut_turn(&[]), None);
        assert_eq!(cut_turn(&[user("u1"), reply.clone()]), None, "answered");
        assert_eq!(cut_turn(&[user("u1"), error]), None, "failed, and recorded");
        assert_eq!(cut_turn(&[user("u1"), reply, user("u2")]), Some("u2"));
        assert_eq!(cut_turn(&[user("u1"), call]), Some("u1"), "cut while a tool ran");
    }
}
