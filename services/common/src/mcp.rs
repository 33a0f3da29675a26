//! The rules an MCP server definition must meet: the same where it is stored
//! (a tool resource's `mcpServer`, an image's `mcpServers`) and where it is
//! used (the runtime, before it starts or reaches the server), so a tenant
//! cannot store what no turn may run.
//!
//! - a stdio server starts only a command the operator allows (`[runtime.mcp]
//!   allowed_commands`), unless an operator published it;
//! - an HTTP or SSE server's URL passes the address guard (`address.rs`):
//!   no loopback, private or metadata address unless `[runtime.fetch] allow`
//!   names it;
//! - a definition has only the fields of its type: a misspelt `headers` would
//!   otherwise be stored and silently send none.

use serde_json::Value;
use url::Url;

use crate::ApiError;
use crate::address::AddressGuard;

/// Refuses `command` for the server `server` unless an operator published
/// it (`public`) or the operator allows it.
pub fn check_command(allowed_commands: &[String], server: &str, command: &str, public: bool) -> Result<(), ApiError> {
    if public || allowed_commands.iter().any(|allowed| allowed == command) {
        return Ok(());
    }
    Err(ApiError::invalid(
        "MCP_COMMAND_NOT_APPROVED",
        format!(
            "the tool {server:?} would start the command {command:?}: a tenant's tool resource may start only \
             commands the operator allows ([runtime.mcp] allowed_commands); public tool resources are \
             published by operators"
        ),
    ))
}

/// Refuses a server URL that is not one, or that the address guard refuses.
pub fn check_url(guard: &AddressGuard, url: &str) -> Result<(), ApiError> {
    let parsed = Url::parse(url)
        .map_err(|err| ApiError::invalid("MCP_SERVER_REFUSED", format!("{url:?} is not a URL: {err}")))?;
    guard
        .check_url(&parsed)
        .map_err(|refusal| ApiError::invalid("MCP_SERVER_REFUSED", refusal))
}

/// The fields of a server run as a command (type `stdio`, the default).
pub const COMMAND_FIELDS: &[&str] = &["type", "command", "args", "env"];

/// The fields of a server reached over the network (type `sse` or `http`).
pub const REMOTE_FIELDS: &[&str] = &["type", "url", "headers"];

/// Refuses a definition of the server `server` that is not an object
/// (`INVALID_MCP_SERVERS`) or has a field its type does not
/// (`UNKNOWN_FIELD`, naming the first in sorted order).
pub fn check_fields(server: &str, definition: &Value) -> Result<(), ApiError> {
    let server: String = server.chars().take(64).collect();
    let Some(fields) = definition.as_object() else {
        return Err(ApiError::invalid(
            "INVALID_MCP_SERVERS",
            format!("mcpServers.{server} must be a json object"),
        ));
    };
    let known = match definition["type"].as_str() {
        Some("http" | "sse") => REMOTE_FIELDS,
        _ => COMMAND_FIELDS,
    };
    let mut unknown: Vec<&String> = fields.keys().filter(|field| !known.contains(&field.as_str())).collect();
    unknown.sort();
    match unknown.first() {
        Some(field) => {
            let field: String = field.chars().take(64).collect();
            Err(ApiError::invalid(
                "UNKNOWN_FIELD",
                format!(
                    "mcpServers.{server}.{field} is not a field here (known: {})",
                    known.join(", ")
                ),
            ))
        }
        None => Ok(()),
    }
}

/// The operator's rules for MCP server definitions, as the services that
/// store them hold them.
#[derive(Clone, Debug, Default)]
pub struct McpServerRules {
    allowed_commands: Vec<String>,
    guard: AddressGuard,
}

impl McpServerRules {
    /// Returns the rules of `[runtime.mcp] allowed_commands` and
    /// `[runtime.fetch] allow`; an allow-list entry that is neither a host, an
    /// address nor a network is `INVALID_CONFIG`.
    pub fn new(allowed_commands: Vec<String>, allow: &[String]) -> Result<Self, ApiError> {
        Ok(Self {
            allowed_commands,
            guard: AddressGuard::new(allow)?,
        })
    }

    /// Refuses the definition of the server `server` (one `mcpServer`
    /// object: `{command, …}` or `{type: "http"|"sse", url, …}`) that the
    /// runtime would refuse, or that has fields its type does not
    /// ([`check_fields`]); `public` when an operator publishes it. The rest of
    /// its shape is checked elsewhere: what is not a command or a URL passes.
    pub fn check(&self, server: &str, definition: &Value, public: bool) -> Result<(), ApiError> {
        check_fields(server, definition)?;
        match definition["type"].as_str() {
            Some("http" | "sse") => match definition["url"].as_str() {
                Some(url) => check_url(&self.guard, url),
                None => Ok(()),
            },
            _ => match definition["command"].as_str() {
                Some(command) => check_command(&self.allowed_commands, server, command, public),
                None => Ok(()),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn definitions_meet_the_runtimes_rules() {
        let rules = McpServerRules::new(vec!["mcp-approved".into()], &["10.0.0.0/8".into()]).unwrap();
        let reason = |definition: Value, public: bool| match rules.check("s", &definition, public) {
            Ok(()) => "ok".to_owned(),
            Err(err) => err.reason.into_owned(),
        };
        assert_eq!(reason(json!({"command": "/bin/sh"}), false), "MCP_COMMAND_NOT_APPROVED");
        assert_eq!(
            reason(json!({"type": "stdio", "command": "/bin/sh"}), false),
            "MCP_COMMAND_NOT_APPROVED"
        );
        assert_eq!(reason(json!({"command": "/bin/sh"}), true), "ok");
        assert_eq!(reason(json!({"command": "mcp-approved"}), false), "ok");
        for url in [
            "http://169.254.169.254/mcp",
            "http://127.0.0.1:9/mcp",
            "http://localhost/mcp",
            "not a url",
        ] {
            assert_eq!(
                reason(json!({"type": "http", "url": url}), true),
                "MCP_SERVER_REFUSED",
                "{url}"
            );
            assert_eq!(
                reason(json!({"type": "sse", "url": url}), false),
                "MCP_SERVER_REFUSED",
                "{url}"
            );
        }
        assert_eq!(
            reason(json!({"type": "http", "url": "http://10.2.3.4/mcp"}), false),
            "ok"
        );
        assert_eq!(
            reason(json!({"type": "http", "url": "https://mcp.example/mcp"}), false),
            "ok"
        );
        // Issue 26 item 22: a misspelt field is refused, not stored.
        assert_eq!(
            reason(
                json!({"type": "http", "url": "https://mcp.example/mcp", "header": {}}),
                false
            ),
            "UNKNOWN_FIELD"
        );
        assert_eq!(
            reason(json!({"command": "mcp-approved", "argv": ["-v"]}), false),
            "UNKNOWN_FIELD"
        );
        assert_eq!(reason(json!("mcp-approved"), false), "INVALID_MCP_SERVERS");
        assert_eq!(
            reason(json!({"command": "mcp-approved", "args": [], "env": {}}), false),
            "ok"
        );
    }
}
