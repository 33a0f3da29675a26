//! One WebSocket connection: the loop that owns its socket.
//!
//! One task per connection owns the socket. Frames are read in order;
//! requests run concurrently (bounded) and answer when done; each subscribed
//! session is an event stream of the runtime merged into the loop.
//!
//! A `message_send_request` is answered where the runtime accepted it in
//! its session's stream: the runtime publishes `message_accepted` (with the
//! request's id) after `message_persisted` and before the turn's events, and
//! this connection turns it into the `message_send_response`. Without a
//! subscription to that session, the call's own result answers.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use avm_common::event::EventKind;
use avm_common::{ApiError, Code, RequestContext};
use avm_proto::runtime::v1 as rt;
use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket, close_code};
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use serde_json::{Value, json};
use tokio::sync::broadcast;
use tokio_stream::StreamMap;
use tracing::Instrument;

use super::dispatch::{self, Request, RequestKind};
use crate::api::groups;
use crate::api::images::{self, EventStream};
use crate::auth::Caller;
use crate::frames::{self, error_response_frame, event_frame, response_frame, system_error_frame};
use crate::state::GatewayState;
use crate::users::{FeedFrame, UserFeed};

/// What a finished background request hands back to the connection loop.
enum Completion {
    /// A response frame to send.
    Reply(String),
    /// A `message_send_request` ended: `accepted` says where its session's
    /// stream shows the acceptance (session and cursor), when it succeeded.
    Sent {
        correlation: String,
        accepted: Option<(String, u64)>,
        frame: String,
    },
}

/// Why the loop ends.
enum Exit {
    Closed,
    Close(u16, Cow<'static, str>),
}

/// Returns the close code (RFC 6455, 7.4.1), its reason and the typed error
/// for a frame the transport refused: 1009 beyond the size limit, 1007 for
/// a text frame that is not UTF-8, 1002 for a frame that breaks the
/// protocol; `None` when the stream itself broke and nothing can be said.
fn read_failure(err: axum::Error, limit: usize) -> Option<(u16, &'static str, ApiError)> {
    use tokio_tungstenite::tungstenite::Error as WsError;
    match *err.into_inner().downcast::<WsError>().ok()? {
        WsError::Capacity(_) => Some((
            close_code::SIZE,
            "frame too large",
            ApiError::invalid("FRAME_TOO_LARGE", format!("frame exceeds the limit of {limit} bytes")),
        )),
        WsError::Utf8(_) => Some((
            close_code::INVALID,
            "invalid UTF-8",
            ApiError::invalid("INVALID_UTF8", "text frames must be UTF-8"),
        )),
        WsError::Protocol(protocol) => Some((
            close_code::PROTOCOL,
            "protocol error",
            ApiError::invalid(
                "PROTOCOL_ERROR",
                format!("the frame breaks the WebSocket protocol: {protocol}"),
            ),
        )),
        _ => None,
    }
}

/// Returns the close of a connection whose credential is missing or refused:
/// 1008 with the error as a JSON reason (kept within the 123-byte limit).
fn auth_close(err: &ApiError) -> Exit {
    let mut message = err.message.clone();
    message.truncate(60);
    Exit::Close(
        close_code::POLICY,
        Cow::Owned(json!({"code": err.reason, "message": message}).to_string()),
    )
}

/// A `message_send_request` in flight, by the id of its request context
/// (the `requestId` of its `message_accepted` event).
struct PendingSend {
    /// The request's name and the client's `requestId`, to answer with.
    name: String,
    request_id: Value,
    /// The call's answer, once it came, waiting for the session's stream to
    /// reach the acceptance (session, cursor).
    parked: Option<(String, u64, String)>,
}

impl PendingSend {
    /// Whether this answer waits for `session_id`'s stream to pass a cursor
    /// it has now passed (`seen`).
    fn parked_before(&self, session_id: &str, seen: u64) -> bool {
        self.parked
            .as_ref()
            .is_some_and(|(session, cursor, _)| session == session_id && *cursor <= seen)
    }
}

/// What an event of a subscribed session asks of the connection.
enum Relay {
    /// Relay this frame.
    Frame(String),
    /// The stream ended with this error.
    Ended(ApiError),
    /// The acceptance of a `message_send_request`, answered, never relayed.
    Accepted(rt::Event),
    /// Relay this frame after the answers parked until this cursor.
    AfterParked(u64, String),
    /// A message the subscription's history already showed: not relayed.
    Shown,
}

/// How many of a history's last message ids a subscription checks its live
/// message events against: those stored while the history was read.
const HISTORY_OVERLAP: usize = 64;

/// The message events a history may already hold.
fn is_message_event(kind: Option<EventKind>) -> bool {
    matches!(
        kind,
        Some(
            EventKind::UserMessage
                | EventKind::AssistantMessage
                | EventKind::ToolCallMessage
                | EventKind::ToolResultMessage
                | EventKind::ErrorMessage
        )
    )
}

/// Names a caller's user in a word: a connection follows that user's feed.
fn user_key(principal: &avm_common::auth::Principal) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (&principal.tenant_id, &principal.user_id).hash(&mut hasher);
    hasher.finish()
}

