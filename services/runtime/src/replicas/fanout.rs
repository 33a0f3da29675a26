//! Session events between runtime replicas, through Redis.
//!
//! The replica that runs a turn publishes each event once, in order, from one
//! writer task: `PUBLISH` on the session's channel (live) and `XADD` to the
//! session's stream, capped at the retention length and expiring after the
//! retention period (replay). Every replica that keeps a hub of a session
//! (someone subscribed there, or it runs the session's agent) listens to the
//! channel on one shared pub/sub connection and feeds what other replicas
//! publish into its hub; a hub made on a replica starts from the stream, so
//! a client resuming with its last cursor on any replica gets what it missed.
//! Nothing here touches a database.

use avm_common::backoff::Backoff;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use redis::aio::ConnectionManager;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use avm_common::event::EventKind;

use crate::event::{Detail, EventContext, SessionEvent};

/// Events and turn records waiting for the writer; past this, events are
/// dropped for other replicas (counted), never held in memory.
const OUTBOX: usize = 65_536;
/// Most commands the writer sends in one round trip.
const BATCH: usize = 512;

/// What the writer sends to Redis, in order.
pub(crate) enum Outgoing {
    Event(Arc<SessionEvent>),
    /// `HSET` of a turn record.
    TurnStarted {
        key: String,
        field: String,
        record: String,
    },
    /// `HDEL` of a turn record.
    TurnEnded {
        key: String,
        field: String,
    },
}

/// Where the listener delivers other replicas' events: this replica's hubs.
pub(crate) trait Followers: Send + Sync + 'static {
    /// Adds what was published while nobody listened (oldest first, each with
    /// its publisher) to the session's hub, if this replica keeps one.
    fn seed(&self, session_id: &str, events: Vec<(String, SessionEvent)>);
    /// Offers an event the replica `origin` published to its session's hub,
    /// if this replica keeps one.
    fn inject(&self, origin: &str, event: SessionEvent);
}

/// What the listener is asked to do.
enum Command {
    Follow(String, oneshot::Sender<()>),
    Unfollow(String),
}

/// An event as it travels between replicas (`S`: borrowed to send, owned
/// when received).
#[derive(Serialize, Deserialize)]
struct Wire<S> {
    /// The replica that published it.
    o: S,
    k: S,
    c: u64,
    t: i64,
    /// Container, image, agent and session ids.
    x: [S; 4],
    d: S,
    /// What the mesh reads of the event besides its kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    r: Option<Box<Detail>>,
}

/// The Redis side of the event hubs of one replica; cheap to clone.
#[derive(Clone)]
pub struct Fanout {
    inner: Arc<FanoutInner>,
}

struct FanoutInner {
    replica_id: String,
    prefix: String,
    retention: usize,
    retention_period: Duration,
    conn: ConnectionManager,
    outbox: mpsc::Sender<Outgoing>,
    commands: mpsc::UnboundedSender<Command>,
    /// What the tasks take when they start.
    receivers: Mutex<Option<(mpsc::Receiver<Outgoing>, mpsc::UnboundedReceiver<Command>)>>,
}

impl Fanout {
    pub(crate) fn new(
        replica_id: &str,
        prefix: &str,
        conn: ConnectionManager,
        retention: usize,
        retention_period: Duration,
    ) -> Self {
        let (outbox, outbox_rx) = mpsc::channel(OUTBOX);
        let (commands, commands_rx) = mpsc::unbounded_channel();
        Self {
            inner: Arc::new(FanoutInner {
                replica_id: replica_id.to_owned(),
                prefix: prefix.to_owned(),
                retention: retention.max(1),
                retention_period,
                conn,
                outbox,
                commands,
                receivers: Mutex::new(Some((outbox_rx, commands_rx))),
            }),
        }
    }

    fn channel(&self, session_id: &str) -> String {
        format!("{}runtime:events:{session_id}", self.inner.prefix)
    }

