//! A mock LLM at the network edge, the one stand-in this project allows.
//!
//! It serves the Anthropic Messages API (`POST /v1/messages`) and the OpenAI
//! Chat Completions API (`POST /v1/chat/completions`) on one loopback port,
//! speaking their real streaming wire formats, with configurable latency,
//! reply length and failures. Tests and benchmarks point the real drivers at it.
//!
//! A request can override the behaviour with a directive anywhere in the text
//! of its last user message, e.g.
//! `[mock tokens=50 interval_ms=20 first_ms=100 fail=429|malformed|drop:3|hang reply="..."]`;
//! a directive that does not parse is ignored.
//!
//! Tool calls are scripted the same way: `[mock call=write_file:{"path":"a"}
//! call='run_command:{"command": "cat a"}' rounds=1]` makes the reply call
//! those tools (in one reply, in order), for `rounds` replies; a call named
//! with its round, `call='2:run_command:{…}'`, is made by that reply only
//! (one script, each reply its calls). Once the tools' results are in the
//! conversation the reply is text, by default `Tool results: <result> | <result>`
//! (the last round's). A request that leaves a tool call
//! without its result (or a result without its call) is refused with a 400,
//! as the real APIs refuse it.

mod tools;

pub use tools::MockToolCall;

use std::collections::VecDeque;
use std::net::{Ipv4Addr, SocketAddr};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The largest request body accepted, as large as the real APIs take, so that
/// attachments pass.
const MAX_BODY: usize = 32 * 1024 * 1024;

/// Which API a request spoke.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MockApi {
    Anthropic,
    OpenAi,
}

/// A request as the mock received it.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    pub api: MockApi,
    /// The parsed JSON body, `Null` when the body was not JSON.
    pub body: Value,
    /// The key from `x-api-key` (Anthropic) or `authorization: Bearer` (OpenAI).
    pub api_key: Option<String>,
    /// The `anthropic-version` header.
    pub anthropic_version: Option<String>,
}

/// Stands in a reply for the request's system prompt, so that agents with
/// different prompts answer differently.
pub const SYSTEM_PLACEHOLDER: &str = "{system}";

/// The system prompt of a request, as one string (empty when none).
fn system_prompt(api: MockApi, body: &Value) -> String {
    let system = match api {
        MockApi::Anthropic => body.get("system"),
        MockApi::OpenAi => body
            .get("messages")
            .and_then(Value::as_array)
            .and_then(|messages| messages.iter().find(|message| message["role"] == "system"))
            .and_then(|message| message.get("content")),
    };
    match system {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .filter_map(|block| block.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// How the mock answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MockBehavior {
    /// The reply, streamed a word (with its trailing whitespace) per delta;
    /// `None` streams `tokens` deltas `mock-0 mock-1 …`. A
    /// [`SYSTEM_PLACEHOLDER`] in it stands for the request's system prompt.
    pub reply: Option<String>,
    /// How many deltas the default reply has.
    pub tokens: usize,
    /// Time between the response headers and the first delta.
    pub first_token_delay: Duration,
    /// Time between two deltas.
    pub token_interval: Duration,
    /// The input token count reported; `None` counts the whitespace-separated
    /// words of the system prompt and the messages' text.
    pub input_tokens: Option<u64>,
    /// A failure to act out instead of a normal reply.
    pub failure: Option<MockFailure>,
    /// Tools the reply calls, in one reply; none: the reply is text.
    pub tool_calls: Vec<MockToolCall>,
    /// How many replies call the tools before one answers with text.
    pub tool_rounds: usize,
    /// Calls only the tools a request offers, as a well-behaved model does
    /// (else it calls what it is told, offered or not).
    pub offered_tools_only: bool,
}

impl Default for MockBehavior {
    fn default() -> Self {
        Self {
            reply: None,
            tokens: 5,
            first_token_delay: Duration::ZERO,
            token_interval: Duration::ZERO,
            input_tokens: None,
            failure: None,
            tool_calls: Vec::new(),
            tool_rounds: 1,
            offered_tools_only: false,
        }
    }
}

impl MockBehavior {
    /// Returns the text deltas this behaviour streams (before any `max_tokens` cut).
    pub fn deltas(&self) -> Vec<String> {
        match &self.reply {
            Some(reply) => split_words(reply),
            None => (0..self.tokens)
                .map(|index| {
                    if index + 1 < self.tokens {
                        format!("mock-{index} ")
                    } else {
                        format!("mock-{index}")
                    }
                })
                .collect(),
        }
    }

    /// Returns the whole reply text this behaviour streams.
    pub fn reply_text(&self) -> String {
        self.deltas().concat()
    }
}

/// A failure the mock acts out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MockFailure {
    /// Answers with this status and an error body in the API's format (with
    /// `retry-after` on 429). A 401 body echoes the key received, as a careless
    /// provider or proxy might, so tests can check drivers never pass it on.
    Status(u16),
    /// Sends a `data:` line that is not JSON after a couple of good deltas.
    MalformedStream,
    /// Breaks the connection after this many deltas, without the final events.
    DropAfter(usize),
    /// Accepts the request and never sends a byte.
    Hang,
}

impl FromStr for MockFailure {
    type Err = String;

    /// Parses `429`, `malformed`, `drop:3` or `hang`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "malformed" => Ok(Self::MalformedStream),
            "hang" => Ok(Self::Hang),
            _ => {
                if let Some(count) = text.strip_prefix("drop:") {
                    return count
                        .parse()
                        .map(Self::DropAfter)
                        .map_err(|_| format!("bad delta count in {text:?}"));
                }
                match text.parse::<u16>() {
                    Ok(status) if (100..=999).contains(&status) => Ok(Self::Status(status)),
                    _ => Err(format!(
                        "unknown failure {text:?}: expected an HTTP status, malformed, drop:N or hang"
                    )),
                }
            }
        }
    }
}

