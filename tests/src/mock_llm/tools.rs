//! Scripted tool calls: a reply that calls given tools with given inputs,
//! then, once their results are in the conversation, a reply that uses them;
//! and the real APIs' refusal of a tool call left without its result.

use serde_json::{Value, json};

use super::MockApi;

/// A tool call the mock makes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MockToolCall {
    pub name: String,
    /// The call's input, a JSON object.
    pub input: Value,
    /// The reply (1 for the first) that makes this call; calls of round 1
    /// only are repeated for `tool_rounds` replies.
    pub round: usize,
}

/// Returns the names of the tools a request offers the model.
pub(super) fn offered(api: MockApi, body: &Value) -> Vec<String> {
    let tools = body.get("tools").and_then(Value::as_array).cloned().unwrap_or_default();
    tools
        .iter()
        .filter_map(|tool| match api {
            MockApi::Anthropic => tool.get("name"),
            MockApi::OpenAi => tool.get("function").and_then(|function| function.get("name")),
        })
        .filter_map(Value::as_str)
        .map(str::to_owned)
        .collect()
}

/// Returns the calls of the reply after `rounds_done` tool rounds, if it calls any.
pub(super) fn calls_for(calls: &[MockToolCall], tool_rounds: usize, rounds_done: usize) -> Option<Vec<MockToolCall>> {
    if calls.is_empty() {
        return None;
    }
    let scripted = calls.iter().any(|call| call.round > 1);
    let round = rounds_done + 1;
    let due: Vec<MockToolCall> = if scripted {
        calls.iter().filter(|call| call.round == round).cloned().collect()
    } else if rounds_done < tool_rounds {
        calls.to_vec()
    } else {
        Vec::new()
    };
    (!due.is_empty()).then_some(due)
}

impl std::str::FromStr for MockToolCall {
    type Err = String;

    /// Parses `name` or `name:{json object}`, optionally after the round:
    /// `2:name:{…}`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (round, text) = match text.split_once(':') {
            Some((round, rest)) if !round.is_empty() && round.bytes().all(|b| b.is_ascii_digit()) => {
                let round: usize = round.parse().map_err(|_| format!("bad round {round:?}"))?;
                if round == 0 {
                    return Err("rounds count from 1".to_owned());
                }
                (round, rest)
            }
            _ => (1, text),
        };
        let (name, input) = match text.split_once(':') {
            Some((name, input)) => {
                let input: Value =
                    serde_json::from_str(input).map_err(|err| format!("bad tool input {input:?}: {err}"))?;
                if !input.is_object() {
                    return Err(format!("tool input must be a JSON object: {input}"));
                }
                (name, input)
            }
            None => (text, json!({})),
        };
        if name.is_empty() {
            return Err("a tool call needs a tool name".to_owned());
        }
        Ok(Self {
            name: name.to_owned(),
            input,
            round,
        })
    }
}

/// Where the conversation stands since the user's last text message.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Progress {
    /// Replies of the assistant since then: each one a round of tool calls.
    pub rounds: usize,
    /// The texts of the tool results that end the conversation, in order.
    pub results: Vec<String>,
}

/// Returns whether a message is one the user typed (not tool results only).
pub(super) fn is_user_text(api: MockApi, message: &Value) -> bool {
    if message["role"] != "user" {
        return false;
    }
    match (api, &message["content"]) {
        (MockApi::Anthropic, Value::Array(parts)) => parts.iter().any(|part| part["type"] != "tool_result"),
        _ => true,
    }
}

