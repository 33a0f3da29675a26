//! The content schema of each kind, checked on publish.
//!
//! Content is a JSON object; unknown fields are refused at every level but a
//! tool's `inputSchema` (a JSON Schema, the tool's own business). Each error
//! names the field, as `content.variables[1].name: …`, under the stable
//! reason `INVALID_CONTENT`. Written out by hand rather than derived with
//! serde: serde's messages name neither the path nor the rule.
//!
//! ```text
//! prompt     {template, variables?: [{name, description?, required? (true), default?}]}
//! tool       {name, description?, inputSchema: {type: "object", …},
//!             mcpServer: {command, args?, env?} | {type: "sse"|"http", url, headers?}  | builtin: name}
//! sandbox    {limits: {cpuMillis?, memoryMb?, diskMb?, timeoutSeconds?, network?},
//!             environment?: shell|python|node, env?: {NAME: value | {secret: name}}}
//! agent      {prompt: prompt uri, model?, tools?: [tool uri], sandbox?: sandbox uri,
//!             knowledge?: [knowledge uri], variables?: {name: string},
//!             parameters?: {maxTokens?, temperature? (0..=2)}}
//! knowledge  {documents: [{title?, text, mediaType?}, …]} (at least one)
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;

use serde_json::{Map, Value};

use crate::error::ResourceError;
use crate::kind::Kind;
use crate::template::{self, PromptContent, Variable};
use crate::uri::ResourceUri;

/// Largest content, in bytes of JSON.
pub const MAX_CONTENT_BYTES: usize = 256 * 1024;

/// The path every error message starts from.
const ROOT: &str = "content";

type Object = Map<String, Value>;

/// What rendering needs of an agent's content.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct AgentContent {
    pub prompt: ResourceUri,
    /// Values for the prompt's variables, under those of a request.
    pub variables: BTreeMap<String, String>,
}

/// Checks `content_json` against the schema of `kind`; returns the resource
/// URIs it names (an agent's prompt, tools, sandbox and knowledge), in order.
pub(crate) fn validate(kind: Kind, content_json: &str) -> Result<Vec<ResourceUri>, ResourceError> {
    if content_json.len() > MAX_CONTENT_BYTES {
        return Err(ResourceError::invalid(
            "CONTENT_TOO_LARGE",
            format!("content must be at most {} KiB", MAX_CONTENT_BYTES / 1024),
        ));
    }
    let value: Value = serde_json::from_str(content_json)
        .map_err(|err| ResourceError::invalid("INVALID_CONTENT", format!("content is not valid json: {err}")))?;
    let checked = match kind {
        Kind::Prompt => prompt(&value).map(|_| Vec::new()),
        Kind::Tool => tool(&value).map(|()| Vec::new()),
        Kind::Sandbox => sandbox(&value).map(|()| Vec::new()),
        Kind::Agent => agent(&value).map(|(_, uris)| uris),
        Kind::Knowledge => knowledge(&value).map(|()| Vec::new()),
    };
    checked.map_err(|message| ResourceError::invalid("INVALID_CONTENT", message))
}

impl PromptContent {
    /// Reads a stored prompt's content.
    pub(crate) fn from_json(content_json: &str) -> Result<PromptContent, String> {
        let value: Value = serde_json::from_str(content_json).map_err(|err| err.to_string())?;
        prompt(&value)
    }
}

impl AgentContent {
    /// Reads a stored agent's content.
    pub(crate) fn from_json(content_json: &str) -> Result<AgentContent, String> {
        let value: Value = serde_json::from_str(content_json).map_err(|err| err.to_string())?;
        agent(&value).map(|(content, _)| content)
    }
}

