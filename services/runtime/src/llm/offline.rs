//! The network-free provider used when no LLM is configured: it streams a
//! deterministic reply that says so and echoes the user's last message, so
//! `avm serve` works end to end on a bare machine.

use futures::StreamExt;

use super::{LlmContent, LlmError, LlmEvent, LlmProvider, LlmRequest, LlmRole, LlmStream, StopReason};
use crate::config::{LlmConfig, OFFLINE_MODEL};

/// What every offline reply starts with.
const PREAMBLE: &str =
    "AgentVM is running offline: no LLM provider is configured (set LLM_PROVIDER and LLM_API_KEY). You said:";

/// Answers without a network, deterministically.
pub struct OfflineProvider;

impl OfflineProvider {
    /// Returns the offline provider; it reports [`OFFLINE_MODEL`] as its model,
    /// whatever `config.model` says.
    pub fn new(_config: &LlmConfig) -> Self {
        Self
    }

    /// Returns the events of the reply to `request`, all of them at once.
    fn reply(&self, request: &LlmRequest) -> Vec<LlmEvent> {
        let said = request
            .messages
            .iter()
            .rev()
            .find(|message| message.role == LlmRole::User)
            .map(|message| texts(&message.content).collect::<Vec<_>>().join(" "))
            .unwrap_or_default();
        let said = said.trim();
        let text = if said.is_empty() {
            format!("{PREAMBLE} (nothing)")
        } else {
            format!("{PREAMBLE} {said}")
        };
        let deltas = split_words(&text);
        let input_words = request.system.iter().map(|system| count_words(system)).sum::<usize>()
            + request
                .messages
                .iter()
                .flat_map(|message| texts(&message.content))
                .map(count_words)
                .sum::<usize>();
        let output_tokens = deltas.len() as u64;
        let mut events = Vec::with_capacity(deltas.len() + 3);
        events.push(LlmEvent::Start {
            model: OFFLINE_MODEL.to_owned(),
            input_tokens: Some(input_words as u64),
        });
        events.extend(deltas.into_iter().map(|delta| LlmEvent::TextDelta(delta.to_owned())));
        events.push(LlmEvent::Usage {
            input_tokens: Some(input_words as u64),
            output_tokens: Some(output_tokens),
        });
        events.push(LlmEvent::Stop {
            reason: StopReason::EndTurn,
        });
        events
    }
}

#[async_trait::async_trait]
impl LlmProvider for OfflineProvider {
    fn name(&self) -> &'static str {
        "offline"
    }

    async fn stream(&self, request: LlmRequest) -> Result<LlmStream, LlmError> {
        Ok(futures::stream::iter(self.reply(&request).into_iter().map(Ok)).boxed())
    }
}

fn texts(content: &[LlmContent]) -> impl Iterator<Item = &str> {
    content.iter().filter_map(|part| match part {
        LlmContent::Text(text) => Some(text.as_str()),
        _ => None,
    })
}

fn count_words(text: &str) -> usize {
    text.split_whitespace().count()
}

/// Splits `text` into words, each with the whitespace that follows it, so the
/// pieces concatenate back to `text` exactly.
fn split_words(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut seen_word = false;
    let mut in_space = false;
    for (index, ch) in text.char_indices() {
        if ch.is_whitespace() {
            in_space = seen_word;
        } else {
            if in_space {
                pieces.push(&text[start..index]);
                start = index;
                in_space = false;
            }
            seen_word = true;
        }
    }
    if start < text.len() {
        pieces.push(&text[start..]);
    }
    pieces
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_words_with_their_trailing_spaces() {
        assert_eq!(split_words("a  b\nc "), vec!["a  ", "b\n", "c "]);
        assert_eq!(split_words(" lead"), vec![" lead"]);
        assert_eq!(split_words(""), Vec::<&str>::new());
        assert_eq!(split_words("héllo wörld").concat(), "héllo wörld");
    }
}
