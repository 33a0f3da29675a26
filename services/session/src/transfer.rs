//! Export and import: a conversation as a versioned JSON document, a
//! container as JSON Lines (a header, then one conversation document a line).
//!
//! A document holds the image's configuration, every message with its id,
//! `seq` and time (user content byte for byte), the resources its turns ran
//! with at their exact versions, and its usage totals. Exports are written a
//! piece at a time ([`ExportWriter`]), never whole in memory; an import is
//! read and checked whole ([`read_import`]) before anything is written.

use std::collections::{BTreeSet, HashSet};

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::error::SessionError;
use crate::record::{ImageRecord, MessageBody, MessageRecord, NewMessage, Usage};

/// The `format` of a conversation document.
pub const CONVERSATION_FORMAT: &str = "agentvm.conversation";
/// The `format` of a container export's first line.
pub const CONTAINER_FORMAT: &str = "agentvm.container";
/// The document version this server writes, and the newest it reads.
pub const DOCUMENT_VERSION: u32 = 1;
/// The largest import, in bytes: an import travels in one gRPC message.
pub const MAX_IMPORT_BYTES: usize = 15 * 1024 * 1024;
/// The most conversations one import may hold.
pub const MAX_IMPORT_CONVERSATIONS: usize = 1000;
/// Bytes of export after which a chunk is handed on.
pub const EXPORT_CHUNK_BYTES: usize = 256 * 1024;

/// What opens every document and container line: read first, alone, so a
/// newer version is named as such rather than as an unknown field.
#[derive(Deserialize)]
struct Header {
    #[serde(default)]
    format: String,
    #[serde(default)]
    version: Option<serde_json::Value>,
}

/// A container export's first line.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ContainerHeader {
    format: String,
    version: u32,
    container_id: String,
    exported_at: i64,
    conversations: usize,
}

/// Where a document came from (informational; an import makes new ids).
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Source {
    container_id: String,
    image_id: String,
    session_id: String,
}

/// An image's configuration as a document holds it.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DocumentImage {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// MCP server definitions, name to definition.
    pub mcp_servers: Box<RawValue>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// Values of the prompt's variables.
    pub variables: Box<RawValue>,
    #[serde(default)]
    pub tools: Vec<String>,
    /// What the conversation's clients keep with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Box<RawValue>>,
    pub created_at: i64,
    pub updated_at: i64,
}

/// Token counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DocumentUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// One message as a document holds it.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DocumentMessage {
    pub id: String,
    pub seq: u64,
    pub created_at: i64,
    pub body: DocumentBody,
}

/// What a message says, by kind.
#[derive(Debug, Serialize, Deserialize)]
#[serde(
    tag = "kind",
    rename_all = "snake_case",
    rename_all_fields = "camelCase",
    deny_unknown_fields
)]
pub enum DocumentBody {
    /// What the user sent: a string or a list of parts. (A value, not raw
    /// text: serde buffers a tagged enum's fields, which raw text cannot
    /// pass through; stored content is compact JSON, so it comes back the same.)
    User {
        content: serde_json::Value,
    },
    Assistant {
        text: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<DocumentUsage>,
        #[serde(default)]
        interrupted: bool,
        #[serde(default)]
        model: String,
        #[serde(default)]
        stop_reason: String,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        resources: Vec<String>,
    },
    ToolCall {
        tool_call_id: String,
        tool_name: String,
        /// The call's input as the model wrote it (JSON text).
        input_json: String,
        parent_id: String,
    },
    ToolResult {
        tool_call_id: String,
        tool_name: String,
        output: String,
        is_error: bool,
    },
    Error {
        text: String,
        error_code: String,
    },
}

