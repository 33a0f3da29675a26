//! Turns a crash cut, ended as soon as the runtime starts again.
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

use tokio_util::sync::CancellationToken;

use super::AgentPool;
use crate::error::RuntimeError;
use crate::event::EventContext;
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
    async fn end_open_turns(&self, kept: &mut Vec<OpenHub>) -> Result<(), RuntimeError> {
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
    async fn end_open_turn(&self, turn: OpenTurn) -> Option<OpenHub> {
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
        super::publish_lost_turn(&hub, &context, "TURN_LOST", CUT_TURN_TEXT, Some(stored));
        Some(hub)
    }

    /// Returns what keeps this runtime from being ready while it starts:
    /// the turns the previous process left open, not yet ended (no agent
    /// starts before, or for at most [`RECOVERY_WAIT`]).
    pub fn starting(&self) -> Option<avm_common::auth::Unready> {
        (!*self.inner.recovered.borrow()).then_some(avm_common::auth::Unready {
            dependency: "runtime.recovery",
            reason: "STARTING",
            message: "ending the turns the previous process left open (the session service must answer)",
        })
    }

    /// Waits (at most [`RECOVERY_WAIT`]) until the turns the previous
    /// process left open are ended.
    pub(super) async fn recovered(&self) {
        let mut recovered = self.inner.recovered.subscribe();
        let _ = tokio::time::timeout(RECOVERY_WAIT, recovered.wait_for(|done| *done)).await;
    }
}
