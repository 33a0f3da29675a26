//! The gRPC adapter: proto ⇄ domain, metadata → `RequestContext`, error → `Status`.

use avm_common::auth::{Authenticated, TokenVerifier, caller};
use avm_common::config::GrpcConfig;
use avm_proto::config::v1 as pb;
use avm_proto::config::v1::config_service_server::{ConfigService as ConfigApi, ConfigServiceServer};
use futures::StreamExt;
use futures::stream::BoxStream;
use tonic::{Request, Response, Status};

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
