//! Bounds on what a caller names: ids, cursors, names and paths are checked
//! here, at the edge, before any call to a service, so an oversized or
//! NUL-holding value is a typed 400 rather than something a service echoes
//! back (issue 26 item 5) or a database refuses its own way (item 16).
//!
//! Every surface passes through these checks: path parameters and queries
//! (the `http` extractors), JSON bodies and WebSocket requests
//! (`api::decode`), WebSocket frames (`frames::parse_frame`) and the
//! `Last-Event-ID` header.

use avm_common::ApiError;
use serde_json::Value;

/// Longest id, cursor, name or key, in bytes. Server-made ids are 36 bytes;
/// names the caller picks (containers, groups) are far shorter in practice.
pub const MAX_ID_BYTES: usize = 256;

/// Longest workspace path, in bytes (Linux's `PATH_MAX`).
pub const MAX_PATH_BYTES: usize = 4096;

/// Longest value of any other query parameter, in bytes.
pub const MAX_QUERY_VALUE_BYTES: usize = 4096;

/// The longest field name quoted back in an error.
const MAX_QUOTED_NAME: usize = 64;

/// Returns the bound of a JSON field or parameter by its name, or `None` for
/// free text (a message's content, a prompt), which only the body or frame
/// limit bounds.
pub fn limit_for(name: &str) -> Option<usize> {
    if name == "path" || name.ends_with("Path") {
        return Some(MAX_PATH_BYTES);
    }
    let id_like = matches!(
        name,
        "id" | "ids" | "after" | "before" | "cursor" | "name" | "key" | "server" | "user" | "pageToken"
    ) || ["Id", "Ids", "Cursor", "Name"]
        .iter()
        .any(|suffix| name.ends_with(suffix));
    id_like.then_some(MAX_ID_BYTES)
}

/// Checks one named value: within `limit` bytes when given, and free of NUL
/// characters (which Postgres refuses in text while SQLite stores them, so
/// neither backend ever sees one).
pub fn check(name: &str, value: &str, limit: Option<usize>) -> Result<(), ApiError> {
    if let Some(limit) = limit
        && value.len() > limit
    {
        return Err(ApiError::invalid(
            "TOO_LONG",
            format!("{} is longer than {limit} bytes", quoted(name)),
        ));
    }
    if value.contains('\0') {
        return Err(ApiError::invalid(
            "NUL_CHARACTER",
            format!("{} holds a NUL character", quoted(name)),
        ));
    }
    Ok(())
}

/// Checks a path parameter: a workspace file's `path` up to
/// [`MAX_PATH_BYTES`], every other one (an id, a name) up to [`MAX_ID_BYTES`].
pub fn check_path_param(name: &str, value: &str) -> Result<(), ApiError> {
    let limit = if name == "path" { MAX_PATH_BYTES } else { MAX_ID_BYTES };
    check(name, value, Some(limit))
}

/// Checks a query parameter: by its name's bound, else [`MAX_QUERY_VALUE_BYTES`].
/// A credential (`token`, the WebSocket handshake's) is the authenticator's
/// to bound: an oversized one is an invalid token (401), like one in a header.
pub fn check_query_param(name: &str, value: &str) -> Result<(), ApiError> {
    check(name, name_within_limits(name)?, Some(MAX_ID_BYTES))?;
    let limit = match name {
        "token" => None,
        _ => Some(limit_for(name).unwrap_or(MAX_QUERY_VALUE_BYTES)),
    };
    check(name, value, limit)
}

/// Checks every string of a JSON value: each field's value by the field's
/// name, every field name as an id, and no string holding NUL.
pub fn check_json(value: &Value) -> Result<(), ApiError> {
    check_json_within(value, "the body", None)
}

/// Checks the given fields of an object as [`check_json`] does.
pub fn check_fields<'a>(mut fields: impl Iterator<Item = (&'a String, &'a Value)>) -> Result<(), ApiError> {
    fields.try_for_each(|(field, item)| {
        check(field, name_within_limits(field)?, Some(MAX_ID_BYTES))?;
        check_json_within(item, field, limit_for(field))
    })
}

