//! The outbox: messages of a turn that the session service could not take
//! when the turn ended, kept and stored later, in order, under their ids
//! and times (issue 26, item 8).
//!
//! A turn tries the session service first, as always; only a message it
//! could not store within its retries comes here, and so does every later
//! message of the same session while any waits, so that a session's
//! history keeps its order. A background drainer stores them once the
//! service answers again (backing off meanwhile); the next message of a
//! session, and the start of its agent, first store what waits for it, so
//! no turn runs on a history missing a reply.
//!
//! The messages are kept in Redis when the runtime has it (`AVM_REDIS_URL`),
//! so the next process of a runtime that died, or another replica, stores
//! them; else in this process's memory, and lost with it (the next start of
//! the agent then records the turn as lost, `TURN_LOST`). Either is bounded
//! (`runtime.outbox_max_bytes`); a message it has no room for is not kept,
//! and the turn whose reply it was ends with `REPLY_NOT_STORED`.
//!
//! Redis keys, under the deployment's key prefix: `runtime:outbox:sessions`,
//! a set of `<tenant>/<session>` with messages waiting;
//! `runtime:outbox:queue:<tenant>/<session>`, the list of that session's
//! messages, oldest first (each the session service's wire form of the
//! message); `runtime:outbox:bytes`, what the lists hold together.

use avm_common::backoff::Backoff;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use avm_common::auth::ServiceIdentity;
use redis::aio::ConnectionManager;
use tokio_util::sync::CancellationToken;

use crate::error::RuntimeError;
use crate::message::{Message, MessageBody};
use crate::peers::{Sessions, decode_message, encode_message};
use crate::replicas::Replicas;

/// Room kept beyond the bound for error messages (a failed turn's record,
/// a few hundred bytes each), so that a turn whose reply found no room
/// still leaves its marker.
const MARKER_RESERVE: usize = 256 * 1024;
/// The drainer's first wait after the session service refused a message.
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
/// Its longest wait: a message kept is stored within this of the service's return.
const LAST_BACKOFF: Duration = Duration::from_secs(4);
/// How long a stopping runtime tries to store what its outbox holds.
const LAST_DRAIN_WITHIN: Duration = Duration::from_secs(2);
/// How often a runtime sharing Redis looks for messages that another
/// process (one that died) left.
const SHARED_SCAN_EVERY: Duration = Duration::from_secs(10);

/// The outbox of one runtime process; cheap to clone.
#[derive(Clone)]
pub(crate) struct Outbox {
    inner: Arc<Inner>,
}

struct Inner {
    keep: Keep,
    sessions: Sessions,
    identity: ServiceIdentity,
    max_bytes: usize,
    /// With Redis: the sessions this process knows to have messages
    /// waiting, each with a count of the messages it kept for them (a
    /// drainer that found the queue empty forgets it only if none came
    /// meanwhile). Every store of a turn looks here (or in the memory's
    /// queues), so the normal path costs one lookup.
    waiting: Mutex<HashMap<Queue, u64>>,
    /// Wakes the drainer when a message is kept.
    kept: tokio::sync::Notify,
}

/// Where the messages wait.
enum Keep {
    Memory(Mutex<MemoryKeep>),
    Redis(RedisKeep),
}

#[derive(Default)]
struct MemoryKeep {
    queues: HashMap<Queue, VecDeque<Kept>>,
    bytes: usize,
}

struct RedisKeep {
    conn: ConnectionManager,
    /// `<prefix>runtime:outbox:`.
    prefix: String,
}

/// A session's queue: its tenant and id.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Queue {
    tenant_id: String,
    session_id: String,
}

impl Queue {
    fn member(&self) -> String {
        format!("{}/{}", self.tenant_id, self.session_id)
    }

    fn parse(member: &str) -> Option<Self> {
        let (tenant_id, session_id) = member.split_once('/')?;
        Some(Self {
            tenant_id: tenant_id.to_owned(),
            session_id: session_id.to_owned(),
        })
    }
}

