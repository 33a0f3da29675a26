//! The tools an agent may call, and running their calls.
//!
//! Tiered by need: an agent without tools has no toolbox at all, and an
//! agent with tools gets its workspace directory only on the first call.
//! A tool's failure is a result with `is_error` that the model reads, never a
//! failed turn.

use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use crate::error::RuntimeError;
use crate::llm::{ToolCall, ToolSpec};

pub(crate) mod disk;
mod fetch;
mod kubernetes;
mod mcp;
mod mcp_sse;
mod remote;

pub use remote::Launcher;

pub use avm_sandbox::{Env, FileSystem, Process, Workspace, access, egress};

pub use crate::config::{EnvValue, McpConfig, SandboxEnvironment, SandboxLimits, SandboxRequest};
pub use disk::WorkspaceStore;
pub use fetch::{AddressGuard, Fetcher};
use mcp::McpServer;
pub use mcp::{Caller, CredentialSource, McpServerSpec, McpTransport, ServerState};

/// Most bytes of a tool result the model is sent; the rest is cut with a marker.
pub const MAX_RESULT_BYTES: usize = 64 * 1024;

/// The built-in tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Builtin {
    ReadFile,
    WriteFile,
    EditFile,
    ListFiles,
    SearchFiles,
    RunCommand,
    FetchUrl,
    /// Starts a child agent with a task; the turn runs it, not the toolbox.
    SpawnAgent,
}

impl Builtin {
    /// Every built-in tool.
    pub const ALL: [Builtin; 8] = [
        Builtin::ReadFile,
        Builtin::WriteFile,
        Builtin::EditFile,
        Builtin::ListFiles,
        Builtin::SearchFiles,
        Builtin::RunCommand,
        Builtin::FetchUrl,
        Builtin::SpawnAgent,
    ];

