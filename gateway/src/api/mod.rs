//! The operations of the public API, each written once: a typed request, the
//! call to the service that owns the rule, a typed response. The REST
//! handlers (`rest/`) and the WebSocket dispatcher (`ws/`) are thin adapters
//! over these functions; neither decodes, validates or shapes on its own.
//!
//! Field rules live on the types (serde), so both surfaces refuse the same
//! input with the same reason: a missing field is `MISSING_FIELD`, a value of
//! the wrong type `INVALID_FIELD`, and a field with its own vocabulary names
//! it (`INVALID_CONTENT`, `INVALID_KIND`, …).

use avm_common::ApiError;
use serde::de::{DeserializeOwned, Error as _, Unexpected};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};
use utoipa::ToSchema;

pub mod agents;
pub mod auth;
pub mod containers;
pub mod credentials;
pub mod groups;
pub mod images;
pub mod messages;
pub mod recent;
pub mod resources;
pub mod retention;
pub mod search;
pub mod secrets;
pub mod settings;
pub mod transfer;
pub mod usage;
pub mod workspace;

/// Decodes a request object into its typed form, naming the field at fault;
/// its ids, names and paths are bounded first (`crate::bounds`), so both
/// surfaces refuse an oversized one before any call.
pub fn decode<T: DeserializeOwned>(value: Value) -> Result<T, ApiError> {
    crate::bounds::check_json(&value)?;
    serde_path_to_error::deserialize(value).map_err(|err| {
        let path = err.path().to_string();
        field_error(&path, &err.inner().to_string())
    })
}

/// Returns a serde error that carries its own stable reason; `{field}` in
/// the message becomes the path of the refused field.
///
/// The reason travels in the message as `[REASON] message`, the one form
/// [`decode`] reads back; serde offers no other channel for it.
pub fn reasoned<E: serde::de::Error>(reason: &'static str, message: impl std::fmt::Display) -> E {
    E::custom(format!("[{reason}] {message}"))
}

/// Maps serde's description of a refused field to the API's vocabulary.
fn field_error(path: &str, message: &str) -> ApiError {
    if let Some(rest) = message.strip_prefix('[')
        && let Some((reason, text)) = rest.split_once("] ")
        && !reason.is_empty()
        && reason.bytes().all(|b| b.is_ascii_uppercase() || b == b'_')
    {
        let field = if path.is_empty() || path == "." {
            "the body"
        } else {
            path
        };
        return ApiError::new(
            avm_common::Code::InvalidArgument,
            reason.to_owned(),
            text.replace("{field}", field),
        );
    }
    let within = |field: &str| {
        if path.is_empty() || path == "." {
            field.to_owned()
        } else {
            format!("{path}.{field}")
        }
    };
    if let Some(field) = message
        .strip_prefix("missing field `")
        .and_then(|rest| rest.strip_suffix('`'))
    {
        return ApiError::invalid("MISSING_FIELD", format!("{} is required", within(field)));
    }
    let field = if path.is_empty() || path == "." {
        "the body"
    } else {
        path
    };
    if let Some(rest) = message.strip_prefix("unknown field `")
        && let Some((name, expected)) = rest.split_once('`')
    {
        let field = if path.ends_with(name) { path } else { name };
        let known = expected.trim_start_matches(", expected ").trim_start_matches("one of ");
        // A type that flattens another names no known fields in its error.
        if known.is_empty() {
            return ApiError::invalid("UNKNOWN_FIELD", format!("{field} is not a field here"));
        }
        return ApiError::invalid("UNKNOWN_FIELD", format!("{field} is not a field here (known: {known})"));
    }
    if message.starts_with("invalid type: null") {
        return ApiError::invalid("MISSING_FIELD", format!("{field} is required"));
    }
    if let Some((_, expected)) = message.split_once(", expected ") {
        return ApiError::invalid("INVALID_FIELD", format!("{field} must be {expected}"));
    }
    ApiError::invalid("INVALID_FIELD", format!("{field}: {message}"))
}

/// A JSON object whose fields are the caller's own (resource content, prompt
/// variables); anything else is `INVALID_FIELD` "… must be an object".
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
#[schema(value_type = Object)]
pub struct JsonObject(pub Map<String, Value>);

