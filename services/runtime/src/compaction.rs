//! Context compaction: when what a turn would send nears the model's window
//! (`llm.contextWindows`, per model), the older turns give way to a summary
//! the model writes of them (a metered call like any other) or, by policy
//! (`llm.compaction = drop`) or when the summary cannot be had, are left
//! out. The cut falls before a user message, so every tool call kept keeps
//! its result. The stored history stays whole: the compaction is recorded
//! with the session (its summary and the first message still read), and an
//! agent started later loads that and the messages after it, so what a turn
//! loads and sends is bounded by the window, not by the conversation.

use std::future::Future;
use std::sync::Arc;

use avm_common::RequestContext;
use avm_common::auth::ServiceIdentity;
use avm_common::event::data;
use tokio_util::sync::CancellationToken;

use crate::agent::Agent;
use crate::config::{Compaction, LlmConfig};
use crate::context::{History, MESSAGE_TOKENS, context_to_llm, json_len, request_tokens};
use crate::error::RuntimeError;
use crate::llm::{LlmContent, LlmMessage, LlmRequest, LlmRole};
use crate::message::{Message, MessageBody};
use crate::outbox::Outbox;
use crate::peers::{Compaction as Record, Sessions};

/// A request estimated past this share of the window (less the reply's
/// room) is compacted.
const THRESHOLD: f64 = 0.8;
/// The recent turns kept whole take at most this share of it.
const KEEP: f64 = 0.4;
/// Bytes of text per token, as the estimates count them.
const BYTES_PER_TOKEN: f64 = 4.0;
/// A message's framing ([`MESSAGE_TOKENS`]) as bytes of text.
const FRAMING_BYTES: usize = MESSAGE_TOKENS as usize * 4;
/// A tool's output is cut to this many bytes in what is summarised.
const TOOL_OUTPUT_BYTES: usize = 2_000;

/// What the model is told when asked for a summary.
const SUMMARY_INSTRUCTIONS: &str = "You summarise a conversation between a user and an AI assistant so that the \
assistant can go on with it without the messages themselves. Keep what later turns need: the user's goals, \
requests and preferences, decisions made, facts and figures given, names of files, tools used and what they \
returned, and what is still open. Be concise and factual; write it as notes, not as a reply to the user.";

/// What a compaction reads, writes and answers to.
pub(crate) struct Compactor<'a> {
    pub(crate) sessions: &'a Sessions,
    pub(crate) outbox: &'a Outbox,
    pub(crate) identity: &'a ServiceIdentity,
    pub(crate) ctx: &'a RequestContext,
    pub(crate) agent: &'a Agent,
    pub(crate) config: &'a LlmConfig,
    /// The turn's: an interrupt during the summary leaves the context alone.
    pub(crate) cancel: &'a CancellationToken,
}

