//! `GET /ws`: the AgentX-compatible WebSocket protocol (PROTOCOL.md).
//!
//! One task per connection owns the socket. Frames are read in order;
//! requests run concurrently (bounded) and answer when done; each subscribed
//! session is a gRPC event stream merged into the loop. While a
//! `message_send_request` is pending, its conversation's events are held so
//! the response goes out before the turn's first stream event.

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use avm_common::{ApiError, Code, RequestContext};
use avm_proto::runtime::v1 as rt;
use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket, WebSocketUpgrade, close_code};
use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_stream::StreamMap;

use crate::GatewayState;
use crate::backends::{Backends, ImageConfig, agent_json};
use crate::wire::{error_response_frame, event_frame, response_frame, system_error_frame};

/// Query parameters of the upgrade request.
#[derive(Debug, Default, Deserialize)]
pub struct WsQuery {
    /// `1`/`true` wraps every frame for acknowledged delivery (`__msgId`/`__ack`).
    #[serde(default)]
    ack: Option<String>,
    /// Accepted for AgentX compatibility; verified once the auth service exists.
    #[serde(default)]
    #[allow(dead_code)]
    token: Option<String>,
}

/// Upgrades to a WebSocket with small buffers (an idle connection stays a few KiB).
pub async fn upgrade(
    State(state): State<Arc<GatewayState>>,
    Query(query): Query<WsQuery>,
    ws: WebSocketUpgrade,
) -> Response {
    let config = &state.config;
    if state.connections.load(Ordering::Relaxed) >= config.max_connections {
        let err = ApiError::new(
            Code::ResourceExhausted,
            "TOO_MANY_CONNECTIONS",
            "the gateway is at its connection limit",
        );
        return crate::rest::error_response(&err, &avm_common::ids::new_id("req"));
    }
    // Frames up to the transport limit are read whole, so even a frame that
    // ends the connection is answered with a clean 1009 close; only beyond it
    // does the transport give up mid-frame.
    let transport_limit = config.max_frame_bytes.saturating_mul(16);
    let ack = matches!(query.ack.as_deref(), Some("1" | "true"));
    ws.read_buffer_size(1024)
        .write_buffer_size(0)
        .max_write_buffer_size(transport_limit.max(64 * 1024))
        .max_message_size(transport_limit)
        .max_frame_size(transport_limit)
        .on_upgrade(move |socket| async move {
            state.connections.fetch_add(1, Ordering::Relaxed);
            Connection::new(Arc::clone(&state), ack).run(socket).await;
            state.connections.fetch_sub(1, Ordering::Relaxed);
        })
        .into_response()
}

type EventStream = Pin<Box<dyn futures::Stream<Item = Result<rt::SubscribeEventsResponse, tonic::Status>> + Send>>;

/// What a finished background request hands back to the connection loop.
enum Completion {
    /// A response frame to send.
    Reply(String),
    /// A `message_send_request` ended; held events of `key` are released
    /// around the response (those up to `cursor` first).
    Sent {
        key: String,
        session_id: Option<String>,
        cursor: Option<u64>,
        frame: String,
    },
}

/// Why the loop ends.
enum Exit {
    Closed,
    Close(u16, &'static str),
}

/// A `message_send` response that waits until its session's stream has
/// delivered the acceptance cursor (events travel on a separate gRPC stream).
struct Parked {
    cursor: u64,
    frame: String,
}

struct Connection {
    state: Arc<GatewayState>,
    id: String,
    ctx: RequestContext,
    ack: bool,
    next_msg: u64,
    unacked: HashSet<String>,
    /// Events held per conversation (image or legacy agent id) during a pending send.
    held: HashMap<String, Vec<rt::Event>>,
    held_count: usize,
    /// Responses waiting for their session's events up to the accepted cursor.
    parked: HashMap<String, Parked>,
    /// Highest cursor received per subscribed session.
    seen: HashMap<String, u64>,
    window_start: Instant,
    window_frames: u32,
    last_seen: Instant,
}

impl Connection {
    fn new(state: Arc<GatewayState>, ack: bool) -> Self {
        let id = avm_common::ids::new_id("conn");
        Self {
            ctx: RequestContext::local(),
            state,
            id,
            ack,
            next_msg: 0,
            unacked: HashSet::new(),
            held: HashMap::new(),
            held_count: 0,
            parked: HashMap::new(),
            seen: HashMap::new(),
            window_start: Instant::now(),
            window_frames: 0,
            last_seen: Instant::now(),
        }
    }

