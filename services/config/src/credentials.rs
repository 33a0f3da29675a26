//! Credentials for remote MCP servers: the headers (a bearer token, an API
//! key header) a user's requests send to one server. A user's own credential
//! is used for that user's requests only; a tenant's (set by its admins) for
//! its users without one. Values are sealed at rest like secret config
//! values and never read back, except by AgentVM's components, which send
//! them to that server alone.
//!
//! A credential is bound to the origin (`scheme://host:port`) of the server
//! URL it was set for, and resolved only for a URL of that origin: a tool
//! resource repointed at another address, by whoever publishes its versions,
//! does not take the credential along. One stored before credentials were
//! bound has no origin and is never resolved; storing it again binds it.
//!
//! They are stored beside the configuration's overrides, in scopes of their
//! own (`credentials/<tenant>` and `credentials/<tenant>/<user>`), keyed by
//! server; no change event is sent (the runtime reads them when it connects).

use std::collections::BTreeMap;

use avm_common::RequestContext;
use avm_common::auth::Scopes;
use tracing::instrument;

use crate::error::ConfigError;
use crate::service::ConfigService;
use crate::store::{Change, StoredValue};

/// Most headers one credential holds.
pub const MAX_CREDENTIAL_HEADERS: usize = 16;
/// Largest header value, in bytes.
const MAX_HEADER_VALUE_BYTES: usize = 8 * 1024;
/// Headers the MCP transport sets itself.
const RESERVED_HEADERS: [&str; 8] = [
    "accept",
    "content-type",
    "content-length",
    "host",
    "connection",
    "mcp-session-id",
    "mcp-protocol-version",
    "last-event-id",
];

/// Whose a credential is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CredentialScope {
    User,
    Tenant,
}

/// A stored credential, without its values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CredentialInfo {
    pub server: String,
    pub scope: CredentialScope,
    pub header_names: Vec<String>,
    /// The origin it is sent to; `None` for one stored before credentials
    /// were bound, which is never sent.
    pub origin: Option<String>,
}

/// What a credential holds once opened: sealed as one JSON document.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Sealed {
    origin: String,
    headers: BTreeMap<String, String>,
}

/// Returns the origin (`scheme://host:port`, the port always written) of
/// an `http` or `https` URL, which is what a credential is bound to.
pub fn origin_of(url: &str) -> Result<String, ConfigError> {
    let invalid = || {
        ConfigError::invalid(
            "INVALID_CREDENTIAL_URL",
            "a credential names the http or https URL of the server it is for",
        )
    };
    let parsed = url::Url::parse(url).map_err(|_| invalid())?;
    let (Some(host), Some(port)) = (parsed.host_str(), parsed.port_or_known_default()) else {
        return Err(invalid());
    };
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(invalid());
    }
    Ok(format!("{}://{host}:{port}", parsed.scheme()))
}

fn tenant_scope(tenant_id: &str) -> String {
    format!("credentials/{tenant_id}")
}

fn user_scope(tenant_id: &str, user_id: &str) -> String {
    format!("credentials/{tenant_id}/{user_id}")
}

fn store_scope(ctx: &RequestContext, scope: CredentialScope) -> String {
    match scope {
        CredentialScope::User => user_scope(&ctx.tenant_id, &ctx.principal.user_id),
        CredentialScope::Tenant => tenant_scope(&ctx.tenant_id),
    }
}

/// Checks a server's name: a tool resource's name.
fn check_server(server: &str) -> Result<(), ConfigError> {
    if avm_common::ids::is_plain_name(server) {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            "INVALID_SERVER_NAME",
            "a server is named by its tool resource's name: 1 to 128 letters, digits, `-`, `_` or `.`",
        ))
    }
}

