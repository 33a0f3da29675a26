//! A WebSocket client that speaks PROTOCOL.md, for tests.

use std::collections::VecDeque;
use std::time::Duration;

use anyhow::{Context, bail};
use avm_common::event::EventKind;
use futures::{SinkExt, StreamExt};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

type Socket = WebSocketStream<MaybeTlsStream<tokio::net::TcpStream>>;

/// How long a test waits for an expected frame before failing.
pub const FRAME_DEADLINE: Duration = Duration::from_secs(15);

/// A protocol client: requests match their responses by `requestId`; every
/// other frame is queued in arrival order for the test to read.
pub struct WsClient {
    socket: Socket,
    next_request: u64,
    queued: VecDeque<Value>,
    /// Close frame received, if any: (code, reason).
    pub closed: Option<(u16, String)>,
    /// Message ids of the frames that arrived wrapped for acknowledged delivery (all acknowledged).
    pub acknowledged: Vec<String>,
    /// Frames that arrived unwrapped.
    pub plain: usize,
}

impl WsClient {
    /// Connects to a `ws://…/ws` URL.
    pub async fn connect(url: &str) -> anyhow::Result<Self> {
        // Nagle off, as every socket on the path: requests go out at once.
        let (socket, _) = tokio_tungstenite::connect_async_with_config(url, None, true)
            .await
            .with_context(|| format!("connect {url}"))?;
        Ok(Self {
            socket,
            next_request: 0,
            queued: VecDeque::new(),
            closed: None,
            acknowledged: Vec::new(),
            plain: 0,
        })
    }

    /// Sends raw text.
    pub async fn send_text(&mut self, text: impl Into<String>) -> anyhow::Result<()> {
        self.socket.send(Message::text(text.into())).await?;
        Ok(())
    }

    /// Sends a JSON frame.
    pub async fn send_json(&mut self, value: &Value) -> anyhow::Result<()> {
        self.send_text(value.to_string()).await
    }

    /// Sends a binary frame.
    pub async fn send_binary(&mut self, bytes: Vec<u8>) -> anyhow::Result<()> {
        self.socket.send(Message::binary(bytes)).await?;
        Ok(())
    }

    /// Sends `<kind>_request` without waiting; returns its request id.
    pub async fn send_request(&mut self, kind: &str, mut data: Value) -> anyhow::Result<String> {
        self.next_request += 1;
        let request_id = format!("req_test_{}", self.next_request);
        data["requestId"] = Value::String(request_id.clone());
        let frame = json!({
            "type": format!("{kind}_request"),
            "timestamp": 0,
            "data": data,
            "source": "command",
            "category": "request",
            "intent": "request",
        });
        self.send_json(&frame).await?;
        Ok(request_id)
    }

    /// Sends a request and returns the `data` of its response; events that
    /// arrive meanwhile stay queued.
    pub async fn request(&mut self, kind: &str, data: Value) -> anyhow::Result<Value> {
        let request_id = self.send_request(kind, data).await?;
        self.response(&request_id).await
    }

    /// Waits for the response to `request_id` and returns its `data`.
    pub async fn response(&mut self, request_id: &str) -> anyhow::Result<Value> {
        if let Some(index) = self.queued.iter().position(|frame| is_response_to(frame, request_id)) {
            return Ok(self
                .queued
                .remove(index)
                .map(|frame| frame["data"].clone())
                .unwrap_or_default());
        }
        loop {
            let frame = self.read().await?;
            if is_response_to(&frame, request_id) {
                return Ok(frame["data"].clone());
            }
            self.queued.push_back(frame);
        }
    }

    /// Sends `subscribe` for a session (optionally after a cursor).
    pub async fn subscribe(&mut self, session_id: &str, after_cursor: Option<&str>) -> anyhow::Result<()> {
        let mut frame = json!({"type": "subscribe", "sessionId": session_id});
        if let Some(cursor) = after_cursor {
            frame["afterCursor"] = Value::String(cursor.to_owned());
        }
        self.send_json(&frame).await
    }

    /// Takes the frames queued so far (those that arrived while a response was awaited).
    pub fn take_queued(&mut self) -> Vec<Value> {
        self.queued.drain(..).collect()
    }

    /// Returns the next frame in arrival order.
    pub async fn next_frame(&mut self) -> anyhow::Result<Value> {
        match self.queued.pop_front() {
            Some(frame) => Ok(frame),
            None => self.read().await,
        }
    }

    /// Returns frames up to and including the first of type `kind`.
    pub async fn frames_until(&mut self, kind: &str) -> anyhow::Result<Vec<Value>> {
        let mut frames = Vec::new();
        loop {
            let frame = self.next_frame().await?;
            let done = frame["type"] == kind;
            frames.push(frame);
            if done {
                return Ok(frames);
            }
        }
    }

    /// Returns frames until one ends a turn (`conversation_end` or `error_occurred`).
    pub async fn turn(&mut self) -> anyhow::Result<Vec<Value>> {
        let mut frames = Vec::new();
        loop {
            let frame = self.next_frame().await?;
            let done = frame["type"]
                .as_str()
                .and_then(EventKind::parse)
                .is_some_and(EventKind::ends_turn);
            frames.push(frame);
            if done {
                return Ok(frames);
            }
        }
    }

    async fn read(&mut self) -> anyhow::Result<Value> {
        loop {
            let message = tokio::time::timeout(FRAME_DEADLINE, self.socket.next())
                .await
                .context("no frame within the deadline")?;
            match message {
                Some(Ok(Message::Text(text))) => {
                    let value: Value = serde_json::from_str(text.as_str()).context("server sent invalid JSON")?;
                    // Acknowledged delivery: unwrap and acknowledge.
                    if let Some(msg_id) = value.get("__msgId").and_then(Value::as_str) {
                        let payload = value["__payload"].as_str().context("__payload must be a string")?;
                        let inner: Value = serde_json::from_str(payload)?;
                        self.send_json(&json!({"__ack": msg_id})).await?;
                        self.acknowledged.push(msg_id.to_owned());
                        return Ok(inner);
                    }
                    self.plain += 1;
                    return Ok(value);
                }
                Some(Ok(Message::Close(frame))) => {
                    self.closed = Some(
                        frame
                            .map(|f| (u16::from(f.code), f.reason.to_string()))
                            .unwrap_or((1005, String::new())),
                    );
                    bail!("connection closed: {:?}", self.closed);
                }
                Some(Ok(_)) => continue,
                Some(Err(err)) => bail!("websocket error: {err}"),
                None => bail!("connection ended"),
            }
        }
    }
}

fn is_response_to(frame: &Value, request_id: &str) -> bool {
    frame["category"] == "response" && frame["data"]["requestId"] == request_id
}
