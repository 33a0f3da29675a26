//! Full-text search over a tenant's messages and conversation names: what a
//! caller asks (`SearchRequest`), the match expression both stores read
//! (`Terms`), what a store finds (`SearchRow`) and what the caller gets back
//! (`SearchHit`, with a highlighted snippet made here, the same for both
//! stores).
//!
//! The words are matched, not parsed as a query language: every word must
//! appear, and a quoted phrase must appear as written; case does not matter.
//! Both stores read the same expression, a list of quoted phrases, which
//! FTS5's `MATCH` and Postgres' `websearch_to_tsquery` both take as "all of
//! these", so neither sees an operator or a syntax error from a caller.

use crate::error::SessionError;
use crate::record::{MessageBody, MessageRecord};

/// The longest query, in bytes.
pub const MAX_QUERY_BYTES: usize = 512;
/// The most words and phrases a query may hold.
pub const MAX_QUERY_TERMS: usize = 16;
/// Hits per page when the caller does not say.
pub const DEFAULT_SEARCH_PAGE_SIZE: u32 = 20;
/// The most hits of one page.
pub const MAX_SEARCH_PAGE_SIZE: u32 = 100;
/// How far paging goes: ranking every match past this would cost more than
/// a caller should ask of one request.
pub const MAX_SEARCH_OFFSET: u64 = 10_000;
/// Words of a snippet.
const SNIPPET_WORDS: usize = 24;
/// Words shown before the first match.
const SNIPPET_LEAD: usize = 6;

/// The kinds of message a search may be limited to (the stored kinds).
pub const SEARCH_ROLES: [&str; 5] = ["user", "assistant", "tool_call", "tool_result", "error"];

/// What a caller searches for, and where.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SearchRequest {
    pub query: String,
    pub container_id: Option<String>,
    pub image_id: Option<String>,
    /// One of [`SEARCH_ROLES`]; conversation names are searched only without it.
    pub role: Option<String>,
    /// Only what was written at or after this instant (Unix ms).
    pub from_ms: Option<i64>,
    /// Only what was written before this instant (Unix ms).
    pub to_ms: Option<i64>,
    /// 0 means [`DEFAULT_SEARCH_PAGE_SIZE`].
    pub page_size: u32,
    /// Where the previous page ended; empty for the first page.
    pub page_token: String,
}

/// A query's words and phrases, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Terms {
    /// Each term's words, lowercased, as the stores split them.
    phrases: Vec<Vec<String>>,
}

impl Terms {
    /// Reads a query: quoted phrases and single words, all of which must
    /// match. Words without a letter or digit are dropped; a query left with
    /// none is refused.
    pub fn parse(query: &str) -> Result<Terms, SessionError> {
        if query.len() > MAX_QUERY_BYTES {
            return Err(SessionError::invalid(
                "INVALID_QUERY",
                format!("a search query must be at most {MAX_QUERY_BYTES} bytes"),
            ));
        }
        if query.chars().any(|c| c.is_control() && !c.is_whitespace()) {
            return Err(SessionError::invalid(
                "INVALID_QUERY",
                "a search query must not hold control characters",
            ));
        }
        let mut phrases = Vec::new();
        // Between quotes is a phrase, outside them single words; an unclosed
        // quote runs to the end.
        for (index, part) in query.split('"').enumerate() {
            let words = words_of(part);
            if index % 2 == 1 {
                if !words.is_empty() {
                    phrases.push(words);
                }
            } else {
                phrases.extend(words.into_iter().map(|word| vec![word]));
            }
        }
        if phrases.is_empty() {
            return Err(SessionError::invalid(
                "INVALID_QUERY",
                "a search query needs at least one word of letters or digits",
            ));
        }
        if phrases.len() > MAX_QUERY_TERMS {
            return Err(SessionError::invalid(
                "INVALID_QUERY",
                format!("a search query may hold at most {MAX_QUERY_TERMS} words and phrases"),
            ));
        }
        Ok(Terms { phrases })
    }

    /// Returns the expression both stores match: each term a quoted phrase,
    /// all of them required.
    pub fn expression(&self) -> String {
        let quoted: Vec<String> = self
            .phrases
            .iter()
            .map(|words| format!("\"{}\"", words.join(" ")))
            .collect();
        quoted.join(" ")
    }

    fn has(&self, word: &str) -> bool {
        self.phrases.iter().flatten().any(|known| known == word)
    }
}