    fn stream(&self, session_id: &str) -> String {
        format!("{}runtime:stream:{session_id}", self.inner.prefix)
    }

    /// Queues an event of a hub of this replica for the other replicas.
    pub(crate) fn publish(&self, event: &Arc<SessionEvent>) {
        self.send(Outgoing::Event(Arc::clone(event)));
    }

    /// Queues a write for the writer task; a full outbox drops it (counted).
    pub(crate) fn send(&self, outgoing: Outgoing) {
        if self.inner.outbox.try_send(outgoing).is_err() {
            metrics::counter!("avm_runtime_fanout_dropped_total").increment(1);
        }
    }

    /// Starts listening to a session's channel; the answer comes once Redis
    /// confirmed it. Sent while the hubs are locked, so follow and unfollow
    /// of one session reach the listener in the order the hubs changed.
    pub(crate) fn follow(&self, session_id: &str) -> oneshot::Receiver<()> {
        let (done, wait) = oneshot::channel();
        let _ = self.inner.commands.send(Command::Follow(session_id.to_owned(), done));
        wait
    }

    /// Stops listening to a session's channel.
    pub(crate) fn unfollow(&self, session_id: &str) {
        let _ = self.inner.commands.send(Command::Unfollow(session_id.to_owned()));
    }

    /// Returns the retained events of a session, oldest first.
    pub(crate) async fn history(&self, session_id: &str) -> Vec<(String, SessionEvent)> {
        let mut conn = self.inner.conn.clone();
        let entries: redis::RedisResult<Vec<(String, Vec<String>)>> = redis::cmd("XRANGE")
            .arg(self.stream(session_id))
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await;
        match entries {
            Ok(entries) => entries
                .iter()
                .filter_map(|(_, fields)| fields.get(1))
                .filter_map(|payload| decode(payload))
                .collect(),
            Err(err) => {
                tracing::warn!(session_id, error = %err, "cannot read a session's retained events from redis");
                Vec::new()
            }
        }
    }