/// Counters of what the mock did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MockStats {
    /// Requests received, valid or not.
    pub requests: usize,
    /// Streams sent to their planned end (including planned malformed or broken ones).
    pub streams_completed: usize,
    /// Streams cut short because the client went away (or the mock shut down).
    pub streams_cancelled: usize,
    /// Text deltas handed to the connection, over all streams.
    pub deltas_sent: usize,
    /// Streams being sent now.
    pub streams_open: usize,
    /// The most streams ever sent at once.
    pub most_streams_open: usize,
    /// The messages and the body's bytes of the latest request.
    pub last_messages: usize,
    pub last_body_bytes: usize,
}

/// A running mock LLM; dropping it stops it.
pub struct MockLlm {
    addr: SocketAddr,
    shared: Arc<Shared>,
    server: Option<JoinHandle<()>>,
}

struct Shared {
    behavior: Mutex<MockBehavior>,
    requests: Mutex<Vec<RecordedRequest>>,
    /// Whether requests are kept for [`MockLlm::requests`].
    recording: AtomicBool,
    stats: watch::Sender<MockStats>,
    shutdown: CancellationToken,
    next_id: AtomicU64,
}

impl MockLlm {
    /// Starts a mock on a free loopback port.
    pub async fn start(behavior: MockBehavior) -> anyhow::Result<Self> {
        Self::start_on(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), behavior).await
    }

    /// Starts a mock on `addr`.
    pub async fn start_on(addr: SocketAddr, behavior: MockBehavior) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot bind the mock LLM to {addr}"))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            behavior: Mutex::new(behavior),
            requests: Mutex::new(Vec::new()),
            recording: AtomicBool::new(true),
            stats: watch::Sender::new(MockStats::default()),
            shutdown: CancellationToken::new(),
            next_id: AtomicU64::new(1),
        });
        let router = Router::new()
            .route("/v1/messages", post(anthropic_messages))
            .route("/v1/chat/completions", post(openai_chat_completions))
            .layer(DefaultBodyLimit::max(MAX_BODY))
            .with_state(shared.clone());
        let shutdown = shared.shutdown.clone();
        let server = tokio::spawn(async move {
            // Deltas go out at once, as a real provider's do (no delayed-ACK wait).
            let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
                let _ = tcp.set_nodelay(true);
            });
            let serve = axum::serve(listener, router).with_graceful_shutdown(shutdown.cancelled_owned());
            if let Err(err) = serve.await {
                tracing::warn!(error = %err, "mock llm server failed");
            }
        });
        Ok(Self {
            addr,
            shared,
            server: Some(server),
        })
    }

    /// Returns the address the mock listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Returns the base URL for the Anthropic driver (`http://127.0.0.1:PORT`).
    pub fn anthropic_base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Returns the base URL for the OpenAI driver (`http://127.0.0.1:PORT/v1`).
    pub fn openai_base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Replaces the behaviour for the requests that follow.
    pub fn set_behavior(&self, behavior: MockBehavior) {
        *self.shared.behavior.lock().unwrap_or_else(PoisonError::into_inner) = behavior;
    }

    /// Keeps (the default) or stops keeping the requests received: a
    /// long-running mock (the `mock-llm` binary, a benchmark) would
    /// otherwise hold every request it ever served, growing histories included.
    pub fn set_recording(&self, recording: bool) {
        self.shared.recording.store(recording, Ordering::Relaxed);
        if !recording {
            self.shared
                .requests
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clear();
        }
    }

    /// Returns the requests received so far, oldest first.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Returns the counters.
    pub fn stats(&self) -> MockStats {
        *self.shared.stats.borrow()
    }

    /// Waits until `n` requests have arrived and returns them all.
    pub async fn wait_for_requests(&self, n: usize, timeout: Duration) -> anyhow::Result<Vec<RecordedRequest>> {
        self.wait_for_stats(|stats| stats.requests >= n, timeout)
            .await
            .with_context(|| format!("waiting for {n} requests"))?;
        Ok(self.requests())
    }

    /// Waits until `n` streams have been cut short by their client going away.
    pub async fn wait_for_cancelled(&self, n: usize, timeout: Duration) -> anyhow::Result<MockStats> {
        self.wait_for_stats(|stats| stats.streams_cancelled >= n, timeout)
            .await
            .with_context(|| format!("waiting for {n} cancelled streams"))
    }

    /// Waits until the counters satisfy `condition` and returns them.
    pub async fn wait_for_stats(
        &self,
        condition: impl Fn(&MockStats) -> bool,
        timeout: Duration,
    ) -> anyhow::Result<MockStats> {
        let mut stats = self.shared.stats.subscribe();
        match tokio::time::timeout(timeout, stats.wait_for(|stats| condition(stats))).await {
            Ok(Ok(stats)) => Ok(*stats),
            Ok(Err(_)) => anyhow::bail!("the mock LLM stopped"),
            Err(_) => anyhow::bail!(
                "the mock LLM did not reach the expected state within {timeout:?}: {:?}",
                self.stats()
            ),
        }
    }

    /// Stops the mock: ends hanging requests and streams, and waits for the server.
    pub async fn shutdown(mut self) {
        self.shared.shutdown.cancel();
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
    }
}