/// A message waiting, with its wire form (its size, and its value in Redis).
#[derive(Clone)]
struct Kept {
    message: Message,
    wire: Vec<u8>,
}

/// Why a message was not kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotKept {
    /// The outbox holds `runtime.outbox_max_bytes` already.
    Full,
    /// Redis did not take it.
    Unavailable,
}

impl NotKept {
    fn as_str(self) -> &'static str {
        match self {
            NotKept::Full => "full",
            NotKept::Unavailable => "unavailable",
        }
    }
}

const PUSH: &str = r"
local used = tonumber(redis.call('GET', KEYS[3]) or '0')
if used + string.len(ARGV[1]) > tonumber(ARGV[3]) then return 0 end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('INCRBY', KEYS[3], string.len(ARGV[1]))
redis.call('SADD', KEYS[2], ARGV[2])
return 1
";

const REMOVE: &str = r"
local removed = redis.call('LREM', KEYS[1], 1, ARGV[1])
if removed > 0 then redis.call('DECRBY', KEYS[3], string.len(ARGV[1])) end
if redis.call('LLEN', KEYS[1]) == 0 then redis.call('SREM', KEYS[2], ARGV[2]) end
return removed
";

impl RedisKeep {
    fn queue_key(&self, queue: &Queue) -> String {
        format!("{}queue:{}", self.prefix, queue.member())
    }

    fn sessions_key(&self) -> String {
        format!("{}sessions", self.prefix)
    }

    fn bytes_key(&self) -> String {
        format!("{}bytes", self.prefix)
    }

    async fn push(&self, queue: &Queue, wire: &[u8], limit: usize) -> Result<bool, redis::RedisError> {
        let mut conn = self.conn.clone();
        let pushed: i64 = redis::Script::new(PUSH)
            .key(self.queue_key(queue))
            .key(self.sessions_key())
            .key(self.bytes_key())
            .arg(wire)
            .arg(queue.member())
            .arg(limit)
            .invoke_async(&mut conn)
            .await?;
        Ok(pushed == 1)
    }

    async fn head(&self, queue: &Queue) -> Result<Option<Vec<u8>>, redis::RedisError> {
        let mut conn = self.conn.clone();
        redis::cmd("LINDEX")
            .arg(self.queue_key(queue))
            .arg(0)
            .query_async(&mut conn)
            .await
    }

    async fn remove(&self, queue: &Queue, wire: &[u8]) -> Result<(), redis::RedisError> {
        let mut conn = self.conn.clone();
        let _: i64 = redis::Script::new(REMOVE)
            .key(self.queue_key(queue))
            .key(self.sessions_key())
            .key(self.bytes_key())
            .arg(wire)
            .arg(queue.member())
            .invoke_async(&mut conn)
            .await?;
        Ok(())
    }

    async fn queues(&self) -> Result<(Vec<Queue>, usize), redis::RedisError> {
        let mut conn = self.conn.clone();
        let (members, bytes): (Vec<String>, Option<usize>) = redis::pipe()
            .cmd("SMEMBERS")
            .arg(self.sessions_key())
            .cmd("GET")
            .arg(self.bytes_key())
            .query_async(&mut conn)
            .await?;
        Ok((
            members.iter().filter_map(|member| Queue::parse(member)).collect(),
            bytes.unwrap_or(0),
        ))
    }

    async fn holds(&self, queue: &Queue) -> Result<bool, redis::RedisError> {
        let mut conn = self.conn.clone();
        redis::cmd("EXISTS")
            .arg(self.queue_key(queue))
            .query_async(&mut conn)
            .await
    }
}

/// What draining a session's queue came to.
enum Drained {
    /// Nothing waits for it any more.
    Empty,
    /// The session service (or Redis) is still unavailable; the rest waits.
    Waiting,
}

