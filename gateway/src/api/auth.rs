//! Tenants, their users, API keys, token exchange, the verification keys and
//! the caller's identity: the public face of the auth service.

use avm_common::auth::{Principal, Scopes};
use avm_common::{ApiError, RequestContext};
use avm_proto::auth::v1 as pb;
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

use super::reasoned;
use crate::peers::Peers;

/// Request and token limits; 0 means unlimited.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", default, expecting = "an object", deny_unknown_fields)]
pub struct Limits {
    #[serde(deserialize_with = "per_minute")]
    pub requests_per_minute: u32,
    #[serde(deserialize_with = "count")]
    pub tokens_per_month: u64,
}

fn count<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    match Value::deserialize(deserializer)? {
        Value::Null => Ok(0),
        value => value
            .as_u64()
            .ok_or_else(|| reasoned("INVALID_FIELD", "{field} must be a non-negative integer")),
    }
}

fn per_minute<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    u32::try_from(count(deserializer)?).map_err(|_| reasoned("INVALID_FIELD", "{field} is too large"))
}

impl From<Option<pb::Limits>> for Limits {
    fn from(limits: Option<pb::Limits>) -> Self {
        let limits = limits.unwrap_or_default();
        Self {
            requests_per_minute: limits.requests_per_minute,
            tokens_per_month: limits.tokens_per_month,
        }
    }
}

impl From<Limits> for pb::Limits {
    fn from(limits: Limits) -> Self {
        Self {
            requests_per_minute: limits.requests_per_minute,
            tokens_per_month: limits.tokens_per_month,
        }
    }
}

impl From<avm_common::auth::Limits> for Limits {
    fn from(limits: avm_common::auth::Limits) -> Self {
        Self {
            requests_per_minute: limits.requests_per_minute,
            tokens_per_month: limits.tokens_per_month,
        }
    }
}

/// A tenant.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Tenant {
    pub tenant_id: String,
    pub name: String,
    /// Whether it runs the deployment (its admins manage every tenant).
    pub operator: bool,
    pub limits: Limits,
    pub created_at: i64,
    pub updated_at: i64,
}

impl From<pb::Tenant> for Tenant {
    fn from(tenant: pb::Tenant) -> Self {
        Self {
            limits: tenant.limits.into(),
            tenant_id: tenant.tenant_id,
            name: tenant.name,
            operator: tenant.operator,
            created_at: tenant.created_at_ms,
            updated_at: tenant.updated_at_ms,
        }
    }
}

/// A user of a tenant.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct User {
    pub user_id: String,
    pub tenant_id: String,
    pub name: String,
    /// `admin`, `member` or `service`.
    pub role: String,
    pub created_at: i64,
}

impl From<pb::User> for User {
    fn from(user: pb::User) -> Self {
        let role = match pb::Role::try_from(user.role) {
            Ok(pb::Role::Admin) => "admin",
            Ok(pb::Role::Member) => "member",
            Ok(pb::Role::Service) => "service",
            _ => "unknown",
        };
        Self {
            user_id: user.user_id,
            tenant_id: user.tenant_id,
            name: user.name,
            role: role.to_owned(),
            created_at: user.created_at_ms,
        }
    }
}

/// An API key (never its secret).
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiKey {
    pub key_id: String,
    pub tenant_id: String,
    pub user_id: String,
    pub name: String,
    /// The start of the key, to tell keys apart.
    pub prefix: String,
    pub scopes: Vec<String>,
    pub limits: Limits,
    pub created_at: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<i64>,
}

impl From<pb::ApiKey> for ApiKey {
    fn from(key: pb::ApiKey) -> Self {
        Self {
            limits: key.limits.into(),
            key_id: key.key_id,
            tenant_id: key.tenant_id,
            user_id: key.user_id,
            name: key.name,
            prefix: key.prefix,
            scopes: key.scopes,
            created_at: key.created_at_ms,
            expires_at: key.expires_at_ms,
            revoked_at: key.revoked_at_ms,
        }
    }
}