fn check_json_within(value: &Value, name: &str, limit: Option<usize>) -> Result<(), ApiError> {
    match value {
        Value::String(text) => check(name, text, limit),
        // An array's items are bound as its field is (`agentIds`, `mentions`).
        Value::Array(items) => items.iter().try_for_each(|item| check_json_within(item, name, limit)),
        Value::Object(fields) => check_fields(fields.iter()),
        Value::Null | Value::Bool(_) | Value::Number(_) => Ok(()),
    }
}

/// A field name is itself bounded like an id; the error names no more of it
/// than fits.
fn name_within_limits(name: &str) -> Result<&str, ApiError> {
    if name.len() > MAX_ID_BYTES {
        return Err(ApiError::invalid(
            "TOO_LONG",
            format!("a field name ({}) is longer than {MAX_ID_BYTES} bytes", quoted(name)),
        ));
    }
    Ok(name)
}

/// Returns a field name fit to quote in an error: escaped, then cut to at
/// most [`MAX_QUOTED_NAME`] bytes on a character boundary.
fn quoted(name: &str) -> String {
    let escaped = name.escape_debug().to_string();
    if escaped.len() <= MAX_QUOTED_NAME {
        return escaped;
    }
    let mut end = MAX_QUOTED_NAME;
    while !escaped.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &escaped[..end])
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;

    fn reason(result: Result<(), ApiError>) -> String {
        result.err().map(|err| err.reason.into_owned()).unwrap_or_default()
    }

    #[test]
    fn ids_cursors_names_and_paths_are_bounded() {
        let long_id = "x".repeat(MAX_ID_BYTES + 1);
        let long_path = "d/".repeat(MAX_PATH_BYTES);
        assert_eq!(reason(check_json(&json!({"containerId": long_id}))), "TOO_LONG");
        assert_eq!(reason(check_json(&json!({"agentIds": ["a", long_id]}))), "TOO_LONG");
        assert_eq!(reason(check_json(&json!({"afterCursor": long_id}))), "TOO_LONG");
        assert_eq!(reason(check_json(&json!({"config": {"name": long_id}}))), "TOO_LONG");
        assert_eq!(reason(check_json(&json!({"path": long_path}))), "TOO_LONG");
        assert_eq!(reason(check_json(&json!({ long_id.clone(): 1 }))), "TOO_LONG");
        assert_eq!(reason(check_path_param("id", &long_id)), "TOO_LONG");
        assert_eq!(reason(check_path_param("path", &long_path)), "TOO_LONG");
        assert_eq!(reason(check_query_param("after", &long_id)), "TOO_LONG");
        // Text is bound by the body limit only; a long path is fine.
        assert!(check_json(&json!({"content": long_id, "path": "a/".repeat(1000)})).is_ok());
        assert!(check_path_param("path", &"a/".repeat(1000)).is_ok());
        assert!(check_query_param("month", "2026-11").is_ok());
        // A credential is the authenticator's to refuse, as an invalid token.
        assert!(check_query_param("token", &"t".repeat(2 * MAX_QUERY_VALUE_BYTES)).is_ok());
    }

    #[test]
    fn nul_characters_are_refused_anywhere() {
        assert_eq!(reason(check_json(&json!({"content": "a\u{0}b"}))), "NUL_CHARACTER");
        assert_eq!(reason(check_json(&json!({"x": {"y": ["\u{0}"]}}))), "NUL_CHARACTER");
        assert_eq!(reason(check_path_param("id", "img\u{0}")), "NUL_CHARACTER");
    }

    proptest! {
        #[test]
        fn errors_quote_a_bounded_name(name in ".{0,400}", value in ".{0,400}") {
            if let Err(err) = check(&name, &value, Some(8)) {
                prop_assert!(err.message.len() < 2 * MAX_QUOTED_NAME + 64, "{}", err.message);
            }
            if let Err(err) = check_json(&json!({ name.clone(): value })) {
                prop_assert!(err.message.len() < 4 * MAX_QUOTED_NAME + 64, "{}", err.message);
            }
        }
    }
}
