//! What an agent runs with: its image's `resource://` references, resolved
//! when it starts.

use avm_common::RequestContext;
use serde_json::Value;

use crate::error::RuntimeError;
use crate::peers::{Image, Resources};
use crate::tools::{Builtin, McpServerSpec, SandboxRequest, unknown_tool};

/// What a system prompt that names a resource starts with.
pub const RESOURCE_URI_PREFIX: &str = "resource://";

/// What an agent runs with, once its image's references are resolved.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentPlan {
    /// The system prompt, rendered.
    pub system_prompt: Option<String>,
    /// The agent definition's model, over the tenant's configured one.
    pub model: Option<String>,
    /// The agent definition's reply limit, over the configured one.
    pub max_tokens: Option<u32>,
    /// The exact resources (`resource://…@<version>`), recorded on each reply.
    pub resources: Vec<String>,
    /// The built-in tools the agent has (their names): its definition's, then its image's.
    pub tools: Vec<String>,
    /// The MCP servers its tools come from, likewise.
    pub mcp_servers: Vec<McpServerSpec>,
    /// What its definition's sandbox asks of the limits.
    pub sandbox: Option<SandboxRequest>,
}

/// Returns what an image's agent runs with: its agent definition (when it
/// names one), then its system prompt (a `resource://prompts/…` URI is
/// rendered with the image's variables; plain text is used as it is).
pub async fn plan(resources: &Resources, ctx: &RequestContext, image: &Image) -> Result<AgentPlan, RuntimeError> {
    let mut plan = AgentPlan::default();
    if let Some(agent) = image.agent.as_deref().filter(|agent| !agent.is_empty()) {
        let resolved = resources.resolve(ctx, agent, &image.variables_json).await?;
        let content: Value = serde_json::from_str(&resolved.root_content).unwrap_or_default();
        plan.system_prompt = resolved.rendered_prompt;
        plan.model = content["model"].as_str().map(str::to_owned);
        plan.max_tokens = content["parameters"]["maxTokens"]
            .as_u64()
            .and_then(|n| u32::try_from(n).ok());
        plan.resources.extend(resolved.uris);
        plan.sandbox = resolved
            .sandbox
            .as_deref()
            .map(|content| SandboxRequest::from_content(&serde_json::from_str(content).unwrap_or_default()));
        for tool in &resolved.tools {
            plan.add_tool(&tool.content, tool.public)?;
        }
    }
    match image.system_prompt.as_deref().filter(|prompt| !prompt.is_empty()) {
        Some(uri) if uri.starts_with(RESOURCE_URI_PREFIX) => {
            let resolved = resources.resolve(ctx, uri, &image.variables_json).await?;
            plan.system_prompt = resolved.rendered_prompt;
            for uri in resolved.uris {
                if !plan.resources.contains(&uri) {
                    plan.resources.push(uri);
                }
            }
        }
        Some(text) => plan.system_prompt = Some(text.to_owned()),
        None => {}
    }
    // The image's own tools, after its agent's: built-in names as they are,
    // tool resources resolved.
    for tool in &image.tools {
        if tool.starts_with(RESOURCE_URI_PREFIX) {
            let resolved = resources.resolve(ctx, tool, "").await?;
            plan.add_tool(&resolved.root_content, resolved.root_public)?;
            for uri in resolved.uris {
                if !plan.resources.contains(&uri) {
                    plan.resources.push(uri);
                }
            }
        } else {
            let name = Builtin::named(tool)
                .ok_or_else(|| unknown_tool(tool))?
                .name()
                .to_owned();
            if !plan.tools.contains(&name) {
                plan.tools.push(name);
            }
        }
    }
    Ok(plan)
}

impl AgentPlan {
    /// Adds the tool a tool resource describes: a built-in one (`builtin`) or
    /// the MCP server that serves it (`mcpServer`), each once.
    fn add_tool(&mut self, content_json: &str, public: bool) -> Result<(), RuntimeError> {
        let content: Value = serde_json::from_str(content_json).unwrap_or_default();
        if let Some(server) = McpServerSpec::from_tool(&content, public) {
            if !self.mcp_servers.iter().any(|known| known.name == server.name) {
                self.mcp_servers.push(server);
            }
            return Ok(());
        }
        let name = content["builtin"].as_str().unwrap_or_default();
        let name = Builtin::named(name)
            .ok_or_else(|| unknown_tool(name))?
            .name()
            .to_owned();
        if !self.tools.contains(&name) {
            self.tools.push(name);
        }
        Ok(())
    }
}
