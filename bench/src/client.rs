//! The bench's side of the wire: REST calls and turns through a gateway,
//! and the same streaming call made straight to the mock LLM.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use futures::StreamExt;
use serde_json::{Value, json};

/// Calls one deployment's gateway as its operator admin (or, with
/// `--tokens-per-month`, as the admin of a tenant with a token quota).
#[derive(Clone)]
pub struct Api {
    pub client: reqwest::Client,
    pub url: String,
    key: String,
}

/// What a streamed turn showed the client.
pub struct Streamed {
    /// When the request was sent.
    pub sent: Instant,
    /// From sending the request to the first text delta.
    pub first: Duration,
    /// From sending the request to the last text delta.
    pub last: Duration,
    /// Between consecutive text deltas, in arrival order.
    pub gaps: Vec<Duration>,
}

impl Api {
    pub fn new(url: &str, key: &str) -> anyhow::Result<Self> {
        Ok(Self {
            client: client()?,
            url: url.to_owned(),
            key: key.to_owned(),
        })
    }

    pub fn get(&self, path: &str) -> reqwest::RequestBuilder {
        self.client.get(format!("{}{path}", self.url)).bearer_auth(&self.key)
    }

    pub fn post(&self, path: &str) -> reqwest::RequestBuilder {
        self.client.post(format!("{}{path}", self.url)).bearer_auth(&self.key)
    }

    /// Opens an HTTP/1.1 connection to the gateway, makes one request on it
    /// and returns it open and idle, as a keep-alive client leaves it between
    /// requests. The request is `GET /health`, or with `body` bytes a
    /// `POST /v1/containers` the gateway reads whole and refuses (an unknown
    /// field), so the connection has carried a body.
    pub async fn keep_alive(&self, body: usize) -> anyhow::Result<tokio::net::TcpStream> {
        use tokio::io::AsyncWriteExt;
        let authority = self.url.trim_start_matches("http://").trim_end_matches('/');
        let mut stream = tokio::net::TcpStream::connect(authority).await?;
        let (request, expected) = if body == 0 {
            (format!("GET /health HTTP/1.1\r\nhost: {authority}\r\n\r\n"), 200)
        } else {
            let body = json!({"containerId": "keep-alive", "pad": "x".repeat(body)}).to_string();
            let request = format!(
                "POST /v1/containers HTTP/1.1\r\nhost: {authority}\r\nauthorization: Bearer {}\r\n\
                 content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                self.key,
                body.len()
            );
            (request, 400)
        };
        stream.write_all(request.as_bytes()).await?;
        let (status, _) = avm_tests::raw_http::read_response(&mut stream).await?;
        ensure!(status == expected, "the keep-alive request answered {status}");
        Ok(stream)
    }

    /// The WebSocket endpoint, authenticated.
    pub fn ws_url(&self) -> String {
        format!("{}/ws?token={}", self.url.replacen("http://", "ws://", 1), self.key)
    }

    /// Makes the `bench` container unless it exists.
    /// Creates a tenant with a monthly token quota (as the operator) and
    /// returns its admin's API key.
    pub async fn tenant_with_quota(&self, tokens_per_month: u64) -> anyhow::Result<String> {
        let response = self
            .post("/v1/tenants")
            .json(&json!({"name": "bench", "limits": {"tokensPerMonth": tokens_per_month}}))
            .send()
            .await?;
        let status = response.status();
        let body: Value = response.json().await?;
        ensure!(status.is_success(), "cannot create the tenant: {status} {body}");
        body["secret"]
            .as_str()
            .map(str::to_owned)
            .context("the new tenant's key is missing")
    }

    pub async fn container(&self) -> anyhow::Result<()> {
        let response = self
            .post("/v1/containers")
            .json(&json!({"containerId": "bench"}))
            .send()
            .await?;
        let status = response.status();
        ensure!(
            status.is_success() || status == reqwest::StatusCode::CONFLICT,
            "cannot create the container: {status} {}",
            response.text().await.unwrap_or_default()
        );
        Ok(())
    }