/// Checks the headers; the error names a header, never a value.
fn check_headers(headers: &BTreeMap<String, String>) -> Result<(), ConfigError> {
    if headers.is_empty() || headers.len() > MAX_CREDENTIAL_HEADERS {
        return Err(ConfigError::invalid(
            "INVALID_CREDENTIAL",
            format!("a credential holds 1 to {MAX_CREDENTIAL_HEADERS} headers"),
        ));
    }
    for (name, value) in headers {
        let token = !name.is_empty()
            && name.len() <= 128
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
        if !token {
            return Err(ConfigError::invalid(
                "INVALID_CREDENTIAL",
                format!("{name:?} is not a header name"),
            ));
        }
        if RESERVED_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
            return Err(ConfigError::invalid(
                "INVALID_CREDENTIAL",
                format!("the header {name} is set by the MCP transport itself"),
            ));
        }
        if value.is_empty() || value.len() > MAX_HEADER_VALUE_BYTES || value.bytes().any(|b| b.is_ascii_control()) {
            return Err(ConfigError::invalid(
                "INVALID_CREDENTIAL",
                format!("the value of {name} must be 1 to {MAX_HEADER_VALUE_BYTES} bytes without control characters"),
            ));
        }
    }
    Ok(())
}

impl ConfigService {
    /// Stores a credential for `server`: the caller's own, or (admins) the tenant's.
    #[instrument(name = "config.set_credential", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn set_credential(
        &self,
        ctx: &RequestContext,
        server: &str,
        scope: CredentialScope,
        url: &str,
        headers: BTreeMap<String, String>,
    ) -> Result<CredentialInfo, ConfigError> {
        ctx.require(Scopes::WRITE)?;
        if scope == CredentialScope::Tenant {
            ctx.principal.require_admin()?;
        }
        check_server(server)?;
        check_headers(&headers)?;
        let origin = origin_of(url)?;
        let store_scope = store_scope(ctx, scope);
        let credential = Sealed { origin, headers };
        let plain = serde_json::to_string(&credential).map_err(|err| ConfigError::corrupt(err.to_string()))?;
        let sealed = self.seal(&store_scope, server, &plain)?;
        let change = Change {
            key: server.to_owned(),
            value: Some(StoredValue {
                key: server.to_owned(),
                value: sealed,
                encrypted: true,
            }),
        };
        self.store()
            .apply(&store_scope, &[change], &ctx.principal.user_id, avm_common::now_ms())
            .await?;
        tracing::info!(server, ?scope, origin = %credential.origin, headers = credential.headers.len(), "credential stored");
        Ok(CredentialInfo {
            server: server.to_owned(),
            scope,
            header_names: credential.headers.into_keys().collect(),
            origin: Some(credential.origin),
        })
    }

    /// Lists the credentials the caller's requests would use: its own, then
    /// its tenant's, each with its header names.
    #[instrument(name = "config.list_credentials", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn list_credentials(&self, ctx: &RequestContext) -> Result<Vec<CredentialInfo>, ConfigError> {
        ctx.require(Scopes::READ)?;
        let mut listed = Vec::new();
        for scope in [CredentialScope::User, CredentialScope::Tenant] {
            let store_scope = store_scope(ctx, scope);
            for stored in self.store().overrides(&store_scope).await? {
                let (origin, headers) = self.open_headers(&store_scope, &stored)?;
                listed.push(CredentialInfo {
                    server: stored.key,
                    scope,
                    header_names: headers.into_keys().collect(),
                    origin,
                });
            }
        }
        Ok(listed)
    }

    /// Removes a credential; a missing one is `CREDENTIAL_NOT_FOUND`.
    #[instrument(name = "config.delete_credential", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn delete_credential(
        &self,
        ctx: &RequestContext,
        server: &str,
        scope: CredentialScope,
    ) -> Result<(), ConfigError> {
        ctx.require(Scopes::WRITE)?;
        if scope == CredentialScope::Tenant {
            ctx.principal.require_admin()?;
        }
        check_server(server)?;
        let store_scope = store_scope(ctx, scope);
        let exists = self
            .store()
            .overrides(&store_scope)
            .await?
            .iter()
            .any(|stored| stored.key == server);
        if !exists {
            return Err(ConfigError::Api(avm_common::ApiError::new(
                avm_common::Code::NotFound,
                "CREDENTIAL_NOT_FOUND",
                format!("no credential for {server}"),
            )));
        }
        let change = Change {
            key: server.to_owned(),
            value: None,
        };
        self.store()
            .apply(&store_scope, &[change], &ctx.principal.user_id, avm_common::now_ms())
            .await?;
        tracing::info!(server, ?scope, "credential removed");
        Ok(())
    }

    /// Returns the headers `user_id`'s requests send to `server` at `url`: the
    /// user's credential, else the tenant's (components only). A credential
    /// bound to another origin than `url`'s, or to none, is not returned.
    #[instrument(name = "config.resolve_credential", skip_all, fields(tenant_id = %tenant_id, request_id = %ctx.request_id))]
    pub async fn resolve_credential(
        &self,
        ctx: &RequestContext,
        tenant_id: &str,
        user_id: &str,
        server: &str,
        url: &str,
    ) -> Result<Option<BTreeMap<String, String>>, ConfigError> {
        ctx.principal.require_service()?;
        let wanted = origin_of(url)?;
        let mut withheld = None;
        for store_scope in [user_scope(tenant_id, user_id), tenant_scope(tenant_id)] {
            let stored = self.store().overrides(&store_scope).await?;
            if let Some(found) = stored.iter().find(|stored| stored.key == server) {
                let (origin, headers) = self.open_headers(&store_scope, found)?;
                if origin.as_deref() == Some(wanted.as_str()) {
                    return Ok(Some(headers));
                }
                withheld = Some(origin);
            }
        }
        if let Some(origin) = withheld {
            tracing::warn!(
                server,
                bound_to = origin.as_deref().unwrap_or("nothing"),
                asked_for = %wanted,
                "credential withheld: the server's URL is not the one it was stored for"
            );
        }
        Ok(None)
    }

    /// Opens a stored credential: its origin (`None` when stored before
    /// credentials were bound) and its headers.
    fn open_headers(
        &self,
        store_scope: &str,
        stored: &StoredValue,
    ) -> Result<(Option<String>, BTreeMap<String, String>), ConfigError> {
        let plain = self.open(store_scope, &stored.key, &stored.value)?;
        let corrupt = || ConfigError::corrupt(format!("the credential for {}", stored.key));
        if let Ok(sealed) = serde_json::from_str::<Sealed>(&plain) {
            return Ok((Some(sealed.origin), sealed.headers));
        }
        let headers = serde_json::from_str(&plain).map_err(|_| corrupt())?;
        Ok((None, headers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_checked_without_echoing_values() {
        assert!(check_server("search-v2.internal").is_ok());
        for bad in ["", "a/b", "x y"] {
            assert!(check_server(bad).is_err(), "{bad:?}");
        }
        let headers = |name: &str, value: &str| BTreeMap::from([(name.to_owned(), value.to_owned())]);
        assert!(check_headers(&headers("Authorization", "Bearer sk-secret")).is_ok());
        for (name, value) in [
            ("Mcp-Session-Id", "x"),
            ("Bad Name", "x"),
            ("X-Key", "line\r\nbreak sk-secret"),
            ("X-Key", ""),
        ] {
            let err = check_headers(&headers(name, value)).unwrap_err().to_string();
            assert!(!err.contains("sk-secret"), "{err}");
        }
        assert!(check_headers(&BTreeMap::new()).is_err());
    }

    #[test]
    fn a_credential_is_bound_to_an_origin_with_its_port() {
        assert_eq!(
            origin_of("https://mcp.example/v1/mcp?x=1").unwrap(),
            "https://mcp.example:443"
        );
        assert_eq!(origin_of("http://127.0.0.1:8123/mcp").unwrap(), "http://127.0.0.1:8123");
        assert_ne!(
            origin_of("http://127.0.0.1:8123/mcp").unwrap(),
            origin_of("http://127.0.0.1:8124/mcp").unwrap()
        );
        for bad in ["", "mcp.example", "file:///etc/passwd", "ftp://mcp.example/"] {
            assert!(origin_of(bad).is_err(), "{bad:?}");
        }
    }
}