/// A new tenant (`POST /v1/tenants`, operators).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NewTenant {
    pub name: String,
    #[serde(default)]
    pub limits: Option<Limits>,
    /// The name of its first admin.
    #[serde(default)]
    pub admin_name: Option<String>,
}

/// A created tenant with its first admin and that admin's key, shown once.
#[derive(Debug, Serialize, ToSchema)]
pub struct TenantCreated {
    pub tenant: Option<Tenant>,
    pub admin: Option<User>,
    pub key: Option<ApiKey>,
    /// The admin's API key; it is not stored and cannot be shown again.
    pub secret: String,
}

/// The tenants an operator sees.
#[derive(Debug, Serialize, ToSchema)]
pub struct TenantList {
    pub tenants: Vec<Tenant>,
}

/// The changes to a tenant.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(default, deny_unknown_fields)]
pub struct TenantUpdate {
    pub name: Option<String>,
    pub limits: Option<Limits>,
}

/// What deleting a tenant answers.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantDeleted {
    pub tenant_id: String,
    pub deleted: bool,
}

/// A new user of a tenant.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewUser {
    pub name: String,
    /// `member` (the default) or `admin`.
    #[serde(default)]
    pub role: Option<RoleName>,
}

/// A role a user may be given.
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(try_from = "String")]
pub enum RoleName {
    Member,
    Admin,
}

impl TryFrom<String> for RoleName {
    type Error = String;

    fn try_from(name: String) -> Result<Self, Self::Error> {
        match name.as_str() {
            "member" => Ok(RoleName::Member),
            "admin" => Ok(RoleName::Admin),
            other => Err(format!(
                "[INVALID_ROLE] unknown role {other:?}; roles are admin and member"
            )),
        }
    }
}

/// A tenant's users.
#[derive(Debug, Serialize, ToSchema)]
pub struct UserList {
    pub users: Vec<User>,
}

/// What deleting a user answers.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UserDeleted {
    pub user_id: String,
    pub deleted: bool,
}

/// A new API key.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct NewKey {
    /// The user it speaks for (default: the caller).
    pub user_id: Option<String>,
    pub name: Option<String>,
    /// `read`, `write`, `admin` (default: all the user's role allows).
    pub scopes: Option<Vec<String>>,
    /// When it stops working, Unix ms; or `expiresIn`.
    #[serde(deserialize_with = "time_ms")]
    pub expires_at: Option<i64>,
    /// How long it works, e.g. `30d` or `12h`; or `expiresAt`.
    pub expires_in: Option<String>,
    pub limits: Option<Limits>,
}

fn time_ms<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<i64>, D::Error> {
    match Value::deserialize(deserializer)? {
        Value::Null => Ok(None),
        value => value
            .as_i64()
            .map(Some)
            .ok_or_else(|| reasoned("INVALID_FIELD", "{field} must be a time in ms")),
    }
}

/// A created key; its secret is shown this once.
#[derive(Debug, Serialize, ToSchema)]
pub struct KeyCreated {
    pub key: Option<ApiKey>,
    pub secret: String,
}

/// Whose keys to list.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase")]
#[into_params(parameter_in = Query)]
pub struct KeyFilter {
    pub user_id: Option<String>,
}

/// API keys.
#[derive(Debug, Serialize, ToSchema)]
pub struct KeyList {
    pub keys: Vec<ApiKey>,
}

/// What to exchange for an access token: an API key or a token of the
/// configured OIDC issuer (or neither, with the key in `Authorization`).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct TokenRequest {
    pub api_key: Option<String>,
    pub subject_token: Option<String>,
}

/// A short-lived access token.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AccessToken {
    pub access_token: String,
    /// Always `Bearer`.
    pub token_type: String,
    /// Seconds from now.
    pub expires_in: i64,
    /// Unix milliseconds.
    pub expires_at: i64,
}

