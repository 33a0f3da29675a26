//! A mock MCP server (rmcp) for the tools suites: over stdio (the `mock-mcp`
//! binary), streamable HTTP ([`serve_http`], in process, optionally behind a
//! bearer token) or the legacy HTTP+SSE transport ([`serve_sse`]).
//!
//! Its tools:
//! - `echo {text}`: answers `echo: <text>`;
//! - `whereami`: its working directory and the names of its environment's
//!   variables, as `cwd=<dir> env=<A,B,…>`;
//! - `fail`: an error result (`isError`), `it failed on purpose`;
//! - `slow {ms}`: answers `slept <ms> ms` after that long;
//! - `unlock`: offers one more tool, `door` (answering `opened`), and tells
//!   the client its tool list changed.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult, PaginatedRequestParams,
    ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler};
use serde_json::{Value, json};

/// The mock server's state: whether `door` is offered yet.
#[derive(Clone, Debug, Default)]
pub struct MockMcp {
    unlocked: Arc<AtomicBool>,
}

fn tool(name: &'static str, description: &'static str, schema: Value) -> Tool {
    let Value::Object(schema) = schema else {
        unreachable!("tool schemas are objects")
    };
    Tool::new(name, description, Arc::new(schema))
}

impl MockMcp {
    fn tools(&self) -> Vec<Tool> {
        let mut tools = vec![
            tool(
                "echo",
                "Echoes a text.",
                json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
            ),
            tool("whereami", "Says where the server runs.", json!({"type": "object"})),
            tool("fail", "Always fails.", json!({"type": "object"})),
            tool(
                "slow",
                "Answers after a while.",
                json!({"type": "object", "properties": {"ms": {"type": "integer"}}}),
            ),
            tool("unlock", "Offers one more tool.", json!({"type": "object"})),
        ];
        if self.unlocked.load(Ordering::SeqCst) {
            tools.push(tool("door", "Opens.", json!({"type": "object"})));
        }
        tools
    }
}

fn text(text: impl Into<String>) -> Result<CallToolResponse, ErrorData> {
    Ok(CallToolResult::success(vec![ContentBlock::text(text)]).into())
}

impl ServerHandler for MockMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_tool_list_changed()
                .build(),
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult {
            tools: self.tools(),
            ..Default::default()
        })
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let arguments = Value::Object(request.arguments.unwrap_or_default());
        match request.name.as_ref() {
            "echo" => text(format!("echo: {}", arguments["text"].as_str().unwrap_or_default())),
            "whereami" => {
                let cwd = std::env::current_dir()
                    .map(|dir| dir.display().to_string())
                    .unwrap_or_default();
                let mut names: Vec<String> = std::env::vars_os()
                    .map(|(name, _)| name.to_string_lossy().into_owned())
                    .collect();
                names.sort();
                text(format!("cwd={cwd} env={}", names.join(",")))
            }
            "fail" => Ok(CallToolResult::error(vec![ContentBlock::text("it failed on purpose")]).into()),
            "slow" => {
                let ms = arguments["ms"].as_u64().unwrap_or(1000);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                text(format!("slept {ms} ms"))
            }
            "unlock" => {
                self.unlocked.store(true, Ordering::SeqCst);
                let _ = context.peer.notify_tool_list_changed().await;
                text("unlocked")
            }
            "door" if self.unlocked.load(Ordering::SeqCst) => text("opened"),
            other => Err(ErrorData::invalid_params(format!("no tool {other:?}"), None)),
        }
    }
}

/// Serves the mock over streamable HTTP at `http://<addr>/mcp` until the
/// returned task is aborted.
pub async fn serve_http() -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    serve_http_with(None).await
}

/// Serves the mock over streamable HTTP, answering 401 (with a
/// `WWW-Authenticate` challenge) to requests without `Authorization: Bearer
/// <token>` when a token is given.
pub async fn serve_http_with(token: Option<String>) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    use axum::http::{StatusCode, header};
    use axum::response::IntoResponse;
    use rmcp::transport::streamable_http_server::{StreamableHttpService, session::local::LocalSessionManager};
    let service: StreamableHttpService<MockMcp, LocalSessionManager> =
        StreamableHttpService::new(|| Ok(MockMcp::default()), Default::default(), Default::default());
    let expected = token.map(|token| format!("Bearer {token}"));
    let router = axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn(
            move |request: axum::extract::Request, next: axum::middleware::Next| {
                let expected = expected.clone();
                async move {
                    let given = request
                        .headers()
                        .get(header::AUTHORIZATION)
                        .and_then(|v| v.to_str().ok());
                    match expected {
                        Some(expected) if given != Some(expected.as_str()) => (
                            StatusCode::UNAUTHORIZED,
                            [(header::WWW_AUTHENTICATE, "Bearer realm=\"mock\"")],
                        )
                            .into_response(),
                        _ => next.run(request).await,
                    }
                }
            },
        ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok((addr, task))
}

/// Serves the mock over the legacy HTTP+SSE transport: `GET /sse` opens a
/// session's event stream (its first event, `endpoint`, names where to post),
/// `POST /messages?sessionId=…` takes the client's messages.
pub async fn serve_sse() -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use axum::extract::{Query, State};
    use axum::http::StatusCode;
    use axum::response::sse::{Event, Sse};
    use rmcp::ServiceExt;
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, WriteHalf};

    type Sessions = Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<WriteHalf<tokio::io::DuplexStream>>>>>>;
    let sessions: Sessions = Arc::default();

    async fn open(State(sessions): State<Sessions>) -> impl axum::response::IntoResponse {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let id = format!("s{}", NEXT.fetch_add(1, Ordering::SeqCst));
        let (client_side, server_side) = tokio::io::duplex(64 * 1024);
        tokio::spawn(async move {
            if let Ok(service) = MockMcp::default().serve(server_side).await {
                let _ = service.waiting().await;
            }
        });
        let (read, write) = tokio::io::split(client_side);
        sessions
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .insert(id.clone(), Arc::new(tokio::sync::Mutex::new(write)));
        let endpoint = futures::stream::once(async move {
            Ok::<_, std::convert::Infallible>(
                Event::default()
                    .event("endpoint")
                    .data(format!("/messages?sessionId={id}")),
            )
        });
        let lines =
            tokio_stream_lines(BufReader::new(read)).map(|line| Ok(Event::default().event("message").data(line)));
        Sse::new(endpoint.chain(lines))
    }

    fn tokio_stream_lines(
        reader: BufReader<tokio::io::ReadHalf<tokio::io::DuplexStream>>,
    ) -> impl futures::Stream<Item = String> {
        futures::stream::unfold(reader.lines(), |mut lines| async move {
            lines.next_line().await.ok().flatten().map(|line| (line, lines))
        })
    }

    async fn post(
        State(sessions): State<Sessions>,
        Query(query): Query<HashMap<String, String>>,
        body: bytes::Bytes,
    ) -> StatusCode {
        let session = query.get("sessionId").and_then(|id| {
            sessions
                .lock()
                .unwrap_or_else(|poison| poison.into_inner())
                .get(id)
                .cloned()
        });
        let Some(session) = session else {
            return StatusCode::NOT_FOUND;
        };
        let mut write = session.lock().await;
        let mut line = body.to_vec();
        line.push(b'\n');
        match write.write_all(&line).await {
            Ok(()) => StatusCode::ACCEPTED,
            Err(_) => StatusCode::GONE,
        }
    }

    use futures::StreamExt;
    let router = axum::Router::new()
        .route("/sse", axum::routing::get(open))
        .route("/messages", axum::routing::post(post))
        .with_state(sessions);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok((addr, task))
}