impl DocumentMessage {
    fn of(message: &MessageRecord) -> Result<DocumentMessage, SessionError> {
        let body = match &message.body {
            MessageBody::User { content_json } => DocumentBody::User {
                content: serde_json::from_str(content_json)
                    .map_err(|_| SessionError::corrupt(format!("message {} content", message.message_id)))?,
            },
            MessageBody::Assistant {
                text,
                usage,
                interrupted,
                model,
                stop_reason,
                resources,
            } => DocumentBody::Assistant {
                text: text.clone(),
                usage: usage.map(|usage| DocumentUsage {
                    input_tokens: usage.input_tokens,
                    output_tokens: usage.output_tokens,
                }),
                interrupted: *interrupted,
                model: model.clone(),
                stop_reason: stop_reason.clone(),
                resources: resources.clone(),
            },
            MessageBody::ToolCall {
                tool_call_id,
                tool_name,
                input_json,
                parent_id,
            } => DocumentBody::ToolCall {
                tool_call_id: tool_call_id.clone(),
                tool_name: tool_name.clone(),
                input_json: input_json.clone(),
                parent_id: parent_id.clone(),
            },
            MessageBody::ToolResult {
                tool_call_id,
                tool_name,
                output,
                is_error,
            } => DocumentBody::ToolResult {
                tool_call_id: tool_call_id.clone(),
                tool_name: tool_name.clone(),
                output: output.clone(),
                is_error: *is_error,
            },
            MessageBody::Error { text, error_code } => DocumentBody::Error {
                text: text.clone(),
                error_code: error_code.clone(),
            },
        };
        Ok(DocumentMessage {
            id: message.message_id.clone(),
            seq: message.seq,
            created_at: message.created_at_ms,
            body,
        })
    }

    /// Returns the message to store, with its `seq`.
    fn into_message(self) -> (u64, NewMessage) {
        let body = match self.body {
            DocumentBody::User { content } => MessageBody::User {
                content_json: content.to_string(),
            },
            DocumentBody::Assistant {
                text,
                usage,
                interrupted,
                model,
                stop_reason,
                resources,
            } => MessageBody::Assistant {
                text,
                usage: usage.map(|usage| Usage {
                    input_tokens: usage.input_tokens,
                    output_tokens: usage.output_tokens,
                }),
                interrupted,
                model,
                stop_reason,
                resources,
            },
            DocumentBody::ToolCall {
                tool_call_id,
                tool_name,
                input_json,
                parent_id,
            } => MessageBody::ToolCall {
                tool_call_id,
                tool_name,
                input_json,
                parent_id,
            },
            DocumentBody::ToolResult {
                tool_call_id,
                tool_name,
                output,
                is_error,
            } => MessageBody::ToolResult {
                tool_call_id,
                tool_name,
                output,
                is_error,
            },
            DocumentBody::Error { text, error_code } => MessageBody::Error { text, error_code },
        };
        (
            self.seq,
            NewMessage {
                message_id: self.id,
                created_at_ms: self.created_at,
                body,
            },
        )
    }
}

/// A whole conversation document, as an import reads it.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ConversationDocument {
    #[allow(dead_code, reason = "checked by the header")]
    format: String,
    #[allow(dead_code, reason = "checked by the header")]
    version: u32,
    document_id: String,
    #[allow(dead_code, reason = "informational")]
    exported_at: i64,
    #[serde(default)]
    #[allow(dead_code, reason = "informational")]
    source: Option<Source>,
    image: DocumentImage,
    messages: Vec<DocumentMessage>,
    #[serde(default)]
    #[allow(dead_code, reason = "derived from the messages")]
    resources: Vec<String>,
    #[serde(default)]
    #[allow(dead_code, reason = "derived from the messages")]
    usage: Option<DocumentUsage>,
}

/// One conversation of an import, read and checked: its document id, its
/// image's configuration and its messages with their `seq`s.
#[derive(Debug)]
pub struct ImportedConversation {
    pub document_id: String,
    pub image: DocumentImage,
    pub messages: Vec<(u64, NewMessage)>,
}

/// Writes a conversation document a piece at a time: [`begin`](Self::begin)
/// with the image, [`message`](Self::message) for each message in order,
/// [`end`](Self::end); each returns the bytes it wrote.
pub struct ExportWriter {
    messages: usize,
    usage: DocumentUsage,
    resources: BTreeSet<String>,
}

