//! Shared steps of the end-to-end suites.

use anyhow::Context;
use avm_common::event::{Event, EventKind};
use avm_tests::cluster::{Cluster, Mode, Options};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

/// Runs an async test body against both cluster modes.
#[macro_export]
macro_rules! both_modes {
    ($name:ident, $body:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn one_process() -> anyhow::Result<()> {
                super::$body(avm_tests::cluster::Mode::OneProcess).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn per_component() -> anyhow::Result<()> {
                super::$body(avm_tests::cluster::Mode::PerComponent).await
            }
        }
    };
}

/// A conversation ready to talk to: container, image and subscription.
pub struct Conversation {
    pub image_id: String,
    pub session_id: String,
    pub record: Value,
}

/// Starts a cluster with default options.
pub async fn cluster(mode: Mode) -> anyhow::Result<Cluster> {
    Cluster::start(mode, Options::default()).await
}

/// Creates a container and an image in it, and subscribes to its session.
pub async fn conversation(client: &mut WsClient, container_id: &str, config: Value) -> anyhow::Result<Conversation> {
    let created = client
        .request("container_create", json!({"containerId": container_id}))
        .await?;
    anyhow::ensure!(
        created["containerId"] == container_id,
        "container_create answered {created}"
    );
    let image = client
        .request("image_create", json!({"containerId": container_id, "config": config}))
        .await?;
    anyhow::ensure!(image.get("error").is_none(), "image_create failed: {image}");
    let session_id = image["__subscriptions"][0].as_str().unwrap_or_default().to_owned();
    let record = image["record"].clone();
    anyhow::ensure!(
        record["sessionId"] == session_id.as_str(),
        "subscriptions do not name the session: {image}"
    );
    client.subscribe(&session_id, None).await?;
    Ok(Conversation {
        image_id: record["imageId"].as_str().unwrap_or_default().to_owned(),
        session_id,
        record,
    })
}

/// Returns the `type` of each frame.
pub fn types(frames: &[Value]) -> Vec<String> {
    frames
        .iter()
        .map(|frame| frame["type"].as_str().unwrap_or("?").to_owned())
        .collect()
}

/// Returns the concatenated `text_delta` texts.
pub fn streamed_text(frames: &[Value]) -> String {
    frames
        .iter()
        .filter(|f| f["type"] == "text_delta")
        .filter_map(|f| f["data"]["text"].as_str())
        .collect()
}

/// Returns the text of the `assistant_message` among the frames.
pub fn assistant_text(frames: &[Value]) -> Option<String> {
    let message = frames.iter().find(|f| f["type"] == "assistant_message")?;
    let parts = message["data"]["content"].as_array()?;
    Some(parts.iter().filter_map(|part| part["text"].as_str()).collect())
}

/// Sends a message and returns every frame up to the end of the turn,
/// starting with the ones before the response (in arrival order); each
/// event among them one of the protocol's, exactly.
pub async fn send_and_finish(client: &mut WsClient, image_id: &str, content: Value) -> anyhow::Result<Vec<Value>> {
    client
        .send_request("message_send", json!({"imageId": image_id, "content": content}))
        .await?;
    let frames = client.turn().await?;
    assert_typed_events(&frames);
    Ok(frames)
}

/// Asserts that every event frame is one of the protocol's events with its
/// envelope and exactly its fields: its `data` reads as the event's typed
/// payload and writes back the same.
pub fn assert_typed_events(frames: &[Value]) {
    for frame in frames {
        let name = frame["type"].as_str().unwrap_or_default();
        if name.ends_with("_response") {
            continue;
        }
        let kind = EventKind::parse(name).unwrap_or_else(|| panic!("{name:?} is no event: {frame}"));
        assert_eq!(frame["source"], kind.source(), "{frame}");
        assert_eq!(frame["category"], kind.category(), "{frame}");
        let event = Event::decode(kind, &frame["data"].to_string()).unwrap_or_else(|e| panic!("{name}: {e}: {frame}"));
        let again: Value =
            serde_json::from_str(&event.data_json()).unwrap_or_else(|e| panic!("{name} wrote bad json: {e}"));
        assert_eq!(again, frame["data"], "{name} has a field its payload lacks");
    }
}

/// Asserts the protocol's order of a text-only turn and returns the reply text.
pub fn assert_text_turn(frames: &[Value]) -> String {
    let kinds = types(frames);
    let position = |kind: &str| {
        kinds
            .iter()
            .position(|k| k == kind)
            .unwrap_or_else(|| panic!("no {kind} in {kinds:?}"))
    };
    let response = position("message_send_response");
    let start = position("message_start");
    assert!(
        position("message_persisted") < response,
        "persisted before the response: {kinds:?}"
    );
    assert!(response < start, "response before any stream event: {kinds:?}");
    assert!(start < position("conversation_start"));
    assert!(position("conversation_start") < position("text_delta"));
    assert!(position("message_delta") < position("message_stop"));
    assert!(position("message_stop") < position("assistant_message"));
    assert!(position("assistant_message") < position("conversation_end"));
    assert_eq!(kinds.last().map(String::as_str), Some("conversation_end"));
    for (i, kind) in kinds.iter().enumerate() {
        if kind == "text_delta" {
            assert_eq!(
                kinds.get(i + 1).map(String::as_str),
                Some("conversation_responding"),
                "{kinds:?}"
            );
        }
    }
    let usage = &frames[position("message_delta")]["data"]["usage"];
    assert!(
        usage["inputTokens"].is_u64() && usage["outputTokens"].is_u64(),
        "usage missing: {usage}"
    );
    assert_eq!(frames[position("conversation_end")]["data"]["reason"], "completed");
    let streamed = streamed_text(frames);
    assert_eq!(
        Some(streamed.clone()),
        assistant_text(frames),
        "deltas must add up to the assistant message"
    );
    streamed
}