impl Outbox {
    /// Returns an outbox kept in Redis when the runtime shares it with
    /// replicas, else in memory, holding at most `max_bytes`.
    pub(crate) fn new(
        sessions: Sessions,
        identity: ServiceIdentity,
        replicas: Option<&Replicas>,
        max_bytes: usize,
    ) -> Self {
        let keep = match replicas {
            Some(replicas) => Keep::Redis(RedisKeep {
                conn: replicas.connection(),
                prefix: replicas.key("outbox:"),
            }),
            None => Keep::Memory(Mutex::default()),
        };
        Self {
            inner: Arc::new(Inner {
                keep,
                sessions,
                identity,
                max_bytes,
                waiting: Mutex::new(HashMap::new()),
                kept: tokio::sync::Notify::new(),
            }),
        }
    }

    fn waiting(&self) -> MutexGuard<'_, HashMap<Queue, u64>> {
        self.inner.waiting.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    fn memory(keep: &Mutex<MemoryKeep>) -> MutexGuard<'_, MemoryKeep> {
        keep.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Returns whether messages of `session_id` wait here: a new message of
    /// the session must then wait behind them.
    pub(crate) fn holds(&self, tenant_id: &str, session_id: &str) -> bool {
        let queue = || Queue {
            tenant_id: tenant_id.to_owned(),
            session_id: session_id.to_owned(),
        };
        // No allocation on the normal path, where nothing waits at all.
        match &self.inner.keep {
            Keep::Memory(keep) => {
                let keep = Self::memory(keep);
                !keep.queues.is_empty() && keep.queues.contains_key(&queue())
            }
            Keep::Redis(_) => {
                let waiting = self.waiting();
                !waiting.is_empty() && waiting.contains_key(&queue())
            }
        }
    }

    /// Notes that a message of `queue` was kept in Redis (or found there).
    fn note_waiting(&self, queue: Queue) {
        *self.waiting().entry(queue).or_default() += 1;
    }

    /// Returns the count of messages noted for `queue`.
    fn noted(&self, queue: &Queue) -> u64 {
        self.waiting().get(queue).copied().unwrap_or(0)
    }

    /// Forgets `queue`, found empty, unless a message was noted since `seen`.
    fn forget(&self, queue: &Queue, seen: u64) {
        let mut waiting = self.waiting();
        if waiting.get(queue).is_some_and(|noted| *noted == seen) {
            waiting.remove(queue);
        }
    }

    /// Keeps a message the session service did not take, behind the
    /// session's others, and wakes the drainer.
    pub(crate) async fn keep(&self, tenant_id: &str, message: &Message) -> Result<(), NotKept> {
        let queue = Queue {
            tenant_id: tenant_id.to_owned(),
            session_id: message.session_id.clone(),
        };
        let wire = encode_message(message);
        // A failed turn's record may use the reserve: its marker stays.
        let limit = match message.body {
            MessageBody::Error { .. } => self.inner.max_bytes.saturating_add(MARKER_RESERVE),
            _ => self.inner.max_bytes,
        };
        let size = wire.len();
        let kept = match &self.inner.keep {
            Keep::Memory(keep) => {
                let mut keep = Self::memory(keep);
                if keep.bytes + size > limit {
                    Err(NotKept::Full)
                } else {
                    keep.bytes += size;
                    metrics::gauge!("avm_runtime_outbox_bytes").set(keep.bytes as f64);
                    keep.queues.entry(queue).or_default().push_back(Kept {
                        message: message.clone(),
                        wire,
                    });
                    Ok(())
                }
            }
            Keep::Redis(keep) => match keep.push(&queue, &wire, limit).await {
                Ok(true) => {
                    self.note_waiting(queue);
                    Ok(())
                }
                Ok(false) => Err(NotKept::Full),
                Err(err) => {
                    tracing::warn!(error = %err, "the outbox's redis does not answer");
                    Err(NotKept::Unavailable)
                }
            },
        };
        match kept {
            Ok(()) => {
                metrics::counter!("avm_runtime_outbox_kept_total").increment(1);
                tracing::warn!(
                    session_id = %message.session_id,
                    message_id = %message.message_id,
                    bytes = size,
                    "the session service did not take a message; kept in the outbox"
                );
                self.inner.kept.notify_one();
            }
            Err(why) => {
                metrics::counter!("avm_runtime_outbox_refused_total", "reason" => why.as_str()).increment(1);
                tracing::error!(
                    session_id = %message.session_id,
                    message_id = %message.message_id,
                    bytes = size,
                    reason = why.as_str(),
                    "a message the session service did not take cannot be kept either"
                );
            }
        }
        kept
    }

