//! The gRPC adapter: proto ⇄ domain, bearer token → `RequestContext`, error → `Status`.

use std::pin::Pin;

use avm_common::auth::{Authenticated, Limits, Principal, Role, caller};
use avm_common::config::GrpcConfig;
use avm_proto::auth::v1 as pb;
use avm_proto::auth::v1::auth_service_server::{AuthService as AuthApi, AuthServiceServer};
use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::error::AuthError;
use crate::events::{AuthEvent, AuthEventKind, WatchItem};
use crate::record::{
    AccessToken, ApiKeyRecord, ApiKeySpec, QuotaState, ReserveOutcome, TenantRecord, TenantUpdate, TokenReservation,
    UsageReport, UserRecord,
};
use crate::service::AuthService;

/// Returns the `avm.auth.v1.AuthService` server over `service`, with the
/// configured message-size limits.
pub fn grpc_server(service: AuthService, config: &GrpcConfig) -> Authenticated<AuthServiceServer<AuthGrpc>> {
    let verifier = service.verifier();
    let server = AuthServiceServer::new(AuthGrpc::new(service))
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);
    Authenticated::new(server, verifier)
}

/// Serves `AuthService` over gRPC.
#[derive(Clone)]
pub struct AuthGrpc {
    service: AuthService,
}

impl AuthGrpc {
    /// Returns the adapter over `service`: what the gRPC server serves, and
    /// what `avm serve` calls in process.
    pub fn new(service: AuthService) -> Self {
        Self { service }
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchAuthEventsResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl AuthApi for AuthGrpc {
    type WatchAuthEventsStream = WatchStream;

    async fn create_tenant(
        &self,
        request: Request<pb::CreateTenantRequest>,
    ) -> Result<Response<pb::CreateTenantResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let created = self
            .service
            .create_tenant(&ctx, &request.name, request.limits.map(limits), &request.admin_name)
            .await?;
        Ok(Response::new(pb::CreateTenantResponse {
            tenant: Some(tenant_pb(created.tenant)),
            admin: Some(user_pb(created.admin)),
            api_key: Some(key_pb(created.api_key.api_key)),
            secret: created.api_key.secret,
        }))
    }

    async fn get_tenant(
        &self,
        request: Request<pb::GetTenantRequest>,
    ) -> Result<Response<pb::GetTenantResponse>, Status> {
        let ctx = caller(&request)?;
        let tenant = self.service.get_tenant(&ctx, &request.get_ref().tenant_id).await?;
        Ok(Response::new(pb::GetTenantResponse {
            tenant: Some(tenant_pb(tenant)),
        }))
    }

    async fn list_tenants(
        &self,
        request: Request<pb::ListTenantsRequest>,
    ) -> Result<Response<pb::ListTenantsResponse>, Status> {
        let ctx = caller(&request)?;
        let tenants = self.service.list_tenants(&ctx).await?;
        Ok(Response::new(pb::ListTenantsResponse {
            tenants: tenants.into_iter().map(tenant_pb).collect(),
        }))
    }

    async fn update_tenant(
        &self,
        request: Request<pb::UpdateTenantRequest>,
    ) -> Result<Response<pb::UpdateTenantResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let update = TenantUpdate {
            name: request.name,
            limits: request.limits.map(limits),
        };
        let tenant = self.service.update_tenant(&ctx, &request.tenant_id, update).await?;
        Ok(Response::new(pb::UpdateTenantResponse {
            tenant: Some(tenant_pb(tenant)),
        }))
    }

    async fn delete_tenant(
        &self,
        request: Request<pb::DeleteTenantRequest>,
    ) -> Result<Response<pb::DeleteTenantResponse>, Status> {
        let ctx = caller(&request)?;
        self.service.delete_tenant(&ctx, &request.get_ref().tenant_id).await?;
        Ok(Response::new(pb::DeleteTenantResponse {}))
    }