/// How long a newly authenticated connection waits for its user's change
/// feed to be live before it reads on without it.
const FEED_LIVE_WITHIN: std::time::Duration = std::time::Duration::from_secs(2);

pub(super) struct Connection {
    state: Arc<GatewayState>,
    id: String,
    /// What the client authenticated with; re-checked on every request, so
    /// expiry and revocation take effect on an open connection too.
    credential: Option<Arc<str>>,
    /// The caller as last authenticated; `None` until an `auth` frame.
    caller: Option<Caller>,
    ack: bool,
    next_msg: u64,
    /// Requests made so far (their ids count them).
    next_request: u64,
    unacked: HashSet<String>,
    /// `message_send_request`s not answered yet.
    pending: HashMap<String, PendingSend>,
    /// Highest cursor received per subscribed session.
    seen: HashMap<String, u64>,
    /// Per session subscribed `withHistory`, the last message ids its
    /// history showed, until a live message event is not one of them.
    shown: Vec<(String, HashSet<String>)>,
    window_start: Instant,
    window_frames: u32,
    last_seen: Instant,
    /// Changes when a key is revoked or a user or tenant deleted anywhere:
    /// the connection then re-checks its caller and ends if it was theirs.
    revocations: tokio::sync::watch::Receiver<u64>,
}

impl Connection {
    pub(super) fn new(state: Arc<GatewayState>, ack: bool, credential: Option<String>, caller: Option<Caller>) -> Self {
        let id = avm_common::ids::new_id("conn");
        let revocations = state.auth.verifier().revocations();
        Self {
            revocations,
            credential: credential.map(Arc::from),
            caller,
            state,
            id,
            ack,
            next_msg: 0,
            next_request: 0,
            unacked: HashSet::new(),
            pending: HashMap::new(),
            seen: HashMap::new(),
            shown: Vec::new(),
            window_start: Instant::now(),
            window_frames: 0,
            last_seen: Instant::now(),
        }
    }