impl Compactor<'_> {
    /// Compacts the agent's context when `request` (`tokens_before` by
    /// [`request_tokens`]) nears the model's window, asking `summarize` for
    /// the summary (a metered call, the caller's); returns the conversation
    /// to send instead with its tokens, or `None` to send it as it is. One
    /// that cannot be made (nothing older than the current turn, the session
    /// service away) leaves the conversation alone.
    pub(crate) async fn compact<F, S>(
        &self,
        request: &LlmRequest,
        tokens_before: u64,
        summarize: S,
    ) -> Option<(History, u64)>
    where
        S: FnOnce(LlmRequest) -> F,
        F: Future<Output = Option<String>>,
    {
        let policy = self.config.compaction;
        if policy == Compaction::Off {
            return None;
        }
        let window = self.config.context_window(&request.model);
        let room = window.saturating_sub(u64::from(request.max_tokens)).max(1) as f64;
        if (tokens_before as f64) <= room * THRESHOLD {
            return None;
        }
        let agent = self.agent;
        let session_id = &agent.image.session_id;
        let (own, (previous, messages)) = match self.load().await {
            Ok(loaded) => loaded,
            Err(err) => {
                tracing::warn!(session_id, error = %err, "cannot load the context to compact it; sent whole");
                return None;
            }
        };
        let keep_bytes = (room * KEEP * BYTES_PER_TOKEN) as usize;
        let cut = cut(&messages, keep_bytes)?;
        let previous_summary = previous.map(|record| record.summary).unwrap_or_default();
        let (summary, method) = match policy {
            Compaction::Summarize => {
                let transcript = transcript(&previous_summary, &messages[..cut], (room * BYTES_PER_TOKEN) as usize);
                match summarize(summary_request(request, transcript)).await {
                    Some(summary) => (summary, "summarized"),
                    // The turn is being interrupted; its call says so.
                    None if self.cancel.is_cancelled() => return None,
                    None => (previous_summary, "dropped"),
                }
            }
            Compaction::Drop | Compaction::Off => (String::new(), "dropped"),
        };
        let kept = &messages[cut..];
        let history = context_to_llm(Some(&summary), kept);
        let tokens_after = request_tokens(&LlmRequest {
            messages: Arc::clone(&history),
            model: String::new(),
            system: request.system.clone(),
            max_tokens: 0,
            tools: Arc::default(),
        });
        let record = Record {
            from_message_id: kept[0].message_id.clone(),
            from_seq: 0,
            method: method.to_owned(),
            summary,
            compacted_messages: cut as u64,
            tokens_before,
            tokens_after,
            created_at_ms: 0,
        };
        // Not recorded, it is still used: a later start compacts again.
        if let Err(err) = self.sessions.record_compaction(&own, session_id, record).await {
            tracing::warn!(session_id, error = %err, "a compaction could not be recorded");
        }
        agent.replace_history(Arc::clone(&history));
        metrics::counter!("avm_runtime_context_compactions_total", "method" => method).increment(1);
        tracing::info!(
            image_id = %agent.image.image_id,
            method,
            compacted = cut,
            tokens_before,
            tokens_after,
            window,
            "context compacted"
        );
        agent.emit(data::ContextCompacted {
            image_id: agent.image.image_id.clone(),
            session_id: session_id.clone(),
            through_message_id: messages[cut - 1].message_id.clone(),
            compacted_messages: cut as u64,
            method: method.to_owned(),
            tokens_before,
            tokens_after,
        });
        Some((history, tokens_after))
    }

    /// Reads what the model reads of the session, with the runtime's own
    /// credential (returned too), once what waits in the outbox is stored.
    async fn load(&self) -> Result<(RequestContext, Loaded), RuntimeError> {
        let session_id = &self.agent.image.session_id;
        self.outbox.settle(&self.ctx.tenant_id, session_id).await?;
        let own = self.identity.context_for(self.ctx).await?;
        let context = self.sessions.list_context(&own, session_id).await?;
        Ok((own, context))
    }
}

/// A session's latest compaction and the messages from it on.
type Loaded = (Option<Record>, Vec<Message>);

/// Returns where the kept messages start: the earliest user message after
/// which at most `keep_bytes` follow, or the last user message when even
/// its turn is larger. `None` when no message would be compacted.
fn cut(messages: &[Message], keep_bytes: usize) -> Option<usize> {
    let mut after = 0;
    let mut cut = None;
    for (index, message) in messages.iter().enumerate().rev() {
        after += bytes(message);
        if matches!(message.body, MessageBody::User(_)) {
            if cut.is_some() && after > keep_bytes {
                break;
            }
            cut = Some(index);
        }
    }
    cut.filter(|&index| index > 0)
}

/// The bytes a message sends, its framing counted as text.
fn bytes(message: &Message) -> usize {
    let text = match &message.body {
        MessageBody::User(content) => content
            .to_llm()
            .iter()
            .map(|part| match part {
                LlmContent::Text(text) => text.len(),
                _ => 0,
            })
            .sum(),
        MessageBody::Assistant(reply) => reply.text.len(),
        MessageBody::ToolCall { call, .. } => call.name.len() + json_len(&call.input),
        MessageBody::ToolResult { output, .. } => output.text.len(),
        _ => 0,
    };
    text + FRAMING_BYTES
}

/// The messages to summarise as plain text, after the previous summary, at
/// most `limit` bytes: the oldest go first when it is longer.
fn transcript(previous: &str, messages: &[Message], limit: usize) -> String {
    let mut lines: Vec<String> = Vec::with_capacity(messages.len() + 1);
    if !previous.is_empty() {
        lines.push(format!("Summary of what came before:\n{previous}"));
    }
    for message in messages {
        let line = match &message.body {
            MessageBody::User(content) => {
                let text: Vec<String> = content
                    .to_llm()
                    .into_iter()
                    .filter_map(|part| match part {
                        LlmContent::Text(text) => Some(text),
                        _ => None,
                    })
                    .collect();
                format!("User: {}", text.join(" "))
            }
            MessageBody::Assistant(reply) if !reply.text.is_empty() => format!("Assistant: {}", reply.text),
            MessageBody::ToolCall { call, .. } => format!("Assistant called {} with {}", call.name, call.input),
            MessageBody::ToolResult { output, .. } => {
                let text = truncated(&output.text, TOOL_OUTPUT_BYTES);
                format!("Tool result{}: {text}", if output.is_error { " (error)" } else { "" })
            }
            _ => continue,
        };
        lines.push(line);
    }
    let mut text = lines.join("\n\n");
    if text.len() > limit {
        let mut start = text.len() - limit;
        while !text.is_char_boundary(start) {
            start += 1;
        }
        text.drain(..start);
    }
    text
}