/// Reads how many tool rounds happened since the user's last text and what
/// the last round's tools answered.
pub(super) fn progress(api: MockApi, body: &Value) -> Progress {
    let Some(messages) = body["messages"].as_array() else {
        return Progress::default();
    };
    let since = messages
        .iter()
        .rposition(|message| is_user_text(api, message))
        .map_or(0, |at| at + 1);
    let tail = &messages[since..];
    let rounds = tail.iter().filter(|message| message["role"] == "assistant").count();
    let results = match api {
        MockApi::Anthropic => tail
            .last()
            .filter(|message| message["role"] == "user")
            .and_then(|message| message["content"].as_array())
            .into_iter()
            .flatten()
            .filter(|part| part["type"] == "tool_result")
            .map(|part| result_text(&part["content"]))
            .collect(),
        MockApi::OpenAi => {
            let trailing = tail
                .iter()
                .rev()
                .take_while(|message| message["role"] == "tool")
                .count();
            tail[tail.len() - trailing..]
                .iter()
                .map(|message| result_text(&message["content"]))
                .collect()
        }
    };
    Progress { rounds, results }
}

/// Returns a tool result's text: a string, or the text of its parts.
fn result_text(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part["text"].as_str())
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// Refuses, as the real APIs do with a 400, a tool call whose result does not
/// come right after it, and a result that answers no call.
pub(super) fn check_pairing(api: MockApi, body: &Value) -> Result<(), String> {
    let Some(messages) = body["messages"].as_array() else {
        return Ok(());
    };
    match api {
        MockApi::Anthropic => {
            let mut open: Vec<&str> = Vec::new();
            for (index, message) in messages.iter().enumerate() {
                let parts = message["content"].as_array().map(Vec::as_slice).unwrap_or_default();
                let answered: Vec<&str> = parts
                    .iter()
                    .filter(|part| part["type"] == "tool_result")
                    .filter_map(|part| part["tool_use_id"].as_str())
                    .collect();
                if let Some(id) = answered.iter().find(|id| !open.contains(id)) {
                    return Err(format!(
                        "messages.{index}.content: unexpected `tool_use_id` found in `tool_result` blocks: {id}. \
                         Each `tool_result` block must have a corresponding `tool_use` block in the previous message."
                    ));
                }
                let missing: Vec<&str> = open.iter().copied().filter(|id| !answered.contains(id)).collect();
                if !missing.is_empty() {
                    return Err(format!(
                        "messages.{index}: `tool_use` ids were found without `tool_result` blocks immediately \
                         after: {}. Each `tool_use` block must have a corresponding `tool_result` block in the next message.",
                        missing.join(", ")
                    ));
                }
                open = parts
                    .iter()
                    .filter(|part| part["type"] == "tool_use")
                    .filter_map(|part| part["id"].as_str())
                    .collect();
            }
            if !open.is_empty() {
                return Err(format!(
                    "messages: `tool_use` ids were found without `tool_result` blocks immediately after: {}",
                    open.join(", ")
                ));
            }
        }
        MockApi::OpenAi => {
            let mut open: Vec<&str> = Vec::new();
            for (index, message) in messages.iter().enumerate() {
                if message["role"] == "tool" {
                    let id = message["tool_call_id"].as_str().unwrap_or_default();
                    let Some(at) = open.iter().position(|open| *open == id) else {
                        return Err(format!(
                            "Invalid parameter: messages.[{index}]: messages with role 'tool' must be a response \
                             to a preceeding message with 'tool_calls'."
                        ));
                    };
                    open.remove(at);
                    continue;
                }
                if !open.is_empty() {
                    return Err(format!(
                        "An assistant message with 'tool_calls' must be followed by tool messages responding to \
                         each 'tool_call_id'. The following tool_call_ids did not have response messages: {}",
                        open.join(", ")
                    ));
                }
                open = message["tool_calls"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|call| call["id"].as_str())
                    .collect();
            }
            if !open.is_empty() {
                return Err(format!(
                    "An assistant message with 'tool_calls' must be followed by tool messages responding to each \
                     'tool_call_id'. The following tool_call_ids did not have response messages: {}",
                    open.join(", ")
                ));
            }
        }
    }
    Ok(())
}

