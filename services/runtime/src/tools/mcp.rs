//! Tools served by MCP servers, spoken to through the official SDK (`rmcp`).
//!
//! A tool resource with an `mcpServer` names a server; every tool it lists
//! is offered to the model as `mcp__<server>__<tool>`. A server is reached
//! when its agent's first turn starts (never for a tool-free agent), listed
//! again when it says its tools changed, and let go with the agent: a stdio
//! server's process group is killed then.
//!
//! Stdio servers are processes: they start only from a public tool resource
//! (only operators publish those) or a command the operator allows
//! (`[runtime.mcp] allowed_commands`), in the agent's workspace under the
//! sandbox's limits, with a clean environment plus the resource's `env`.
//! HTTP servers (streamable HTTP, or the legacy SSE transport, spoken by
//! `mcp_sse.rs`) are reached through `fetch_url`'s address guard, with the
//! caller's stored credential when it is bound to the server URL's origin. A server that cannot be reached is left out
//! of the turn's tools (and tried again 30 s later); one that refuses its
//! credentials is in the `needs_auth` state (tried again next turn).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::{NotificationContext, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::{ClientHandler, RoleClient, ServiceExt};
use serde_json::Value;
use tokio::io::AsyncReadExt;

use super::fetch::{Fetcher, refusal_in};
use super::mcp_sse::SseTransport;
use crate::config::{McpConfig, SandboxLimits};
use crate::error::RuntimeError;
use crate::llm::ToolSpec;
use avm_sandbox::Workspace;

/// What the model's name of an MCP tool starts with.
pub const MCP_TOOL_PREFIX: &str = "mcp__";

/// How a server is reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum McpTransport {
    /// A process spoken to over its standard input and output.
    Stdio {
        command: String,
        args: Vec<String>,
        env: BTreeMap<String, String>,
    },
    /// A streamable HTTP endpoint.
    Http {
        url: String,
        headers: BTreeMap<String, String>,
    },
    /// A legacy HTTP+SSE endpoint.
    Sse {
        url: String,
        headers: BTreeMap<String, String>,
    },
}

/// A server an agent's tools come from: a tool resource's `mcpServer`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct McpServerSpec {
    /// The tool resource's `name`, the `<server>` of the tools' names.
    pub name: String,
    pub transport: McpTransport,
    /// Whether the resource is public, so published by an operator.
    pub public: bool,
}

impl McpServerSpec {
    /// Returns the server a tool resource's content names, `None` when it
    /// names none (a built-in tool).
    pub fn from_tool(content: &Value, public: bool) -> Option<Self> {
        let server = content.get("mcpServer")?;
        let strings = |value: &Value| -> BTreeMap<String, String> {
            value
                .as_object()
                .map(|map| {
                    map.iter()
                        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                        .collect()
                })
                .unwrap_or_default()
        };
        let text = |field: &str| server[field].as_str().unwrap_or_default().to_owned();
        let transport = match server["type"].as_str() {
            Some("http") => McpTransport::Http {
                url: text("url"),
                headers: strings(&server["headers"]),
            },
            Some("sse") => McpTransport::Sse {
                url: text("url"),
                headers: strings(&server["headers"]),
            },
            _ => McpTransport::Stdio {
                command: text("command"),
                args: server["args"]
                    .as_array()
                    .map(|args| args.iter().filter_map(|a| a.as_str().map(str::to_owned)).collect())
                    .unwrap_or_default(),
                env: strings(&server["env"]),
            },
        };
        Some(Self {
            name: content["name"].as_str().unwrap_or_default().to_owned(),
            transport,
            public,
        })
    }

    /// Refuses a server this runtime may not start or reach: the rules the
    /// services storing definitions apply at registration (`avm_common::mcp`).
    pub fn check(&self, config: &McpConfig, fetcher: &Fetcher) -> Result<(), RuntimeError> {
        match &self.transport {
            McpTransport::Stdio { command, .. } => {
                avm_common::mcp::check_command(&config.allowed_commands, &self.name, command, self.public)?;
            }
            McpTransport::Http { url, .. } | McpTransport::Sse { url, .. } => {
                avm_common::mcp::check_url(fetcher.guard(), url)?;
            }
        }
        Ok(())
    }
}

/// Returns `text` with every character a tool name may not hold replaced by `_`.
fn name_part(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// A server's state, as the runtime sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerState {
    /// Not reached yet (or let go after an error).
    Idle,
    Connected,
    /// Could not be reached; tried again next turn.
    Failed(String),
    /// Refused its credentials (HTTP 401 or 403).
    NeedsAuth,
}