impl Drop for MockLlm {
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
    }
}

impl Shared {
    fn update(&self, change: impl FnOnce(&mut MockStats)) {
        self.stats.send_modify(change);
    }
}

async fn anthropic_messages(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    answer(shared, MockApi::Anthropic, &headers, &body).await
}

async fn openai_chat_completions(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    answer(shared, MockApi::OpenAi, &headers, &body).await
}

async fn answer(shared: Arc<Shared>, api: MockApi, headers: &HeaderMap, body: &[u8]) -> Response {
    let json = serde_json::from_slice::<Value>(body).ok();
    let header_text = |name: &str| {
        headers
            .get(name)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned)
    };
    let api_key = match api {
        MockApi::Anthropic => header_text("x-api-key"),
        MockApi::OpenAi => {
            header_text("authorization").map(|value| value.strip_prefix("Bearer ").unwrap_or(&value).to_owned())
        }
    };
    if shared.recording.load(Ordering::Relaxed) {
        shared
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(RecordedRequest {
                api,
                body: json.clone().unwrap_or(Value::Null),
                api_key: api_key.clone(),
                anthropic_version: header_text("anthropic-version"),
            });
    }
    let messages = json
        .as_ref()
        .and_then(|body| body.get("messages"))
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    shared.update(|stats| {
        stats.requests += 1;
        stats.last_messages = messages;
        stats.last_body_bytes = body.len();
    });
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);

    let mut behavior = shared.behavior.lock().unwrap_or_else(PoisonError::into_inner).clone();
    if let Some(directive) = json
        .as_ref()
        .and_then(|body| last_user_text(api, body))
        .as_deref()
        .and_then(Directive::find)
    {
        directive.apply(&mut behavior);
    }
    match behavior.failure {
        Some(MockFailure::Hang) => {
            shared.shutdown.cancelled().await;
            return error_response(api, 503, "the mock is shutting down", id);
        }
        Some(MockFailure::Status(status)) => {
            let message = match status {
                401 => format!("invalid API key: {}", api_key.as_deref().unwrap_or("(none)")),
                429 => "rate limited by the mock; retry later".to_owned(),
                529 => "Overloaded".to_owned(),
                _ => format!("mock failure with HTTP {status}"),
            };
            return error_response(api, status, &message, id);
        }
        _ => {}
    }
    let Some(json) = json else {
        return error_response(api, 400, "the request body is not valid JSON", id);
    };
    if let Err(message) = validate(api, headers, &json).and_then(|()| tools::check_pairing(api, &json)) {
        return error_response(api, 400, &message, id);
    }
    let progress = tools::progress(api, &json);
    let offered = tools::offered(api, &json);
    let calls = tools::calls_for(&behavior.tool_calls, behavior.tool_rounds, progress.rounds)
        .map(|calls| {
            calls
                .into_iter()
                .filter(|call| !behavior.offered_tools_only || offered.contains(&call.name))
                .collect::<Vec<_>>()
        })
        .filter(|calls| !calls.is_empty());
    if behavior.reply.is_none() && !progress.results.is_empty() {
        behavior.reply = Some(format!("Tool results: {}", progress.results.join(" | ")));
    }
    if let Some(reply) = behavior.reply.as_mut()
        && reply.contains(SYSTEM_PLACEHOLDER)
    {
        *reply = reply.replace(SYSTEM_PLACEHOLDER, &system_prompt(api, &json));
    }
    let steps = match (api, calls) {
        (MockApi::Anthropic, None) => anthropic_stream(&json, &behavior, id),
        (MockApi::OpenAi, None) => openai_stream(&json, &behavior, id),
        (MockApi::Anthropic, Some(calls)) => anthropic_tool_stream(&json, &behavior, &calls, id),
        (MockApi::OpenAi, Some(calls)) => openai_tool_stream(&json, &behavior, &calls, id),
    };
    let body = Body::from_stream(body_stream(shared, steps));
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// Checks what the real APIs check before streaming.
fn validate(api: MockApi, headers: &HeaderMap, body: &Value) -> Result<(), String> {
    if !body.is_object() {
        return Err("the request body must be a JSON object".to_owned());
    }
    if body.get("model").and_then(Value::as_str).is_none_or(str::is_empty) {
        return Err("model: Field required".to_owned());
    }
    let Some(messages) = body.get("messages").and_then(Value::as_array) else {
        return Err("messages: Field required".to_owned());
    };
    if messages.is_empty() {
        return Err("messages: at least one message is required".to_owned());
    }
    let roles: &[&str] = match api {
        MockApi::Anthropic => &["user", "assistant"],
        MockApi::OpenAi => &["system", "developer", "user", "assistant", "tool"],
    };
    for (index, message) in messages.iter().enumerate() {
        let role = message.get("role").and_then(Value::as_str).unwrap_or_default();
        if !roles.contains(&role) {
            return Err(format!("messages.{index}.role: unexpected role {role:?}"));
        }
        if message.get("content").is_none() {
            return Err(format!("messages.{index}.content: Field required"));
        }
    }
    if api == MockApi::Anthropic {
        if !headers.contains_key("anthropic-version") {
            return Err("anthropic-version: header is required".to_owned());
        }
        if body
            .get("max_tokens")
            .and_then(Value::as_u64)
            .is_none_or(|max| max == 0)
        {
            return Err("max_tokens: Field required".to_owned());
        }
    }
    if body.get("stream").and_then(Value::as_bool) != Some(true) {
        return Err("this mock serves streaming requests only: set \"stream\": true".to_owned());
    }
    Ok(())
}

