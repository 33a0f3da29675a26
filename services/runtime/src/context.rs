//! The conversation an agent holds: its history as the LLM reads it, shared
//! with each turn's request rather than copied into it.

use std::collections::HashSet;
use std::sync::Arc;

use crate::llm::{LlmContent, LlmMessage, LlmRequest, LlmRole, ToolOutput};
use crate::message::{Message, MessageBody};
use crate::metering::estimate_tokens;

/// The messages an LLM request carries; a turn holds the same allocation as
/// its agent, and the agent copies it only to append while a turn still
/// holds it (a copy-on-write of the vector, never of the messages' text).
pub type History = Arc<Vec<LlmMessage>>;

/// What a tool call left without its result is answered with, so that the
/// next request is valid (the providers refuse unpaired calls).
pub const UNANSWERED: &str = "the tool call was not completed (interrupted or stopped)";

/// What stands before a compacted conversation's summary.
pub const SUMMARY_HEADER: &str = "Summary of the conversation before this point:";

/// Turns stored history into alternating LLM messages.
///
/// Error messages are not part of the conversation; empty assistant messages
/// (an interrupt before any text) are skipped; consecutive messages of one
/// role (a user message whose turn failed, then another) are merged, because
/// providers expect roles to alternate. Tool calls join their reply's
/// assistant message and tool results the user message after it; a call
/// found without its result (a runtime that stopped mid-call) gets an error
/// result.
///
/// After a compaction, its summary (when it has one) is read first, as the
/// user's, and `history` holds the messages it kept.
pub fn context_to_llm(summary: Option<&str>, history: &[Message]) -> History {
    let mut messages: Vec<LlmMessage> = Vec::with_capacity(history.len() + 1);
    let history = match summary.filter(|summary| !summary.is_empty()) {
        Some(summary) => {
            messages.push(LlmMessage {
                role: LlmRole::User,
                content: vec![LlmContent::Text(format!("{SUMMARY_HEADER}\n\n{summary}"))],
            });
            history
        }
        // The model reads the user first: what is left of a turn whose
        // start retention deleted is not sent.
        None => {
            let first_user = history
                .iter()
                .position(|message| matches!(message.body, MessageBody::User(_)))
                .unwrap_or(history.len());
            &history[first_user..]
        }
    };
    // A result whose call is not in the history (retention deleted the
    // older messages by age) is left out: providers refuse it.
    let mut calls: HashSet<&str> = HashSet::new();
    for message in history {
        let (role, content) = match &message.body {
            MessageBody::User(content) => (LlmRole::User, content.to_llm()),
            MessageBody::Assistant(reply) if !reply.text.is_empty() => {
                (LlmRole::Assistant, vec![LlmContent::Text(reply.text.clone())])
            }
            MessageBody::ToolCall { call, .. } => {
                calls.insert(&call.id);
                (LlmRole::Assistant, vec![LlmContent::ToolUse(call.clone())])
            }
            MessageBody::ToolResult { output, .. } if calls.contains(output.tool_call_id.as_str()) => {
                (LlmRole::User, vec![LlmContent::ToolResult(output.clone())])
            }
            _ => continue,
        };
        push_message(&mut messages, role, content);
    }
    pair_tool_calls(&mut messages);
    Arc::new(messages)
}

/// Appends to the conversation, merging into the last message when roles repeat.
///
/// Within a message, text comes before tool calls and tool results before
/// text, the order the providers expect.
pub fn push_message(messages: &mut Vec<LlmMessage>, role: LlmRole, content: Vec<LlmContent>) {
    match messages.last_mut() {
        Some(last) if last.role == role => {
            last.content.extend(content);
            // A stable sort: the order within each kind stays.
            last.content.sort_by_key(|part| match (role, part) {
                (LlmRole::Assistant, LlmContent::ToolUse(_)) => 1,
                (LlmRole::User, LlmContent::ToolResult(_)) => 0,
                (LlmRole::User, _) => 1,
                _ => 0,
            });
        }
        _ => messages.push(LlmMessage { role, content }),
    }
}

