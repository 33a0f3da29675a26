//! A tenant's secrets, for its agents' sandboxes: set and removed by its
//! admins, listed by name, never shown (the config center seals them; only
//! the runtime resolves them, into a sandbox's environment).

use avm_common::{ApiError, RequestContext};
use avm_proto::config::v1 as pb;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::peers::Peers;

/// A secret's value.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretInput {
    /// 4 to 8192 bytes, no NUL; never shown again.
    pub value: String,
}

/// A stored secret, without its value.
#[derive(Debug, Serialize, ToSchema)]
pub struct Secret {
    pub name: String,
}

/// The tenant's secrets, by name.
#[derive(Debug, Serialize, ToSchema)]
pub struct Secrets {
    pub secrets: Vec<Secret>,
}

/// A removed secret.
#[derive(Debug, Serialize, ToSchema)]
pub struct SecretDeleted {
    pub name: String,
    pub deleted: bool,
}

/// Stores a secret of the caller's tenant (admins).
pub async fn set(peers: &Peers, ctx: &RequestContext, name: String, input: SecretInput) -> Result<Secret, ApiError> {
    let request = ctx.request(pb::SetSecretRequest {
        name,
        value: input.value,
    });
    let name = peers.config.set_secret(request).await?.into_inner().name;
    Ok(Secret { name })
}

/// Lists the caller's tenant's secrets.
pub async fn list(peers: &Peers, ctx: &RequestContext) -> Result<Secrets, ApiError> {
    let names = peers
        .config
        .list_secrets(ctx.request(pb::ListSecretsRequest {}))
        .await?
        .into_inner()
        .names;
    Ok(Secrets {
        secrets: names.into_iter().map(|name| Secret { name }).collect(),
    })
}

/// Removes a secret (admins).
pub async fn delete(peers: &Peers, ctx: &RequestContext, name: String) -> Result<SecretDeleted, ApiError> {
    let request = ctx.request(pb::DeleteSecretRequest { name: name.clone() });
    peers.config.delete_secret(request).await?;
    Ok(SecretDeleted { name, deleted: true })
}