fn error_response(api: MockApi, status: u16, message: &str, id: u64) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let code = status.as_u16();
    let body = match api {
        MockApi::Anthropic => {
            let kind = match code {
                401 => "authentication_error",
                403 => "permission_error",
                404 => "not_found_error",
                413 => "request_too_large",
                429 => "rate_limit_error",
                529 => "overloaded_error",
                400..=499 => "invalid_request_error",
                _ => "api_error",
            };
            json!({"type": "error", "error": {"type": kind, "message": message}, "request_id": format!("req_mock_{id}")})
        }
        MockApi::OpenAi => {
            let (kind, error_code) = match code {
                401 => ("invalid_request_error", Value::from("invalid_api_key")),
                404 => ("invalid_request_error", Value::from("model_not_found")),
                429 => ("requests", Value::from("rate_limit_exceeded")),
                400..=499 => ("invalid_request_error", Value::Null),
                _ => ("server_error", Value::Null),
            };
            json!({"error": {"message": message, "type": kind, "param": null, "code": error_code}})
        }
    };
    let mut response = (status, axum::Json(body)).into_response();
    if code == 429 {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

/// One piece of a planned stream.
enum Frame {
    /// Protocol framing around the text.
    Event(Bytes),
    /// A text delta, counted in the stats.
    Delta(Bytes),
    /// Breaks the connection.
    Abort,
}

struct Step {
    delay: Duration,
    frame: Frame,
}

/// The deltas a request gets, the stop reason, and where a failure cuts in.
struct Reply {
    deltas: Vec<String>,
    truncated: bool,
    input_tokens: u64,
    first_token_delay: Duration,
    token_interval: Duration,
    failure: Option<MockFailure>,
}

impl Reply {
    fn new(body: &Value, behavior: &MockBehavior, max_tokens: Option<u64>) -> Self {
        let mut deltas = behavior.deltas();
        let limit = max_tokens
            .and_then(|max| usize::try_from(max).ok())
            .unwrap_or(usize::MAX);
        let truncated = deltas.len() > limit;
        deltas.truncate(limit);
        Self {
            deltas,
            truncated,
            input_tokens: behavior.input_tokens.unwrap_or_else(|| count_words(body)),
            first_token_delay: behavior.first_token_delay,
            token_interval: behavior.token_interval,
            failure: behavior.failure.clone(),
        }
    }

    /// Appends the delta frames built by `frame` and the failure, if any;
    /// returns whether the stream goes on to its normal end.
    fn push_deltas(&self, steps: &mut Vec<Step>, frame: impl Fn(&str) -> Bytes, malformed: &'static str) -> bool {
        let cut = match self.failure {
            Some(MockFailure::MalformedStream) => Some(2.min(self.deltas.len())),
            Some(MockFailure::DropAfter(count)) => Some(count.min(self.deltas.len())),
            _ => None,
        };
        for (index, delta) in self.deltas.iter().enumerate() {
            if cut == Some(index) {
                break;
            }
            let delay = if index == 0 {
                self.first_token_delay
            } else {
                self.token_interval
            };
            steps.push(Step {
                delay,
                frame: Frame::Delta(frame(delta)),
            });
        }
        let delay = if self.deltas.is_empty() {
            self.first_token_delay
        } else {
            self.token_interval
        };
        match self.failure {
            Some(MockFailure::MalformedStream) => {
                steps.push(Step {
                    delay,
                    frame: Frame::Event(Bytes::from_static(malformed.as_bytes())),
                });
                false
            }
            Some(MockFailure::DropAfter(_)) => {
                steps.push(Step {
                    delay: Duration::ZERO,
                    frame: Frame::Abort,
                });
                false
            }
            _ => true,
        }
    }
}

fn sse_event(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

fn sse_data(data: &Value) -> Bytes {
    Bytes::from(format!("data: {data}\n\n"))
}

/// Plans the Messages stream: `message_start`, `content_block_start`, `ping`,
/// `content_block_delta`×n, `content_block_stop`, `message_delta`, `message_stop`.
fn anthropic_stream(body: &Value, behavior: &MockBehavior, id: u64) -> Vec<Step> {
    let model = body["model"].as_str().unwrap_or_default();
    let reply = Reply::new(body, behavior, body["max_tokens"].as_u64());
    let now = |frame| Step {
        delay: Duration::ZERO,
        frame: Frame::Event(frame),
    };
    let mut steps = vec![
        now(sse_event(
            "message_start",
            &json!({"type": "message_start", "message": {
                "id": format!("msg_mock_{id}"), "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": reply.input_tokens, "cache_creation_input_tokens": 0,
                          "cache_read_input_tokens": 0, "output_tokens": 1},
            }}),
        )),
        now(sse_event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        )),
        now(sse_event("ping", &json!({"type": "ping"}))),
    ];
    let delta = |text: &str| {
        sse_event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}),
        )
    };
    let malformed = "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_del\n\n";
    if reply.push_deltas(&mut steps, delta, malformed) {
        let stop_reason = if reply.truncated { "max_tokens" } else { "end_turn" };
        steps.push(Step {
            delay: reply.token_interval,
            frame: Frame::Event(sse_event(
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": 0}),
            )),
        });
        steps.push(now(sse_event(
            "message_delta",
            &json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": null},
                    "usage": {"output_tokens": reply.deltas.len()}}),
        )));
        steps.push(now(sse_event("message_stop", &json!({"type": "message_stop"}))));
    }
    steps
}