impl ServerState {
    /// Returns the state's name.
    pub fn as_str(&self) -> &'static str {
        match self {
            ServerState::Idle => "idle",
            ServerState::Connected => "connected",
            ServerState::Failed(_) => "failed",
            ServerState::NeedsAuth => "needs_auth",
        }
    }
}

/// Notices a server's `tools/list_changed`.
struct Listener {
    stale: Arc<AtomicBool>,
}

impl ClientHandler for Listener {
    async fn on_tool_list_changed(&self, _context: NotificationContext<RoleClient>) {
        self.stale.store(true, Ordering::SeqCst);
    }
}

/// A live session with a server, and the process behind a stdio one.
struct Session {
    service: RunningService<RoleClient, Listener>,
    /// The user whose credentials opened it (HTTP servers).
    user_id: Option<String>,
    /// The process of a stdio server, killed with everything it started when dropped.
    _server: Option<Box<dyn std::any::Any + Send + Sync>>,
}

/// A tool a server listed: the model's name for it and the server's.
#[derive(Clone, Debug)]
struct ListedTool {
    spec: ToolSpec,
    name: String,
}

/// One server of an agent.
pub struct McpServer {
    spec: McpServerSpec,
    prefix: String,
    session: tokio::sync::Mutex<Option<Session>>,
    state: Mutex<ServerState>,
    tools: Mutex<Vec<ListedTool>>,
    stale: Arc<AtomicBool>,
    /// When an unreachable server is tried again.
    retry_at: Mutex<Option<std::time::Instant>>,
}

/// How long an unreachable server is left out before it is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(30);

impl std::fmt::Debug for McpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServer")
            .field("name", &self.spec.name)
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

/// Where the credentials users stored for servers are read.
#[async_trait::async_trait]
pub trait CredentialSource: Send + Sync {
    /// Returns the headers `user_id`'s requests send to `server` at `url`,
    /// if a credential is stored for it and bound to `url`'s origin (issue 26
    /// item 4: a credential never goes to an address it was not set for).
    /// The error says why none could be read.
    async fn headers(
        &self,
        tenant_id: &str,
        user_id: &str,
        server: &str,
        url: &str,
    ) -> Result<Option<BTreeMap<String, String>>, String>;

    /// Returns the values of `tenant_id`'s secrets named in `names` that are
    /// stored, for its agent's sandbox. The error says why none could be read.
    async fn secrets(&self, tenant_id: &str, names: &[String]) -> Result<BTreeMap<String, String>, String>;
}

/// No stored credentials, for tests.
#[cfg(test)]
pub struct NoCredentials;

#[cfg(test)]
#[async_trait::async_trait]
impl CredentialSource for NoCredentials {
    async fn headers(&self, _: &str, _: &str, _: &str, _: &str) -> Result<Option<BTreeMap<String, String>>, String> {
        Ok(None)
    }

    async fn secrets(&self, _: &str, _: &[String]) -> Result<BTreeMap<String, String>, String> {
        Ok(BTreeMap::new())
    }
}

/// Whose turn reaches a server: its credentials are used.
#[derive(Clone, Copy, Debug)]
pub struct Caller<'a> {
    pub tenant_id: &'a str,
    pub user_id: &'a str,
}

/// What reaching a server needs from its agent.
pub struct Reach<'a> {
    pub workspace: &'a Workspace,
    /// Where a stdio server runs: the workspace itself, or its sandbox.
    pub process: &'a dyn avm_sandbox::Process,
    pub limits: &'a SandboxLimits,
    pub fetcher: &'a Fetcher,
    pub config: &'a McpConfig,
    pub credentials: &'a dyn CredentialSource,
    pub caller: Caller<'a>,
    /// The variables of the agent's sandbox, for a stdio server (or why
    /// they could not be read).
    pub env: Result<&'a [(String, String)], &'a str>,
}

impl McpServer {
    /// Returns the server, not reached yet.
    pub fn new(spec: McpServerSpec) -> Self {
        let prefix = format!("{MCP_TOOL_PREFIX}{}__", name_part(&spec.name));
        Self {
            spec,
            prefix,
            session: tokio::sync::Mutex::new(None),
            state: Mutex::new(ServerState::Idle),
            tools: Mutex::new(Vec::new()),
            stale: Arc::new(AtomicBool::new(false)),
            retry_at: Mutex::new(None),
        }
    }