    /// Returns the tool's name, as the model and the image config name it.
    pub fn name(self) -> &'static str {
        match self {
            Builtin::ReadFile => "read_file",
            Builtin::WriteFile => "write_file",
            Builtin::EditFile => "edit_file",
            Builtin::ListFiles => "list_files",
            Builtin::SearchFiles => "search_files",
            Builtin::RunCommand => "run_command",
            Builtin::FetchUrl => "fetch_url",
            Builtin::SpawnAgent => "spawn_agent",
        }
    }

    /// Returns the built-in tool of this name.
    pub fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|tool| tool.name() == name)
    }

    /// Returns the tool as the model sees it: its description and input schema.
    pub fn spec(self) -> ToolSpec {
        let path = json!({"type": "string", "description": "A path relative to the workspace."});
        let (description, schema) = match self {
            Builtin::ReadFile => (
                "Reads a UTF-8 text file of the workspace.",
                json!({"type": "object", "properties": {"path": path}, "required": ["path"]}),
            ),
            Builtin::WriteFile => (
                "Writes a text file of the workspace, creating it and its directories or replacing it.",
                json!({"type": "object", "properties": {"path": path, "content": {"type": "string"}},
                       "required": ["path", "content"]}),
            ),
            Builtin::EditFile => (
                "Replaces one exact occurrence of `old` with `new` in a text file of the workspace.",
                json!({"type": "object", "properties": {"path": path, "old": {"type": "string"}, "new": {"type": "string"}},
                       "required": ["path", "old", "new"]}),
            ),
            Builtin::ListFiles => (
                "Lists a directory of the workspace (the workspace itself by default).",
                json!({"type": "object", "properties": {"path": path}}),
            ),
            Builtin::SearchFiles => (
                "Finds the lines of the workspace's text files that contain `text` (exactly, case-sensitive), \
                 below `path` (the whole workspace by default); answers `path:line: text` per match.",
                json!({"type": "object", "properties": {"text": {"type": "string"}, "path": path},
                       "required": ["text"]}),
            ),
            Builtin::RunCommand => (
                "Runs a shell command (/bin/sh -c) in the workspace, under time, CPU, memory and output limits; \
                 returns its exit code, stdout and stderr.",
                json!({"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}),
            ),
            Builtin::FetchUrl => (
                "Fetches a public http:// or https:// URL (GET, redirects followed) and returns its status, \
                 content type and text, cut at a size limit. Internal addresses are refused.",
                json!({"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}),
            ),
            Builtin::SpawnAgent => (
                "Starts a child agent in this container and gives it a task. It answers with the child's reply \
                 (or, with `wait: false`, at once with the child's image id while it works). The child has its \
                 own prompt (`prompt`, or the `resource://agents/…` definition in `agent`) and may use the tools \
                 in `tools` (among this agent's own); with `groupId` it also joins that group, with `newGroup` \
                 it and this agent make a new group of that name.",
                json!({"type": "object", "properties": {
                    "task": {"type": "string", "description": "What the child is to do; its first message."},
                    "prompt": {"type": "string", "description": "The child's system prompt."},
                    "agent": {"type": "string", "description": "A resource://agents/… definition the child runs."},
                    "name": {"type": "string", "description": "A name for the child."},
                    "tools": {"type": "array", "items": {"type": "string"}, "description": "Tools the child may use, among this agent's."},
                    "groupId": {"type": "string", "description": "A group of this container the child joins."},
                    "newGroup": {"type": "string", "description": "The name of a new group of this agent and the child (instead of groupId)."},
                    "wait": {"type": "boolean", "description": "Wait for the child's answer (default true)."}
                }, "required": ["task"]}),
            ),
        };
        ToolSpec {
            name: self.name().to_owned(),
            description: description.to_owned(),
            input_schema: schema,
        }
    }
}

/// What a tool call gave back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolReply {
    pub text: String,
    pub is_error: bool,
}

impl ToolReply {
    pub(crate) fn ok(text: String) -> Self {
        Self {
            text: truncate(text),
            is_error: false,
        }
    }

    pub(crate) fn error(text: String) -> Self {
        Self {
            text: truncate(text),
            is_error: true,
        }
    }

    /// Returns the reply of a tool that says whether its answer is an error.
    fn of(result: Result<(String, bool), String>) -> Self {
        match result {
            Ok((text, is_error)) => Self {
                text: truncate(text),
                is_error,
            },
            Err(failure) => Self::error(failure),
        }
    }
}

/// Cuts a result to [`MAX_RESULT_BYTES`] on a character boundary, saying so.
fn truncate(mut text: String) -> String {
    if text.len() > MAX_RESULT_BYTES {
        let mut end = MAX_RESULT_BYTES;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let cut = text.len() - end;
        text.truncate(end);
        text.push_str(&format!("\n[… {cut} more bytes not shown]"));
    }
    text
}

/// What a toolbox runs its tools with, shared by the pool's agents.
#[derive(Clone, Debug)]
pub struct ToolContext {
    pub limits: SandboxLimits,
    pub fetcher: Fetcher,
    pub mcp: McpConfig,
    /// The credentials users stored for MCP servers.
    pub credentials: Arc<dyn CredentialSource>,
    /// Where workspaces persist between agents (`[runtime] workspace_store`);
    /// `None`: on this replica's disk only.
    pub store: Option<WorkspaceStore>,
    /// What starts sandboxes (`[runtime.sandbox] provider = "process"`);
    /// `None`: commands run in this process, behind the fence.
    pub sandboxes: Option<Arc<Launcher>>,
}

impl std::fmt::Debug for dyn CredentialSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CredentialSource")
    }
}

/// The tools of one agent, over its image's workspace.
#[derive(Debug)]
pub struct Toolbox {
    tools: Vec<Builtin>,
    /// The server's limits narrowed by the agent's sandbox resource.
    limits: SandboxLimits,
    servers: Vec<McpServer>,
    /// The built-in tools' specs, then every reachable server's tools.
    specs: Mutex<Arc<Vec<ToolSpec>>>,
    workspace: Workspace,
    /// Where its commands run: the workspace itself, or a sandbox.
    process: Arc<dyn Process>,
    context: ToolContext,
    /// The tenant whose secrets the sandbox's `env` names.
    tenant_id: String,
    /// The variables its sandbox resource sets.
    env: Vec<(String, EnvValue)>,
    /// Those variables with their secrets' values, once a tool needed them.
    variables: tokio::sync::OnceCell<Arc<Env>>,
    /// What its commands are given besides a shell.
    environment: SandboxEnvironment,
}