impl ExportWriter {
    /// Opens a document for `image`: everything before its messages.
    pub fn begin(image: &ImageRecord, document_id: &str, now_ms: i64) -> Result<(ExportWriter, Vec<u8>), SessionError> {
        let raw = |json: &str, field: &str| {
            RawValue::from_string(json.to_owned())
                .map_err(|_| SessionError::corrupt(format!("image {} {field}", image.image_id)))
        };
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Opening<'a> {
            format: &'a str,
            version: u32,
            document_id: &'a str,
            exported_at: i64,
            source: Source,
            image: DocumentImage,
        }
        let opening = Opening {
            format: CONVERSATION_FORMAT,
            version: DOCUMENT_VERSION,
            document_id,
            exported_at: now_ms,
            source: Source {
                container_id: image.container_id.clone(),
                image_id: image.image_id.clone(),
                session_id: image.session_id.clone(),
            },
            image: DocumentImage {
                name: image.name.clone(),
                description: image.description.clone(),
                system_prompt: image.system_prompt.clone(),
                mcp_servers: raw(&image.mcp_servers_json, "mcp_servers_json")?,
                agent: image.agent.clone(),
                variables: raw(&image.variables_json, "variables_json")?,
                tools: image.tools.clone(),
                metadata: Some(raw(&image.metadata_json, "metadata_json")?),
                created_at: image.created_at_ms,
                updated_at: image.updated_at_ms,
            },
        };
        let mut bytes = to_json(&opening)?;
        // The object stays open for the messages.
        bytes.pop();
        bytes.extend_from_slice(br#","messages":["#);
        let writer = ExportWriter {
            messages: 0,
            usage: DocumentUsage::default(),
            resources: BTreeSet::new(),
        };
        Ok((writer, bytes))
    }

    /// Writes the next message.
    pub fn message(&mut self, message: &MessageRecord, out: &mut Vec<u8>) -> Result<(), SessionError> {
        if let MessageBody::Assistant { usage, resources, .. } = &message.body {
            if let Some(usage) = usage {
                self.usage.input_tokens += usage.input_tokens;
                self.usage.output_tokens += usage.output_tokens;
            }
            self.resources.extend(resources.iter().cloned());
        }
        if self.messages > 0 {
            out.push(b',');
        }
        self.messages += 1;
        out.extend_from_slice(&to_json(&DocumentMessage::of(message)?)?);
        Ok(())
    }

    /// Closes the document: the resources the turns ran with and the usage totals.
    pub fn end(self) -> Result<Vec<u8>, SessionError> {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Closing {
            resources: BTreeSet<String>,
            usage: DocumentUsage,
        }
        let closing = to_json(&Closing {
            resources: self.resources,
            usage: self.usage,
        })?;
        // `],` then the closing object's fields, and its brace closes the document.
        let mut bytes = b"],".to_vec();
        bytes.extend_from_slice(&closing[1..]);
        Ok(bytes)
    }
}

/// Returns a container export's first line, with its newline.
pub fn container_header(container_id: &str, conversations: usize, now_ms: i64) -> Result<Vec<u8>, SessionError> {
    let mut line = to_json(&ContainerHeader {
        format: CONTAINER_FORMAT.to_owned(),
        version: DOCUMENT_VERSION,
        container_id: container_id.to_owned(),
        exported_at: now_ms,
        conversations,
    })?;
    line.push(b'\n');
    Ok(line)
}

fn to_json<T: Serialize>(value: &T) -> Result<Vec<u8>, SessionError> {
    serde_json::to_vec(value).map_err(|err| SessionError::corrupt(format!("cannot write an export: {err}")))
}

fn refused(reason: &'static str, message: impl Into<String>) -> SessionError {
    SessionError::invalid(reason, message)
}

/// Checks a line's or document's header: the format it must have, and a
/// version this server reads.
fn check_header(text: &str, format: &str, what: &str) -> Result<(), SessionError> {
    let header: Header = serde_json::from_str(text).map_err(|err| {
        refused(
            "INVALID_DOCUMENT",
            format!("{what} is not a JSON object: {}", short(&err)),
        )
    })?;
    if header.format != format {
        return Err(refused(
            "INVALID_DOCUMENT",
            format!("{what} must have \"format\": \"{format}\""),
        ));
    }
    let version = header.version.as_ref().and_then(serde_json::Value::as_u64);
    match version {
        Some(version) if version > u64::from(DOCUMENT_VERSION) => Err(SessionError::invalid(
            "UNSUPPORTED_VERSION",
            format!(
                "{what} is version {version}, newer than this server reads ({DOCUMENT_VERSION}); \
                 import it into a newer AgentVM"
            ),
        )),
        Some(version) if version >= 1 => Ok(()),
        _ => Err(refused(
            "INVALID_DOCUMENT",
            format!("{what} must have a \"version\" from 1 to {DOCUMENT_VERSION}"),
        )),
    }
}

/// Returns serde's description of a refused document without the input it quotes.
fn short(err: &serde_json::Error) -> String {
    let text = err.to_string();
    let text: String = text.chars().take(200).collect();
    text
}