/// Plans the Chat Completions stream: a role chunk, content chunks, a chunk
/// with the finish reason, the usage chunk when asked for, and `[DONE]`.
fn openai_stream(body: &Value, behavior: &MockBehavior, id: u64) -> Vec<Step> {
    let model = body["model"].as_str().unwrap_or_default().to_owned();
    let max_tokens = body["max_completion_tokens"]
        .as_u64()
        .or_else(|| body["max_tokens"].as_u64());
    let reply = Reply::new(body, behavior, max_tokens);
    let include_usage = body["stream_options"]["include_usage"].as_bool() == Some(true);
    let chunk = move |choices: Value, usage: Value| {
        let mut chunk = json!({
            "id": format!("chatcmpl-mock-{id}"), "object": "chat.completion.chunk", "created": 1_700_000_000,
            "model": model, "system_fingerprint": null, "choices": choices,
        });
        if include_usage {
            chunk["usage"] = usage;
        }
        sse_data(&chunk)
    };
    let choice = |delta: Value, finish_reason: Value| json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}]);
    let now = |frame| Step {
        delay: Duration::ZERO,
        frame: Frame::Event(frame),
    };
    let mut steps = vec![now(chunk(
        choice(
            json!({"role": "assistant", "content": "", "refusal": null}),
            Value::Null,
        ),
        Value::Null,
    ))];
    let delta = |text: &str| chunk(choice(json!({"content": text}), Value::Null), Value::Null);
    let malformed = "data: {\"id\":\"chatcmpl-mock\",\"object\":\"chat.completion.chu\n\n";
    if reply.push_deltas(&mut steps, delta, malformed) {
        let finish_reason = if reply.truncated { "length" } else { "stop" };
        steps.push(Step {
            delay: reply.token_interval,
            frame: Frame::Event(chunk(choice(json!({}), json!(finish_reason)), Value::Null)),
        });
        if include_usage {
            let output = reply.deltas.len() as u64;
            let usage = json!({"prompt_tokens": reply.input_tokens, "completion_tokens": output,
                               "total_tokens": reply.input_tokens + output});
            steps.push(now(chunk(json!([]), usage)));
        }
        steps.push(now(Bytes::from_static(b"data: [DONE]\n\n")));
    }
    steps
}