    async fn run(mut self, mut socket: WebSocket) {
        let shutdown = self.state.shutdown.clone();
        let config = self.state.config.clone();
        let mut requests: FuturesUnordered<BoxFuture<'static, Completion>> = FuturesUnordered::new();
        let mut subscriptions: StreamMap<String, EventStream> = StreamMap::new();
        let mut ping = tokio::time::interval(config.ping_interval);
        ping.reset();
        tracing::debug!(conn_id = %self.id, "websocket connected");
        let exit = loop {
            let step = tokio::select! {
                frame = socket.recv() => self.on_frame(frame, &mut socket, &mut requests, &mut subscriptions).await,
                Some(done) = requests.next() => {
                    let subscribed = matches!(&done, Completion::Sent { session_id: Some(id), .. } if subscriptions.contains_key(id));
                    self.on_completion(done, subscribed, &mut socket).await
                }
                Some((session_id, item)) = subscriptions.next() => self.on_event(&session_id, item, &mut socket).await,
                _ = ping.tick() => self.on_ping(&mut socket, &config).await,
                () = shutdown.cancelled() => Err(Exit::Close(close_code::AWAY, "server shutting down")),
            };
            if let Err(exit) = step {
                break exit;
            }
        };
        if let Exit::Close(code, reason) = exit {
            let frame = CloseFrame {
                code,
                reason: Utf8Bytes::from_static(reason),
            };
            let _ = tokio::time::timeout(config.send_timeout, socket.send(Message::Close(Some(frame)))).await;
        }
        tracing::debug!(conn_id = %self.id, "websocket closed");
    }

    /// Sends one frame, wrapped when the client asked for acknowledged delivery.
    async fn send(&mut self, socket: &mut WebSocket, frame: String) -> Result<(), Exit> {
        let frame = if self.ack {
            if self.unacked.len() >= self.state.config.max_unacked {
                return Err(Exit::Close(close_code::POLICY, "too many unacknowledged frames"));
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
                Err(Exit::Close(close_code::POLICY, "client too slow to receive events"))
            }
        }
    }