fn prompt(value: &Value) -> Result<PromptContent, String> {
    let content = object(value, ROOT)?;
    only(content, ROOT, &["template", "variables"])?;
    let template = non_empty_string(required(content, ROOT, "template")?, "content.template")?;
    let mut variables = Vec::new();
    if let Some(declared) = content.get("variables") {
        for (i, item) in array(declared, "content.variables")?.iter().enumerate() {
            let path = format!("content.variables[{i}]");
            let variable = object(item, &path)?;
            only(variable, &path, &["name", "description", "required", "default"])?;
            let name = string(required(variable, &path, "name")?, &format!("{path}.name"))?;
            if !is_identifier(name) {
                return Err(at(
                    &format!("{path}.name"),
                    format!("{name:?} is not an identifier ([A-Za-z_][A-Za-z0-9_]*)"),
                ));
            }
            if variables.iter().any(|v: &Variable| v.name == name) {
                return Err(at(&format!("{path}.name"), format!("{name} is declared twice")));
            }
            if let Some(description) = variable.get("description") {
                string(description, &format!("{path}.description"))?;
            }
            let required = match variable.get("required") {
                Some(flag) => boolean(flag, &format!("{path}.required"))?,
                None => true,
            };
            let default = match variable.get("default") {
                Some(default) => Some(string(default, &format!("{path}.default"))?.to_owned()),
                None => None,
            };
            variables.push(Variable {
                name: name.to_owned(),
                required,
                default,
            });
        }
    }
    if let Some(undeclared) = template::placeholders(template)
        .into_iter()
        .find(|name| !variables.iter().any(|v| v.name == *name))
    {
        return Err(at(
            "content.template",
            format!("undeclared variable {{{{{undeclared}}}}}; declare it in content.variables"),
        ));
    }
    Ok(PromptContent {
        template: template.to_owned(),
        variables,
    })
}

fn tool(value: &Value) -> Result<(), String> {
    let content = object(value, ROOT)?;
    only(
        content,
        ROOT,
        &["name", "description", "inputSchema", "mcpServer", "builtin"],
    )?;
    non_empty_string(required(content, ROOT, "name")?, "content.name")?;
    if let Some(description) = content.get("description") {
        string(description, "content.description")?;
    }
    let schema = object(required(content, ROOT, "inputSchema")?, "content.inputSchema")?;
    if schema.get("type").and_then(Value::as_str) != Some("object") {
        return Err(at("content.inputSchema.type", "must be \"object\""));
    }
    match (content.get("mcpServer"), content.get("builtin")) {
        (Some(_), Some(_)) => Err(at(ROOT, "has both mcpServer and builtin; a tool is one or the other")),
        (None, None) => Err(at(ROOT, "needs an mcpServer or a builtin")),
        (Some(server), None) => mcp_server(server, "content.mcpServer"),
        (None, Some(builtin)) => non_empty_string(builtin, "content.builtin").map(|_| ()),
    }
}

/// An MCP server: a command to run (stdio), or an SSE or streamable-HTTP endpoint.
fn mcp_server(value: &Value, path: &str) -> Result<(), String> {
    let server = object(value, path)?;
    let transport = match server.get("type") {
        Some(kind) => string(kind, &format!("{path}.type"))?,
        None if server.contains_key("command") => "stdio",
        None => return Err(at(path, "needs a command, or a type of sse or http with a url")),
    };
    match transport {
        "stdio" => {
            only(server, path, avm_common::mcp::COMMAND_FIELDS)?;
            non_empty_string(required(server, path, "command")?, &format!("{path}.command"))?;
            if let Some(args) = server.get("args") {
                for (i, arg) in array(args, &format!("{path}.args"))?.iter().enumerate() {
                    string(arg, &format!("{path}.args[{i}]"))?;
                }
            }
            if let Some(env) = server.get("env") {
                string_map(env, &format!("{path}.env"))?;
            }
        }
        "sse" | "http" => {
            only(server, path, avm_common::mcp::REMOTE_FIELDS)?;
            let url = non_empty_string(required(server, path, "url")?, &format!("{path}.url"))?;
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(at(&format!("{path}.url"), "must be an http:// or https:// url"));
            }
            if let Some(headers) = server.get("headers") {
                string_map(headers, &format!("{path}.headers"))?;
            }
        }
        other => {
            return Err(at(
                &format!("{path}.type"),
                format!("{other:?} is not one of stdio, sse, http"),
            ));
        }
    }
    Ok(())
}

/// Environment variables a sandbox may not set: the fence sets them.
const RESERVED_ENV: [&str; 11] = [
    "PATH",
    "HOME",
    "TMPDIR",
    "LANG",
    "PWD",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
    "NO_PROXY",
    "no_proxy",
];

/// Most variables a sandbox's `env` names.
const MAX_ENV: usize = 32;