/// Plans a Messages reply that calls `calls`: a `tool_use` block each, its
/// input in `input_json_delta` pieces, and `stop_reason: tool_use`.
fn anthropic_tool_stream(body: &Value, behavior: &MockBehavior, calls: &[MockToolCall], id: u64) -> Vec<Step> {
    let model = body["model"].as_str().unwrap_or_default();
    let input_tokens = behavior.input_tokens.unwrap_or_else(|| count_words(body));
    let step = |delay, name: &str, data: Value| Step {
        delay,
        frame: Frame::Event(sse_event(name, &data)),
    };
    let mut steps = vec![step(
        Duration::ZERO,
        "message_start",
        json!({"type": "message_start", "message": {
            "id": format!("msg_mock_{id}"), "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": input_tokens, "output_tokens": 1},
        }}),
    )];
    let mut pieces_sent = 0;
    for (index, call) in calls.iter().enumerate() {
        let delay = if index == 0 {
            behavior.first_token_delay
        } else {
            behavior.token_interval
        };
        steps.push(step(delay, "content_block_start", json!({"type": "content_block_start", "index": index,
            "content_block": {"type": "tool_use", "id": format!("toolu_mock_{id}_{index}"), "name": call.name, "input": {}}})));
        for piece in tools::input_pieces(&call.input) {
            pieces_sent += 1;
            steps.push(step(
                behavior.token_interval,
                "content_block_delta",
                json!({"type": "content_block_delta",
                "index": index, "delta": {"type": "input_json_delta", "partial_json": piece}}),
            ));
        }
        steps.push(step(
            Duration::ZERO,
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ));
    }
    steps.push(step(
        Duration::ZERO,
        "message_delta",
        json!({"type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": pieces_sent}}),
    ));
    steps.push(step(Duration::ZERO, "message_stop", json!({"type": "message_stop"})));
    steps
}

/// Plans a Chat Completions reply that calls `calls`: a `tool_calls` delta
/// naming each, its arguments in pieces, and `finish_reason: tool_calls`.
fn openai_tool_stream(body: &Value, behavior: &MockBehavior, calls: &[MockToolCall], id: u64) -> Vec<Step> {
    let model = body["model"].as_str().unwrap_or_default();
    let input_tokens = behavior.input_tokens.unwrap_or_else(|| count_words(body));
    let include_usage = body["stream_options"]["include_usage"].as_bool() == Some(true);
    let chunk = |choices: Value, usage: Value| {
        let mut chunk = json!({"id": format!("chatcmpl-mock-{id}"), "object": "chat.completion.chunk",
            "created": 1_700_000_000, "model": model, "choices": choices});
        if include_usage {
            chunk["usage"] = usage;
        }
        sse_data(&chunk)
    };
    let delta = |delta: Value, finish: Value| json!([{"index": 0, "delta": delta, "finish_reason": finish}]);
    let step = |delay, frame| Step {
        delay,
        frame: Frame::Event(frame),
    };
    let mut steps = vec![step(
        Duration::ZERO,
        chunk(
            delta(json!({"role": "assistant", "content": null}), Value::Null),
            Value::Null,
        ),
    )];
    let mut pieces_sent = 0_u64;
    for (index, call) in calls.iter().enumerate() {
        let delay = if index == 0 {
            behavior.first_token_delay
        } else {
            behavior.token_interval
        };
        let named = json!({"tool_calls": [{"index": index, "id": format!("call_mock_{id}_{index}"), "type": "function",
            "function": {"name": call.name, "arguments": ""}}]});
        steps.push(step(delay, chunk(delta(named, Value::Null), Value::Null)));
        for piece in tools::input_pieces(&call.input) {
            pieces_sent += 1;
            let more = json!({"tool_calls": [{"index": index, "function": {"arguments": piece}}]});
            steps.push(step(
                behavior.token_interval,
                chunk(delta(more, Value::Null), Value::Null),
            ));
        }
    }
    steps.push(step(
        Duration::ZERO,
        chunk(delta(json!({}), json!("tool_calls")), Value::Null),
    ));
    if include_usage {
        let usage = json!({"prompt_tokens": input_tokens, "completion_tokens": pieces_sent,
            "total_tokens": input_tokens + pieces_sent});
        steps.push(step(Duration::ZERO, chunk(json!([]), usage)));
    }
    steps.push(step(Duration::ZERO, Bytes::from_static(b"data: [DONE]\n\n")));
    steps
}

/// Counts the stream's outcome when the body is dropped: at its planned end,
/// or early because the client went away.
struct StreamGuard {
    shared: Arc<Shared>,
    finished: bool,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let finished = self.finished;
        self.shared.update(|stats| {
            stats.streams_open -= 1;
            if finished {
                stats.streams_completed += 1;
            } else {
                stats.streams_cancelled += 1;
            }
        });
    }
}