    /// Gives the mock's model (`claude-…`) a context window of `tokens`;
    /// `false` when the deployment has no such setting (an older build).
    pub async fn set_context_window(&self, tokens: u64) -> anyhow::Result<bool> {
        let response = self
            .client
            .put(format!("{}/v1/config", self.url))
            .bearer_auth(&self.key)
            .json(&json!({"llm.contextWindows": {"claude-": tokens}}))
            .send()
            .await?;
        let status = response.status();
        if status == reqwest::StatusCode::BAD_REQUEST {
            return Ok(false);
        }
        ensure!(
            status.is_success(),
            "cannot set the context window: {status} {}",
            response.text().await.unwrap_or_default()
        );
        Ok(true)
    }

    /// Makes `count` conversations in the `bench` container.
    pub async fn images(&self, count: usize) -> anyhow::Result<Vec<String>> {
        let made = futures::stream::iter(0..count)
            .map(|_| async {
                let image: Value = self
                    .post("/v1/containers/bench/images")
                    .json(&json!({"name": "bench"}))
                    .send()
                    .await?
                    .error_for_status()?
                    .json()
                    .await?;
                Ok::<_, anyhow::Error>(image["imageId"].as_str().context("no imageId")?.to_owned())
            })
            .buffered(16)
            .collect::<Vec<_>>()
            .await;
        made.into_iter().collect()
    }

    /// Runs one turn in each image, `lanes` at a time.
    pub async fn turns(&self, images: &[String], lanes: usize) -> anyhow::Result<()> {
        let results = futures::stream::iter(images)
            .map(|image| self.turn(image))
            .buffer_unordered(lanes.max(1))
            .collect::<Vec<_>>()
            .await;
        for result in results {
            result?;
        }
        Ok(())
    }

    /// Runs one turn over REST + SSE, to its `conversation_end`.
    pub async fn turn(&self, image: &str) -> anyhow::Result<Streamed> {
        self.turn_saying(image, "hello").await
    }

    /// [`Api::turn`] with `text` as the message.
    pub async fn turn_saying(&self, image: &str, text: &str) -> anyhow::Result<Streamed> {
        let started = Instant::now();
        let response = self.send(image, text).await?;
        stream(response, started, b"event: text_delta", b"event: conversation_end").await
    }

    /// Sends a message and returns its event stream.
    ///
    /// A server that still holds the image's previous turn for a moment after
    /// its `conversation_end` (409 `AGENT_BUSY`; builds before aa2dfb0) is
    /// asked again, as a client would, and the wait counts in the figures.
    async fn send(&self, image: &str, content: &str) -> anyhow::Result<reqwest::Response> {
        let mut attempts = 0;
        let response = loop {
            let response = self
                .post(&format!("/v1/images/{image}/messages"))
                .json(&json!({ "content": content }))
                .send()
                .await?;
            attempts += 1;
            if response.status() == reqwest::StatusCode::CONFLICT && attempts < 100 {
                tokio::task::yield_now().await;
                continue;
            }
            break response;
        };
        let status = response.status();
        ensure!(
            status.is_success(),
            "{}: message refused: {status} {}",
            self.url,
            response.text().await.unwrap_or_default()
        );
        Ok(response)
    }

    /// Makes `count` conversations whose agent may call `run_command`, with
    /// network or (through a sandbox resource) without.
    pub async fn tool_images(&self, count: usize, network: bool) -> anyhow::Result<Vec<String>> {
        let mut config = json!({"name": "bench-tools", "tools": ["run_command"]});
        if !network {
            let resources = [
                json!({"kind": "sandbox", "name": "bench-offline", "version": "1.0.0",
                    "content": {"limits": {"network": false}}}),
                json!({"kind": "prompt", "name": "bench-offline", "version": "1.0.0",
                    "content": {"template": "You run commands."}}),
                json!({"kind": "agent", "name": "bench-offline", "version": "1.0.0", "content": {
                    "prompt": "resource://prompts/bench-offline@1",
                    "sandbox": "resource://sandboxes/bench-offline@1"}}),
            ];
            for resource in resources {
                let response = self.post("/v1/resources").json(&resource).send().await?;
                let status = response.status();
                ensure!(
                    status.is_success() || status == reqwest::StatusCode::CONFLICT,
                    "cannot publish {}: {status} {}",
                    resource["name"],
                    response.text().await.unwrap_or_default()
                );
            }
            config["agent"] = json!("resource://agents/bench-offline@1");
        }
        let mut images = Vec::with_capacity(count);
        for _ in 0..count {
            let image: Value = self
                .post("/v1/containers/bench/images")
                .json(&config)
                .send()
                .await?
                .error_for_status()?
                .json()
                .await?;
            images.push(image["imageId"].as_str().context("no imageId")?.to_owned());
        }
        Ok(images)
    }