/// Returns a built-in tool as the model sees it; `run_command` says what its
/// sandbox's environment gives.
fn builtin_spec(tool: Builtin, environment: SandboxEnvironment) -> ToolSpec {
    let mut spec = tool.spec();
    let given = match environment {
        SandboxEnvironment::Shell => None,
        SandboxEnvironment::Python => {
            Some(" Python 3 is installed (python3; pip reaches public indexes when the sandbox has network).")
        }
        SandboxEnvironment::Node => {
            Some(" Node.js is installed (node; npm reaches the public registry when the sandbox has network).")
        }
    };
    if let (Builtin::RunCommand, Some(given)) = (tool, given) {
        spec.description.push_str(given);
    }
    spec
}

impl Toolbox {
    /// Returns the toolbox of these built-in tool names and MCP servers;
    /// `None` for none (a tool-free agent). An unknown name, a stdio server
    /// no operator approved and an internal server address are refused.
    pub fn new(
        (tenant_id, image_id): (&str, &str),
        names: &[String],
        servers: &[McpServerSpec],
        sandbox: Option<&SandboxRequest>,
        workspace: Workspace,
        context: &ToolContext,
    ) -> Result<Option<Self>, RuntimeError> {
        if names.is_empty() && servers.is_empty() {
            return Ok(None);
        }
        let mut tools = Vec::with_capacity(names.len());
        for name in names {
            let tool = Builtin::named(name).ok_or_else(|| unknown_tool(name))?;
            if !tools.contains(&tool) {
                tools.push(tool);
            }
        }
        for server in servers {
            server.check(&context.mcp, &context.fetcher)?;
        }
        let environment = sandbox.map(|request| request.environment).unwrap_or_default();
        let specs = Mutex::new(Arc::new(
            tools.iter().map(|tool| builtin_spec(*tool, environment)).collect(),
        ));
        let limits = match sandbox {
            Some(request) => context.limits.narrowed(request),
            None => context.limits.clone(),
        };
        let workspace = workspace.with_quota_mb(limits.disk_mb);
        let process: Arc<dyn Process> = match &context.sandboxes {
            Some(launcher) => Arc::new(remote::RemoteProcess::new(
                Arc::clone(launcher),
                image_id,
                environment,
                workspace.clone(),
            )),
            None => Arc::new(workspace.clone()),
        };
        Ok(Some(Self {
            process,
            tools,
            limits,
            servers: servers.iter().cloned().map(McpServer::new).collect(),
            specs,
            workspace,
            context: context.clone(),
            tenant_id: tenant_id.to_owned(),
            env: sandbox.map(|request| request.env.clone()).unwrap_or_default(),
            environment,
            variables: tokio::sync::OnceCell::new(),
        }))
    }

    /// Returns the variables the sandbox's commands see, reading the
    /// tenant's secrets they name the first time (a failure is tried again
    /// on the next call).
    async fn variables(&self) -> Result<Arc<Env>, String> {
        let resolved = self
            .variables
            .get_or_try_init(|| async {
                let mut names: Vec<String> = self
                    .env
                    .iter()
                    .filter_map(|(_, value)| match value {
                        EnvValue::Secret(name) => Some(name.clone()),
                        EnvValue::Plain(_) => None,
                    })
                    .collect();
                names.sort();
                names.dedup();
                let values = if names.is_empty() {
                    std::collections::BTreeMap::new()
                } else {
                    self.context
                        .credentials
                        .secrets(&self.tenant_id, &names)
                        .await
                        .map_err(|why| format!("cannot read this agent's secrets: {why}"))?
                };
                let mut variables = Env::default();
                for (variable, value) in &self.env {
                    match value {
                        EnvValue::Plain(plain) => variables.set(variable, plain),
                        EnvValue::Secret(name) => {
                            let value = values.get(name).ok_or_else(|| {
                                format!(
                                    "this agent's sandbox sets {variable} from the secret {name:?}, which its tenant \
                                     does not have (an admin stores it: PUT /v1/secrets/{name})"
                                )
                            })?;
                            variables.set_secret(variable, name, value);
                        }
                    }
                }
                Ok::<_, String>(Arc::new(variables))
            })
            .await?;
        Ok(Arc::clone(resolved))
    }