/// Who the caller is.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Caller {
    pub tenant_id: String,
    pub user_id: String,
    pub role: String,
    pub operator: bool,
    pub key_id: Option<String>,
    pub scopes: Vec<String>,
    pub limits: CallerLimits,
}

/// The limits that apply to the caller.
#[derive(Debug, Serialize, ToSchema)]
pub struct CallerLimits {
    pub tenant: Limits,
    pub key: Limits,
}

/// Whose token quota to show (operators may name another tenant). Other
/// fields are ignored: the WebSocket request also carries its `requestId`.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct QuotaQuery {
    pub tenant_id: Option<String>,
}

/// A tenant's token use this month against its quota.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Quota {
    /// `YYYY-MM` (UTC).
    pub month: String,
    pub tokens_used: u64,
    /// 0 means unlimited.
    pub tokens_per_month: u64,
}

/// The new signing key.
#[derive(Debug, Serialize, ToSchema)]
pub struct Rotated {
    /// Its key id, as tokens name it.
    pub kid: String,
}

/// Creates a tenant with its first admin.
pub async fn create_tenant(peers: &Peers, ctx: &RequestContext, request: NewTenant) -> Result<TenantCreated, ApiError> {
    let call = pb::CreateTenantRequest {
        name: request.name,
        limits: request.limits.map(pb::Limits::from),
        admin_name: request.admin_name.unwrap_or_default(),
    };
    let created = peers.auth.create_tenant(ctx.request(call)).await?.into_inner();
    Ok(TenantCreated {
        tenant: created.tenant.map(Tenant::from),
        admin: created.admin.map(User::from),
        key: created.api_key.map(ApiKey::from),
        secret: created.secret,
    })
}

/// Lists the tenants.
pub async fn list_tenants(peers: &Peers, ctx: &RequestContext) -> Result<TenantList, ApiError> {
    let call = ctx.request(pb::ListTenantsRequest {});
    let tenants = peers.auth.list_tenants(call).await?.into_inner().tenants;
    Ok(TenantList {
        tenants: tenants.into_iter().map(Tenant::from).collect(),
    })
}

/// Returns a tenant.
pub async fn get_tenant(peers: &Peers, ctx: &RequestContext, tenant_id: String) -> Result<Option<Tenant>, ApiError> {
    let call = ctx.request(pb::GetTenantRequest { tenant_id });
    let tenant = peers.auth.get_tenant(call).await?.into_inner().tenant;
    Ok(tenant.map(Tenant::from))
}

/// Changes a tenant's name or limits.
pub async fn update_tenant(
    peers: &Peers,
    ctx: &RequestContext,
    tenant_id: String,
    update: TenantUpdate,
) -> Result<Option<Tenant>, ApiError> {
    let call = pb::UpdateTenantRequest {
        tenant_id,
        name: update.name,
        limits: update.limits.map(pb::Limits::from),
    };
    let tenant = peers.auth.update_tenant(ctx.request(call)).await?.into_inner().tenant;
    Ok(tenant.map(Tenant::from))
}

/// Deletes a tenant with its users and keys.
pub async fn delete_tenant(peers: &Peers, ctx: &RequestContext, tenant_id: String) -> Result<TenantDeleted, ApiError> {
    let call = ctx.request(pb::DeleteTenantRequest {
        tenant_id: tenant_id.clone(),
    });
    peers.auth.delete_tenant(call).await?;
    Ok(TenantDeleted {
        tenant_id,
        deleted: true,
    })
}

/// Creates a user of a tenant.
pub async fn create_user(
    peers: &Peers,
    ctx: &RequestContext,
    tenant_id: String,
    request: NewUser,
) -> Result<Option<User>, ApiError> {
    let role = match request.role {
        None | Some(RoleName::Member) => pb::Role::Member,
        Some(RoleName::Admin) => pb::Role::Admin,
    };
    let call = pb::CreateUserRequest {
        tenant_id,
        name: request.name,
        role: role as i32,
    };
    let user = peers.auth.create_user(ctx.request(call)).await?.into_inner().user;
    Ok(user.map(User::from))
}