/// Checks a sandbox's `env`: names as shells take them, each a plain value
/// (up to 4 KiB, no NUL) or `{"secret": "<name>"}`, a secret of the tenant.
fn env(value: &Value) -> Result<(), String> {
    let path = "content.env";
    let env = object(value, path)?;
    if env.len() > MAX_ENV {
        return Err(at(path, format!("at most {MAX_ENV} variables")));
    }
    for (name, value) in env {
        let at_name = format!("{path}.{}", name.chars().take(64).collect::<String>());
        if name.len() > 64 || !is_identifier(name) {
            return Err(at(
                &at_name,
                "a variable's name is 1 to 64 letters, digits or `_`, not starting with a digit",
            ));
        }
        if RESERVED_ENV.contains(&name.as_str()) {
            return Err(at(&at_name, "is set by the sandbox itself"));
        }
        match value {
            Value::String(plain) if plain.len() <= 4096 && !plain.contains('\0') => {}
            Value::String(_) => return Err(at(&at_name, "a value is at most 4096 bytes, without NUL")),
            Value::Object(secret) => {
                only(secret, &at_name, &["secret"])?;
                let name = secret.get("secret").and_then(Value::as_str).ok_or_else(|| {
                    at(
                        &format!("{at_name}.secret"),
                        "is required: the name of one of the tenant's secrets",
                    )
                })?;
                if !avm_common::ids::is_plain_name(name) {
                    return Err(at(
                        &format!("{at_name}.secret"),
                        "a secret's name is 1 to 128 letters, digits, `-`, `_` or `.`",
                    ));
                }
            }
            _ => return Err(at(&at_name, "must be a string or {\"secret\": name}")),
        }
    }
    Ok(())
}

fn sandbox(value: &Value) -> Result<(), String> {
    let content = object(value, ROOT)?;
    only(content, ROOT, &["limits", "environment", "env"])?;
    if let Some(environment) = content.get("environment")
        && !matches!(environment.as_str(), Some("shell" | "python" | "node"))
    {
        return Err(at("content.environment", "must be one of shell, python, node"));
    }
    if let Some(variables) = content.get("env") {
        env(variables)?;
    }
    let path = "content.limits";
    let limits = object(required(content, ROOT, "limits")?, path)?;
    only(
        limits,
        path,
        &["cpuMillis", "memoryMb", "diskMb", "timeoutSeconds", "network"],
    )?;
    for name in ["cpuMillis", "memoryMb", "diskMb", "timeoutSeconds"] {
        if let Some(limit) = limits.get(name) {
            positive_integer(limit, &format!("{path}.{name}"))?;
        }
    }
    if let Some(network) = limits.get("network") {
        boolean(network, &format!("{path}.network"))?;
    }
    Ok(())
}

fn agent(value: &Value) -> Result<(AgentContent, Vec<ResourceUri>), String> {
    let content = object(value, ROOT)?;
    only(
        content,
        ROOT,
        &[
            "prompt",
            "model",
            "tools",
            "sandbox",
            "knowledge",
            "variables",
            "parameters",
        ],
    )?;
    let prompt = uri_of(required(content, ROOT, "prompt")?, "content.prompt", Kind::Prompt)?;
    let mut uris = vec![prompt.clone()];
    if let Some(model) = content.get("model") {
        non_empty_string(model, "content.model")?;
    }
    if let Some(tools) = content.get("tools") {
        for (i, tool) in array(tools, "content.tools")?.iter().enumerate() {
            uris.push(uri_of(tool, &format!("content.tools[{i}]"), Kind::Tool)?);
        }
    }
    if let Some(sandbox) = content.get("sandbox") {
        uris.push(uri_of(sandbox, "content.sandbox", Kind::Sandbox)?);
    }
    if let Some(knowledge) = content.get("knowledge") {
        for (i, item) in array(knowledge, "content.knowledge")?.iter().enumerate() {
            uris.push(uri_of(item, &format!("content.knowledge[{i}]"), Kind::Knowledge)?);
        }
    }
    let mut variables = BTreeMap::new();
    if let Some(values) = content.get("variables") {
        for (name, value) in object(values, "content.variables")? {
            let path = format!("content.variables.{name}");
            if !is_identifier(name) {
                return Err(at(
                    &path,
                    format!("{name:?} is not an identifier ([A-Za-z_][A-Za-z0-9_]*)"),
                ));
            }
            variables.insert(name.clone(), string(value, &path)?.to_owned());
        }
    }
    if let Some(parameters) = content.get("parameters") {
        let path = "content.parameters";
        let parameters = object(parameters, path)?;
        only(parameters, path, &["maxTokens", "temperature"])?;
        if let Some(max_tokens) = parameters.get("maxTokens") {
            positive_integer(max_tokens, "content.parameters.maxTokens")?;
        }
        if let Some(temperature) = parameters.get("temperature") {
            match temperature.as_f64() {
                Some(t) if (0.0..=2.0).contains(&t) => {}
                _ => return Err(at("content.parameters.temperature", "must be a number from 0 to 2")),
            }
        }
    }
    Ok((AgentContent { prompt, variables }, uris))
}