/// Plays the planned steps with real timers; the connection's end drops the
/// stream, which the guard records.
fn body_stream(
    shared: Arc<Shared>,
    steps: Vec<Step>,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    shared.update(|stats| {
        stats.streams_open += 1;
        stats.most_streams_open = stats.most_streams_open.max(stats.streams_open);
    });
    let guard = StreamGuard {
        shared,
        finished: false,
    };
    futures::stream::unfold((VecDeque::from(steps), guard), |(mut steps, mut guard)| async move {
        let step = steps.pop_front()?;
        if !step.delay.is_zero() {
            tokio::select! {
                () = tokio::time::sleep(step.delay) => {}
                () = guard.shared.shutdown.cancelled() => {
                    return Some((Err(std::io::Error::other("the mock is shutting down")), (VecDeque::new(), guard)));
                }
            }
        }
        // Once the last frame is handed to the connection the plan is done,
        // whether or not the client reads on to the end of the body.
        guard.finished = steps.is_empty();
        let item = match step.frame {
            Frame::Event(bytes) => Ok(bytes),
            Frame::Delta(bytes) => {
                guard.shared.update(|stats| stats.deltas_sent += 1);
                Ok(bytes)
            }
            Frame::Abort => {
                // Yielding once lets the server flush what is buffered (it
                // flushes while the body is pending), so the client gets every
                // delta sent before the break, as over a real network.
                tokio::task::yield_now().await;
                guard.finished = true;
                steps.clear();
                Err(std::io::Error::other("the mock breaks the connection, as asked"))
            }
        };
        Some((item, (steps, guard)))
    })
}

/// Returns the text of the last message the user typed (string content or
/// text parts), passing over messages that only carry tool results.
fn last_user_text(api: MockApi, body: &Value) -> Option<String> {
    let message = body["messages"]
        .as_array()?
        .iter()
        .rev()
        .find(|message| tools::is_user_text(api, message))?;
    Some(content_texts(&message["content"]).collect::<Vec<_>>().join("\n"))
}

fn content_texts(content: &Value) -> Box<dyn Iterator<Item = &str> + '_> {
    match content {
        Value::String(text) => Box::new(std::iter::once(text.as_str())),
        Value::Array(parts) => Box::new(parts.iter().filter_map(|part| part.get("text").and_then(Value::as_str))),
        _ => Box::new(std::iter::empty()),
    }
}