    /// Stores what waits for a session before its next message; fails with
    /// `REPLY_PENDING` (retryable) while the session service still does
    /// not take it. Costs a lookup when nothing waits here.
    pub(crate) async fn settle(&self, tenant_id: &str, session_id: &str) -> Result<(), RuntimeError> {
        if !self.holds(tenant_id, session_id) {
            return Ok(());
        }
        self.settle_queue(Queue {
            tenant_id: tenant_id.to_owned(),
            session_id: session_id.to_owned(),
        })
        .await
    }

    /// Stores what waits for a session before its agent reads the history,
    /// including what another process left in Redis (the agent may have
    /// run on a replica that died).
    pub(crate) async fn settle_before_loading(&self, tenant_id: &str, session_id: &str) -> Result<(), RuntimeError> {
        let queue = Queue {
            tenant_id: tenant_id.to_owned(),
            session_id: session_id.to_owned(),
        };
        let waits = match &self.inner.keep {
            Keep::Memory(keep) => Self::memory(keep).queues.contains_key(&queue),
            Keep::Redis(keep) => keep.holds(&queue).await.map_err(|err| {
                tracing::warn!(error = %err, "the outbox's redis does not answer");
                RuntimeError::RepliesPending
            })?,
        };
        if !waits {
            return Ok(());
        }
        if matches!(self.inner.keep, Keep::Redis(_)) {
            self.note_waiting(queue.clone());
        }
        self.settle_queue(queue).await
    }

    async fn settle_queue(&self, queue: Queue) -> Result<(), RuntimeError> {
        match self.drain(&queue).await {
            Drained::Empty => Ok(()),
            Drained::Waiting => Err(RuntimeError::RepliesPending),
        }
    }

    /// Stores a session's waiting messages, oldest first; each leaves the
    /// outbox once stored, so a message is stored only after every one
    /// before it. Two drainers of one queue at once store a message twice,
    /// which the session service takes as one (appends are idempotent on
    /// the message id).
    async fn drain(&self, queue: &Queue) -> Drained {
        let mut stored = 0_u64;
        let drained = loop {
            let seen = self.noted(queue);
            let head = match self.head(queue).await {
                Ok(Some(head)) => head,
                Ok(None) => {
                    self.forget(queue, seen);
                    break Drained::Empty;
                }
                Err(()) => break Drained::Waiting,
            };
            match self.store(queue, &head.message).await {
                Ok(()) => {
                    stored += 1;
                    metrics::counter!("avm_runtime_outbox_stored_total").increment(1);
                }
                Err(err) if err.transient() => break Drained::Waiting,
                Err(err) => {
                    // Never storable (its session was deleted meanwhile):
                    // it must not hold the messages behind it.
                    metrics::counter!("avm_runtime_outbox_dropped_total").increment(1);
                    tracing::error!(
                        session_id = %queue.session_id,
                        message_id = %head.message.message_id,
                        error = %err,
                        "the session service refuses a kept message; dropped"
                    );
                }
            }
            if self.remove(queue, &head).await.is_err() {
                break Drained::Waiting;
            }
        };
        if stored > 0 {
            tracing::info!(session_id = %queue.session_id, stored, "kept messages stored");
        }
        drained
    }

    async fn head(&self, queue: &Queue) -> Result<Option<Kept>, ()> {
        match &self.inner.keep {
            Keep::Memory(keep) => Ok(Self::memory(keep)
                .queues
                .get(queue)
                .and_then(|messages| messages.front().cloned())),
            Keep::Redis(keep) => loop {
                let unanswered = |err: redis::RedisError| {
                    tracing::warn!(error = %err, "the outbox's redis does not answer");
                };
                let Some(wire) = keep.head(queue).await.map_err(unanswered)? else {
                    return Ok(None);
                };
                if let Some(message) = decode_message(&wire) {
                    return Ok(Some(Kept { message, wire }));
                }
                // Written by a newer runtime, or damaged: it must not block the rest.
                tracing::error!(session_id = %queue.session_id, "an unreadable message in the outbox; dropped");
                metrics::counter!("avm_runtime_outbox_dropped_total").increment(1);
                keep.remove(queue, &wire).await.map_err(unanswered)?;
            },
        }
    }

