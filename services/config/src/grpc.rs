//! The gRPC adapter: proto ⇄ domain, metadata → `RequestContext`, error → `Status`.

use avm_common::auth::{Authenticated, TokenVerifier, caller};
use avm_common::config::GrpcConfig;
use avm_proto::config::v1 as pb;
use avm_proto::config::v1::config_service_server::{ConfigService as ConfigApi, ConfigServiceServer};
use futures::StreamExt;
use futures::stream::BoxStream;
use tonic::{Request, Response, Status};

use crate::credentials::{CredentialInfo, CredentialScope};
use crate::service::{ConfigService, EntryView, Snapshot, Source, UpdateScope, WatchUpdate};

/// Returns the `avm.config.v1.ConfigService` server over `service`, with the
/// configured message-size limits. Every call's caller is verified from its
/// bearer token.
pub fn grpc_server(
    service: ConfigService,
    verifier: TokenVerifier,
    config: &GrpcConfig,
) -> Authenticated<ConfigServiceServer<ConfigGrpc>> {
    let server = ConfigServiceServer::new(ConfigGrpc::new(service))
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);
    Authenticated::new(server, verifier)
}

/// Serves `ConfigService` over gRPC.
#[derive(Clone)]
pub struct ConfigGrpc {
    service: ConfigService,
}

impl ConfigGrpc {
    /// Returns the adapter over `service`: what the gRPC server serves, and
    /// what `avm serve` calls in process.
    pub fn new(service: ConfigService) -> Self {
        Self { service }
    }
}

#[tonic::async_trait]
impl ConfigApi for ConfigGrpc {
    async fn get_config(
        &self,
        request: Request<pb::GetConfigRequest>,
    ) -> Result<Response<pb::GetConfigResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let snapshot = self
            .service
            .get(&ctx, &request.tenant_id, request.system_only, &request.key)
            .await?;
        Ok(Response::new(pb::GetConfigResponse {
            revision: snapshot.revision,
            entries: entries_pb(&snapshot),
        }))
    }

    async fn update_config(
        &self,
        request: Request<pb::UpdateConfigRequest>,
    ) -> Result<Response<pb::UpdateConfigResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let scope = match pb::Scope::try_from(request.scope) {
            Ok(pb::Scope::System) => UpdateScope::System,
            Ok(pb::Scope::Tenant) => UpdateScope::Tenant(request.tenant_id),
            _ => {
                return Err(avm_common::ApiError::invalid(
                    "INVALID_SCOPE",
                    "scope must be SCOPE_SYSTEM or SCOPE_TENANT",
                )
                .into());
            }
        };
        let mut values: Vec<(String, String)> = request.values.into_iter().collect();
        values.sort();
        let snapshot = self.service.update(&ctx, scope, &values).await?;
        Ok(Response::new(pb::UpdateConfigResponse {
            revision: snapshot.revision,
            entries: entries_pb(&snapshot),
        }))
    }

    type WatchConfigStream = BoxStream<'static, Result<pb::WatchConfigResponse, Status>>;

    async fn watch_config(
        &self,
        request: Request<pb::WatchConfigRequest>,
    ) -> Result<Response<Self::WatchConfigStream>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let updates = self
            .service
            .watch(&ctx, &request.tenant_id, request.all_tenants)
            .await?;
        let stream = updates.map(|update| match update {
            Ok(WatchUpdate::Entries { snapshot, state }) => Ok(pb::WatchConfigResponse {
                revision: state.revision,
                entries: entries_pb(&state),
                snapshot,
                changed_tenant_id: String::new(),
            }),
            Ok(WatchUpdate::TenantChanged { revision, tenant_id }) => Ok(pb::WatchConfigResponse {
                revision,
                entries: Vec::new(),
                snapshot: false,
                changed_tenant_id: tenant_id,
            }),
            Err(err) => Err(Status::from(err)),
        });
        Ok(Response::new(stream.boxed()))
    }

    async fn set_credential(
        &self,
        request: Request<pb::SetCredentialRequest>,
    ) -> Result<Response<pb::SetCredentialResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let scope = scope_of(request.scope)?;
        let headers = request.headers.into_iter().collect();
        let stored = self
            .service
            .set_credential(&ctx, &request.server, scope, &request.url, headers)
            .await?;
        Ok(Response::new(pb::SetCredentialResponse {
            credential: Some(credential_pb(stored)),
        }))
    }

    async fn list_credentials(
        &self,
        request: Request<pb::ListCredentialsRequest>,
    ) -> Result<Response<pb::ListCredentialsResponse>, Status> {
        let ctx = caller(&request)?;
        let listed = self.service.list_credentials(&ctx).await?;
        Ok(Response::new(pb::ListCredentialsResponse {
            credentials: listed.into_iter().map(credential_pb).collect(),
        }))
    }

    async fn delete_credential(
        &self,
        request: Request<pb::DeleteCredentialRequest>,
    ) -> Result<Response<pb::DeleteCredentialResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let scope = scope_of(request.scope)?;
        self.service.delete_credential(&ctx, &request.server, scope).await?;
        Ok(Response::new(pb::DeleteCredentialResponse {}))
    }

    async fn resolve_credential(
        &self,
        request: Request<pb::ResolveCredentialRequest>,
    ) -> Result<Response<pb::ResolveCredentialResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let headers = self
            .service
            .resolve_credential(
                &ctx,
                &request.tenant_id,
                &request.user_id,
                &request.server,
                &request.url,
            )
            .await?;
        Ok(Response::new(pb::ResolveCredentialResponse {
            found: headers.is_some(),
            headers: headers.unwrap_or_default().into_iter().collect(),
        }))
    }

    async fn set_secret(
        &self,
        request: Request<pb::SetSecretRequest>,
    ) -> Result<Response<pb::SetSecretResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        self.service.set_secret(&ctx, &request.name, &request.value).await?;
        Ok(Response::new(pb::SetSecretResponse { name: request.name }))
    }

    async fn list_secrets(
        &self,
        request: Request<pb::ListSecretsRequest>,
    ) -> Result<Response<pb::ListSecretsResponse>, Status> {
        let ctx = caller(&request)?;
        let names = self.service.list_secrets(&ctx).await?;
        Ok(Response::new(pb::ListSecretsResponse { names }))
    }

    async fn delete_secret(
        &self,
        request: Request<pb::DeleteSecretRequest>,
    ) -> Result<Response<pb::DeleteSecretResponse>, Status> {
        let ctx = caller(&request)?;
        self.service.delete_secret(&ctx, &request.get_ref().name).await?;
        Ok(Response::new(pb::DeleteSecretResponse {}))
    }

    async fn resolve_secrets(
        &self,
        request: Request<pb::ResolveSecretsRequest>,
    ) -> Result<Response<pb::ResolveSecretsResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let values = self
            .service
            .resolve_secrets(&ctx, &request.tenant_id, &request.names)
            .await?;
        Ok(Response::new(pb::ResolveSecretsResponse {
            values: values.into_iter().collect(),
        }))
    }
}