/// Splits a call's input JSON into the pieces streamed for it, as providers
/// do: a few fragments that only together make the JSON.
pub(super) fn input_pieces(input: &Value) -> Vec<String> {
    let text = input.to_string();
    let chars: Vec<char> = text.chars().collect();
    let size = chars.len().div_ceil(3).max(1);
    chars.chunks(size).map(|chunk| chunk.iter().collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_calls() {
        let call: MockToolCall = r#"write_file:{"path":"a.txt"}"#.parse().unwrap();
        assert_eq!(call.name, "write_file");
        assert_eq!(call.input, json!({"path": "a.txt"}));
        assert_eq!("list_files".parse::<MockToolCall>().unwrap().input, json!({}));
        assert!("x:[1]".parse::<MockToolCall>().is_err());
        assert!(":{}".parse::<MockToolCall>().is_err());
        let later: MockToolCall = r#"2:run_command:{"command":"ls"}"#.parse().unwrap();
        assert_eq!((later.round, later.name.as_str()), (2, "run_command"));
        assert!("0:x".parse::<MockToolCall>().is_err());
    }

    #[test]
    fn scripted_rounds_call_in_turn_and_plain_calls_repeat() {
        let call = |text: &str| text.parse::<MockToolCall>().unwrap();
        let plain = [call("a")];
        assert_eq!(calls_for(&plain, 2, 0).map(|c| c.len()), Some(1));
        assert_eq!(calls_for(&plain, 2, 1).map(|c| c.len()), Some(1));
        assert_eq!(calls_for(&plain, 2, 2), None);
        let scripted = [call("a"), call("b"), call("2:c")];
        assert_eq!(calls_for(&scripted, 1, 0).map(|c| c.len()), Some(2));
        assert_eq!(
            calls_for(&scripted, 1, 1).map(|c| c[0].name.clone()),
            Some("c".to_owned())
        );
        assert_eq!(calls_for(&scripted, 1, 2), None);
    }

    #[test]
    fn input_pieces_make_the_input() {
        let input = json!({"command": "cat a.txt", "n": 1});
        let pieces = input_pieces(&input);
        assert!(pieces.len() > 1);
        assert_eq!(serde_json::from_str::<Value>(&pieces.concat()).unwrap(), input);
    }

    #[test]
    fn unpaired_calls_are_refused_in_both_formats() {
        let anthropic = |messages: Value| check_pairing(MockApi::Anthropic, &json!({"messages": messages}));
        let call =
            json!({"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "x", "input": {}}]});
        let result =
            json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]});
        let user = json!({"role": "user", "content": "hi"});
        assert!(anthropic(json!([user, call, result])).is_ok());
        assert!(anthropic(json!([user, call, user])).is_err());
        assert!(anthropic(json!([user, result])).is_err());
        assert!(anthropic(json!([user, call])).is_err());

        let openai = |messages: Value| check_pairing(MockApi::OpenAi, &json!({"messages": messages}));
        let call = json!({"role": "assistant", "content": null,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "x", "arguments": "{}"}}]});
        let result = json!({"role": "tool", "tool_call_id": "c1", "content": "ok"});
        assert!(openai(json!([user, call, result])).is_ok());
        assert!(openai(json!([user, call, user])).is_err());
        assert!(openai(json!([user, result])).is_err());
        assert!(openai(json!([user, call])).is_err());
    }

    #[test]
    fn progress_counts_rounds_and_reads_the_last_results() {
        let body = json!({"messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "x", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "42"}]}]},
        ]});
        assert_eq!(
            progress(MockApi::Anthropic, &body),
            Progress {
                rounds: 1,
                results: vec!["42".into()]
            }
        );
        let body = json!({"messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": null, "tool_calls": []},
            {"role": "tool", "tool_call_id": "c1", "content": "a"},
            {"role": "tool", "tool_call_id": "c2", "content": "b"},
        ]});
        assert_eq!(
            progress(MockApi::OpenAi, &body),
            Progress {
                rounds: 1,
                results: vec!["a".into(), "b".into()]
            }
        );
    }
}