    /// Starts the writer and the listener (once); they stop with `shutdown`,
    /// the writer after sending what was queued.
    pub(crate) fn spawn(&self, client: redis::Client, hubs: Arc<dyn Followers>, shutdown: CancellationToken) {
        let Some((outbox, commands)) = self.inner.receivers.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return;
        };
        tokio::spawn(self.clone().write(outbox));
        tokio::spawn(self.clone().listen(client, hubs, commands, shutdown));
    }

    /// Sends queued writes in order, many per round trip.
    async fn write(self, mut outbox: mpsc::Receiver<Outgoing>) {
        let mut conn = self.inner.conn.clone();
        let mut batch = Vec::with_capacity(BATCH);
        while outbox.recv_many(&mut batch, BATCH).await > 0 {
            let mut pipe = redis::pipe();
            let mut streams = HashSet::new();
            for outgoing in batch.drain(..) {
                match outgoing {
                    Outgoing::Event(event) => {
                        let payload = encode(&self.inner.replica_id, &event);
                        let session_id = &event.context.session_id;
                        pipe.cmd("PUBLISH").arg(self.channel(session_id)).arg(&payload).ignore();
                        let stream = self.stream(session_id);
                        pipe.cmd("XADD")
                            .arg(&stream)
                            .arg("MAXLEN")
                            .arg("~")
                            .arg(self.inner.retention)
                            .arg("*")
                            .arg("e")
                            .arg(&payload)
                            .ignore();
                        streams.insert(stream);
                    }
                    Outgoing::TurnStarted { key, field, record } => {
                        pipe.cmd("HSET").arg(key).arg(field).arg(record).ignore();
                    }
                    Outgoing::TurnEnded { key, field } => {
                        pipe.cmd("HDEL").arg(key).arg(field).ignore();
                    }
                }
            }
            let period = u64::try_from(self.inner.retention_period.as_millis())
                .unwrap_or(u64::MAX)
                .max(1000);
            // The replay window is bounded by time as well as by count: an
            // active session's entries older than the period go (the ids
            // are Redis's milliseconds), and an idle stream expires whole.
            let oldest = u64::try_from(avm_common::now_ms())
                .unwrap_or_default()
                .saturating_sub(period);
            for stream in streams {
                // Exact: an approximate trim keeps a small stream whole.
                pipe.cmd("XTRIM").arg(&stream).arg("MINID").arg(oldest).ignore();
                pipe.cmd("PEXPIRE").arg(stream).arg(period).ignore();
            }
            if let Err(err) = pipe.query_async::<()>(&mut conn).await {
                metrics::counter!("avm_runtime_fanout_errors_total").increment(1);
                tracing::warn!(error = %err, "cannot send events to redis; other replicas miss them");
            }
        }
    }

    /// Feeds other replicas' events into this replica's hubs, following the
    /// sessions it is asked to; reconnects (and catches up from the streams)
    /// after losing Redis.
    async fn listen(
        self,
        client: redis::Client,
        hubs: Arc<dyn Followers>,
        mut commands: mpsc::UnboundedReceiver<Command>,
        shutdown: CancellationToken,
    ) {
        let mut followed: HashSet<String> = HashSet::new();
        let mut backoff = Backoff::default();
        loop {
            let connected = tokio::select! {
                () = shutdown.cancelled() => return,
                connected = client.get_async_pubsub() => connected,
            };
            let (mut sink, mut messages) = match connected {
                Ok(pubsub) => pubsub.split(),
                Err(err) => {
                    tracing::warn!(error = %err, "cannot listen to redis for other replicas' events; retrying");
                    if !backoff.wait(&shutdown).await {
                        return;
                    }
                    continue;
                }
            };
            let channels: Vec<String> = followed.iter().map(|session| self.channel(session)).collect();
            if !channels.is_empty() && sink.subscribe(&channels).await.is_err() {
                continue;
            }
            backoff.reset();
            // What was published while nobody listened.
            for session_id in &followed {
                hubs.seed(session_id, self.history(session_id).await);
            }
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    command = commands.recv() => match command {
                        None => return,
                        Some(Command::Follow(session_id, done)) => {
                            if followed.insert(session_id.clone())
                                && let Err(err) = sink.subscribe(self.channel(&session_id)).await
                            {
                                tracing::warn!(error = %err, "cannot follow a session on redis; reconnecting");
                                let _ = done.send(());
                                break;
                            }
                            let _ = done.send(());
                        }
                        Some(Command::Unfollow(session_id)) => {
                            if followed.remove(&session_id)
                                && sink.unsubscribe(self.channel(&session_id)).await.is_err()
                            {
                                break;
                            }
                        }
                    },
                    message = messages.next() => {
                        let Some(message) = message else {
                            tracing::warn!("lost the redis connection for other replicas' events; reconnecting");
                            break;
                        };
                        let Ok(payload) = message.get_payload::<String>() else { continue };
                        let Some((origin, event)) = decode(&payload) else { continue };
                        if origin == self.inner.replica_id {
                            continue;
                        }
                        hubs.inject(&origin, event);
                    }
                }
            }
        }
    }
}

fn encode(origin: &str, event: &SessionEvent) -> String {
    let context = &event.context;
    let wire = Wire {
        o: origin,
        k: event.kind.name(),
        c: event.cursor,
        t: event.timestamp_ms,
        x: [
            context.container_id.as_str(),
            context.image_id.as_str(),
            context.agent_id.as_str(),
            context.session_id.as_str(),
        ],
        d: event.data_json.as_str(),
        r: event.detail.clone(),
    };
    serde_json::to_string(&wire).unwrap_or_default()
}