impl<'de> Deserialize<'de> for JsonObject {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        match Value::deserialize(deserializer)? {
            Value::Object(map) => Ok(JsonObject(map)),
            other => Err(D::Error::invalid_type(unexpected(&other), &"an object")),
        }
    }
}

/// Returns how serde names a JSON value in its errors.
fn unexpected(value: &Value) -> Unexpected<'_> {
    match value {
        Value::Null => Unexpected::Unit,
        Value::Bool(b) => Unexpected::Bool(*b),
        Value::Number(n) => n.as_f64().map_or(Unexpected::Other("number"), Unexpected::Float),
        Value::String(s) => Unexpected::Str(s),
        Value::Array(_) => Unexpected::Seq,
        Value::Object(_) => Unexpected::Map,
    }
}

/// Succeeds when `user_id` is a user of the caller's tenant, as `ctx` sees
/// it; another tenant's user and a missing one answer alike,
/// `USER_NOT_FOUND`, so an id of another tenant says nothing.
pub(crate) async fn require_tenant_user(
    peers: &crate::peers::Peers,
    ctx: &avm_common::RequestContext,
    user_id: &str,
) -> Result<(), ApiError> {
    let call = ctx.request(avm_proto::auth::v1::GetUserRequest {
        user_id: user_id.to_owned(),
    });
    let user = match peers.auth.get_user(call).await {
        Ok(found) => found.into_inner().user,
        Err(status) if status.code() == tonic::Code::NotFound => None,
        Err(status) => return Err(ApiError::from_status(&status)),
    };
    match user {
        Some(user) if user.tenant_id == ctx.tenant_id => Ok(()),
        _ => Err(ApiError::new(
            avm_common::Code::NotFound,
            "USER_NOT_FOUND",
            format!("user {user_id} not found"),
        )),
    }
}

/// Returns the error of a service that answered without the object it owes.
pub(crate) fn missing(what: &str) -> ApiError {
    ApiError::internal(format!("the service returned no {what}"))
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::json;

    use super::*;

    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "camelCase")]
    #[allow(dead_code)]
    struct Sample {
        container_id: String,
        #[serde(default)]
        inner: Option<Inner>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(expecting = "an object")]
    #[allow(dead_code)]
    struct Inner {
        name: Option<String>,
        #[serde(default, deserialize_with = "odd")]
        odd: u8,
    }

    fn odd<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<u8, D::Error> {
        let value = u8::deserialize(deserializer)?;
        if value % 2 == 1 {
            Ok(value)
        } else {
            Err(reasoned("NOT_ODD", format!("{value} is even")))
        }
    }

    fn reason(value: serde_json::Value) -> (String, String) {
        let err = decode::<Sample>(value)
            .err()
            .unwrap_or_else(|| ApiError::internal("decoded"));
        (err.reason.into_owned(), err.message)
    }

    #[test]
    fn refused_fields_are_named_with_the_api_reasons() {
        assert_eq!(
            reason(json!({})),
            ("MISSING_FIELD".into(), "containerId is required".into())
        );
        assert_eq!(
            reason(json!({"containerId": null})),
            ("MISSING_FIELD".into(), "containerId is required".into())
        );
        assert_eq!(
            reason(json!({"containerId": 42})),
            ("INVALID_FIELD".into(), "containerId must be a string".into())
        );
        assert_eq!(
            reason(json!({"containerId": "c", "inner": 5})),
            ("INVALID_FIELD".into(), "inner must be an object".into())
        );
        assert_eq!(
            reason(json!({"containerId": "c", "inner": {"name": 1}})),
            ("INVALID_FIELD".into(), "inner.name must be a string".into())
        );
        assert_eq!(
            reason(json!({"containerId": "c", "inner": {"odd": 2}})),
            ("NOT_ODD".into(), "2 is even".into())
        );
        assert!(decode::<Sample>(json!({"containerId": "c", "extra": true})).is_ok());
    }

    #[derive(Debug, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    #[allow(dead_code)]
    struct Strict {
        tenant_id: Option<String>,
        month: Option<String>,
    }

    #[test]
    fn unknown_fields_of_strict_requests_are_named() {
        let err = decode::<Strict>(json!({"tenant": "t"}))
            .err()
            .unwrap_or_else(|| ApiError::internal("decoded"));
        assert_eq!(err.reason, "UNKNOWN_FIELD");
        assert_eq!(err.message, "tenant is not a field here (known: `tenantId` or `month`)");
    }
}