    /// Returns the server's name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Returns the server's state.
    pub fn state(&self) -> ServerState {
        self.state.lock().unwrap_or_else(|poison| poison.into_inner()).clone()
    }

    fn set_state(&self, state: ServerState) {
        *self.state.lock().unwrap_or_else(|poison| poison.into_inner()) = state;
    }

    /// Returns the tools the model sees.
    pub fn specs(&self) -> Vec<ToolSpec> {
        let tools = self.tools.lock().unwrap_or_else(|poison| poison.into_inner());
        tools.iter().map(|tool| tool.spec.clone()).collect()
    }

    /// Returns whether the model's name `name` is one of this server's tools.
    pub fn serves(&self, name: &str) -> bool {
        name.starts_with(&self.prefix)
    }

    /// Reaches the server if it is not, and lists its tools again if it said
    /// they changed; returns whether its tools changed.
    pub async fn prepare(&self, reach: &Reach<'_>) -> bool {
        let mut session = self.session.lock().await;
        // Another user's turn does not use the session opened with someone's credentials.
        if session
            .as_ref()
            .is_some_and(|live| live.user_id.as_deref().is_some_and(|user| user != reach.caller.user_id))
        {
            *session = None;
        }
        if session.is_some() && !self.stale.swap(false, Ordering::SeqCst) {
            return false;
        }
        // A server that could not be reached is tried again after a while,
        // not at every turn (a refused credential at once: one may be stored now).
        let retry_at = *self.retry_at.lock().unwrap_or_else(|poison| poison.into_inner());
        if session.is_none() && retry_at.is_some_and(|at| std::time::Instant::now() < at) {
            return false;
        }
        let timeout = Duration::from_secs(reach.config.connect_timeout_seconds.max(1));
        let result = tokio::time::timeout(timeout, async {
            let live = match &mut *session {
                Some(live) => live,
                empty => empty.insert(self.connect(reach).await?),
            };
            live.service.list_all_tools().await.map_err(|err| {
                (
                    format!("listing its tools failed: {err}"),
                    err.auth_challenge().is_some(),
                )
            })
        })
        .await
        .unwrap_or_else(|_| Err((format!("no answer within {} s", timeout.as_secs()), false)));
        match result {
            Ok(listed) => {
                *self.retry_at.lock().unwrap_or_else(|poison| poison.into_inner()) = None;
                let tools = listed
                    .into_iter()
                    .map(|tool| {
                        let mut exposed = format!("{}{}", self.prefix, name_part(&tool.name));
                        exposed.truncate(64);
                        ListedTool {
                            spec: ToolSpec {
                                name: exposed,
                                description: tool.description.as_deref().unwrap_or_default().to_owned(),
                                input_schema: Value::Object((*tool.input_schema).clone()),
                            },
                            name: tool.name.into_owned(),
                        }
                    })
                    .collect::<Vec<_>>();
                tracing::info!(server = %self.spec.name, tools = tools.len(), "MCP server ready");
                *self.tools.lock().unwrap_or_else(|poison| poison.into_inner()) = tools;
                self.set_state(ServerState::Connected);
            }
            Err((why, needs_auth)) => {
                tracing::warn!(server = %self.spec.name, needs_auth, "MCP server unavailable: {why}");
                *session = None;
                *self.retry_at.lock().unwrap_or_else(|poison| poison.into_inner()) =
                    (!needs_auth).then(|| std::time::Instant::now() + RETRY_AFTER);
                self.tools.lock().unwrap_or_else(|poison| poison.into_inner()).clear();
                self.set_state(if needs_auth {
                    ServerState::NeedsAuth
                } else {
                    ServerState::Failed(why)
                });
            }
        }
        true
    }

