//! Strategies of the property tests (the fuzz suite): arbitrary JSON shaped
//! like what clients send, and the check that a refusal is a typed error.

use avm_common::{ApiError, Code};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::{Map, Number, Value};

use crate::api::messages::{ContentPart, MessageContent};

/// Field names the API knows, so arbitrary objects often hit real fields
/// with values of the wrong type.
const FIELDS: &[&str] = &[
    "type",
    "data",
    "requestId",
    "imageId",
    "agentId",
    "containerId",
    "content",
    "text",
    "mediaType",
    "filename",
    "config",
    "updates",
    "name",
    "description",
    "systemPrompt",
    "mcpServers",
    "tools",
    "variables",
    "path",
    "encoding",
    "server",
    "scope",
    "bearerToken",
    "headers",
    "sessionId",
    "afterCursor",
    "token",
    "__ack",
];

/// Strings clients send: anything, or the vocabulary's own words.
pub fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => any::<String>(),
        1 => prop::sample::select(vec![
            "", "text", "image", "file", "utf-8", "base64", "default", "img_1", "agent_1", "resource://prompts/x",
            "\u{0}", "%ff", "../..", "🦀",
        ])
        .prop_map(str::to_owned),
    ]
}

/// JSON leaves, huge and awkward numbers included.
fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_filter_map("finite", |f| Number::from_f64(f).map(Value::Number)),
        prop::sample::select(vec![u64::MAX as f64, 1e308, -1e308, f64::MIN_POSITIVE, -0.0])
            .prop_filter_map("finite", |f| Number::from_f64(f).map(Value::Number)),
        text().prop_map(Value::String),
    ]
}

/// Object keys: mostly the API's fields, sometimes anything.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => prop::sample::select(FIELDS).prop_map(str::to_owned),
        1 => any::<String>(),
    ]
}

/// Any JSON value, a few levels deep.
pub fn json() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(5, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(key(), inner, 0..8).prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

/// Any JSON object.
pub fn object() -> impl Strategy<Value = Value> {
    prop::collection::btree_map(key(), json(), 0..8)
        .prop_map(|map| Value::Object(map.into_iter().collect::<Map<_, _>>()))
}

/// One part of a message, with any strings.
fn content_part() -> impl Strategy<Value = ContentPart> {
    prop_oneof![
        text().prop_map(|text| ContentPart::Text { text }),
        (text(), text()).prop_map(|(data, media_type)| ContentPart::Image { data, media_type }),
        (text(), text(), proptest::option::of(text())).prop_map(|(data, media_type, filename)| {
            ContentPart::File {
                data,
                media_type,
                filename,
            }
        }),
    ]
}

/// Any message content a client can send.
pub fn content() -> impl Strategy<Value = MessageContent> {
    prop_oneof![
        text().prop_map(MessageContent::Text),
        prop::collection::vec(content_part(), 0..4).prop_map(MessageContent::Parts),
    ]
}

/// A value nested `depth` arrays or objects deep, as far as a frame can
/// carry (serde_json refuses beyond 128 levels).
pub fn nested(depth: usize, objects: bool) -> Value {
    let mut value = Value::Null;
    for _ in 0..depth {
        value = if objects {
            Value::Object(Map::from_iter([("content".to_owned(), value)]))
        } else {
            Value::Array(vec![value])
        };
    }
    value
}

/// Fails the case unless `err` is a client error with a stable reason and a message.
pub fn assert_typed(err: &ApiError) -> Result<(), TestCaseError> {
    prop_assert_eq!(err.code, Code::InvalidArgument, "{:?}", err);
    prop_assert!(
        !err.reason.is_empty() && err.reason.bytes().all(|b| b.is_ascii_uppercase() || b == b'_'),
        "reason {:?} is not SCREAMING_SNAKE_CASE",
        err.reason
    );
    prop_assert!(!err.message.is_empty(), "{:?} has no message", err);
    Ok(())
}