/// Returns an event published by a replica, with the replica's id; `None`
/// for what is not one, or an event of a kind this build does not know (a
/// newer replica's, counted), which its clients could not read either.
fn decode(payload: &str) -> Option<(String, SessionEvent)> {
    let wire: Wire<String> = serde_json::from_str(payload).ok()?;
    let Some(kind) = EventKind::parse(&wire.k) else {
        metrics::counter!("avm_runtime_fanout_unknown_events_total").increment(1);
        return None;
    };
    let [container_id, image_id, agent_id, session_id] = wire.x;
    let event = SessionEvent {
        kind,
        cursor: wire.c,
        timestamp_ms: wire.t,
        context: Arc::new(EventContext {
            container_id,
            image_id,
            agent_id,
            session_id,
        }),
        data_json: wire.d,
        detail: wire.r,
    };
    Some((wire.o, event))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(session_id: &str) -> SessionEvent {
        SessionEvent {
            kind: EventKind::MessageAccepted,
            cursor: 1,
            timestamp_ms: 7,
            context: Arc::new(EventContext {
                container_id: "c".into(),
                image_id: "img".into(),
                agent_id: "agent".into(),
                session_id: session_id.into(),
            }),
            data_json: "{}".into(),
            detail: None,
        }
    }

    /// Entries older than the retention period leave a session's stream on
    /// its next write, however few it holds.
    #[tokio::test]
    async fn the_replay_window_is_bounded_by_time() {
        let Some(url) = avm_common::testing::external_service(avm_common::testing::REDIS_URL_VAR) else {
            return;
        };
        let client = redis::Client::open(url).expect("a redis url");
        let mut conn = ConnectionManager::new(client).await.expect("redis");
        let prefix = format!("avm-test-{}:", avm_common::ids::new_id("t"));
        let fanout = Fanout::new("rt_1", &prefix, conn.clone(), 100, Duration::from_secs(60));
        let (outbox, _) = fanout.inner.receivers.lock().unwrap().take().expect("receivers");
        tokio::spawn(fanout.clone().write(outbox));
        let stream = fanout.stream("sess_1");
        // An entry from long ago (ids are milliseconds), then a write now.
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("1-1")
            .arg("e")
            .arg("old")
            .query_async(&mut conn)
            .await
            .expect("xadd");
        fanout.publish(&Arc::new(event("sess_1")));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let ids = loop {
            let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
                .arg(&stream)
                .arg("-")
                .arg("+")
                .query_async(&mut conn)
                .await
                .expect("xrange");
            let ids: Vec<String> = entries.into_iter().map(|(id, _)| id).collect();
            if ids.len() == 1 && ids[0] != "1-1" {
                break ids;
            }
            assert!(tokio::time::Instant::now() < deadline, "the old entry stayed: {ids:?}");
            tokio::task::yield_now().await;
        };
        assert_eq!(ids.len(), 1);
        let _: () = redis::cmd("DEL")
            .arg(&stream)
            .query_async(&mut conn)
            .await
            .expect("del");
    }

    #[test]
    fn events_travel_whole() {
        let event = SessionEvent {
            kind: EventKind::MessageAccepted,
            cursor: 42,
            timestamp_ms: 7,
            context: Arc::new(EventContext {
                container_id: "c".into(),
                image_id: "img".into(),
                agent_id: "agent".into(),
                session_id: "sess".into(),
            }),
            data_json: r#"{"text":"a \"b\""}"#.into(),
            detail: Some(Box::new(Detail::Request("req_1".into()))),
        };
        let (origin, back) = decode(&encode("rt_1", &event)).expect("decodes");
        assert_eq!(origin, "rt_1");
        assert_eq!(back.kind, EventKind::MessageAccepted);
        assert_eq!(back.detail, event.detail);
        assert_eq!(back.cursor, 42);
        assert_eq!(back.timestamp_ms, 7);
        assert_eq!(*back.context, *event.context);
        assert_eq!(back.data_json, event.data_json);
        assert!(decode("not json").is_none());
        let unknown = encode("rt_1", &event).replace("message_accepted", "message_from_the_future");
        assert!(decode(&unknown).is_none());
    }
}