    async fn create_user(
        &self,
        request: Request<pb::CreateUserRequest>,
    ) -> Result<Response<pb::CreateUserResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        // A user is a member unless said otherwise: the least privilege.
        let role = match pb::Role::try_from(request.role) {
            Ok(pb::Role::Unspecified | pb::Role::Member) => Role::Member,
            Ok(pb::Role::Admin) => Role::Admin,
            Ok(pb::Role::Service) | Err(_) => {
                return Err(AuthError::invalid("INVALID_ROLE", "a user's role is admin or member").into());
            }
        };
        let user = self
            .service
            .create_user(&ctx, &request.tenant_id, &request.name, role)
            .await?;
        Ok(Response::new(pb::CreateUserResponse {
            user: Some(user_pb(user)),
        }))
    }

    async fn get_user(&self, request: Request<pb::GetUserRequest>) -> Result<Response<pb::GetUserResponse>, Status> {
        let ctx = caller(&request)?;
        let user = self.service.get_user(&ctx, &request.get_ref().user_id).await?;
        Ok(Response::new(pb::GetUserResponse {
            user: Some(user_pb(user)),
        }))
    }

    async fn list_users(
        &self,
        request: Request<pb::ListUsersRequest>,
    ) -> Result<Response<pb::ListUsersResponse>, Status> {
        let ctx = caller(&request)?;
        let users = self.service.list_users(&ctx, &request.get_ref().tenant_id).await?;
        Ok(Response::new(pb::ListUsersResponse {
            users: users.into_iter().map(user_pb).collect(),
        }))
    }

    async fn delete_user(
        &self,
        request: Request<pb::DeleteUserRequest>,
    ) -> Result<Response<pb::DeleteUserResponse>, Status> {
        let ctx = caller(&request)?;
        self.service.delete_user(&ctx, &request.get_ref().user_id).await?;
        Ok(Response::new(pb::DeleteUserResponse {}))
    }

    async fn create_api_key(
        &self,
        request: Request<pb::CreateApiKeyRequest>,
    ) -> Result<Response<pb::CreateApiKeyResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let spec = ApiKeySpec {
            user_id: Some(request.user_id).filter(|id| !id.is_empty()),
            name: request.name,
            scopes: request.scopes,
            expires_at_ms: request.expires_at_ms,
            limits: request.limits.map(limits),
        };
        let created = self.service.create_api_key(&ctx, spec).await?;
        Ok(Response::new(pb::CreateApiKeyResponse {
            api_key: Some(key_pb(created.api_key)),
            secret: created.secret,
        }))
    }

    async fn get_api_key(
        &self,
        request: Request<pb::GetApiKeyRequest>,
    ) -> Result<Response<pb::GetApiKeyResponse>, Status> {
        let ctx = caller(&request)?;
        let key = self.service.get_api_key(&ctx, &request.get_ref().key_id).await?;
        Ok(Response::new(pb::GetApiKeyResponse {
            api_key: Some(key_pb(key)),
        }))
    }

    async fn list_api_keys(
        &self,
        request: Request<pb::ListApiKeysRequest>,
    ) -> Result<Response<pb::ListApiKeysResponse>, Status> {
        let ctx = caller(&request)?;
        let keys = self
            .service
            .list_api_keys(&ctx, request.get_ref().user_id.as_deref())
            .await?;
        Ok(Response::new(pb::ListApiKeysResponse {
            api_keys: keys.into_iter().map(key_pb).collect(),
        }))
    }

    async fn revoke_api_key(
        &self,
        request: Request<pb::RevokeApiKeyRequest>,
    ) -> Result<Response<pb::RevokeApiKeyResponse>, Status> {
        let ctx = caller(&request)?;
        let key = self.service.revoke_api_key(&ctx, &request.get_ref().key_id).await?;
        Ok(Response::new(pb::RevokeApiKeyResponse {
            api_key: Some(key_pb(key)),
        }))
    }

    async fn exchange_api_key(
        &self,
        request: Request<pb::ExchangeApiKeyRequest>,
    ) -> Result<Response<pb::ExchangeApiKeyResponse>, Status> {
        let token = self.service.exchange_api_key(&request.get_ref().api_key).await?;
        let (access_token, expires_at_ms, caller) = token_parts(token);
        Ok(Response::new(pb::ExchangeApiKeyResponse {
            access_token,
            expires_at_ms,
            caller: Some(caller),
        }))
    }

    async fn exchange_external_token(
        &self,
        request: Request<pb::ExchangeExternalTokenRequest>,
    ) -> Result<Response<pb::ExchangeExternalTokenResponse>, Status> {
        let token = self
            .service
            .exchange_external_token(&request.get_ref().subject_token)
            .await?;
        let (access_token, expires_at_ms, caller) = token_parts(token);
        Ok(Response::new(pb::ExchangeExternalTokenResponse {
            access_token,
            expires_at_ms,
            caller: Some(caller),
        }))
    }

    async fn get_jwks(&self, _request: Request<pb::GetJwksRequest>) -> Result<Response<pb::GetJwksResponse>, Status> {
        let jwks_json = self.service.jwks_json().await?;
        Ok(Response::new(pb::GetJwksResponse { jwks_json }))
    }

    async fn rotate_signing_key(
        &self,
        request: Request<pb::RotateSigningKeyRequest>,
    ) -> Result<Response<pb::RotateSigningKeyResponse>, Status> {
        let ctx = caller(&request)?;
        let kid = self.service.rotate_signing_key(&ctx).await?;
        Ok(Response::new(pb::RotateSigningKeyResponse { kid }))
    }

    async fn get_caller(
        &self,
        request: Request<pb::GetCallerRequest>,
    ) -> Result<Response<pb::GetCallerResponse>, Status> {
        let ctx = caller(&request)?;
        let principal = self.service.caller(&ctx).await?;
        Ok(Response::new(pb::GetCallerResponse {
            caller: Some(caller_pb(principal)),
        }))
    }

    async fn record_usage(
        &self,
        request: Request<pb::RecordUsageRequest>,
    ) -> Result<Response<pb::RecordUsageResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let report = UsageReport {
            tenant_id: request.tenant_id,
            key_id: request.key_id.filter(|id| !id.is_empty()),
            input_tokens: request.input_tokens,
            output_tokens: request.output_tokens,
            report_id: request.report_id,
        };
        let tenant_tokens_this_month = self.service.record_usage(&ctx, report).await?;
        Ok(Response::new(pb::RecordUsageResponse {
            tenant_tokens_this_month,
        }))
    }

    async fn reserve_tokens(
        &self,
        request: Request<pb::ReserveTokensRequest>,
    ) -> Result<Response<pb::ReserveTokensResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let reservation = TokenReservation {
            tenant_id: request.tenant_id,
            key_id: request.key_id.filter(|id| !id.is_empty()),
            reservation_id: request.reservation_id,
            tokens: request.tokens,
        };
        let answer = match self.service.reserve_tokens(&ctx, reservation).await? {
            ReserveOutcome::Reserved => pb::ReserveTokensResponse {
                reserved: true,
                ..Default::default()
            },
            ReserveOutcome::Refused { quota, used_up } => pb::ReserveTokensResponse {
                reserved: false,
                exceeded: Some(quota_pb(quota)),
                used_up,
            },
        };
        Ok(Response::new(answer))
    }

    async fn get_usage(&self, request: Request<pb::GetUsageRequest>) -> Result<Response<pb::GetUsageResponse>, Status> {
        let ctx = caller(&request)?;
        let usage = self.service.usage(&ctx, &request.get_ref().tenant_id).await?;
        Ok(Response::new(pb::GetUsageResponse {
            month: usage.month,
            tokens_used: usage.tokens_used,
            tokens_per_month: usage.tokens_per_month,
        }))
    }

    async fn watch_auth_events(
        &self,
        request: Request<pb::WatchAuthEventsRequest>,
    ) -> Result<Response<Self::WatchAuthEventsStream>, Status> {
        let ctx = caller(&request)?;
        let events = self.service.watch_events(&ctx).await?;
        // Every stream ends with a typed status: the error item is the last one.
        let stream = events.map(|item| match item {
            Ok(WatchItem::Event(event)) => Ok(pb::WatchAuthEventsResponse {
                event: Some(event_pb(event)),
                snapshot_complete: false,
            }),
            Ok(WatchItem::SnapshotComplete) => Ok(pb::WatchAuthEventsResponse {
                event: None,
                snapshot_complete: true,
            }),
            Err(err) => Err(Status::from(err)),
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

fn limits(limits: pb::Limits) -> Limits {
    Limits {
        requests_per_minute: limits.requests_per_minute,
        tokens_per_month: limits.tokens_per_month,
    }
}

fn limits_pb(limits: Limits) -> pb::Limits {
    pb::Limits {
        requests_per_minute: limits.requests_per_minute,
        tokens_per_month: limits.tokens_per_month,
    }
}

fn role_pb(role: Role) -> pb::Role {
    match role {
        Role::Admin => pb::Role::Admin,
        Role::Member => pb::Role::Member,
        Role::Service => pb::Role::Service,
    }
}

fn tenant_pb(tenant: TenantRecord) -> pb::Tenant {
    pb::Tenant {
        tenant_id: tenant.tenant_id,
        name: tenant.name,
        operator: tenant.operator,
        limits: Some(limits_pb(tenant.limits)),
        created_at_ms: tenant.created_at_ms,
        updated_at_ms: tenant.updated_at_ms,
    }
}

fn user_pb(user: UserRecord) -> pb::User {
    pb::User {
        user_id: user.user_id,
        tenant_id: user.tenant_id,
        name: user.name,
        role: role_pb(user.role) as i32,
        created_at_ms: user.created_at_ms,
    }
}

fn key_pb(key: ApiKeyRecord) -> pb::ApiKey {
    pb::ApiKey {
        key_id: key.key_id,
        tenant_id: key.tenant_id,
        user_id: key.user_id,
        name: key.name,
        prefix: key.prefix,
        scopes: key.scopes.names(),
        limits: Some(limits_pb(key.limits)),
        created_at_ms: key.created_at_ms,
        expires_at_ms: key.expires_at_ms,
        revoked_at_ms: key.revoked_at_ms,
    }
}

fn caller_pb(principal: Principal) -> pb::Caller {
    pb::Caller {
        tenant_id: principal.tenant_id,
        user_id: principal.user_id,
        role: role_pb(principal.role) as i32,
        operator: principal.operator,
        key_id: principal.key_id,
        scopes: principal.scopes.names(),
        tenant_limits: Some(limits_pb(principal.tenant_limits)),
        key_limits: Some(limits_pb(principal.key_limits)),
    }
}

fn token_parts(token: AccessToken) -> (String, i64, pb::Caller) {
    (token.token, token.expires_at_ms, caller_pb(token.principal))
}

fn quota_pb(quota: QuotaState) -> pb::QuotaState {
    pb::QuotaState {
        tenant_id: quota.tenant_id,
        key_id: quota.key_id,
        month: quota.month,
    }
}

fn event_pb(event: AuthEvent) -> pb::AuthEvent {
    use pb::auth_event::Kind;
    let kind = match event.kind {
        AuthEventKind::KeyRevoked(id) => Kind::KeyRevoked(id),
        AuthEventKind::UserDeleted(id) => Kind::UserDeleted(id),
        AuthEventKind::TenantDeleted(id) => Kind::TenantDeleted(id),
        AuthEventKind::TenantUpdated(id) => Kind::TenantUpdated(id),
        AuthEventKind::QuotaExhausted(quota) => Kind::QuotaExhausted(quota_pb(quota)),
        AuthEventKind::QuotaRestored(quota) => Kind::QuotaRestored(quota_pb(quota)),
        AuthEventKind::SigningKeyRotated(kid) => Kind::SigningKeyRotated(kid),
    };
    pb::AuthEvent {
        at_ms: event.at_ms,
        kind: Some(kind),
    }
}