    /// Returns the tools as the model sees them.
    pub fn specs(&self) -> Arc<Vec<ToolSpec>> {
        Arc::clone(&self.specs.lock().unwrap_or_else(|poison| poison.into_inner()))
    }

    /// Reaches the MCP servers not reached yet (with `caller`'s credentials)
    /// and lists again the tools of those that said theirs changed; returns
    /// the servers this left unavailable, with their state. Nothing to do
    /// without servers.
    pub async fn prepare(&self, caller: Caller<'_>) -> Vec<(String, ServerState)> {
        if self.servers.is_empty() {
            return Vec::new();
        }
        let variables = self.variables().await;
        let reach = mcp::Reach {
            workspace: &self.workspace,
            process: self.process.as_ref(),
            limits: &self.limits,
            fetcher: &self.context.fetcher,
            config: &self.context.mcp,
            credentials: self.context.credentials.as_ref(),
            caller,
            env: variables
                .as_ref()
                .map(|variables| variables.vars.as_slice())
                .map_err(String::as_str),
        };
        let changed = futures::future::join_all(self.servers.iter().map(|server| server.prepare(&reach))).await;
        let unavailable = self
            .servers
            .iter()
            .zip(&changed)
            .filter(|(server, changed)| **changed && server.state() != ServerState::Connected)
            .map(|(server, _)| (server.name().to_owned(), server.state()))
            .collect();
        if changed.contains(&true) {
            let mut specs: Vec<ToolSpec> = self
                .tools
                .iter()
                .map(|tool| builtin_spec(*tool, self.environment))
                .collect();
            for server in &self.servers {
                specs.extend(server.specs());
            }
            *self.specs.lock().unwrap_or_else(|poison| poison.into_inner()) = Arc::new(specs);
        }
        unavailable
    }

    /// Returns the workspace.
    pub fn workspace(&self) -> &Workspace {
        &self.workspace
    }

    /// Runs a call; every failure is a result the model reads. With secrets
    /// in the sandbox's `env`, their values never reach it: each is
    /// replaced by `[secret <name>]` in what any tool returns.
    pub async fn call(&self, call: &ToolCall) -> ToolReply {
        let reply = self.run(call).await;
        if !self.env.iter().any(|(_, value)| matches!(value, EnvValue::Secret(_))) {
            return reply;
        }
        match self.variables().await {
            Ok(variables) => ToolReply {
                text: variables.redacted(reply.text),
                is_error: reply.is_error,
            },
            Err(why) => ToolReply::error(why),
        }
    }

    async fn run(&self, call: &ToolCall) -> ToolReply {
        if call.name.starts_with(mcp::MCP_TOOL_PREFIX)
            && let Some(server) = self.servers.iter().find(|server| server.serves(&call.name))
        {
            let timeout = std::time::Duration::from_secs(self.context.mcp.call_timeout_seconds.max(1));
            return ToolReply::of(Ok(server.call(&call.name, &call.input, timeout).await));
        }
        let Some(tool) = self.tools.iter().copied().find(|tool| tool.name() == call.name) else {
            return ToolReply::error(format!("unknown tool {:?}: this agent has no such tool", call.name));
        };
        match tool {
            Builtin::FetchUrl => ToolReply::of(
                async {
                    if !self.limits.network {
                        return Err("this agent's sandbox has no network (network: false)".to_owned());
                    }
                    self.context.fetcher.fetch(text_field(&call.input, "url")?).await
                }
                .await,
            ),
            Builtin::RunCommand => ToolReply::of(
                async {
                    self.workspace.load().await?;
                    let script = text_field(&call.input, "command")?;
                    if !self
                        .context
                        .sandboxes
                        .as_ref()
                        .is_some_and(|sandboxes| sandboxes.picks_environment())
                    {
                        self.environment.check(&crate::config::COMMAND_PATH)?;
                    }
                    let variables = self.variables().await?;
                    let command = avm_sandbox::Command {
                        script,
                        limits: &self.limits,
                        guard: self.context.fetcher.guard(),
                        env: &variables.vars,
                    };
                    self.process.run(command).await
                }
                .await,
            ),
            Builtin::SpawnAgent => ToolReply::error("spawn_agent is run by the agent's turn".to_owned()),
            _ => ToolReply::of(self.call_file_tool(tool, &call.input).await.map(|text| (text, false))),
        }
    }