/// Returns the words of a text as the stores split them: runs of letters and
/// digits, lowercased.
fn words_of(text: &str) -> Vec<String> {
    word_spans(text)
        .map(|(start, end)| text[start..end].to_lowercase())
        .collect()
}

/// Returns the byte ranges of the words of a text.
fn word_spans(text: &str) -> impl Iterator<Item = (usize, usize)> + '_ {
    let mut chars = text.char_indices().peekable();
    std::iter::from_fn(move || {
        let (start, _) = chars.by_ref().find(|(_, c)| c.is_alphanumeric())?;
        let mut end = text.len();
        while let Some(&(at, c)) = chars.peek() {
            if !c.is_alphanumeric() {
                end = at;
                break;
            }
            chars.next();
        }
        Some((start, end))
    })
}

/// One hit as a store finds it: where, how well, and the message (none for
/// a conversation found by its name).
#[derive(Clone, Debug, PartialEq)]
pub struct SearchRow {
    pub container_id: String,
    pub image_id: String,
    pub session_id: String,
    pub image_name: String,
    /// Higher is better; comparable within one search.
    pub score: f64,
    /// The message's time, or the conversation's creation for a name.
    pub at_ms: i64,
    pub message: Option<MessageRecord>,
}

/// One hit as the caller sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct SearchHit {
    pub container_id: String,
    pub image_id: String,
    pub session_id: String,
    pub image_name: String,
    pub score: f64,
    pub at_ms: i64,
    /// The message found; `None` when the conversation's name matched.
    pub message_id: Option<String>,
    pub seq: Option<u64>,
    /// The message's kind (one of [`SEARCH_ROLES`]).
    pub role: Option<&'static str>,
    /// A few words around the first match, HTML-escaped, each matching word
    /// inside `<mark>`…`</mark>`.
    pub snippet: String,
}

/// A page of hits, best first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SearchPage {
    pub hits: Vec<SearchHit>,
    /// Empty on the last page.
    pub next_page_token: String,
}

impl SearchHit {
    /// Makes the caller's hit of a store's row, with its snippet.
    pub fn new(row: SearchRow, terms: &Terms) -> SearchHit {
        let (message_id, seq, role, snippet) = match &row.message {
            Some(message) => (
                Some(message.message_id.clone()),
                Some(message.seq),
                Some(message.body.kind()),
                snippet(&message.body.search_text(), terms),
            ),
            None => (None, None, None, snippet(&row.image_name, terms)),
        };
        SearchHit {
            container_id: row.container_id,
            image_id: row.image_id,
            session_id: row.session_id,
            image_name: row.image_name,
            score: row.score,
            at_ms: row.at_ms,
            message_id,
            seq,
            role,
            snippet,
        }
    }
}

impl MessageBody {
    /// Returns the words a message is found by: what a user wrote (a string,
    /// or the text parts of a list), an assistant's or an error's text, a
    /// tool's name with its input or output. The stores' indexes read the
    /// same (migrations `0009_search.sql`); this copy makes snippets.
    pub fn search_text(&self) -> String {
        match self {
            MessageBody::User { content_json } => match serde_json::from_str::<serde_json::Value>(content_json) {
                Ok(serde_json::Value::String(text)) => text,
                Ok(serde_json::Value::Array(parts)) => {
                    let texts: Vec<&str> = parts
                        .iter()
                        .filter(|part| part["type"] == "text")
                        .filter_map(|part| part["text"].as_str())
                        .collect();
                    texts.join(" ")
                }
                Ok(_) => String::new(),
                Err(_) => content_json.clone(),
            },
            MessageBody::Assistant { text, .. } | MessageBody::Error { text, .. } => text.clone(),
            MessageBody::ToolCall {
                tool_name, input_json, ..
            } => format!("{tool_name} {input_json}"),
            MessageBody::ToolResult { tool_name, output, .. } => format!("{tool_name} {output}"),
        }
    }
}