/// Returns the scope a request names; unset means the caller's own.
fn scope_of(scope: i32) -> Result<CredentialScope, Status> {
    match pb::CredentialScope::try_from(scope) {
        Ok(pb::CredentialScope::Unspecified | pb::CredentialScope::User) => Ok(CredentialScope::User),
        Ok(pb::CredentialScope::Tenant) => Ok(CredentialScope::Tenant),
        Err(_) => Err(avm_common::ApiError::invalid(
            "INVALID_SCOPE",
            "scope must be CREDENTIAL_SCOPE_USER or CREDENTIAL_SCOPE_TENANT",
        )
        .into()),
    }
}

fn credential_pb(credential: CredentialInfo) -> pb::Credential {
    let scope = match credential.scope {
        CredentialScope::User => pb::CredentialScope::User,
        CredentialScope::Tenant => pb::CredentialScope::Tenant,
    };
    pb::Credential {
        server: credential.server,
        scope: scope as i32,
        header_names: credential.header_names,
        origin: credential.origin.unwrap_or_default(),
    }
}

fn entries_pb(snapshot: &Snapshot) -> Vec<pb::Entry> {
    snapshot.entries.iter().map(entry_pb).collect()
}

fn entry_pb(entry: &EntryView) -> pb::Entry {
    let source = match entry.source {
        Source::Default => pb::Source::Default,
        Source::Deployment => pb::Source::Deployment,
        Source::System => pb::Source::System,
        Source::Tenant => pb::Source::Tenant,
    };
    pb::Entry {
        key: entry.spec.key.to_owned(),
        value_json: entry.value.to_string(),
        source: source as i32,
        secret: entry.spec.secret,
        tenant_overridable: entry.spec.tenant_overridable,
        writable: entry.spec.writable,
        description: entry.spec.description.to_owned(),
    }
}