/// Counts the whitespace-separated words of the system prompt and of every message's text.
fn count_words(body: &Value) -> u64 {
    let system = content_texts(&body["system"]);
    let messages = body["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|message| content_texts(&message["content"]));
    system
        .chain(messages)
        .map(|text| text.split_whitespace().count() as u64)
        .sum()
}

/// Splits `text` into words, each with the whitespace that follows it.
fn split_words(text: &str) -> Vec<String> {
    let mut pieces = Vec::new();
    let mut current = String::new();
    let mut in_space = false;
    for ch in text.chars() {
        if ch.is_whitespace() {
            in_space = !current.is_empty();
        } else if in_space {
            pieces.push(std::mem::take(&mut current));
            in_space = false;
        }
        current.push(ch);
    }
    if !current.is_empty() {
        pieces.push(current);
    }
    pieces
}

/// Per-request overrides: `[mock key=value …]`.
#[derive(Debug, Default, PartialEq)]
struct Directive {
    tokens: Option<usize>,
    first_token_delay: Option<Duration>,
    token_interval: Option<Duration>,
    input_tokens: Option<u64>,
    failure: Option<MockFailure>,
    reply: Option<String>,
    tool_calls: Vec<MockToolCall>,
    tool_rounds: Option<usize>,
}

impl Directive {
    /// Returns the first well-formed directive in `text`.
    fn find(text: &str) -> Option<Self> {
        let mut rest = text;
        while let Some(start) = rest.find("[mock") {
            let after = &rest[start + "[mock".len()..];
            if after.starts_with(|ch: char| ch.is_whitespace() || ch == ']')
                && let Some(directive) = Self::parse(after)
            {
                return Some(directive);
            }
            rest = after;
        }
        None
    }

    /// Parses `key=value …]`, where a value is a bare word or a string quoted
    /// with `"` or `'` and `\` escapes; any unknown key or bad value rejects it all.
    fn parse(text: &str) -> Option<Self> {
        let mut directive = Self::default();
        let mut chars = text.chars().peekable();
        loop {
            while chars.next_if(|ch| ch.is_whitespace()).is_some() {}
            match chars.peek() {
                Some(']') => return Some(directive),
                None => return None,
                Some(_) => {}
            }
            let mut key = String::new();
            while let Some(ch) = chars.next_if(|ch| *ch != '=' && *ch != ']' && !ch.is_whitespace()) {
                key.push(ch);
            }
            chars.next_if_eq(&'=')?;
            let mut value = String::new();
            if let Some(quote) = chars.next_if(|ch| *ch == '"' || *ch == '\'') {
                loop {
                    match chars.next()? {
                        ch if ch == quote => break,
                        '\\' => value.push(chars.next()?),
                        ch => value.push(ch),
                    }
                }
            } else {
                while let Some(ch) = chars.next_if(|ch| *ch != ']' && !ch.is_whitespace()) {
                    value.push(ch);
                }
            }
            let millis = |value: &str| value.parse::<u64>().ok().map(Duration::from_millis);
            match key.as_str() {
                "tokens" => directive.tokens = Some(value.parse().ok()?),
                "interval_ms" => directive.token_interval = Some(millis(&value)?),
                "first_ms" => directive.first_token_delay = Some(millis(&value)?),
                "input_tokens" => directive.input_tokens = Some(value.parse().ok()?),
                "fail" => directive.failure = Some(value.parse().ok()?),
                "reply" => directive.reply = Some(value),
                "call" => directive.tool_calls.push(value.parse().ok()?),
                "rounds" => directive.tool_rounds = Some(value.parse().ok()?),
                _ => return None,
            }
        }
    }

    fn apply(self, behavior: &mut MockBehavior) {
        if let Some(tokens) = self.tokens {
            behavior.tokens = tokens;
            behavior.reply = None;
        }
        if let Some(reply) = self.reply {
            behavior.reply = Some(reply);
        }
        if let Some(delay) = self.first_token_delay {
            behavior.first_token_delay = delay;
        }
        if let Some(interval) = self.token_interval {
            behavior.token_interval = interval;
        }
        if let Some(input_tokens) = self.input_tokens {
            behavior.input_tokens = Some(input_tokens);
        }
        if let Some(failure) = self.failure {
            behavior.failure = Some(failure);
        }
        if !self.tool_calls.is_empty() {
            behavior.tool_calls = self.tool_calls;
        }
        if let Some(rounds) = self.tool_rounds {
            behavior.tool_rounds = rounds;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_directives() {
        let directive =
            Directive::find(r#"hello [mock tokens=50 interval_ms=20 first_ms=100 fail=drop:3 reply="a \"b\" ]c"] bye"#)
                .unwrap();
        assert_eq!(
            directive,
            Directive {
                tokens: Some(50),
                first_token_delay: Some(Duration::from_millis(100)),
                token_interval: Some(Duration::from_millis(20)),
                input_tokens: None,
                failure: Some(MockFailure::DropAfter(3)),
                reply: Some("a \"b\" ]c".to_owned()),
                ..Directive::default()
            }
        );
        let tools =
            Directive::find(r#"[mock call=list_files call='run_command:{"command": "cat a"}' rounds=2]"#).unwrap();
        assert_eq!(tools.tool_rounds, Some(2));
        assert_eq!(
            tools.tool_calls,
            vec![
                MockToolCall {
                    name: "list_files".into(),
                    input: json!({}),
                    round: 1,
                },
                MockToolCall {
                    name: "run_command".into(),
                    input: json!({"command": "cat a"}),
                    round: 1,
                },
            ]
        );
        assert_eq!(Directive::find("[mock call=x:notjson]"), None);
        assert_eq!(
            Directive::find("[mock fail=429]").unwrap().failure,
            Some(MockFailure::Status(429))
        );
        assert_eq!(Directive::find("[mock]"), Some(Directive::default()));
        assert_eq!(Directive::find("[mockery tokens=1]"), None);
        assert_eq!(Directive::find("[mock tokens=many]"), None);
        assert_eq!(Directive::find("[mock colour=red]"), None);
        assert_eq!(Directive::find("[mock tokens=1"), None);
        assert_eq!(Directive::find("[mock reply=\"open]"), None);
        assert_eq!(
            Directive::find("[mock oops] then [mock tokens=2]").unwrap().tokens,
            Some(2)
        );
    }

    #[test]
    fn parses_failures() {
        assert_eq!("500".parse(), Ok(MockFailure::Status(500)));
        assert_eq!("malformed".parse(), Ok(MockFailure::MalformedStream));
        assert_eq!("drop:0".parse(), Ok(MockFailure::DropAfter(0)));
        assert_eq!("hang".parse(), Ok(MockFailure::Hang));
        assert!("drop:x".parse::<MockFailure>().is_err());
        assert!("42".parse::<MockFailure>().is_err());
    }

    #[test]
    fn splits_replies_and_counts_words() {
        assert_eq!(split_words(" a  b\n"), vec![" a  ", "b\n"]);
        assert_eq!(
            MockBehavior::default().reply_text(),
            "mock-0 mock-1 mock-2 mock-3 mock-4"
        );
        let body = json!({"system": "one two", "messages": [
            {"role": "user", "content": "three"},
            {"role": "user", "content": [{"type": "text", "text": "four five"}, {"type": "image"}]},
        ]});
        assert_eq!(count_words(&body), 5);
        assert_eq!(last_user_text(MockApi::Anthropic, &body).as_deref(), Some("four five"));
    }
}