/// Returns up to [`SNIPPET_WORDS`] words of `text` from a little before its
/// first matching word, HTML-escaped, with every matching word marked and
/// runs of white space made one space; `…` where text was cut.
pub fn snippet(text: &str, terms: &Terms) -> String {
    let spans: Vec<(usize, usize)> = word_spans(text).collect();
    let matches = |&(start, end): &(usize, usize)| terms.has(&text[start..end].to_lowercase());
    let first = spans.iter().position(matches).unwrap_or(0);
    let from = first.saturating_sub(SNIPPET_LEAD);
    let to = (from + SNIPPET_WORDS).min(spans.len());
    if spans.is_empty() {
        return String::new();
    }
    // Whole ends keep what surrounds their words (a closing `?`).
    let start = if from == 0 { 0 } else { spans[from].0 };
    let end = if to == spans.len() { text.len() } else { spans[to - 1].1 };
    let mut out = String::new();
    if start > 0 {
        out.push('…');
    }
    let mut at = start;
    for span in &spans[from..to] {
        push_escaped(&mut out, &text[at..span.0]);
        if matches(span) {
            out.push_str("<mark>");
            push_escaped(&mut out, &text[span.0..span.1]);
            out.push_str("</mark>");
        } else {
            push_escaped(&mut out, &text[span.0..span.1]);
        }
        at = span.1;
    }
    push_escaped(&mut out, &text[at..end]);
    if end < text.len() {
        out.push('…');
    }
    out
}

/// Appends text HTML-escaped, with each run of white space as one space.
fn push_escaped(out: &mut String, text: &str) {
    let mut space = false;
    for c in text.chars() {
        if c.is_whitespace() {
            if !space {
                out.push(' ');
            }
            space = true;
            continue;
        }
        space = false;
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
}

/// Returns the offset a page token names: empty is the first page.
pub fn page_offset(page_token: &str) -> Result<u64, SessionError> {
    if page_token.is_empty() {
        return Ok(0);
    }
    page_token
        .parse::<u64>()
        .ok()
        .filter(|offset| *offset <= MAX_SEARCH_OFFSET)
        .ok_or_else(|| SessionError::invalid("INVALID_PAGE_TOKEN", "pageToken is not one this search returned"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_become_required_phrases() {
        let terms = Terms::parse(r#"Blue  "humpback Whale" song-bird"#).unwrap();
        assert_eq!(terms.expression(), r#""blue" "humpback whale" "song" "bird""#);
        // Operators and stray quotes are words, never syntax.
        let terms = Terms::parse(r#"NOT a* OR "b"c" (d)"#).unwrap();
        assert_eq!(terms.expression(), r#""not" "a" "or" "b" "c" "d""#);
    }

    #[test]
    fn empty_long_and_control_queries_are_refused() {
        for query in ["", "  ", "\"\"", "- * ()", "a\u{0}b", "a\u{1b}b"] {
            let err = Terms::parse(query).unwrap_err();
            assert_eq!(avm_common::ApiError::from(err).reason, "INVALID_QUERY", "{query:?}");
        }
        assert!(Terms::parse(&"a".repeat(MAX_QUERY_BYTES + 1)).is_err());
        assert!(Terms::parse(&"a ".repeat(MAX_QUERY_TERMS + 1)).is_err());
        assert!(Terms::parse(&"a ".repeat(MAX_QUERY_TERMS)).is_ok());
        assert_eq!(Terms::parse("a\nb\tc").unwrap().expression(), r#""a" "b" "c""#);
    }

    #[test]
    fn snippets_mark_matches_and_escape_the_rest() {
        let terms = Terms::parse("whale").unwrap();
        assert_eq!(
            snippet("The <b>blue</b>\n\n Whale & its whales", &terms),
            "The &lt;b&gt;blue&lt;/b&gt; <mark>Whale</mark> &amp; its whales"
        );
        let long: Vec<String> = (0..100).map(|n| format!("w{n}")).collect();
        let text = format!("{} whale {}", long[..50].join(" "), long[50..].join(" "));
        let cut = snippet(&text, &terms);
        assert!(cut.starts_with("…w44 "), "{cut}");
        assert!(cut.contains("<mark>whale</mark>"), "{cut}");
        assert!(cut.ends_with("w66…"), "{cut}");
        // No match seen (the store's split differs): the opening words.
        assert_eq!(snippet("a b", &terms), "a b");
        assert_eq!(snippet("", &terms), "");
    }

    #[test]
    fn page_tokens_are_bounded_offsets() {
        assert_eq!(page_offset("").unwrap(), 0);
        assert_eq!(page_offset("40").unwrap(), 40);
        for token in ["-1", "x", "10001", "99999999999999999999999"] {
            assert!(page_offset(token).is_err(), "{token}");
        }
    }
}
