//! One agent: the running, in-memory instance of an image, holding its
//! conversation and running at most one turn at a time.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use avm_common::event::Event;
use tokio_util::sync::CancellationToken;

use crate::context::{self, History};
use crate::error::RuntimeError;
use crate::event::EventContext;
use crate::hub::OpenHub;
use crate::llm::{LlmContent, LlmRole};
use crate::message::Message;
use crate::peers::Image;
use crate::plan::AgentPlan;
use crate::tools::Toolbox;

/// What callers learn about an agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentInfo {
    pub agent_id: String,
    pub container_id: String,
    pub image_id: String,
    pub session_id: String,
    pub running: bool,
    pub started_at_ms: i64,
}

/// A running, in-memory instance of an image.
pub(crate) struct Agent {
    pub(crate) agent_id: String,
    pub(crate) tenant_id: String,
    pub(crate) image: Image,
    /// What its image's resource references resolved to when it started.
    pub(crate) plan: AgentPlan,
    /// Its tools; `None` for a tool-free agent, which has no workspace either.
    pub(crate) tools: Option<Arc<Toolbox>>,
    pub(crate) started_at_ms: i64,
    pub(crate) context: Arc<EventContext>,
    /// Its session's hub, kept among the runtime's hubs while the agent lives.
    pub(crate) hub: OpenHub,
    state: Mutex<AgentState>,
    /// Woken when a turn ends.
    stopped: tokio::sync::Notify,
    /// Woken when it stops reading its group messages.
    read_finished: tokio::sync::Notify,
}

struct AgentState {
    history: History,
    turn: Option<CancellationToken>,
    last_active: Instant,
    /// Set once the agent left the pool; a send that raced with it starts over.
    retired: bool,
    /// Whether it is reading its unread group messages, and whether it was
    /// woken again meanwhile (then it reads once more when done).
    reading: Option<bool>,
    /// How many times it stopped reading: a wake is read once this passes
    /// its value at the wake.
    reads_finished: u64,
}