/// Lists a tenant's users.
pub async fn list_users(peers: &Peers, ctx: &RequestContext, tenant_id: String) -> Result<UserList, ApiError> {
    let call = ctx.request(pb::ListUsersRequest { tenant_id });
    let users = peers.auth.list_users(call).await?.into_inner().users;
    Ok(UserList {
        users: users.into_iter().map(User::from).collect(),
    })
}

/// Returns a user, answering NOT_FOUND when it is not of the tenant named.
pub async fn get_user(
    peers: &Peers,
    ctx: &RequestContext,
    tenant_id: String,
    user_id: String,
) -> Result<User, ApiError> {
    let call = ctx.request(pb::GetUserRequest {
        user_id: user_id.clone(),
    });
    match peers.auth.get_user(call).await?.into_inner().user {
        Some(user) if user.tenant_id == tenant_id => Ok(user.into()),
        _ => Err(ApiError::not_found(
            "USER_NOT_FOUND",
            format!("user {user_id} not found"),
        )),
    }
}

/// Deletes a user of the tenant named.
pub async fn delete_user(
    peers: &Peers,
    ctx: &RequestContext,
    tenant_id: String,
    user_id: String,
) -> Result<UserDeleted, ApiError> {
    get_user(peers, ctx, tenant_id, user_id.clone()).await?;
    let call = ctx.request(pb::DeleteUserRequest {
        user_id: user_id.clone(),
    });
    peers.auth.delete_user(call).await?;
    Ok(UserDeleted { user_id, deleted: true })
}

/// Creates an API key.
pub async fn create_key(peers: &Peers, ctx: &RequestContext, request: NewKey) -> Result<KeyCreated, ApiError> {
    let scopes = request.scopes.unwrap_or_default();
    // Refused here too, so the error names the field the caller wrote.
    Scopes::parse(&scopes)?;
    let expires_at_ms = match (request.expires_at, request.expires_in) {
        (Some(at), None) => Some(at),
        (None, Some(within)) => {
            let within = humantime::parse_duration(&within).map_err(|_| {
                ApiError::invalid(
                    "INVALID_FIELD",
                    "expiresIn must be a duration such as \"30d\" or \"12h\"",
                )
            })?;
            let within = i64::try_from(within.as_millis()).unwrap_or(i64::MAX);
            Some(avm_common::now_ms().saturating_add(within))
        }
        (None, None) => None,
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "INVALID_FIELD",
                "give either expiresAt (ms) or expiresIn (duration), not both",
            ));
        }
    };
    let call = pb::CreateApiKeyRequest {
        user_id: request.user_id.unwrap_or_default(),
        name: request.name.unwrap_or_default(),
        scopes,
        expires_at_ms,
        limits: request.limits.map(pb::Limits::from),
    };
    let created = peers.auth.create_api_key(ctx.request(call)).await?.into_inner();
    Ok(KeyCreated {
        key: created.api_key.map(ApiKey::from),
        secret: created.secret,
    })
}

/// Lists API keys (the caller's, or a user's).
pub async fn list_keys(peers: &Peers, ctx: &RequestContext, filter: KeyFilter) -> Result<KeyList, ApiError> {
    let call = ctx.request(pb::ListApiKeysRequest {
        user_id: filter.user_id,
    });
    let keys = peers.auth.list_api_keys(call).await?.into_inner().api_keys;
    Ok(KeyList {
        keys: keys.into_iter().map(ApiKey::from).collect(),
    })
}

/// Returns an API key.
pub async fn get_key(peers: &Peers, ctx: &RequestContext, key_id: String) -> Result<Option<ApiKey>, ApiError> {
    let call = ctx.request(pb::GetApiKeyRequest { key_id });
    let key = peers.auth.get_api_key(call).await?.into_inner().api_key;
    Ok(key.map(ApiKey::from))
}