fn knowledge(value: &Value) -> Result<(), String> {
    let content = object(value, ROOT)?;
    only(content, ROOT, &["documents"])?;
    let documents = array(required(content, ROOT, "documents")?, "content.documents")?;
    if documents.is_empty() {
        return Err(at("content.documents", "needs at least one document"));
    }
    for (i, item) in documents.iter().enumerate() {
        let path = format!("content.documents[{i}]");
        let document = object(item, &path)?;
        only(document, &path, &["title", "text", "mediaType"])?;
        non_empty_string(required(document, &path, "text")?, &format!("{path}.text"))?;
        for optional in ["title", "mediaType"] {
            if let Some(field) = document.get(optional) {
                string(field, &format!("{path}.{optional}"))?;
            }
        }
    }
    Ok(())
}

/// Returns whether `name` is `[A-Za-z_][A-Za-z0-9_]*`.
fn is_identifier(name: &str) -> bool {
    let mut bytes = name.bytes();
    bytes
        .next()
        .is_some_and(|first| first == b'_' || first.is_ascii_alphabetic())
        && bytes.all(|b| b == b'_' || b.is_ascii_alphanumeric())
}

fn at(path: &str, why: impl Display) -> String {
    format!("{path}: {why}")
}

fn object<'a>(value: &'a Value, path: &str) -> Result<&'a Object, String> {
    value.as_object().ok_or_else(|| at(path, "must be a json object"))
}

fn array<'a>(value: &'a Value, path: &str) -> Result<&'a Vec<Value>, String> {
    value.as_array().ok_or_else(|| at(path, "must be an array"))
}

fn string<'a>(value: &'a Value, path: &str) -> Result<&'a str, String> {
    value.as_str().ok_or_else(|| at(path, "must be a string"))
}

fn non_empty_string<'a>(value: &'a Value, path: &str) -> Result<&'a str, String> {
    match string(value, path)? {
        text if text.trim().is_empty() => Err(at(path, "must not be empty")),
        text => Ok(text),
    }
}

fn boolean(value: &Value, path: &str) -> Result<bool, String> {
    value.as_bool().ok_or_else(|| at(path, "must be true or false"))
}

fn positive_integer(value: &Value, path: &str) -> Result<u64, String> {
    value
        .as_u64()
        .filter(|n| *n > 0)
        .ok_or_else(|| at(path, "must be a positive integer"))
}

fn string_map(value: &Value, path: &str) -> Result<(), String> {
    for (key, item) in object(value, path)? {
        string(item, &format!("{path}.{key}"))?;
    }
    Ok(())
}

fn required<'a>(object: &'a Object, path: &str, field: &str) -> Result<&'a Value, String> {
    object
        .get(field)
        .ok_or_else(|| at(&format!("{path}.{field}"), "is required"))
}

/// Refuses fields outside `allowed`, naming the first one (in sorted order).
fn only(object: &Object, path: &str, allowed: &[&str]) -> Result<(), String> {
    let unknown: BTreeSet<&str> = object
        .keys()
        .map(String::as_str)
        .filter(|key| !allowed.contains(key))
        .collect();
    match unknown.first() {
        Some(field) => Err(at(
            &format!("{path}.{field}"),
            format!("unknown field; known fields are {}", allowed.join(", ")),
        )),
        None => Ok(()),
    }
}