    /// Starts or reaches the server and initializes a session.
    async fn connect(&self, reach: &Reach<'_>) -> Result<Session, (String, bool)> {
        let listener = Listener {
            stale: Arc::clone(&self.stale),
        };
        match &self.spec.transport {
            McpTransport::Stdio { command, args, env } => {
                reach.workspace.load().await.map_err(|why| (why, false))?;
                let sandbox_env = reach.env.map_err(|why| (why.to_owned(), false))?;
                let program = avm_sandbox::Program {
                    program: command,
                    args,
                    limits: reach.limits,
                    guard: reach.fetcher.guard(),
                    env: sandbox_env,
                    own: env,
                };
                let served = reach.process.serve(program).await.map_err(|why| (why, false))?;
                let (stdout, stdin, stderr, keep) = (served.stdout, served.stdin, served.stderr, served.keep);
                match listener.serve((stdout, stdin)).await {
                    Ok(service) => Ok(Session {
                        service,
                        user_id: None,
                        _server: Some(keep),
                    }),
                    Err(err) => {
                        // What the server said before it went away explains more than the protocol error.
                        let mut said = String::new();
                        if let Some(mut stderr) = stderr {
                            let mut buffer = vec![0_u8; 2048];
                            let read = tokio::time::timeout(Duration::from_millis(200), stderr.read(&mut buffer))
                                .await
                                .ok()
                                .and_then(Result::ok)
                                .unwrap_or(0);
                            said = String::from_utf8_lossy(&buffer[..read]).trim().to_owned();
                        }
                        Err((
                            format!("{command} did not start as an MCP server: {err}; it said: {said:?}"),
                            false,
                        ))
                    }
                }
            }
            McpTransport::Http { url, headers } | McpTransport::Sse { url, headers } => {
                let stored = reach
                    .credentials
                    .headers(reach.caller.tenant_id, reach.caller.user_id, &self.spec.name, url)
                    .await
                    .map_err(|why| (format!("its credential could not be read: {why}"), false))?;
                reach.fetcher.precheck(url).await.map_err(|why| (why, false))?;
                // A stored credential's headers win over the resource's own.
                let mut headers = headers.clone();
                headers.extend(stored.unwrap_or_default());
                let service = if matches!(self.spec.transport, McpTransport::Sse { .. }) {
                    let transport = SseTransport::connect(reach.fetcher.mcp_client(), url, &headers).await?;
                    listener
                        .serve(transport)
                        .await
                        .map_err(|err| (format!("{url}: {err}"), false))?
                } else {
                    let mut config = StreamableHttpClientTransportConfig::with_uri(url.as_str());
                    for (name, value) in &headers {
                        let (Ok(name), Ok(value)) = (
                            reqwest::header::HeaderName::try_from(name.as_str()),
                            reqwest::header::HeaderValue::try_from(value.as_str()),
                        ) else {
                            return Err((format!("the header {name:?} cannot be sent"), false));
                        };
                        config.custom_headers.insert(name, value);
                    }
                    let transport = StreamableHttpClientTransport::with_client(reach.fetcher.mcp_client(), config);
                    listener.serve(transport).await.map_err(|err| {
                        let why = refusal_in(&err).unwrap_or_else(|| format!("{url}: {err}"));
                        (why, err.is_authorization_required())
                    })?
                };
                Ok(Session {
                    service,
                    user_id: Some(reach.caller.user_id.to_owned()),
                    _server: None,
                })
            }
        }
    }

    /// Calls the tool the model names `name`; every failure is a text the
    /// model reads, flagged as an error.
    pub async fn call(&self, name: &str, input: &Value, timeout: Duration) -> (String, bool) {
        let tool = {
            let tools = self.tools.lock().unwrap_or_else(|poison| poison.into_inner());
            tools
                .iter()
                .find(|tool| tool.spec.name == name)
                .map(|tool| tool.name.clone())
        };
        let Some(tool) = tool else {
            return (
                format!("the MCP server {:?} offers no tool {name:?} now", self.spec.name),
                true,
            );
        };
        let peer = {
            let session = self.session.lock().await;
            match session.as_ref() {
                Some(live) => live.service.peer().clone(),
                None => {
                    return (
                        format!("the MCP server {:?} is not reachable now", self.spec.name),
                        true,
                    );
                }
            }
        };
        let mut params = CallToolRequestParams::new(tool);
        if let Value::Object(arguments) = input {
            params = params.with_arguments(arguments.clone());
        }
        match tokio::time::timeout(timeout, peer.call_tool(params)).await {
            Ok(Ok(result)) => {
                // A server that may change its tools says so in a
                // notification its SDK handles on a task of its own, which
                // can run after this answer is read: its tools are listed
                // again before the next model call rather than raced.
                let may_change = peer.peer_info().is_some_and(|info| {
                    info.capabilities
                        .tools
                        .as_ref()
                        .is_some_and(|tools| tools.list_changed == Some(true))
                });
                if may_change {
                    self.stale.store(true, Ordering::SeqCst);
                }
                (result_text(&result), result.is_error.unwrap_or(false))
            }
            Ok(Err(rmcp::ServiceError::McpError(err))) => {
                (format!("the MCP server refused the call: {}", err.message), true)
            }
            Ok(Err(err)) => {
                let needs_auth = err.auth_challenge().is_some();
                // The session is gone: reach the server again next turn.
                *self.session.lock().await = None;
                self.set_state(if needs_auth {
                    ServerState::NeedsAuth
                } else {
                    ServerState::Idle
                });
                (format!("the MCP server {:?} failed: {err}", self.spec.name), true)
            }
            Err(_) => (
                format!("the MCP tool {name} did not answer within {} s", timeout.as_secs()),
                true,
            ),
        }
    }
}