/// At most `limit` bytes of `text`, cut at a character boundary.
fn truncated(text: &str, limit: usize) -> &str {
    if text.len() <= limit {
        return text;
    }
    let mut end = limit;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The request that asks the model for a summary of `transcript`, without tools.
fn summary_request(request: &LlmRequest, transcript: String) -> LlmRequest {
    LlmRequest {
        model: request.model.clone(),
        system: Some(SUMMARY_INSTRUCTIONS.to_owned()),
        messages: Arc::new(vec![LlmMessage {
            role: LlmRole::User,
            content: vec![LlmContent::Text(format!(
                "Summarise this conversation:\n\n{transcript}"
            ))],
        }]),
        max_tokens: request.max_tokens.min(2_048),
        tools: Arc::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::{ToolCall, ToolOutput};
    use crate::message::{Content, Part, Reply as Said};

    fn message(id: &str, body: MessageBody) -> Message {
        Message {
            message_id: id.into(),
            session_id: "sess_1".into(),
            created_at_ms: 0,
            body,
        }
    }

    fn user(id: &str, text: &str) -> Message {
        message(
            id,
            MessageBody::User(Content {
                parts: vec![Part::Text(text.into())],
                plain_text: true,
            }),
        )
    }

    fn assistant(id: &str, text: &str) -> Message {
        message(
            id,
            MessageBody::Assistant(Said {
                text: text.into(),
                ..Said::default()
            }),
        )
    }

    fn call(id: &str) -> Message {
        message(
            id,
            MessageBody::ToolCall {
                call: ToolCall {
                    id: format!("t_{id}"),
                    name: "read_file".into(),
                    input: serde_json::json!({}),
                },
                parent_id: String::new(),
            },
        )
    }

    fn result(id: &str, call_id: &str, text: &str) -> Message {
        message(
            id,
            MessageBody::ToolResult {
                output: ToolOutput {
                    tool_call_id: format!("t_{call_id}"),
                    text: text.into(),
                    is_error: false,
                },
                tool_name: "read_file".into(),
            },
        )
    }

    #[test]
    fn the_cut_falls_before_a_user_message_and_keeps_what_fits() {
        let ten = "x".repeat(10);
        let history = [
            user("u1", &ten),
            assistant("a1", &ten),
            user("u2", &ten),
            call("c2"),
            result("r2", "c2", &ten),
            assistant("a2", &ten),
            user("u3", &ten),
            assistant("a3", &ten),
        ];
        // u3 a3 is 52 bytes with their framing; u2's turn takes it past 60.
        assert_eq!(cut(&history, 60), Some(6));
        assert_eq!(cut(&history, 1_000), None, "everything fits: nothing to compact");
        // Even the last turn is larger than what may be kept: it is kept whole.
        assert_eq!(cut(&history, 5), Some(6));
        // A conversation of one turn has nothing older to compact.
        assert_eq!(cut(&history[..2], 5), None);
        // What is kept never starts inside a turn: its tool calls keep their results.
        assert_eq!(cut(&history, 200), Some(2));
        let kept = &history[cut(&history, 200).unwrap()..];
        assert!(matches!(kept[0].body, MessageBody::User(_)), "{kept:?}");
        let llm = context_to_llm(Some("earlier"), kept);
        assert_eq!(llm[0].role, LlmRole::User);
        assert!(matches!(&llm[0].content[0], LlmContent::Text(text) if text.ends_with("earlier")));
    }

    #[test]
    fn the_transcript_is_bounded_and_keeps_its_latest_part() {
        let history = [
            user("u1", "first"),
            assistant("a1", "reply"),
            call("c1"),
            result("r1", "c1", &"é".repeat(5_000)),
        ];
        let text = transcript("before", &history, 100_000);
        assert!(text.starts_with("Summary of what came before:\nbefore"), "{text}");
        assert!(text.contains("User: first") && text.contains("Assistant called read_file"));
        assert!(text.len() < 3_000, "a tool's output is cut: {}", text.len());
        let short = transcript("before", &history, 50);
        assert!(short.len() <= 50 && short.ends_with('é'), "{short}");
    }
}