impl Agent {
    /// Returns an agent of `image` with the conversation so far.
    pub(crate) fn new(
        agent_id: String,
        tenant_id: String,
        image: Image,
        plan: AgentPlan,
        tools: Option<Arc<Toolbox>>,
        hub: OpenHub,
        history: History,
    ) -> Self {
        let context = Arc::new(EventContext {
            container_id: image.container_id.clone(),
            image_id: image.image_id.clone(),
            agent_id: agent_id.clone(),
            session_id: image.session_id.clone(),
        });
        Self {
            agent_id,
            tenant_id,
            started_at_ms: avm_common::now_ms(),
            context,
            hub,
            plan,
            tools,
            image,
            stopped: tokio::sync::Notify::new(),
            read_finished: tokio::sync::Notify::new(),
            state: Mutex::new(AgentState {
                history,
                turn: None,
                last_active: Instant::now(),
                retired: false,
                reading: None,
                reads_finished: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, AgentState> {
        self.state.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Returns what callers learn about the agent.
    pub(crate) fn info(&self) -> AgentInfo {
        AgentInfo {
            agent_id: self.agent_id.clone(),
            container_id: self.image.container_id.clone(),
            image_id: self.image.image_id.clone(),
            session_id: self.image.session_id.clone(),
            running: self.is_running(),
            started_at_ms: self.started_at_ms,
        }
    }

    /// Publishes an event of this agent's session; returns its cursor.
    pub(crate) fn emit(&self, event: impl Into<Event>) -> u64 {
        self.hub.publish(&self.context, event).cursor
    }

    /// Publishes the event that shows a stored message of the agent's turn.
    pub(crate) fn emit_message(&self, message: &Message) {
        if let Some(event) = message.event() {
            self.emit(event);
        }
    }

    /// Claims the turn slot; `None` when the agent left the pool meanwhile.
    pub(crate) fn begin_turn(&self) -> Option<Result<CancellationToken, RuntimeError>> {
        let mut state = self.lock();
        if state.retired {
            return None;
        }
        if state.turn.is_some() {
            return Some(Err(RuntimeError::AgentBusy));
        }
        let cancel = CancellationToken::new();
        state.turn = Some(cancel.clone());
        state.last_active = Instant::now();
        Some(Ok(cancel))
    }

    /// Adds the user's message and returns the conversation to send.
    pub(crate) fn add_user(&self, content: Vec<LlmContent>) -> History {
        let mut state = self.lock();
        context::append(&mut state.history, LlmRole::User, content);
        Arc::clone(&state.history)
    }

    /// Adds to the conversation during a turn (a reply's tool calls, their
    /// results) and returns the conversation to send next.
    pub(crate) fn extend_history(&self, role: LlmRole, content: Vec<LlmContent>) -> History {
        let mut state = self.lock();
        context::append(&mut state.history, role, content);
        Arc::clone(&state.history)
    }

    /// Replaces the conversation with a compacted one (during a turn, whose
    /// slot keeps anyone else from appending meanwhile).
    pub(crate) fn replace_history(&self, history: History) {
        self.lock().history = history;
    }

    /// Records the end of a turn and what it added to the conversation, and
    /// publishes the turn's last event (`conversation_end`, `error_occurred`).
    ///
    /// The event goes out while the turn slot is still held: a client that
    /// sends its next message on seeing it never finds the agent busy, and
    /// the next turn's events never come before it.
    pub(crate) fn finish_turn(&self, reply: Option<String>, last: Option<Event>) {
        let mut state = self.lock();
        if let Some(text) = reply.filter(|text| !text.is_empty()) {
            context::append(&mut state.history, LlmRole::Assistant, vec![LlmContent::Text(text)]);
        }
        if let Some(last) = last {
            self.hub.publish(&self.context, last);
        }
        state.turn = None;
        state.last_active = Instant::now();
        drop(state);
        self.stopped.notify_waiters();
    }

    /// Waits until no turn runs.
    pub(crate) async fn stopped(&self) {
        loop {
            let notified = self.stopped.notified();
            if !self.is_running() {
                return;
            }
            notified.await;
        }
    }

    /// Interrupts the running turn; `false` when the agent was idle.
    pub(crate) fn interrupt(&self) -> bool {
        match &self.lock().turn {
            Some(cancel) => {
                cancel.cancel();
                true
            }
            None => false,
        }
    }

    /// Marks the agent out of the pool and interrupts its turn.
    pub(crate) fn retire(&self) {
        let mut state = self.lock();
        state.retired = true;
        if let Some(cancel) = &state.turn {
            cancel.cancel();
        }
    }

    /// Returns whether the agent left the pool.
    pub(crate) fn is_retired(&self) -> bool {
        self.lock().retired
    }

    /// Returns whether a turn is running.
    pub(crate) fn is_running(&self) -> bool {
        self.lock().turn.is_some()
    }

    /// Returns whether the agent has had no turn for `timeout` and reads
    /// no group messages.
    pub(crate) fn idle_for(&self, timeout: Duration) -> bool {
        let state = self.lock();
        state.turn.is_none() && state.reading.is_none() && state.last_active.elapsed() >= timeout
    }

    /// Wakes the agent to read its group messages: whether it should start
    /// reading (else it reads already, and reads again after).
    pub(crate) fn wake(&self) -> Wake {
        let mut state = self.lock();
        let start = match &mut state.reading {
            Some(again) => {
                *again = true;
                false
            }
            None => {
                state.reading = Some(false);
                true
            }
        };
        Wake {
            start,
            reads_finished: state.reads_finished,
        }
    }

    /// Ends a read: `true` when it was woken meanwhile and must read again.
    pub(crate) fn read_done(&self) -> bool {
        let mut state = self.lock();
        let again = state.reading == Some(true);
        state.reading = again.then_some(false);
        state.last_active = Instant::now();
        if !again {
            state.reads_finished += 1;
            drop(state);
            self.read_finished.notify_waiters();
        }
        again
    }

    /// Waits until the agent stopped reading after `wake`: what woke it was
    /// read, unless it left the pool meanwhile.
    pub(crate) async fn read(&self, wake: &Wake) {
        loop {
            let notified = self.read_finished.notified();
            if self.lock().reads_finished > wake.reads_finished {
                return;
            }
            notified.await;
        }
    }
}

/// A wake of an agent, to wait until it was read.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Wake {
    /// Whether the wake starts the agent reading (a reader task to spawn).
    pub(crate) start: bool,
    reads_finished: u64,
}