/// Renders a tool result's content as the text the model reads: text as it
/// is, other content named, structured content as JSON when there is no text.
fn result_text(result: &CallToolResult) -> String {
    let blocks = serde_json::to_value(&result.content).unwrap_or_default();
    let mut parts = Vec::new();
    for block in blocks.as_array().into_iter().flatten() {
        let part = match block["type"].as_str() {
            Some("text") => block["text"].as_str().unwrap_or_default().to_owned(),
            Some(kind @ ("image" | "audio")) => {
                format!(
                    "[{kind} content, {}]",
                    block["mimeType"].as_str().unwrap_or("unknown type")
                )
            }
            Some("resource") => match block["resource"]["text"].as_str() {
                Some(text) => text.to_owned(),
                None => format!("[resource {}]", block["resource"]["uri"].as_str().unwrap_or_default()),
            },
            Some("resource_link") => format!("[resource link {}]", block["uri"].as_str().unwrap_or_default()),
            _ => block.to_string(),
        };
        parts.push(part);
    }
    if parts.is_empty()
        && let Some(structured) = &result.structured_content
    {
        parts.push(structured.to_string());
    }
    parts.join("\n")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn tool_resources_name_their_servers() {
        let stdio = json!({"name": "search", "inputSchema": {"type": "object"},
            "mcpServer": {"command": "mcp-search", "args": ["-v"], "env": {"K": "v"}}});
        let spec = McpServerSpec::from_tool(&stdio, false).unwrap();
        assert_eq!(
            spec.transport,
            McpTransport::Stdio {
                command: "mcp-search".into(),
                args: vec!["-v".into()],
                env: BTreeMap::from([("K".into(), "v".into())]),
            }
        );
        let builtin = json!({"name": "read_file", "inputSchema": {"type": "object"}, "builtin": "read_file"});
        assert!(McpServerSpec::from_tool(&builtin, false).is_none());

        let fetcher = Fetcher::new(&Default::default()).unwrap();
        let config = McpConfig {
            allowed_commands: vec!["mcp-approved".into()],
            ..McpConfig::default()
        };
        let reason = |spec: &McpServerSpec| match spec.check(&config, &fetcher) {
            Ok(()) => "ok".to_owned(),
            Err(err) => avm_common::ApiError::from(err).reason.into_owned(),
        };
        assert_eq!(reason(&spec), "MCP_COMMAND_NOT_APPROVED");
        assert_eq!(
            reason(&McpServerSpec {
                public: true,
                ..spec.clone()
            }),
            "ok"
        );
        let approved = json!({"name": "s", "mcpServer": {"command": "mcp-approved"}});
        assert_eq!(reason(&McpServerSpec::from_tool(&approved, false).unwrap()), "ok");
        for (url, expected) in [
            ("http://127.0.0.1:9/mcp", "MCP_SERVER_REFUSED"),
            ("http://169.254.169.254/mcp", "MCP_SERVER_REFUSED"),
            ("https://mcp.example.com/mcp", "ok"),
        ] {
            let http = json!({"name": "s", "mcpServer": {"type": "http", "url": url}});
            assert_eq!(
                reason(&McpServerSpec::from_tool(&http, true).unwrap()),
                expected,
                "{url}"
            );
        }
    }

    #[test]
    fn tool_names_hold_only_what_providers_accept() {
        let server = McpServer::new(McpServerSpec {
            name: "my server.v2".into(),
            transport: McpTransport::Stdio {
                command: "x".into(),
                args: vec![],
                env: BTreeMap::new(),
            },
            public: true,
        });
        assert!(server.serves("mcp__my_server_v2__echo"));
        assert!(!server.serves("mcp__other__echo"));
        assert_eq!(server.state(), ServerState::Idle);
    }
}