/// Reads an import: one conversation document, or a container export
/// (JSON Lines whose first line has `"format": "agentvm.container"`).
/// Everything is checked here; nothing is written.
pub fn read_import(document: &[u8]) -> Result<Vec<ImportedConversation>, SessionError> {
    if document.len() > MAX_IMPORT_BYTES {
        return Err(refused(
            "DOCUMENT_TOO_LARGE",
            format!("an import must be at most {} MiB", MAX_IMPORT_BYTES / (1024 * 1024)),
        ));
    }
    let text = std::str::from_utf8(document).map_err(|_| refused("INVALID_DOCUMENT", "an import must be UTF-8"))?;
    let first = text.trim_start().lines().next().unwrap_or_default();
    let is_container = serde_json::from_str::<Header>(first).is_ok_and(|header| header.format == CONTAINER_FORMAT);
    let documents: Vec<(String, &str)> = if is_container {
        check_header(first, CONTAINER_FORMAT, "the first line")?;
        serde_json::from_str::<ContainerHeader>(first)
            .map_err(|err| refused("INVALID_DOCUMENT", format!("the first line: {}", short(&err))))?;
        text.trim_start()
            .lines()
            .enumerate()
            .skip(1)
            .filter(|(_, line)| !line.trim().is_empty())
            .map(|(index, line)| (format!("line {}", index + 1), line))
            .collect()
    } else {
        vec![("the document".to_owned(), text)]
    };
    if documents.len() > MAX_IMPORT_CONVERSATIONS {
        return Err(refused(
            "DOCUMENT_TOO_LARGE",
            format!("an import may hold at most {MAX_IMPORT_CONVERSATIONS} conversations"),
        ));
    }
    let mut seen = HashSet::new();
    let mut conversations = Vec::with_capacity(documents.len());
    for (what, text) in documents {
        let conversation = read_conversation(text, &what)?;
        if !seen.insert(conversation.document_id.clone()) {
            return Err(refused(
                "INVALID_DOCUMENT",
                format!("{what} repeats a documentId of an earlier line"),
            ));
        }
        conversations.push(conversation);
    }
    Ok(conversations)
}

fn read_conversation(text: &str, what: &str) -> Result<ImportedConversation, SessionError> {
    check_header(text, CONVERSATION_FORMAT, what)?;
    let document: ConversationDocument =
        serde_json::from_str(text).map_err(|err| refused("INVALID_DOCUMENT", format!("{what}: {}", short(&err))))?;
    if !crate::checks::is_valid_client_id(&document.document_id) {
        return Err(refused(
            "INVALID_DOCUMENT",
            format!("{what}: documentId must be 1 to 128 characters of letters, digits and . _ : @ -"),
        ));
    }
    let mut ids = HashSet::new();
    let mut last_seq = 0;
    let mut messages = Vec::with_capacity(document.messages.len());
    for (index, message) in document.messages.into_iter().enumerate() {
        let at = || format!("{what}: messages[{index}]");
        if message.seq <= last_seq {
            return Err(refused("INVALID_DOCUMENT", format!("{}: seq must rise from 1", at())));
        }
        last_seq = message.seq;
        if message.created_at <= 0 {
            return Err(refused(
                "INVALID_DOCUMENT",
                format!("{}: createdAt must be a time", at()),
            ));
        }
        if !ids.insert(message.id.clone()) {
            return Err(refused(
                "INVALID_DOCUMENT",
                format!("{}: id repeats an earlier message's", at()),
            ));
        }
        let (seq, message) = message.into_message();
        crate::checks::validate_message(&message).map_err(|err| match err {
            SessionError::Invalid { reason, message } => SessionError::Invalid {
                reason,
                message: format!("{}: {message}", at()),
            },
            other => other,
        })?;
        messages.push((seq, message));
    }
    Ok(ImportedConversation {
        document_id: document.document_id,
        image: document.image,
        messages,
    })
}

/// What an import made of one conversation (or found made by an earlier
/// import of the same document).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Imported {
    pub document_id: String,
    pub image: ImageRecord,
    /// False when an earlier import of this document made it.
    pub created: bool,
}

/// A conversation to write: its document id, its new image (ids, times and
/// checked configuration) and its messages with their `seq`s.
#[derive(Clone, Debug)]
pub struct ImportWrite {
    pub document_id: String,
    pub image: ImageRecord,
    pub messages: Vec<(u64, NewMessage)>,
}