    /// Returns whether the agent may call this built-in tool.
    pub fn has(&self, tool: Builtin) -> bool {
        self.tools.contains(&tool)
    }

    /// Runs a file tool; the text is what the model reads.
    async fn call_file_tool(&self, tool: Builtin, input: &Value) -> Result<String, String> {
        self.workspace.load().await?;
        let files: &dyn FileSystem = &self.workspace;
        match tool {
            Builtin::ReadFile => files.read(text_field(input, "path")?).await,
            Builtin::WriteFile => {
                let (path, content) = (text_field(input, "path")?, text_field(input, "content")?);
                files.write(path, content).await?;
                Ok(format!("wrote {} bytes to {path}", content.len()))
            }
            Builtin::EditFile => {
                let path = text_field(input, "path")?;
                files
                    .edit(path, text_field(input, "old")?, text_field(input, "new")?)
                    .await?;
                Ok(format!("edited {path}"))
            }
            Builtin::ListFiles => {
                files
                    .list(input.get("path").and_then(Value::as_str).unwrap_or(""))
                    .await
            }
            Builtin::SearchFiles => {
                let text = text_field(input, "text")?;
                files
                    .search(input.get("path").and_then(Value::as_str).unwrap_or(""), text)
                    .await
            }
            Builtin::RunCommand | Builtin::FetchUrl | Builtin::SpawnAgent => {
                Err(format!("{} is not a file tool", tool.name()))
            }
        }
    }
}

/// Returns the error for a tool name no toolbox has.
pub fn unknown_tool(name: &str) -> RuntimeError {
    let known: Vec<&str> = Builtin::ALL.iter().map(|tool| tool.name()).collect();
    RuntimeError::invalid(
        "UNKNOWN_TOOL",
        format!("unknown tool {name:?}; the built-in tools are {}", known.join(", ")),
    )
}

/// Returns a string field of a tool's input.
fn text_field<'a>(input: &'a Value, field: &str) -> Result<&'a str, String> {
    match input.get(field) {
        Some(Value::String(text)) => Ok(text),
        Some(_) => Err(format!("`{field}` must be a string")),
        None => Err(format!("`{field}` is required")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_results_are_cut_with_a_marker() {
        let text = "é".repeat(MAX_RESULT_BYTES);
        let cut = truncate(text);
        assert!(cut.len() < MAX_RESULT_BYTES + 64);
        assert!(cut.ends_with(&format!("[… {} more bytes not shown]", MAX_RESULT_BYTES)));
        assert_eq!(truncate("short".into()), "short");
    }

    #[test]
    fn the_shared_list_names_every_built_in_tool() {
        let names: Vec<&str> = Builtin::ALL.iter().map(|tool| tool.name()).collect();
        assert_eq!(names, avm_common::tools::BUILTIN_TOOLS);
    }

    #[test]
    fn unknown_tools_are_refused() {
        let workspace = Workspace::new("/nonexistent".into());
        let context = ToolContext {
            limits: SandboxLimits::default(),
            fetcher: Fetcher::new(&Default::default()).unwrap(),
            mcp: McpConfig::default(),
            credentials: Arc::new(mcp::NoCredentials),
            store: None,
            sandboxes: None,
        };
        assert!(
            Toolbox::new(("ten_a", "img_a"), &[], &[], None, workspace.clone(), &context)
                .unwrap()
                .is_none()
        );
        let err = Toolbox::new(
            ("ten_a", "img_a"),
            &["read_file".into(), "rm_rf".into()],
            &[],
            None,
            workspace,
            &context,
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                RuntimeError::Invalid {
                    reason: "UNKNOWN_TOOL",
                    ..
                }
            ),
            "{err:?}"
        );
    }
}
