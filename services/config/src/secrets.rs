//! A tenant's secrets: values its admins store by name for its agents'
//! sandboxes, which receive them as environment variables where an agent's
//! sandbox resource names them (`"env": {"GITHUB_TOKEN": {"secret":
//! "github"}}`). Sealed at rest like secret config values and never read
//! back: a listing shows names only, and only AgentVM's components resolve
//! values, for the sandbox of an agent of that tenant.
//!
//! Stored beside the configuration's overrides, in a scope of their own
//! (`secrets/<tenant>`), keyed by name; no change event is sent (the
//! runtime reads them when an agent's first command needs them).

use std::collections::BTreeMap;

use avm_common::RequestContext;
use avm_common::auth::Scopes;
use tracing::instrument;

use crate::error::ConfigError;
use crate::service::ConfigService;
use crate::store::{Change, StoredValue};

/// Shortest secret value, in bytes: tool output the model sees has every
/// value replaced, and a shorter one would replace ordinary text.
pub const MIN_SECRET_BYTES: usize = 4;
/// Largest secret value, in bytes.
pub const MAX_SECRET_BYTES: usize = 8 * 1024;
/// Most secrets one tenant holds.
pub const MAX_SECRETS: usize = 256;
/// Most secrets one resolution names.
const MAX_RESOLVED: usize = 64;

fn scope(tenant_id: &str) -> String {
    format!("secrets/{tenant_id}")
}

/// Checks a secret's name: 1 to 128 letters, digits, `-`, `_` or `.`.
pub fn check_name(name: &str) -> Result<(), ConfigError> {
    if avm_common::ids::is_plain_name(name) {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            "INVALID_SECRET_NAME",
            "a secret's name is 1 to 128 letters, digits, `-`, `_` or `.`",
        ))
    }
}

/// Checks a value; the error never holds it.
fn check_value(value: &str) -> Result<(), ConfigError> {
    if value.len() < MIN_SECRET_BYTES || value.len() > MAX_SECRET_BYTES || value.contains('\0') {
        return Err(ConfigError::invalid(
            "INVALID_SECRET",
            format!("a secret's value is {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes without NUL"),
        ));
    }
    Ok(())
}

fn not_found(name: &str) -> ConfigError {
    ConfigError::Api(avm_common::ApiError::new(
        avm_common::Code::NotFound,
        "SECRET_NOT_FOUND",
        format!("no secret named {name}"),
    ))
}

impl ConfigService {
    /// Stores one of the caller's tenant's secrets (its admins).
    #[instrument(name = "config.set_secret", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn set_secret(&self, ctx: &RequestContext, name: &str, value: &str) -> Result<(), ConfigError> {
        ctx.require(Scopes::WRITE)?;
        ctx.principal.require_admin()?;
        check_name(name)?;
        check_value(value)?;
        let scope = scope(&ctx.tenant_id);
        let stored = self.store().overrides(&scope).await?;
        if stored.len() >= MAX_SECRETS && !stored.iter().any(|known| known.key == name) {
            return Err(ConfigError::invalid(
                "TOO_MANY_SECRETS",
                format!("a tenant holds at most {MAX_SECRETS} secrets; delete one first"),
            ));
        }
        let change = Change {
            key: name.to_owned(),
            value: Some(StoredValue {
                key: name.to_owned(),
                value: self.seal(&scope, name, value)?,
                encrypted: true,
            }),
        };
        self.store()
            .apply(&scope, &[change], &ctx.principal.user_id, avm_common::now_ms())
            .await?;
        tracing::info!(name, "secret stored");
        Ok(())
    }

    /// Lists the names of the caller's tenant's secrets, sorted.
    #[instrument(name = "config.list_secrets", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn list_secrets(&self, ctx: &RequestContext) -> Result<Vec<String>, ConfigError> {
        ctx.require(Scopes::READ)?;
        let mut names: Vec<String> = self
            .store()
            .overrides(&scope(&ctx.tenant_id))
            .await?
            .into_iter()
            .map(|stored| stored.key)
            .collect();
        names.sort();
        Ok(names)
    }

    /// Removes a secret (the tenant's admins); a missing one is `SECRET_NOT_FOUND`.
    #[instrument(name = "config.delete_secret", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn delete_secret(&self, ctx: &RequestContext, name: &str) -> Result<(), ConfigError> {
        ctx.require(Scopes::WRITE)?;
        ctx.principal.require_admin()?;
        check_name(name)?;
        let scope = scope(&ctx.tenant_id);
        let exists = self
            .store()
            .overrides(&scope)
            .await?
            .iter()
            .any(|stored| stored.key == name);
        if !exists {
            return Err(not_found(name));
        }
        let change = Change {
            key: name.to_owned(),
            value: None,
        };
        self.store()
            .apply(&scope, &[change], &ctx.principal.user_id, avm_common::now_ms())
            .await?;
        tracing::info!(name, "secret removed");
        Ok(())
    }

    /// Returns the values of `tenant_id`'s secrets named in `names` that are
    /// stored (components only).
    #[instrument(name = "config.resolve_secrets", skip_all, fields(tenant_id = %tenant_id, request_id = %ctx.request_id))]
    pub async fn resolve_secrets(
        &self,
        ctx: &RequestContext,
        tenant_id: &str,
        names: &[String],
    ) -> Result<BTreeMap<String, String>, ConfigError> {
        ctx.principal.require_service()?;
        if names.len() > MAX_RESOLVED {
            return Err(ConfigError::invalid(
                "INVALID_SECRET_NAME",
                format!("at most {MAX_RESOLVED} secrets are resolved at once"),
            ));
        }
        for name in names {
            check_name(name)?;
        }
        let scope = scope(tenant_id);
        let mut values = BTreeMap::new();
        for stored in self.store().overrides(&scope).await? {
            if names.contains(&stored.key) {
                let value = self.open(&scope, &stored.key, &stored.value)?;
                values.insert(stored.key, value);
            }
        }
        Ok(values)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_values_are_checked_without_echoing_values() {
        assert!(check_name("github.token-v2_x").is_ok());
        for bad in ["", "a/b", "x y", "é", &"n".repeat(129)] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_value("s3cr3t").is_ok());
        for bad in [
            String::new(),
            "abc".to_owned(),
            "ab\0cd".to_owned(),
            "x".repeat(MAX_SECRET_BYTES + 1),
        ] {
            let err = check_value(&bad).unwrap_err().to_string();
            assert!(bad.is_empty() || !err.contains(&bad), "{err}");
        }
    }
}