    /// Returns the connection's loop, which owns the socket until it closes.
    ///
    /// Not an `async fn`: that would keep its arguments twice in the future,
    /// and an idle connection is this future (with its socket) and little
    /// else. For the same reason, everything rare (a frame, a completion, a
    /// ping, an event that is more than a relay, the close) runs boxed, only
    /// while it runs; the loop itself holds the relay of a plain event.
    #[expect(clippy::manual_async_fn, reason = "an async fn would hold its arguments twice")]
    pub(super) fn run(mut self, mut socket: WebSocket) -> impl Future<Output = ()> + Send + 'static {
        async move {
            self.state.connections.fetch_add(1, Ordering::Relaxed);
            metrics::gauge!("avm_gateway_websocket_connections").increment(1.0);
            let shutdown = self.state.shutdown.clone();
            let mut requests: FuturesUnordered<BoxFuture<'static, Completion>> = FuturesUnordered::new();
            let mut subscriptions: StreamMap<String, EventStream> = StreamMap::new();
            let mut ping = tokio::time::interval(self.state.config.ping_interval);
            ping.reset();
            // A connection without a credential must send an `auth` frame
            // first, and soon; the timer is freed once it has.
            let mut auth_deadline = self
                .caller
                .is_none()
                .then(|| Box::pin(tokio::time::sleep(self.state.config.auth_timeout)));
            // What changes in the caller's containers, once the caller is
            // known; followed again when another user authenticates.
            let mut feed: Option<(Arc<UserFeed>, broadcast::Receiver<Arc<FeedFrame>>)> = None;
            let mut feed_of: Option<u64> = None;
            tracing::debug!(conn_id = %self.id, "websocket connected");
            let exit = loop {
                if self.caller.is_some() {
                    auth_deadline = None;
                }
                let caller = self.caller.as_ref().map(|caller| user_key(&caller.principal));
                if caller != feed_of {
                    // Boxed: rare, and its future would otherwise enlarge every idle connection.
                    feed = Box::pin(self.join_feed()).await;
                    feed_of = caller;
                }
                let step = tokio::select! {
                    () = async {
                        match auth_deadline.as_mut() {
                            Some(deadline) => deadline.await,
                            None => std::future::pending().await,
                        }
                    }, if auth_deadline.is_some() => {
                        Err(auth_close(&ApiError::new(Code::Unauthenticated, "UNAUTHENTICATED", "no auth frame in time")))
                    }
                    frame = socket.recv() => Box::pin(self.on_frame(frame, &mut socket, &mut requests, &mut subscriptions)).await,
                    Some(done) = requests.next() => {
                        let subscribed = matches!(&done, Completion::Sent { accepted: Some((id, _)), .. } if subscriptions.contains_key(id));
                        Box::pin(self.on_completion(done, subscribed, &mut socket)).await
                    }
                    Some((session_id, item)) = subscriptions.next() => match self.relay(&session_id, item) {
                        Ok(Relay::Frame(frame)) => self.send(&mut socket, frame).await,
                        Ok(relay) => Box::pin(self.on_event(&session_id, relay, &mut socket)).await,
                        Err(exit) => Err(exit),
                    },
                    Ok(()) = self.revocations.changed(), if self.caller.is_some() => Box::pin(self.on_revocation(&mut socket)).await,
                    changed = async {
                        match feed.as_mut() {
                            Some((_, receiver)) => receiver.recv().await,
                            None => std::future::pending().await,
                        }
                    } => match changed {
                        // Not what this connection did: it has its answer.
                        Ok(change) if change.origin.starts_with(&self.request_prefix()) => Ok(()),
                        Ok(change) => self.send(&mut socket, change.frame.clone()).await,
                        // Changes are news, not history: one that fell behind skips on.
                        Err(broadcast::error::RecvError::Lagged(_)) => Ok(()),
                        Err(broadcast::error::RecvError::Closed) => {
                            feed = None;
                            Ok(())
                        }
                    },
                    _ = ping.tick() => Box::pin(self.on_ping(&mut socket)).await,
                    () = shutdown.cancelled() => Err(Exit::Close(close_code::AWAY, "server shutting down".into())),
                };
                if let Err(exit) = step {
                    break exit;
                }
            };
            if let Exit::Close(code, reason) = exit {
                let frame = CloseFrame {
                    code,
                    reason: Utf8Bytes::from(reason.into_owned()),
                };
                let send_timeout = self.state.config.send_timeout;
                let _ = Box::pin(tokio::time::timeout(
                    send_timeout,
                    socket.send(Message::Close(Some(frame))),
                ))
                .await;
            }
            tracing::debug!(conn_id = %self.id, "websocket closed");
            self.state.connections.fetch_sub(1, Ordering::Relaxed);
            metrics::gauge!("avm_gateway_websocket_connections").decrement(1.0);
        }
    }

    /// Sends one frame, wrapped when the client asked for acknowledged delivery.
    async fn send(&mut self, socket: &mut WebSocket, frame: String) -> Result<(), Exit> {
        let frame = if self.ack {
            if self.unacked.len() >= self.state.config.max_unacked {
                return Err(Exit::Close(close_code::POLICY, "too many unacknowledged frames".into()));
            }
            self.next_msg += 1;
            let msg_id = format!("{}_{}", self.id, self.next_msg);
            let wrapped = json!({"__msgId": msg_id, "__payload": frame}).to_string();
            self.unacked.insert(msg_id);
            wrapped
        } else {
            frame
        };
        match tokio::time::timeout(self.state.config.send_timeout, socket.send(Message::Text(frame.into()))).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(Exit::Closed),
            Err(_) => {
                tracing::warn!(conn_id = %self.id, "client too slow; disconnecting");
                Err(Exit::Close(
                    close_code::POLICY,
                    "client too slow to receive events".into(),
                ))
            }
        }
    }

    /// Ends the connection, with an error frame and a 1008 close, when a
    /// revocation just applied is its caller's: subscriptions made with a
    /// revoked key stop within the time the event takes to arrive, idle or not.
    async fn on_revocation(&mut self, socket: &mut WebSocket) -> Result<(), Exit> {
        let Some(Err(err)) = self.caller.as_ref().map(|caller| self.state.auth.still_valid(caller)) else {
            return Ok(());
        };
        tracing::debug!(conn_id = %self.id, reason = %err.reason, "credential revoked; closing");
        let _ = self.send(socket, system_error_frame(&err, None)).await;
        Err(auth_close(&err))
    }

    async fn on_ping(&mut self, socket: &mut WebSocket) -> Result<(), Exit> {
        let config = &self.state.config;
        if self.last_seen.elapsed() > config.ping_interval * 2 {
            return Err(Exit::Close(close_code::AWAY, "no answer to pings".into()));
        }
        match tokio::time::timeout(config.send_timeout, socket.send(Message::Ping(bytes::Bytes::new()))).await {
            Ok(Ok(())) => Ok(()),
            _ => Err(Exit::Closed),
        }
    }

    async fn on_frame(
        &mut self,
        frame: Option<Result<Message, axum::Error>>,
        socket: &mut WebSocket,
        requests: &mut FuturesUnordered<BoxFuture<'static, Completion>>,
        subscriptions: &mut StreamMap<String, EventStream>,
    ) -> Result<(), Exit> {
        self.last_seen = Instant::now();
        let text = match frame {
            None => return Err(Exit::Closed),
            Some(Ok(Message::Text(text))) => text,
            Some(Ok(Message::Binary(_))) => {
                let err = ApiError::invalid("BINARY_NOT_SUPPORTED", "frames must be JSON text");
                return self.send(socket, system_error_frame(&err, None)).await;
            }
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => return Ok(()),
            Some(Ok(Message::Close(_))) => return Err(Exit::Closed),
            Some(Err(err)) => {
                // The transport refused the frame or the stream broke; a refused
                // frame gets a typed error before the close RFC 6455 names for it.
                tracing::debug!(conn_id = %self.id, error = %err, "websocket read failed");
                let Some((code, reason, err)) = read_failure(err, self.state.config.max_frame_bytes) else {
                    return Err(Exit::Closed);
                };
                let _ = self.send(socket, system_error_frame(&err, None)).await;
                return Err(Exit::Close(code, reason.into()));
            }
        };
        let limit = self.state.config.max_frame_bytes;
        if text.len() > limit {
            let err = ApiError::invalid("FRAME_TOO_LARGE", format!("frame exceeds the limit of {limit} bytes"));
            self.send(socket, system_error_frame(&err, None)).await?;
            // Far beyond the limit is abuse rather than a mistake: end the connection.
            if text.len() > limit.saturating_mul(4) {
                return Err(Exit::Close(close_code::SIZE, "frame too large".into()));
            }
            return Ok(());
        }
        let value = match frames::parse_frame(text.as_str()) {
            Ok(value) => value,
            Err(err) => return self.send(socket, system_error_frame(&err, None)).await,
        };
        if let Some(msg_id) = value.get("__ack").and_then(Value::as_str) {
            self.unacked.remove(msg_id);
            return Ok(());
        }
        // Acknowledgements are not counted: in acknowledged mode one arrives per event.
        if !self.within_rate() {
            let err = ApiError::new(
                Code::ResourceExhausted,
                "RATE_LIMITED",
                "too many frames per second on this connection",
            );
            let kind = value.get("type").and_then(Value::as_str).unwrap_or_default();
            return match kind.strip_suffix("_request") {
                // A request is still answered by its own response.
                Some(name) => {
                    let request_id = value["data"].get("requestId").cloned().unwrap_or(Value::Null);
                    self.send(socket, error_response_frame(name, &request_id, &err)).await
                }
                None => self.send(socket, system_error_frame(&err, None)).await,
            };
        }
        let kind = match frames::frame_type(&value) {
            Ok(kind) => kind,
            Err(err) => return self.send(socket, system_error_frame(&err, None)).await,
        };
        if kind == "auth" {
            return self.authenticate_frame(&value, socket, subscriptions).await;
        }
        if self.caller.is_none() {
            let err = ApiError::new(
                Code::Unauthenticated,
                "UNAUTHENTICATED",
                "authenticate first: ?token=, Authorization or an auth frame",
            );
            return Err(auth_close(&err));
        }
        match kind {
            "subscribe" => self.subscribe(&value, socket, subscriptions).await,
            "unsubscribe" => {
                let key = value.get("sessionId").or_else(|| value.get("groupId"));
                if let Some(session_id) = key.and_then(Value::as_str) {
                    subscriptions.remove(session_id);
                    self.seen.remove(session_id);
                    return self.release_parked(socket, session_id, u64::MAX).await;
                }
                Ok(())
            }
            _ => match kind.strip_suffix("_request") {
                Some(name) => self.request(name.to_owned(), value, socket, requests).await,
                None => {
                    let err = ApiError::invalid("UNKNOWN_TYPE", format!("unknown frame type {kind:?}"));
                    self.send(socket, system_error_frame(&err, None)).await
                }
            },
        }
    }

    fn within_rate(&mut self) -> bool {
        if self.window_start.elapsed().as_secs() >= 1 {
            self.window_start = Instant::now();
            self.window_frames = 0;
        }
        self.window_frames += 1;
        self.window_frames <= self.state.config.messages_per_second
    }

    /// Opens a session subscription before reading the next frame, so a
    /// `message_send_request` that follows cannot miss the turn's first events.
    async fn subscribe(
        &mut self,
        value: &Value,
        socket: &mut WebSocket,
        subscriptions: &mut StreamMap<String, EventStream>,
    ) -> Result<(), Exit> {
        // A group's stream is keyed by its id, which its events carry as `sessionId`.
        let group_id = match value.get("sessionId") {
            None => value.get("groupId").and_then(Value::as_str),
            Some(_) => None,
        };
        let Some(session_id) = value.get("sessionId").and_then(Value::as_str).or(group_id) else {
            let err = ApiError::invalid("MISSING_FIELD", "subscribe needs a string `sessionId` or `groupId`");
            return self.send(socket, system_error_frame(&err, None)).await;
        };
        if !subscriptions.contains_key(session_id) && subscriptions.len() >= self.state.config.max_subscriptions {
            let err = ApiError::new(
                Code::ResourceExhausted,
                "TOO_MANY_SUBSCRIPTIONS",
                "this connection has too many subscriptions",
            );
            return self.send(socket, system_error_frame(&err, None)).await;
        }
        let after = match value.get("afterCursor") {
            None | Some(Value::Null) => None,
            Some(Value::String(cursor)) => Some(cursor.clone()),
            Some(_) => {
                let err = ApiError::invalid("INVALID_CURSOR", "afterCursor must be a string");
                return self.send(socket, system_error_frame(&err, None)).await;
            }
        };
        let with_history = match value.get("withHistory") {
            None | Some(Value::Null | Value::Bool(false)) => false,
            Some(Value::Bool(true)) if group_id.is_none() && after.is_none() => true,
            Some(_) => {
                let err = ApiError::invalid(
                    "INVALID_FIELD",
                    "withHistory must be a boolean, for a session subscribed without afterCursor",
                );
                return self.send(socket, system_error_frame(&err, None)).await;
            }
        };
        // Boxed so the idle connection's state machine does not reserve room
        // for a gRPC call future it rarely runs.
        let ctx = match self.context().await {
            Ok(ctx) => ctx,
            Err(err) => return self.refused(socket, None, &err).await,
        };
        let subscribed = match group_id {
            Some(group_id) => Box::pin(groups::events(
                &self.state.peers,
                &ctx,
                group_id.to_owned(),
                after,
                None,
            )) as futures::future::BoxFuture<'_, Result<EventStream, ApiError>>,
            None => Box::pin(images::subscribe(&self.state.peers, &ctx, session_id.to_owned(), after)),
        };
        match subscribed.await {
            Ok(stream) => {
                subscriptions.insert(session_id.to_owned(), stream);
                if with_history {
                    return Box::pin(self.send_history(socket, &ctx, session_id)).await;
                }
                Ok(())
            }
            Err(err) => self.send(socket, system_error_frame(&err, None)).await,
        }
    }

    /// Sends a session's stored messages (`conversation_history`) to a
    /// subscription just opened, before any of its live events: those are
    /// relayed once the frame goes out, and a message stored while the
    /// history was read, which both show, is relayed once.
    async fn send_history(
        &mut self,
        socket: &mut WebSocket,
        ctx: &RequestContext,
        session_id: &str,
    ) -> Result<(), Exit> {
        let messages = match images::session_history(&self.state.peers, ctx, session_id).await {
            Ok(messages) => messages,
            Err(err) => return self.send(socket, system_error_frame(&err, None)).await,
        };
        let last: HashSet<String> = messages
            .iter()
            .rev()
            .take(HISTORY_OVERLAP)
            .filter_map(|message| message.get("id").and_then(Value::as_str).map(str::to_owned))
            .collect();
        self.shown.retain(|(id, _)| id != session_id);
        if !last.is_empty() {
            self.shown.push((session_id.to_owned(), last));
        }
        let event = avm_common::event::Event::from(avm_common::event::data::ConversationHistory {
            session_id: session_id.to_owned(),
            messages,
        });
        let frame = crate::frames::notification_frame(&event, json!({"sessionId": session_id}));
        self.send(socket, frame).await
    }

    /// Handles an `auth` frame: `{"type":"auth","headers":{"Authorization":"Bearer …"}}`
    /// (or `"token":"…"`). A refused credential closes the connection. One of
    /// the same user (a refreshed token) keeps the subscriptions; one of
    /// another user or tenant first ends every subscription made before, so
    /// nothing of the previous identity arrives after it (requests already
    /// sent are still answered).
    async fn authenticate_frame(
        &mut self,
        value: &Value,
        socket: &mut WebSocket,
        subscriptions: &mut StreamMap<String, EventStream>,
    ) -> Result<(), Exit> {
        let header = value
            .get("headers")
            .and_then(Value::as_object)
            .and_then(|headers| {
                headers
                    .iter()
                    .find(|(name, _)| name.eq_ignore_ascii_case("authorization"))
                    .map(|(_, value)| value)
            })
            .and_then(Value::as_str);
        let credential = match (header, value.get("token").and_then(Value::as_str)) {
            (Some(header), _) => avm_common::auth::parse_bearer(header).ok_or_else(avm_common::auth::invalid_token),
            (None, Some(token)) => Ok(token),
            (None, None) => Err(avm_common::auth::missing_credentials()),
        };
        let credential = credential.map_err(|err| auth_close(&err))?;
        let caller = self
            .state
            .auth
            .authenticate(Some(credential))
            .await
            .map_err(|err| auth_close(&err))?;
        let other = self.caller.as_ref().is_some_and(|before| {
            (&before.principal.tenant_id, &before.principal.user_id)
                != (&caller.principal.tenant_id, &caller.principal.user_id)
        });
        self.credential = Some(Arc::from(credential));
        self.caller = Some(caller);
        if other {
            tracing::debug!(conn_id = %self.id, dropped = subscriptions.len(), "identity changed; subscriptions dropped");
            subscriptions.clear();
            self.seen.clear();
            // Answers parked for a dropped stream go out now.
            let parked: HashSet<String> = self
                .pending
                .values()
                .filter_map(|pending| pending.parked.as_ref().map(|(session, _, _)| session.clone()))
                .collect();
            for session_id in parked {
                self.release_parked(socket, &session_id, u64::MAX).await?;
            }
        }
        Ok(())
    }

    /// Returns the caller's change feed, once it is live (at most
    /// [`FEED_LIVE_WITHIN`]): frames are read once it hears every later change.
    async fn join_feed(&mut self) -> Option<(Arc<UserFeed>, broadcast::Receiver<Arc<FeedFrame>>)> {
        let ctx = self.context().await.ok()?;
        let joined = self.state.users.join(&self.state.peers.session, &ctx);
        let receiver = joined.subscribe();
        joined.wait_live(FEED_LIVE_WITHIN).await;
        Some((joined, receiver))
    }

    /// Returns what the ids of this connection's requests start with.
    fn request_prefix(&self) -> String {
        format!("req_{}_", self.id.trim_start_matches("conn_"))
    }

    /// Returns the context of one request, re-authenticating the connection's
    /// credential (a cache hit, unless it expired or was revoked).
    async fn context(&mut self) -> Result<RequestContext, ApiError> {
        let caller = self.state.auth.authenticate(self.credential.as_deref()).await?;
        // `req_<connection>_<n>`: a change this connection made comes back
        // on its user's feed with this id, and is not sent to it again.
        self.next_request += 1;
        let ctx = caller.context(format!("{}{}", self.request_prefix(), self.next_request));
        self.caller = Some(caller);
        Ok(ctx)
    }

    /// Answers a request whose credential failed: a refused credential ends
    /// the connection; anything else (the auth service briefly away) is an
    /// error answer and the connection goes on.
    async fn refused(
        &mut self,
        socket: &mut WebSocket,
        request: Option<(&str, &Value)>,
        err: &ApiError,
    ) -> Result<(), Exit> {
        if err.code == Code::Unauthenticated {
            let _ = self
                .send(socket, system_error_frame(err, request.map(|(_, id)| id)))
                .await;
            return Err(auth_close(err));
        }
        let frame = match request {
            Some((name, request_id)) => error_response_frame(name, request_id, err),
            None => system_error_frame(err, None),
        };
        self.send(socket, frame).await
    }

    async fn request(
        &mut self,
        name: String,
        value: Value,
        socket: &mut WebSocket,
        requests: &mut FuturesUnordered<BoxFuture<'static, Completion>>,
    ) -> Result<(), Exit> {
        let (request_id, data) = frames::request_data(&value);
        let data = match data {
            Ok(data) => data,
            Err(err) => return self.send(socket, error_response_frame(&name, &request_id, &err)).await,
        };
        if requests.len() >= self.state.config.max_requests_in_flight {
            let err = ApiError::new(
                Code::ResourceExhausted,
                "TOO_MANY_REQUESTS",
                "too many requests in flight on this connection",
            );
            return self.send(socket, error_response_frame(&name, &request_id, &err)).await;
        }
        let ctx = match self.context().await {
            Ok(ctx) => ctx,
            Err(err) => return self.refused(socket, Some((&name, &request_id)), &err).await,
        };
        if let Err(wait) = self.state.limiter.check(&ctx.principal).await {
            let err = crate::http::rate_limit_error(wait);
            let mut frame: Value =
                serde_json::from_str(&error_response_frame(&name, &request_id, &err)).unwrap_or_default();
            frame["data"]["retryAfter"] = json!(crate::limits::retry_after_secs(wait));
            return self.send(socket, frame.to_string()).await;
        }
        // The quota is checked before the data is decoded: an exhausted
        // quota is the answer even to a malformed send.
        let sends = RequestKind::of(&name) == Some(RequestKind::MessageSend);
        if sends && self.state.auth.verifier().quota_exhausted(&ctx.principal) {
            let err = crate::auth::quota_exceeded();
            return self.send(socket, error_response_frame(&name, &request_id, &err)).await;
        }
        let peers = self.state.peers.clone();
        metrics::counter!("avm_gateway_websocket_requests_total").increment(1);
        let span = avm_common::telemetry::request_span("ws", &format!("{name}_request"), &ctx.trace);
        span.in_scope(|| ctx.record_in_span());
        match Request::decode(&name, data) {
            Ok(Request::MessageSend(request)) => {
                let correlation = ctx.request_id.clone();
                self.pending.insert(
                    correlation.clone(),
                    PendingSend {
                        name: name.clone(),
                        request_id: request_id.clone(),
                        parked: None,
                    },
                );
                requests.push(Box::pin(
                    async move {
                        // The turn's events reach subscribers through their
                        // subscriptions; this call's own stream is dropped, and
                        // the turn goes on without it.
                        match dispatch::message_send(&peers, &ctx, request).await {
                            Ok((accepted, reply, _events)) => Completion::Sent {
                                correlation,
                                accepted: accepted.cursor.parse().ok().map(|cursor| (accepted.session_id, cursor)),
                                frame: response_frame(&name, &request_id, reply),
                            },
                            Err(err) => Completion::Sent {
                                correlation,
                                accepted: None,
                                frame: error_response_frame(&name, &request_id, &err),
                            },
                        }
                    }
                    .instrument(span),
                ));
            }
            request => {
                requests.push(Box::pin(
                    async move {
                        let reply = match request {
                            Ok(request) => dispatch::dispatch(&peers, &ctx, request).await,
                            Err(err) => Err(err),
                        };
                        let frame = match reply {
                            Ok(reply) => response_frame(&name, &request_id, reply),
                            Err(err) => error_response_frame(&name, &request_id, &err),
                        };
                        Completion::Reply(frame)
                    }
                    .instrument(span),
                ));
            }
        }
        Ok(())
    }

    async fn on_completion(&mut self, done: Completion, subscribed: bool, socket: &mut WebSocket) -> Result<(), Exit> {
        let (correlation, accepted, frame) = match done {
            Completion::Reply(frame) => return self.send(socket, frame).await,
            Completion::Sent {
                correlation,
                accepted,
                frame,
            } => (correlation, accepted, frame),
        };
        // Answered already, where the stream showed the acceptance.
        let Some(pending) = self.pending.get_mut(&correlation) else {
            return Ok(());
        };
        // A subscriber's stream has not reached the acceptance yet: the
        // answer waits for it (or for anything after it), so it goes out
        // after `message_persisted` and before the turn's events.
        if let Some((session_id, cursor)) = accepted
            && subscribed
            && self.seen.get(&session_id).is_none_or(|seen| *seen < cursor)
        {
            pending.parked = Some((session_id, cursor, frame));
            return Ok(());
        }
        self.pending.remove(&correlation);
        self.send(socket, frame).await
    }

    /// Sends the parked answers of `session_id` whose acceptance the stream has passed (`seen`).
    async fn release_parked(&mut self, socket: &mut WebSocket, session_id: &str, seen: u64) -> Result<(), Exit> {
        let due: Vec<String> = self
            .pending
            .iter()
            .filter(|(_, pending)| pending.parked_before(session_id, seen))
            .map(|(correlation, _)| correlation.clone())
            .collect();
        for correlation in due {
            if let Some(PendingSend {
                parked: Some((_, _, frame)),
                ..
            }) = self.pending.remove(&correlation)
            {
                self.send(socket, frame).await?;
            }
        }
        Ok(())
    }

    /// Answers a `message_send_request` of this connection from its
    /// `message_accepted` event; the event itself is never relayed.
    async fn on_accepted(&mut self, event: &rt::Event, socket: &mut WebSocket) -> Result<(), Exit> {
        let Some(pending) = self.pending.remove(&event.request_id) else {
            return Ok(());
        };
        let context = event.context.clone().unwrap_or_default();
        let data = json!({"imageId": context.image_id, "agentId": context.agent_id});
        self.send(socket, response_frame(&pending.name, &pending.request_id, data))
            .await
    }

    /// Takes an event of a subscribed session: the frame to relay, or what
    /// needs more than a relay.
    fn relay(&mut self, session_id: &str, item: Result<rt::Event, ApiError>) -> Result<Relay, Exit> {
        let event = match item {
            Ok(event) => event,
            Err(err) => return Ok(Relay::Ended(err)),
        };
        // A revoked credential ends its open streams too, at the next event.
        if let Some(caller) = &self.caller
            && let Err(err) = self.state.auth.still_valid(caller)
        {
            return Err(auth_close(&err));
        }
        let cursor = event.cursor.parse::<u64>().unwrap_or(0);
        let seen = self.seen.entry(session_id.to_owned()).or_default();
        *seen = (*seen).max(cursor);
        if frames::kind(&event) == Some(EventKind::MessageAccepted) {
            return Ok(Relay::Accepted(event));
        }
        if self.already_shown(session_id, &event) {
            return Ok(Relay::Shown);
        }
        // A stream that began after the acceptance never shows it: an answer
        // waiting for it goes out before the first event that follows it.
        if self
            .pending
            .values()
            .any(|pending| pending.parked_before(session_id, cursor))
        {
            return Ok(Relay::AfterParked(cursor, event_frame(&event)));
        }
        Ok(Relay::Frame(event_frame(&event)))
    }

    /// Whether a live message event repeats one the session's history
    /// showed; the first that does not ends the check (what follows it is
    /// newer than the history).
    fn already_shown(&mut self, session_id: &str, event: &rt::Event) -> bool {
        let Some(at) = self.shown.iter().position(|(id, _)| id == session_id) else {
            return false;
        };
        if !is_message_event(frames::kind(event)) {
            return false;
        }
        let id = serde_json::from_str::<Value>(&event.data_json)
            .ok()
            .and_then(|data| data.get("id").and_then(Value::as_str).map(str::to_owned));
        if id.is_some_and(|id| self.shown[at].1.contains(&id)) {
            return true;
        }
        self.shown.swap_remove(at);
        false
    }

    /// Handles an event that needs more than a relay.
    async fn on_event(&mut self, session_id: &str, relay: Relay, socket: &mut WebSocket) -> Result<(), Exit> {
        match relay {
            Relay::Frame(frame) => self.send(socket, frame).await,
            Relay::Ended(err) => {
                tracing::debug!(conn_id = %self.id, session_id, reason = %err.reason, "subscription ended");
                // Answers waiting for this stream wait no longer.
                self.release_parked(socket, session_id, u64::MAX).await?;
                self.send(socket, system_error_frame(&err, None)).await
            }
            Relay::Accepted(event) => self.on_accepted(&event, socket).await,
            Relay::AfterParked(cursor, frame) => {
                self.release_parked(socket, session_id, cursor).await?;
                self.send(socket, frame).await
            }
            Relay::Shown => Ok(()),
        }
    }
}