/// Reads a URI naming a resource of `kind`.
fn uri_of(value: &Value, path: &str, kind: Kind) -> Result<ResourceUri, String> {
    let text = string(value, path)?;
    let uri = ResourceUri::parse(text).map_err(|why| at(path, why))?;
    if uri.kind != kind {
        return Err(at(
            path,
            format!("must name a {kind} (resource://{}/…), not {text}", kind.collection()),
        ));
    }
    Ok(uri)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(kind: Kind, json: &str) -> String {
        match validate(kind, json) {
            Err(ResourceError::Invalid {
                reason: "INVALID_CONTENT",
                message,
            }) => message,
            other => panic!("{json}: expected INVALID_CONTENT, got {other:?}"),
        }
    }

    #[test]
    fn prompts_declare_every_placeholder() {
        let good = r#"{"template":"Hi {{ who }} {{x}}","variables":[{"name":"who"},{"name":"x","required":false,"default":"","description":"d"}]}"#;
        assert_eq!(validate(Kind::Prompt, good).unwrap(), []);
        assert!(validate(Kind::Prompt, r#"{"template":"static"}"#).is_ok());
        for (json, says) in [
            ("[]", "content: must be a json object"),
            ("{}", "content.template: is required"),
            (r#"{"template":""}"#, "content.template: must not be empty"),
            (r#"{"template":"x","extra":1}"#, "content.extra: unknown field"),
            (r#"{"template":"{{a}}"}"#, "content.template: undeclared variable {{a}}"),
            (
                r#"{"template":"x","variables":[{"name":"a"},{"name":"1a"}]}"#,
                "content.variables[1].name: \"1a\" is not an identifier",
            ),
            (
                r#"{"template":"x","variables":[{"name":"a"},{"name":"a"}]}"#,
                "content.variables[1].name: a is declared twice",
            ),
            (
                r#"{"template":"x","variables":[{"name":"a","required":"yes"}]}"#,
                "content.variables[0].required: must be true or false",
            ),
            (
                r#"{"template":"x","variables":[{"name":"a","default":3}]}"#,
                "content.variables[0].default: must be a string",
            ),
            (
                r#"{"template":"x","variables":[{"name":"a","type":"s"}]}"#,
                "content.variables[0].type: unknown field",
            ),
        ] {
            let got = message(Kind::Prompt, json);
            assert!(got.starts_with(says), "{json}: {got}");
        }
    }

    #[test]
    fn tools_are_mcp_or_builtin() {
        let schema = r#""inputSchema":{"type":"object","properties":{"q":{"type":"string"}}}"#;
        for good in [
            format!(
                r#"{{"name":"search",{schema},"mcpServer":{{"command":"mcp-search","args":["-v"],"env":{{"K":"v"}}}}}}"#
            ),
            format!(
                r#"{{"name":"search",{schema},"mcpServer":{{"type":"http","url":"https://x/mcp","headers":{{"A":"b"}}}}}}"#
            ),
            format!(r#"{{"name":"search","description":"d",{schema},"builtin":"web_search"}}"#),
        ] {
            assert!(validate(Kind::Tool, &good).is_ok(), "{good}");
        }
        for (json, says) in [
            (
                format!(r#"{{"name":"s",{schema}}}"#),
                "content: needs an mcpServer or a builtin",
            ),
            (
                format!(r#"{{"name":"s",{schema},"builtin":"b","mcpServer":{{"command":"c"}}}}"#),
                "content: has both",
            ),
            (
                r#"{"name":"s","inputSchema":{"type":"string"},"builtin":"b"}"#.to_owned(),
                "content.inputSchema.type: must be \"object\"",
            ),
            (
                r#"{"name":"s","builtin":"b"}"#.to_owned(),
                "content.inputSchema: is required",
            ),
            (
                format!(r#"{{"name":"s",{schema},"mcpServer":{{"type":"sse"}}}}"#),
                "content.mcpServer.url: is required",
            ),
            (
                format!(r#"{{"name":"s",{schema},"mcpServer":{{"type":"ws","url":"x"}}}}"#),
                "content.mcpServer.type: \"ws\" is not one of",
            ),
            (
                format!(r#"{{"name":"s",{schema},"mcpServer":{{"command":"c","args":[1]}}}}"#),
                "content.mcpServer.args[0]: must be a string",
            ),
            (
                format!(r#"{{"name":"",{schema},"builtin":"b"}}"#),
                "content.name: must not be empty",
            ),
        ] {
            let got = message(Kind::Tool, &json);
            assert!(got.starts_with(says), "{json}: {got}");
        }
    }

    #[test]
    fn sandboxes_know_their_limits() {
        let good = r#"{"limits":{"cpuMillis":500,"memoryMb":256,"diskMb":1024,"timeoutSeconds":30,"network":false}}"#;
        assert!(validate(Kind::Sandbox, good).is_ok());
        assert!(validate(Kind::Sandbox, r#"{"limits":{}}"#).is_ok());
        let with_env =
            r#"{"limits":{},"environment":"python","env":{"REGION":"eu","GITHUB_TOKEN":{"secret":"github"}}}"#;
        assert!(validate(Kind::Sandbox, with_env).is_ok());
        for (json, says) in [
            ("{}", "content.limits: is required"),
            (
                r#"{"limits":{"cpuMillis":0}}"#,
                "content.limits.cpuMillis: must be a positive integer",
            ),
            (
                r#"{"limits":{"memoryMb":1.5}}"#,
                "content.limits.memoryMb: must be a positive integer",
            ),
            (
                r#"{"limits":{"network":"no"}}"#,
                "content.limits.network: must be true or false",
            ),
            (r#"{"limits":{"gpus":1}}"#, "content.limits.gpus: unknown field"),
            (r#"{"limits":{},"env":{"1X":"a"}}"#, "content.env.1X: a variable's name"),
            (
                r#"{"limits":{},"environment":"ruby"}"#,
                "content.environment: must be one of",
            ),
            (
                r#"{"limits":{},"env":{"PATH":"/x"}}"#,
                "content.env.PATH: is set by the sandbox itself",
            ),
            (
                r#"{"limits":{},"env":{"A":{"secret":"a/b"}}}"#,
                "content.env.A.secret: a secret's name",
            ),
            (
                r#"{"limits":{},"env":{"A":{"value":"x"}}}"#,
                "content.env.A.value: unknown field",
            ),
            (r#"{"limits":{},"env":{"A":1}}"#, "content.env.A: must be a string"),
        ] {
            let got = message(Kind::Sandbox, json);
            assert!(got.starts_with(says), "{json}: {got}");
        }
    }

    #[test]
    fn agents_name_their_parts_by_uri() {
        let good = r#"{"prompt":"resource://prompts/p@^1","model":"m","tools":["resource://tools/t"],
            "sandbox":"resource://sandboxes/s@1.0.0","knowledge":["resource://knowledge/k"],
            "variables":{"who":"x"},"parameters":{"maxTokens":100,"temperature":0.5}}"#;
        let uris: Vec<String> = validate(Kind::Agent, good)
            .unwrap()
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            uris,
            [
                "resource://prompts/p@^1",
                "resource://tools/t",
                "resource://sandboxes/s@1.0.0",
                "resource://knowledge/k"
            ]
        );
        for (json, says) in [
            ("{}", "content.prompt: is required"),
            (
                r#"{"prompt":"resource://tools/t"}"#,
                "content.prompt: must name a prompt",
            ),
            (
                r#"{"prompt":"resource://prompts/p","tools":["resource://prompts/p"]}"#,
                "content.tools[0]: must name a tool",
            ),
            (
                r#"{"prompt":"prompts/p"}"#,
                "content.prompt: \"prompts/p\" does not start",
            ),
            (
                r#"{"prompt":"resource://prompts/p","parameters":{"temperature":3}}"#,
                "content.parameters.temperature: must be a number from 0 to 2",
            ),
            (
                r#"{"prompt":"resource://prompts/p","parameters":{"maxTokens":-1}}"#,
                "content.parameters.maxTokens: must be a positive integer",
            ),
            (
                r#"{"prompt":"resource://prompts/p","variables":{"a":1}}"#,
                "content.variables.a: must be a string",
            ),
            (
                r#"{"prompt":"resource://prompts/p","memory":true}"#,
                "content.memory: unknown field",
            ),
        ] {
            let got = message(Kind::Agent, json);
            assert!(got.starts_with(says), "{json}: {got}");
        }
    }

    #[test]
    fn knowledge_needs_documents() {
        assert!(
            validate(
                Kind::Knowledge,
                r#"{"documents":[{"title":"t","text":"x","mediaType":"text/plain"}]}"#
            )
            .is_ok()
        );
        for (json, says) in [
            (r#"{"documents":[]}"#, "content.documents: needs at least one document"),
            (
                r#"{"documents":[{"text":"a"},{"title":"t"}]}"#,
                "content.documents[1].text: is required",
            ),
            (
                r#"{"documents":[{"text":" "}]}"#,
                "content.documents[0].text: must not be empty",
            ),
            (
                r#"{"documents":[{"text":"a","url":"u"}]}"#,
                "content.documents[0].url: unknown field",
            ),
        ] {
            let got = message(Kind::Knowledge, json);
            assert!(got.starts_with(says), "{json}: {got}");
        }
    }

    #[test]
    fn content_is_json_and_bounded() {
        assert!(message(Kind::Prompt, "{").starts_with("content is not valid json"));
        let big = format!(r#"{{"template":"{}"}}"#, "x".repeat(MAX_CONTENT_BYTES));
        assert!(matches!(
            validate(Kind::Prompt, &big),
            Err(ResourceError::Invalid {
                reason: "CONTENT_TOO_LARGE",
                ..
            })
        ));
    }
}
