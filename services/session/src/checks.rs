//! The checks every path that writes shares (a message appended, posted or
//! imported; an id a caller chose), in one place.

use crate::error::SessionError;
use crate::record::{MessageBody, NewMessage};

/// Longest id a caller may choose (containers, messages), in bytes.
pub const MAX_ID_BYTES: usize = 128;
/// Largest message, counted as the bytes of its text fields.
pub const MAX_MESSAGE_BYTES: usize = 8 * 1024 * 1024;

/// Checks an id a caller chose: 1 to 128 characters of `[A-Za-z0-9._:@-]`.
pub(crate) fn is_valid_client_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_ID_BYTES
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'@' | b'-'))
}

/// Checks a message id as [`is_valid_client_id`] does.
pub(crate) fn validate_message_id(message_id: &str) -> Result<(), SessionError> {
    if is_valid_client_id(message_id) {
        return Ok(());
    }
    Err(SessionError::invalid(
        "INVALID_MESSAGE_ID",
        "message id must be 1 to 128 characters of letters, digits and . _ : @ -",
    ))
}

/// Checks a message's id, size and (a user's) content.
pub(crate) fn validate_message(message: &NewMessage) -> Result<(), SessionError> {
    validate_message_id(&message.message_id)?;
    if message.body.text_bytes() > MAX_MESSAGE_BYTES {
        return Err(SessionError::invalid(
            "MESSAGE_TOO_LARGE",
            format!("message must be at most {} MiB", MAX_MESSAGE_BYTES / (1024 * 1024)),
        ));
    }
    if let MessageBody::User { content_json } = &message.body {
        // History is replayed into LLM requests: content that does not parse
        // would break every later turn of the session.
        if let Err(err) = serde_json::from_str::<serde::de::IgnoredAny>(content_json) {
            return Err(SessionError::invalid(
                "INVALID_MESSAGE_CONTENT",
                format!("user message content is not valid json: {err}"),
            ));
        }
    }
    Ok(())
}