    async fn on_ping(&mut self, socket: &mut WebSocket, config: &crate::GatewayConfig) -> Result<(), Exit> {
        if self.last_seen.elapsed() > config.ping_interval * 2 {
            return Err(Exit::Close(close_code::AWAY, "no answer to pings"));
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
                // The transport refused the frame (beyond the hard size limit) or the
                // stream broke; a typed error goes out before the close when possible.
                tracing::debug!(conn_id = %self.id, error = %err, "websocket read failed");
                let limit = self.state.config.max_frame_bytes;
                let err = ApiError::invalid("FRAME_TOO_LARGE", format!("frame exceeds the limit of {limit} bytes"));
                let _ = self.send(socket, system_error_frame(&err, None)).await;
                return Err(Exit::Close(close_code::SIZE, "frame too large"));
            }
        };
        let limit = self.state.config.max_frame_bytes;
        if text.len() > limit {
            let err = ApiError::invalid("FRAME_TOO_LARGE", format!("frame exceeds the limit of {limit} bytes"));
            self.send(socket, system_error_frame(&err, None)).await?;
            // Far beyond the limit is abuse rather than a mistake: end the connection.
            if text.len() > limit.saturating_mul(4) {
                return Err(Exit::Close(close_code::SIZE, "frame too large"));
            }
            return Ok(());
        }
        let value: Value = match serde_json::from_str(text.as_str()) {
            Ok(value @ Value::Object(_)) => value,
            _ => {
                let err = ApiError::invalid("INVALID_JSON", "frame is not a JSON object");
                return self.send(socket, system_error_frame(&err, None)).await;
            }
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
        let Some(kind) = value.get("type").and_then(Value::as_str) else {
            let err = ApiError::invalid("MISSING_TYPE", "frame has no string `type`");
            return self.send(socket, system_error_frame(&err, None)).await;
        };
        match kind {
            // Credentials are accepted for compatibility; the auth service will verify them.
            "auth" => Ok(()),
            "subscribe" => self.subscribe(&value, socket, subscriptions).await,
            "unsubscribe" => {
                if let Some(session_id) = value.get("sessionId").and_then(Value::as_str) {
                    subscriptions.remove(session_id);
                    self.seen.remove(session_id);
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
        let Some(session_id) = value.get("sessionId").and_then(Value::as_str) else {
            let err = ApiError::invalid("MISSING_FIELD", "subscribe needs a string `sessionId`");
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
        // Boxed so the idle connection's state machine does not reserve room
        // for a gRPC call future it rarely runs.
        match Box::pin(self.state.backends.subscribe(&self.ctx, session_id, after)).await {
            Ok(stream) => {
                subscriptions.insert(session_id.to_owned(), Box::pin(stream));
                Ok(())
            }
            Err(err) => self.send(socket, system_error_frame(&err, None)).await,
        }
    }

    async fn request(
        &mut self,
        name: String,
        value: Value,
        socket: &mut WebSocket,
        requests: &mut FuturesUnordered<BoxFuture<'static, Completion>>,
    ) -> Result<(), Exit> {
        let data = value.get("data").cloned().unwrap_or(Value::Null);
        let request_id = data.get("requestId").cloned().unwrap_or(Value::Null);
        if !request_id.is_string() {
            let err = ApiError::invalid("MISSING_REQUEST_ID", "data.requestId must be a string");
            return self.send(socket, error_response_frame(&name, &request_id, &err)).await;
        }
        if !data.is_object() {
            let err = ApiError::invalid("INVALID_DATA", "`data` must be an object");
            return self.send(socket, error_response_frame(&name, &request_id, &err)).await;
        }
        if requests.len() >= self.state.config.max_requests_in_flight {
            let err = ApiError::new(
                Code::ResourceExhausted,
                "TOO_MANY_REQUESTS",
                "too many requests in flight on this connection",
            );
            return self.send(socket, error_response_frame(&name, &request_id, &err)).await;
        }
        let backends = self.state.backends.clone();
        let ctx = RequestContext {
            request_id: avm_common::ids::new_id("req"),
            ..self.ctx.clone()
        };
        if name == "message_send" {
            let key = ["imageId", "agentId"]
                .iter()
                .find_map(|field| data.get(*field).and_then(Value::as_str))
                .unwrap_or_default()
                .to_owned();
            self.held.entry(key.clone()).or_default();
            requests.push(Box::pin(async move {
                match message_send(&backends, &ctx, &data).await {
                    Ok((accepted, reply)) => Completion::Sent {
                        key,
                        session_id: accepted.agent.map(|agent| agent.session_id),
                        cursor: accepted.cursor.parse().ok(),
                        frame: response_frame(&name, &request_id, reply),
                    },
                    Err(err) => Completion::Sent {
                        key,
                        session_id: None,
                        cursor: None,
                        frame: error_response_frame(&name, &request_id, &err),
                    },
                }
            }));
        } else {
            requests.push(Box::pin(async move {
                let frame = match handle(&backends, &ctx, &name, &data).await {
                    Ok(reply) => response_frame(&name, &request_id, reply),
                    Err(err) => error_response_frame(&name, &request_id, &err),
                };
                Completion::Reply(frame)
            }));
        }
        Ok(())
    }

    async fn on_completion(&mut self, done: Completion, subscribed: bool, socket: &mut WebSocket) -> Result<(), Exit> {
        match done {
            Completion::Reply(frame) => self.send(socket, frame).await,
            Completion::Sent {
                key,
                session_id,
                cursor,
                frame,
            } => {
                // Wait for the subscription to catch up with the acceptance, so
                // the response follows `message_persisted` and precedes the turn.
                if let (Some(session_id), Some(cursor)) = (session_id, cursor)
                    && subscribed
                    && self.seen.get(&session_id).is_none_or(|seen| *seen < cursor)
                {
                    self.parked.insert(key, Parked { cursor, frame });
                    return Ok(());
                }
                self.release(socket, &key, cursor, frame).await
            }
        }
    }

    /// Sends a conversation's held events up to `cursor`, the response, then the rest.
    async fn release(
        &mut self,
        socket: &mut WebSocket,
        key: &str,
        cursor: Option<u64>,
        frame: String,
    ) -> Result<(), Exit> {
        let held = self.held.remove(key).unwrap_or_default();
        self.held_count -= held.len();
        let (before, after): (Vec<_>, Vec<_>) = held
            .into_iter()
            .partition(|event| cursor.is_some_and(|c| event.cursor.parse::<u64>().is_ok_and(|e| e <= c)));
        for event in before {
            self.send(socket, event_frame(&event)).await?;
        }
        self.send(socket, frame).await?;
        for event in after {
            self.send(socket, event_frame(&event)).await?;
        }
        Ok(())
    }

    async fn on_event(
        &mut self,
        session_id: &str,
        item: Result<rt::SubscribeEventsResponse, tonic::Status>,
        socket: &mut WebSocket,
    ) -> Result<(), Exit> {
        let event = match item {
            Ok(rt::SubscribeEventsResponse { event: Some(event) }) => event,
            Ok(_) => return Ok(()),
            Err(status) => {
                let err = ApiError::from_status(&status);
                tracing::debug!(conn_id = %self.id, session_id, reason = %err.reason, "subscription ended");
                let frame = system_error_frame(&err, None);
                return self.send(socket, frame).await;
            }
        };
        let cursor = event.cursor.parse::<u64>().unwrap_or(0);
        let seen = self.seen.entry(session_id.to_owned()).or_default();
        *seen = (*seen).max(cursor);
        let key = event.context.as_ref().and_then(|context| {
            [&context.image_id, &context.agent_id]
                .into_iter()
                .find(|id| self.held.contains_key(id.as_str()))
                .cloned()
        });
        let Some(key) = key else {
            return self.send(socket, event_frame(&event)).await;
        };
        if self.held_count >= self.state.config.max_held_events {
            return Err(Exit::Close(
                close_code::POLICY,
                "too many events held for a pending request",
            ));
        }
        self.held_count += 1;
        self.held.entry(key.clone()).or_default().push(event);
        if self.parked.get(&key).is_some_and(|parked| cursor >= parked.cursor)
            && let Some(parked) = self.parked.remove(&key)
        {
            return self.release(socket, &key, Some(parked.cursor), parked.frame).await;
        }
        Ok(())
    }
}

/// Runs a `message_send_request`; returns the acceptance cursor and the response data.
async fn message_send(
    backends: &Backends,
    ctx: &RequestContext,
    data: &Value,
) -> Result<(rt::SendMessageAccepted, Value), ApiError> {
    let image_id = match (opt_str(data, "imageId")?, opt_str(data, "agentId")?) {
        (Some(image_id), _) => image_id,
        (None, Some(agent_id)) => backends.get_agent(ctx, &agent_id).await?.image_id,
        (None, None) => return Err(ApiError::invalid("MISSING_FIELD", "imageId (or agentId) is required")),
    };
    let content = content_field(data)?;
    // The turn's events reach subscribers through their subscriptions; the
    // stream of this call is dropped, and the turn goes on without it.
    let (accepted, _events) = backends.send_message(ctx, &image_id, content).await?;
    let agent_id = accepted
        .agent
        .as_ref()
        .map(|agent| agent.agent_id.clone())
        .unwrap_or_default();
    Ok((accepted, json!({"imageId": image_id, "agentId": agent_id})))
}

/// Answers every request type except `message_send`.
async fn handle(backends: &Backends, ctx: &RequestContext, name: &str, data: &Value) -> Result<Value, ApiError> {
    match name {
        "container_create" => {
            let container_id = req_str(data, "containerId")?;
            backends.create_container(ctx, &container_id).await?;
            Ok(json!({"containerId": container_id}))
        }
        "container_get" => {
            let container_id = req_str(data, "containerId")?;
            match backends.get_container(ctx, &container_id).await {
                Ok(_) => Ok(json!({"containerId": container_id, "exists": true})),
                Err(err) if err.code == Code::NotFound => Ok(json!({"exists": false})),
                Err(err) => Err(err),
            }
        }
        "container_list" => {
            let containers = backends.list_containers(ctx).await?;
            let ids: Vec<Value> = containers.into_iter().map(|c| c["containerId"].clone()).collect();
            Ok(json!({"containerIds": ids}))
        }
        "image_create" => {
            let container_id = req_str(data, "containerId")?;
            let config = image_config(data.get("config"))?;
            let (record, session_id) = backends.create_image(ctx, &container_id, config).await?;
            Ok(json!({"record": record, "__subscriptions": [session_id]}))
        }
        "image_get" => {
            let image_id = req_str(data, "imageId")?;
            match backends.get_image(ctx, &image_id).await {
                Ok((record, session_id)) => Ok(json!({"record": record, "__subscriptions": [session_id]})),
                Err(err) if err.code == Code::NotFound => Ok(json!({"record": null})),
                Err(err) => Err(err),
            }
        }
        "image_list" => {
            let container_id = opt_str(data, "containerId")?;
            let images = backends.list_images(ctx, container_id.as_deref()).await?;
            let (records, sessions): (Vec<Value>, Vec<String>) = images.into_iter().unzip();
            Ok(json!({"records": records, "__subscriptions": sessions}))
        }
        "image_update" => {
            let image_id = req_str(data, "imageId")?;
            let updates = data.get("updates").unwrap_or(&Value::Null);
            if !updates.is_object() {
                return Err(ApiError::invalid("MISSING_FIELD", "updates must be an object"));
            }
            let record = backends
                .update_image(
                    ctx,
                    &image_id,
                    opt_str(updates, "name")?,
                    opt_str(updates, "description")?,
                )
                .await?;
            Ok(json!({"record": record}))
        }
        "image_delete" => {
            let image_id = req_str(data, "imageId")?;
            backends.delete_image(ctx, &image_id).await?;
            Ok(json!({"imageId": image_id}))
        }
        "image_run" => {
            let image_id = req_str(data, "imageId")?;
            let (agent, reused) = backends.run_image(ctx, &image_id).await?;
            Ok(json!({"imageId": image_id, "agentId": agent.agent_id, "reused": reused}))
        }
        "image_stop" => {
            let image_id = req_str(data, "imageId")?;
            backends.stop_image(ctx, &image_id).await?;
            Ok(json!({"imageId": image_id}))
        }
        "image_messages" => {
            let image_id = req_str(data, "imageId")?;
            let messages = backends.messages(ctx, &image_id).await?;
            Ok(json!({"imageId": image_id, "messages": messages}))
        }
        "agent_interrupt" => {
            let target = match (opt_str(data, "imageId")?, opt_str(data, "agentId")?) {
                (Some(image_id), _) => rt::interrupt_agent_request::Target::ImageId(image_id),
                (None, Some(agent_id)) => rt::interrupt_agent_request::Target::AgentId(agent_id),
                (None, None) => return Err(ApiError::invalid("MISSING_FIELD", "imageId or agentId is required")),
            };
            let (agent, interrupted) = backends.interrupt(ctx, target).await?;
            Ok(json!({"imageId": agent.image_id, "agentId": agent.agent_id, "interrupted": interrupted}))
        }
        "agent_get" => {
            let agent_id = req_str(data, "agentId")?;
            Ok(match backends.agent_exists(ctx, &agent_id).await? {
                Some(agent) => json!({"agentId": agent.agent_id, "containerId": agent.container_id, "exists": true}),
                None => json!({"exists": false}),
            })
        }
        "agent_list" => {
            let container_id = req_str(data, "containerId")?;
            let agents = backends.list_agents(ctx, Some(&container_id)).await?;
            let agents: Vec<Value> = agents.iter().map(agent_json).collect();
            Ok(json!({"agents": agents}))
        }
        "agent_destroy" => {
            let agent_id = req_str(data, "agentId")?;
            let success = match backends.destroy_agent(ctx, &agent_id).await {
                Ok(()) => true,
                Err(err) if err.code == Code::NotFound => false,
                Err(err) => return Err(err),
            };
            Ok(json!({"agentId": agent_id, "success": success}))
        }
        "agent_destroy_all" => {
            let container_id = req_str(data, "containerId")?;
            backends.destroy_all_agents(ctx, &container_id).await?;
            Ok(json!({"containerId": container_id}))
        }
        _ => Err(ApiError::invalid(
            "UNKNOWN_REQUEST",
            format!("unknown request type {name}_request"),
        )),
    }
}

/// Reads image settings from a `config` object.
pub(crate) fn image_config(config: Option<&Value>) -> Result<ImageConfig, ApiError> {
    let config = match config {
        None | Some(Value::Null) => return Ok(ImageConfig::default()),
        Some(config @ Value::Object(_)) => config,
        Some(_) => return Err(ApiError::invalid("INVALID_FIELD", "config must be an object")),
    };
    Ok(ImageConfig {
        name: opt_str(config, "name")?,
        description: opt_str(config, "description")?,
        system_prompt: opt_str(config, "systemPrompt")?,
        mcp_servers: config.get("mcpServers").cloned(),
    })
}

/// Reads the `content` of a message: a string or a list of parts (the runtime validates the parts).
pub(crate) fn content_field(data: &Value) -> Result<&Value, ApiError> {
    match data.get("content") {
        Some(content @ (Value::String(_) | Value::Array(_))) => Ok(content),
        Some(_) => Err(ApiError::invalid(
            "INVALID_CONTENT",
            "content must be a string or a list of parts",
        )),
        None => Err(ApiError::invalid("MISSING_FIELD", "content is required")),
    }
}

/// Reads a required string field.
pub(crate) fn req_str(data: &Value, field: &str) -> Result<String, ApiError> {
    opt_str(data, field)?.ok_or_else(|| ApiError::invalid("MISSING_FIELD", format!("{field} is required")))
}

/// Reads an optional string field; any other type is an error.
pub(crate) fn opt_str(data: &Value, field: &str) -> Result<Option<String>, ApiError> {
    match data.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(value)) => Ok(Some(value.clone())),
        Some(_) => Err(ApiError::invalid("INVALID_FIELD", format!("{field} must be a string"))),
    }
}