    async fn remove(&self, queue: &Queue, kept: &Kept) -> Result<(), ()> {
        match &self.inner.keep {
            Keep::Memory(keep) => {
                let mut keep = Self::memory(keep);
                let MemoryKeep { queues, bytes } = &mut *keep;
                if let Some(messages) = queues.get_mut(queue) {
                    if messages
                        .front()
                        .is_some_and(|front| front.message.message_id == kept.message.message_id)
                    {
                        messages.pop_front();
                        *bytes -= kept.wire.len();
                    }
                    if messages.is_empty() {
                        queues.remove(queue);
                    }
                }
                metrics::gauge!("avm_runtime_outbox_bytes").set(*bytes as f64);
                Ok(())
            }
            Keep::Redis(keep) => keep.remove(queue, &kept.wire).await.map_err(|err| {
                tracing::warn!(error = %err, "the outbox's redis does not answer");
            }),
        }
    }

    /// Appends a kept message as the runtime itself, for its tenant.
    async fn store(&self, queue: &Queue, message: &Message) -> Result<(), RuntimeError> {
        let ctx = self.inner.identity.tenant_context(&queue.tenant_id).await?;
        self.inner.sessions.append(&ctx, message).await.map(drop)
    }

    /// Drains every queue; returns whether messages still wait.
    async fn drain_all(&self) -> bool {
        let queues: Vec<Queue> = match &self.inner.keep {
            Keep::Memory(keep) => Self::memory(keep).queues.keys().cloned().collect(),
            Keep::Redis(keep) => match keep.queues().await {
                Ok((queues, bytes)) => {
                    metrics::gauge!("avm_runtime_outbox_bytes").set(bytes as f64);
                    queues
                }
                Err(err) => {
                    tracing::warn!(error = %err, "the outbox's redis does not answer");
                    return true;
                }
            },
        };
        let mut waiting = false;
        for queue in queues {
            waiting |= matches!(self.drain(&queue).await, Drained::Waiting);
        }
        waiting
    }

    /// Drains the outbox until `shutdown`, and once more then: at once
    /// (what a process that died left in Redis), whenever a message is
    /// kept, and again with backoff while any waits. Without Redis an empty
    /// outbox never wakes.
    pub(crate) fn spawn(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        let outbox = self.clone();
        let shared = matches!(outbox.inner.keep, Keep::Redis(_));
        tokio::spawn(async move {
            let mut backoff = Backoff::new(FIRST_BACKOFF, LAST_BACKOFF);
            loop {
                let waiting = outbox.drain_all().await;
                let pause = if waiting {
                    Some(backoff.next_pause())
                } else {
                    backoff.reset();
                    shared.then_some(SHARED_SCAN_EVERY)
                };
                let timer = async {
                    match pause {
                        Some(pause) => tokio::time::sleep(pause).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = shutdown.cancelled() => break,
                    () = outbox.inner.kept.notified() => {}
                    () = timer => {}
                }
            }
            // A memory outbox goes with the process: one last try, and the
            // operator learns what is lost (Redis keeps it for the next one).
            let last = tokio::time::timeout(LAST_DRAIN_WITHIN, outbox.drain_all()).await;
            if let Keep::Memory(keep) = &outbox.inner.keep
                && !matches!(last, Ok(false))
            {
                let keep = Self::memory(keep);
                let messages: usize = keep.queues.values().map(VecDeque::len).sum();
                tracing::error!(
                    messages,
                    sessions = keep.queues.len(),
                    "the runtime stops with messages its session service never took; they are lost"
                );
            }
        })
    }
}