    /// Runs a turn that calls `run_command` with `true` once; returns the
    /// time from the stored call to its result.
    pub async fn tool_turn(&self, image: &str) -> anyhow::Result<Duration> {
        let started = Instant::now();
        let response = self
            .send(image, r#"[mock call='run_command:{"command": "true"}']"#)
            .await?;
        // To the turn's end, so the next message finds the agent free.
        let mut body = response.bytes_stream();
        let mut seen = Vec::new();
        let (mut called, mut answered) = (None, None);
        while let Some(chunk) = body.next().await {
            seen.extend_from_slice(&chunk?);
            let now = started.elapsed();
            if called.is_none() && find(&seen, b"event: tool_call_message").is_some() {
                called = Some(now);
            }
            if answered.is_none() && find(&seen, b"event: tool_result").is_some() {
                answered = Some(now);
            }
            if find(&seen, b"event: conversation_end").is_some() {
                break;
            }
        }
        // A refused command (a sandbox it could not get, say) is no figure.
        if find(&seen, br#""isError":true"#).is_some() {
            anyhow::bail!(
                "the command failed: {}",
                String::from_utf8_lossy(&seen).chars().take(2000).collect::<String>()
            );
        }
        match (called, answered) {
            (Some(called), Some(answered)) => Ok(answered.saturating_sub(called)),
            _ => anyhow::bail!(
                "no tool call and result in {}",
                String::from_utf8_lossy(&seen).chars().take(2000).collect::<String>()
            ),
        }
    }

    /// Drops the image's agent, so its next message starts one from stored history.
    pub async fn stop(&self, image: &str) -> anyhow::Result<()> {
        self.post(&format!("/v1/images/{image}/stop"))
            .send()
            .await?
            .error_for_status()?;
        Ok(())
    }
}

/// An HTTP client with Nagle off, as every socket on the path.
pub fn client() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(usize::MAX)
        .build()?)
}

/// One streaming call straight to the mock (Anthropic API), to its `message_stop`.
pub async fn direct(client: &reqwest::Client, mock_url: &str) -> anyhow::Result<Streamed> {
    let started = Instant::now();
    let response = client
        .post(format!("{mock_url}/v1/messages"))
        .header("x-api-key", "bench")
        .header("anthropic-version", "2023-06-01")
        .json(&json!({
            "model": "claude-sonnet-4-20250514",
            "max_tokens": 1024,
            "stream": true,
            "messages": [{"role": "user", "content": "hello"}],
        }))
        .send()
        .await?;
    ensure!(
        response.status().is_success(),
        "the mock refused: {}",
        response.status()
    );
    stream(response, started, b"content_block_delta", b"message_stop").await
}

/// Reads a streamed response to `end` (or its end), noting when each `marker` arrived.
async fn stream(response: reqwest::Response, started: Instant, marker: &[u8], end: &[u8]) -> anyhow::Result<Streamed> {
    let mut body = response.bytes_stream();
    let mut seen = Vec::new();
    let mut scanned = 0;
    let mut arrivals = Vec::new();
    while let Some(chunk) = body.next().await {
        let end_from = seen.len().saturating_sub(end.len());
        seen.extend_from_slice(&chunk?);
        let now = started.elapsed();
        while let Some(at) = find(&seen[scanned..], marker) {
            arrivals.push(now);
            scanned += at + marker.len();
        }
        scanned = scanned.max(seen.len().saturating_sub(marker.len()));
        if find(&seen[end_from..], end).is_some() {
            break;
        }
    }
    let first = *arrivals.first().with_context(|| {
        format!(
            "no {} in {}",
            String::from_utf8_lossy(marker),
            String::from_utf8_lossy(&seen)
        )
    })?;
    let last = arrivals.last().copied().unwrap_or(first);
    let gaps = arrivals.windows(2).map(|pair| pair[1] - pair[0]).collect();
    Ok(Streamed {
        sent: started,
        first,
        last,
        gaps,
    })
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|window| window == needle)
}

/// Milliseconds, for figures.
pub fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1000.0
}