/// Revokes an API key; every service refuses it within a second.
pub async fn revoke_key(peers: &Peers, ctx: &RequestContext, key_id: String) -> Result<Option<ApiKey>, ApiError> {
    let call = ctx.request(pb::RevokeApiKeyRequest { key_id });
    let key = peers.auth.revoke_api_key(call).await?.into_inner().api_key;
    Ok(key.map(ApiKey::from))
}

/// Exchanges an API key (`apiKey`, else `header_key`) or an external token for an access token.
pub async fn exchange_token(
    peers: &Peers,
    request: TokenRequest,
    header_key: Option<&str>,
) -> Result<AccessToken, ApiError> {
    let (expires_at_ms, access_token) = match (request.api_key, request.subject_token) {
        (Some(api_key), None) => exchange_key(peers, api_key).await?,
        (None, Some(subject_token)) => {
            let call = tonic::Request::new(pb::ExchangeExternalTokenRequest { subject_token });
            let response = peers.auth.exchange_external_token(call).await?.into_inner();
            (response.expires_at_ms, response.access_token)
        }
        (None, None) => match header_key {
            Some(api_key) => exchange_key(peers, api_key.to_owned()).await?,
            None => return Err(avm_common::auth::missing_credentials()),
        },
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "INVALID_FIELD",
                "give either apiKey or subjectToken, not both",
            ));
        }
    };
    Ok(AccessToken {
        access_token,
        token_type: "Bearer".to_owned(),
        expires_in: (expires_at_ms - avm_common::now_ms()).max(0) / 1000,
        expires_at: expires_at_ms,
    })
}

async fn exchange_key(peers: &Peers, api_key: String) -> Result<(i64, String), ApiError> {
    let call = tonic::Request::new(pb::ExchangeApiKeyRequest { api_key });
    let response = peers.auth.exchange_api_key(call).await?.into_inner();
    Ok((response.expires_at_ms, response.access_token))
}

/// Returns the keys access tokens are verified with (a JWKS).
pub async fn jwks(peers: &Peers) -> Result<Value, ApiError> {
    let response = peers
        .auth
        .get_jwks(tonic::Request::new(pb::GetJwksRequest {}))
        .await?
        .into_inner();
    serde_json::from_str(&response.jwks_json)
        .map_err(|err| ApiError::internal(format!("auth service sent an unreadable jwks: {err}")))
}

/// Returns who the caller is.
pub fn whoami(ctx: &RequestContext) -> Caller {
    let caller: &Principal = &ctx.principal;
    Caller {
        tenant_id: caller.tenant_id.clone(),
        user_id: caller.user_id.clone(),
        role: caller.role.as_str().to_owned(),
        operator: caller.operator,
        key_id: caller.key_id.clone(),
        scopes: caller.scopes.names(),
        limits: CallerLimits {
            tenant: caller.tenant_limits.into(),
            key: caller.key_limits.into(),
        },
    }
}

/// Returns a tenant's (the caller's by default) token use this month and its quota.
pub async fn quota(peers: &Peers, ctx: &RequestContext, query: QuotaQuery) -> Result<Quota, ApiError> {
    let call = ctx.request(pb::GetUsageRequest {
        tenant_id: query.tenant_id.unwrap_or_default(),
    });
    let usage = peers.auth.get_usage(call).await?.into_inner();
    Ok(Quota {
        month: usage.month,
        tokens_used: usage.tokens_used,
        tokens_per_month: usage.tokens_per_month,
    })
}

/// Starts signing new tokens with a new key (operators).
pub async fn rotate_signing_key(peers: &Peers, ctx: &RequestContext) -> Result<Rotated, ApiError> {
    let call = ctx.request(pb::RotateSigningKeyRequest {});
    let kid = peers.auth.rotate_signing_key(call).await?.into_inner().kid;
    Ok(Rotated { kid })
}