/// Gives every tool call without a result in the next message an error result.
fn pair_tool_calls(messages: &mut Vec<LlmMessage>) {
    let mut index = 0;
    while index < messages.len() {
        let calls: Vec<String> = messages[index]
            .content
            .iter()
            .filter_map(|part| match part {
                LlmContent::ToolUse(call) if messages[index].role == LlmRole::Assistant => Some(call.id.clone()),
                _ => None,
            })
            .collect();
        if !calls.is_empty() {
            let answered: Vec<&str> = messages
                .get(index + 1)
                .filter(|next| next.role == LlmRole::User)
                .map(|next| {
                    next.content
                        .iter()
                        .filter_map(|part| match part {
                            LlmContent::ToolResult(output) => Some(output.tool_call_id.as_str()),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default();
            let missing: Vec<LlmContent> = calls
                .iter()
                .filter(|id| !answered.contains(&id.as_str()))
                .map(|id| {
                    LlmContent::ToolResult(ToolOutput {
                        tool_call_id: id.clone(),
                        text: UNANSWERED.to_owned(),
                        is_error: true,
                    })
                })
                .collect();
            if !missing.is_empty() {
                if messages.get(index + 1).is_some_and(|next| next.role == LlmRole::User) {
                    push_into(&mut messages[index + 1], missing);
                } else {
                    messages.insert(
                        index + 1,
                        LlmMessage {
                            role: LlmRole::User,
                            content: missing,
                        },
                    );
                }
            }
        }
        index += 1;
    }
}

/// Adds results to a user message, after its results and before the rest.
fn push_into(message: &mut LlmMessage, results: Vec<LlmContent>) {
    let at = message
        .content
        .iter()
        .position(|part| !matches!(part, LlmContent::ToolResult(_)))
        .unwrap_or(message.content.len());
    message.content.splice(at..at, results);
}

/// Tokens a message costs beyond its text (its role and the framing of its
/// parts), as providers count them: a conversation of short messages is
/// not a few bytes.
pub const MESSAGE_TOKENS: u64 = 4;

/// Returns the input tokens a request is expected to cost: a token per 4
/// bytes of its text, plus each message's framing. What a turn checks
/// against the model's window and reserves against budgets.
pub fn request_tokens(request: &LlmRequest) -> u64 {
    let messages = u64::try_from(request.messages.len()).unwrap_or(u64::MAX);
    estimate_tokens(request_chars(request)).saturating_add(messages.saturating_mul(MESSAGE_TOKENS))
}

/// Returns the UTF-8 bytes of text a request sends.
fn request_chars(request: &LlmRequest) -> usize {
    let system = request.system.as_ref().map_or(0, String::len);
    let messages: usize = request
        .messages
        .iter()
        .flat_map(|message| message.content.iter())
        .map(|part| match part {
            LlmContent::Text(text) => text.len(),
            LlmContent::ToolUse(call) => call.name.len() + json_len(&call.input),
            LlmContent::ToolResult(output) => output.text.len(),
            LlmContent::Image { .. } | LlmContent::File { .. } => 0,
        })
        .sum();
    system + messages
}

/// The bytes of `value` as JSON, counted without writing them anywhere.
pub fn json_len(value: &serde_json::Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Writing a `Value` to a sink that takes everything cannot fail.
    let _ = serde_json::to_writer(&mut count, value);
    count.0
}

/// Appends to a shared history: in place when no turn holds it any more.
pub fn append(history: &mut History, role: LlmRole, content: Vec<LlmContent>) {
    push_message(Arc::make_mut(history), role, content);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{Content, Part, Reply};

    #[test]
    fn a_request_costs_its_text_and_each_message_s_framing() {
        let input = serde_json::json!({"path": "a.txt", "lines": [1, 2], "note": "é\"\n"});
        assert_eq!(json_len(&input), input.to_string().len());
        let text = |text: &str| LlmMessage {
            role: LlmRole::User,
            content: vec![LlmContent::Text(text.into())],
        };
        let request = LlmRequest {
            model: "m".into(),
            system: Some("sys".into()),
            messages: Arc::new(vec![text("hello"), text("there"), text("")]),
            max_tokens: 10,
            tools: Arc::default(),
        };
        // 13 bytes of text (a token per 4, rounded up) and 3 messages' framing.
        assert_eq!(request_tokens(&request), 4 + 3 * MESSAGE_TOKENS);
        // A conversation of short messages is not a few bytes: 1,000
        // two-byte ones cost some 5,000 tokens, not 500.
        let many = LlmRequest {
            messages: Arc::new(vec![text("hi"); 1_000]),
            ..request
        };
        assert!(request_tokens(&many) >= 4_000, "{}", request_tokens(&many));
    }

    fn message(body: MessageBody) -> Message {
        Message {
            message_id: String::new(),
            session_id: String::new(),
            created_at_ms: 0,
            body,
        }
    }

    fn user(text: &str) -> Message {
        message(MessageBody::User(Content {
            parts: vec![Part::Text(text.into())],
            plain_text: true,
        }))
    }

    fn assistant(text: &str) -> Message {
        message(MessageBody::Assistant(Reply {
            text: text.into(),
            ..Reply::default()
        }))
    }

    #[test]
    fn history_alternates_and_skips_errors_and_empty_replies() {
        let error = message(MessageBody::Error {
            text: "boom".into(),
            error_code: "X".into(),
        });
        let history = [user("a"), error, user("b"), assistant(""), assistant("c"), user("d")];
        let messages = context_to_llm(None, &history);
        let roles: Vec<_> = messages.iter().map(|m| m.role).collect();
        assert_eq!(roles, [LlmRole::User, LlmRole::Assistant, LlmRole::User]);
        assert_eq!(messages[0].content.len(), 2);
    }

    #[test]
    fn tool_calls_pair_with_their_results_and_unanswered_ones_get_an_error() {
        use crate::llm::ToolCall;
        let call = |id: &str| {
            message(MessageBody::ToolCall {
                call: ToolCall {
                    id: id.into(),
                    name: "read_file".into(),
                    input: serde_json::json!({}),
                },
                parent_id: "msg_1".into(),
            })
        };
        let result = |id: &str| {
            message(MessageBody::ToolResult {
                output: ToolOutput {
                    tool_call_id: id.into(),
                    text: "ok".into(),
                    is_error: false,
                },
                tool_name: "read_file".into(),
            })
        };
        // t1 and t2 in one reply, only t1 answered (the runtime stopped), then
        // the user wrote again; later t3 was answered.
        let history = [
            user("a"),
            call("t1"),
            call("t2"),
            result("t1"),
            user("b"),
            assistant("looking"),
            call("t3"),
            result("t3"),
            assistant("done"),
        ];
        let messages = context_to_llm(None, &history);
        let roles: Vec<_> = messages.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            [
                LlmRole::User,
                LlmRole::Assistant,
                LlmRole::User,
                LlmRole::Assistant,
                LlmRole::User,
                LlmRole::Assistant
            ]
        );
        let results: Vec<_> = messages[2]
            .content
            .iter()
            .map(|part| match part {
                LlmContent::ToolResult(output) => (output.tool_call_id.as_str(), output.is_error),
                LlmContent::Text(text) => (text.as_str(), false),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(results, [("t1", false), ("t2", true), ("b", false)]);
        assert!(matches!(
            &messages[3].content[..],
            [LlmContent::Text(_), LlmContent::ToolUse(_)]
        ));
    }

    #[test]
    fn a_result_whose_call_is_gone_is_left_out() {
        use crate::llm::ToolOutput;
        let orphan = message(MessageBody::ToolResult {
            output: ToolOutput {
                tool_call_id: "gone".into(),
                text: "ok".into(),
                is_error: false,
            },
            tool_name: "read_file".into(),
        });
        // Retention left the end of a turn: the model reads from the next user message.
        let messages = context_to_llm(None, &[orphan.clone(), assistant("b"), user("c"), assistant("d")]);
        let roles: Vec<_> = messages.iter().map(|m| m.role).collect();
        assert_eq!(roles, [LlmRole::User, LlmRole::Assistant]);
        // After a summary, a result whose call is gone is left out.
        let messages = context_to_llm(Some("s"), &[user("a"), orphan, assistant("b")]);
        assert_eq!(messages.len(), 2);
        assert!(
            messages
                .iter()
                .flat_map(|m| &m.content)
                .all(|part| !matches!(part, LlmContent::ToolResult(_)))
        );
    }

    #[test]
    fn appending_copies_only_while_a_turn_holds_the_history() {
        let mut history = context_to_llm(None, &[user("a")]);
        let before = Arc::as_ptr(&history);
        append(&mut history, LlmRole::Assistant, vec![LlmContent::Text("b".into())]);
        assert_eq!(Arc::as_ptr(&history), before, "nobody else held it: appended in place");
        let turn = Arc::clone(&history);
        append(&mut history, LlmRole::User, vec![LlmContent::Text("c".into())]);
        assert_eq!((turn.len(), history.len()), (2, 3), "the turn keeps what it was given");
    }
}