/// Sends a JSON request with the cluster's admin key and returns the status and body.
pub async fn call(cluster: &Cluster, method: &str, path: &str, body: Option<Value>) -> anyhow::Result<(u16, Value)> {
    call_as(cluster, &cluster.admin_key, method, path, body).await
}

/// Polls `check` until it gives a value or `limit` passes.
pub async fn poll<T, F, Fut>(limit: std::time::Duration, what: &str, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(value) = check().await? {
            return Ok(value);
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Sends a JSON request with `key` and returns the status and body.
pub async fn call_as(
    cluster: &Cluster,
    key: &str,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> anyhow::Result<(u16, Value)> {
    let http = avm_tests::cluster::http_client(key)?;
    let mut request = http.request(method.parse()?, cluster.url(path));
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    let body = serde_json::from_str(&text).with_context(|| format!("{method} {path} answered {status} {text}"))?;
    Ok((status, body))
}

/// Starts `avm serve` on free ports and returns it with the stdout lines it
/// printed up to its gateway URL, and that URL.
pub async fn serve(
    data_dir: &std::path::Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> anyhow::Result<(tokio::process::Child, Vec<String>, String)> {
    use anyhow::bail;
    use tokio::io::{AsyncBufReadExt, BufReader};
    let mut command = avm_tests::cluster::avm_command()?;
    command
        .args(["serve", "--port", "0", "--grpc-port", "0", "--data-dir"])
        .arg(data_dir)
        .args(extra)
        .env("AVM_LOG_LEVEL", "warn")
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    let mut child = command.spawn()?;
    let mut lines = BufReader::new(child.stdout.take().context("no stdout")?).lines();
    let mut printed = Vec::new();
    let url = tokio::time::timeout(std::time::Duration::from_secs(20), async {
        while let Some(line) = lines.next_line().await? {
            printed.push(line.clone());
            if let Some(url) = line.strip_prefix("listening: gateway ") {
                return Ok::<_, anyhow::Error>(url.to_owned());
            }
        }
        bail!("avm serve exited before listening: {printed:?}")
    })
    .await
    .context("avm serve did not start")??;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, printed, url))
}

/// Stops a process with SIGTERM and checks it exited cleanly.
pub async fn stop(mut child: tokio::process::Child) -> anyhow::Result<()> {
    let pid = child.id().context("no pid")?;
    tokio::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await?;
    let status = tokio::time::timeout(std::time::Duration::from_secs(20), child.wait()).await??;
    anyhow::ensure!(status.success(), "avm serve exited with {status}");
    Ok(())
}

/// Server-sent events as a client reads them.
pub struct SseStream {
    body: std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
    buffer: String,
}

impl SseStream {
    pub fn new(response: reqwest::Response) -> Self {
        Self {
            body: Box::pin(response.bytes_stream()),
            buffer: String::new(),
        }
    }

    /// Returns the next event's id, type and data; fails after 15 s without one.
    pub async fn next_event(&mut self) -> anyhow::Result<(Option<String>, String, Value)> {
        use futures::StreamExt;
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(15);
        loop {
            while let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let (mut id, mut event, mut data) = (None, String::new(), String::new());
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("id: ").or_else(|| line.strip_prefix("id:")) {
                        id = Some(v.to_owned());
                    } else if let Some(v) = line.strip_prefix("event: ").or_else(|| line.strip_prefix("event:")) {
                        event = v.to_owned();
                    } else if let Some(v) = line.strip_prefix("data: ").or_else(|| line.strip_prefix("data:")) {
                        data.push_str(v);
                    }
                }
                if !event.is_empty() {
                    return Ok((id, event, serde_json::from_str(&data)?));
                }
            }
            match tokio::time::timeout_at(deadline, self.body.next()).await? {
                Some(chunk) => self.buffer.push_str(std::str::from_utf8(&chunk?)?),
                None => anyhow::bail!("the event stream ended"),
            }
        }
    }
}

/// Returns what the gRPC health service at `addr` says of `service` (the
/// empty name: the process; `ready`: its readiness).
pub async fn grpc_health(
    addr: &str,
    service: &str,
) -> anyhow::Result<tonic_health::pb::health_check_response::ServingStatus> {
    use tonic_health::pb::health_check_response::ServingStatus;
    let channel = tonic::transport::Endpoint::from_shared(addr.to_owned())?
        .connect()
        .await?;
    let answer = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.into(),
        })
        .await?
        .into_inner();
    Ok(ServingStatus::try_from(answer.status).unwrap_or(ServingStatus::Unknown))
}

/// The text of an Anthropic request's messages, in order, one string each.
pub fn request_texts(body: &Value) -> Vec<String> {
    body["messages"]
        .as_array()
        .map(|messages| {
            messages
                .iter()
                .map(|message| match &message["content"] {
                    Value::String(text) => text.clone(),
                    Value::Array(blocks) => blocks
                        .iter()
                        .filter_map(|block| block["text"].as_str())
                        .collect::<Vec<_>>()
                        .join(" "),
                    _ => String::new(),
                })
                .collect()
        })
        .unwrap_or_default()
}
