//! Credentials for remote MCP servers: the headers a user's (or, set by its
//! admins, the tenant's) requests send to one server. Write-only: they are
//! listed by header name, never shown. Each is bound to the origin of the
//! server's URL when it is stored, and never sent elsewhere (issue 26 item 4).

use std::collections::BTreeMap;

use avm_common::{ApiError, RequestContext};
use avm_proto::config::v1 as pb;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::missing;
use crate::peers::Peers;

/// A credential to store: a bearer token, or headers (or both).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct CredentialInput {
    /// `user` (the caller's own, the default) or `tenant` (admins; used for
    /// the tenant's users without one of their own).
    pub scope: Option<String>,
    /// Sent as `Authorization: Bearer <token>`.
    pub bearer_token: Option<String>,
    /// Headers sent with every request to the server.
    pub headers: Option<BTreeMap<String, String>>,
    /// The server's URL; the credential is sent to its origin
    /// (`scheme://host:port`) only. Default: the URL of the caller's tool
    /// resource named `server`, as it is now.
    pub url: Option<String>,
}

/// Which credential a request names.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct CredentialScopeQuery {
    /// `user` (default) or `tenant`.
    pub scope: Option<String>,
}

/// A stored credential, without its values.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Credential {
    /// The MCP server: its tool resource's name.
    pub server: String,
    /// `user` or `tenant`.
    pub scope: String,
    pub header_names: Vec<String>,
    /// The only origin (`scheme://host:port`) it is sent to; empty for one
    /// stored before credentials were bound, which is never sent until stored again.
    pub origin: String,
}

/// The credentials the caller's requests use: its own, then its tenant's.
#[derive(Debug, Serialize, ToSchema)]
pub struct Credentials {
    pub credentials: Vec<Credential>,
}

/// A removed credential.
#[derive(Debug, Serialize, ToSchema)]
pub struct CredentialDeleted {
    pub server: String,
    pub deleted: bool,
}

fn scope_pb(scope: Option<&str>) -> Result<pb::CredentialScope, ApiError> {
    match scope {
        None | Some("user") => Ok(pb::CredentialScope::User),
        Some("tenant") => Ok(pb::CredentialScope::Tenant),
        Some(other) => Err(ApiError::invalid(
            "INVALID_SCOPE",
            format!("unknown scope {other:?}; credentials are a user's or the tenant's"),
        )),
    }
}

fn credential(credential: pb::Credential) -> Credential {
    let scope = match pb::CredentialScope::try_from(credential.scope) {
        Ok(pb::CredentialScope::Tenant) => "tenant",
        _ => "user",
    };
    Credential {
        server: credential.server,
        scope: scope.to_owned(),
        header_names: credential.header_names,
        origin: credential.origin,
    }
}

/// Returns the URL of the server of the tool resource `server` the caller
/// sees now: what a credential set without a URL is bound to.
async fn server_url(peers: &Peers, ctx: &RequestContext, server: &str) -> Result<String, ApiError> {
    let required = || {
        ApiError::invalid(
            "CREDENTIAL_URL_REQUIRED",
            format!(
                "no tool resource {server:?} with an http or sse mcpServer is visible: say which server URL \
                 the credential is for (`url`)"
            ),
        )
    };
    let call = avm_proto::resource::v1::ResolveResourceRequest {
        uri: format!("resource://tools/{server}"),
        variables_json: String::new(),
    };
    let resolved = match peers.resource.resolve_resource(ctx.request(call)).await {
        Ok(resolved) => resolved.into_inner(),
        Err(status) if status.code() == tonic::Code::NotFound || status.code() == tonic::Code::InvalidArgument => {
            return Err(required());
        }
        Err(status) => return Err(status.into()),
    };
    let content = resolved.root.map(|root| root.content_json).unwrap_or_default();
    let content: serde_json::Value = serde_json::from_str(&content).map_err(|_| required())?;
    content["mcpServer"]["url"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(required)
}

/// Stores a credential for `server`.
pub async fn set(
    peers: &Peers,
    ctx: &RequestContext,
    server: String,
    input: CredentialInput,
) -> Result<Credential, ApiError> {
    let scope = scope_pb(input.scope.as_deref())?;
    let url = match input.url {
        Some(url) => url,
        None => server_url(peers, ctx, &server).await?,
    };
    let mut headers = input.headers.unwrap_or_default();
    if let Some(token) = input.bearer_token {
        headers.insert("Authorization".to_owned(), format!("Bearer {token}"));
    }
    let request = ctx.request(pb::SetCredentialRequest {
        server,
        scope: scope as i32,
        headers: headers.into_iter().collect(),
        url,
    });
    let stored = peers.config.set_credential(request).await?.into_inner().credential;
    stored.map(credential).ok_or_else(|| missing("credential"))
}

/// Lists the caller's credentials and its tenant's.
pub async fn list(peers: &Peers, ctx: &RequestContext) -> Result<Credentials, ApiError> {
    let request = ctx.request(pb::ListCredentialsRequest {});
    let listed = peers.config.list_credentials(request).await?.into_inner().credentials;
    Ok(Credentials {
        credentials: listed.into_iter().map(credential).collect(),
    })
}

/// Removes a credential.
pub async fn delete(
    peers: &Peers,
    ctx: &RequestContext,
    server: String,
    query: CredentialScopeQuery,
) -> Result<CredentialDeleted, ApiError> {
    let scope = scope_pb(query.scope.as_deref())?;
    let request = ctx.request(pb::DeleteCredentialRequest {
        server: server.clone(),
        scope: scope as i32,
    });
    peers.config.delete_credential(request).await?;
    Ok(CredentialDeleted { server, deleted: true })
}
