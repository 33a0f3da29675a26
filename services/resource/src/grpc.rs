//! The gRPC adapter: proto ⇄ domain, metadata → `RequestContext`, error → `Status`.

use avm_common::auth::{Authenticated, TokenVerifier, caller};
use avm_common::config::GrpcConfig;
use avm_proto::resource::v1 as pb;
use avm_proto::resource::v1::resource_service_server::{ResourceService as ResourceApi, ResourceServiceServer};
use tonic::{Request, Response, Status};

use crate::error::ResourceError;
use crate::kind::Kind;
use crate::record::{
    ListQuery, NewResource, NewVersion, Published, ResourceRecord, VersionInfo, VersionRecord, Visibility,
};
use crate::service::ResourceService;

/// Returns the `avm.resource.v1.ResourceService` server over `service`, with
/// the configured message-size limits.
/// Every call's caller is verified from its bearer token.
pub fn grpc_server(
    service: ResourceService,
    verifier: TokenVerifier,
    config: &GrpcConfig,
) -> Authenticated<ResourceServiceServer<ResourceGrpc>> {
    let server = ResourceServiceServer::new(ResourceGrpc::new(service))
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);
    Authenticated::new(server, verifier)
}

/// Serves `ResourceService` over gRPC.
#[derive(Clone)]
pub struct ResourceGrpc {
    service: ResourceService,
}

impl ResourceGrpc {
    /// Returns the adapter over `service`: what the gRPC server serves, and
    /// what `avm serve` calls in process.
    pub fn new(service: ResourceService) -> Self {
        Self { service }
    }
}

#[tonic::async_trait]
impl ResourceApi for ResourceGrpc {
    async fn register_resource(
        &self,
        request: Request<pb::RegisterResourceRequest>,
    ) -> Result<Response<pb::RegisterResourceResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let new = NewResource {
            kind: required_kind(request.kind)?,
            name: request.name,
            version: request.version,
            content_json: request.content_json,
            description: request.description,
            tags: request.tags,
            dependencies: request.dependencies,
            public: request.public,
        };
        let published = self.service.register(&ctx, new).await?;
        let created = published.created;
        let (resource, version) = published_pb(published);
        Ok(Response::new(pb::RegisterResourceResponse {
            resource: Some(resource),
            version: Some(version),
            created,
        }))
    }

    async fn publish_version(
        &self,
        request: Request<pb::PublishVersionRequest>,
    ) -> Result<Response<pb::PublishVersionResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        // Tags change when asked to (`replace_tags`, which may clear them) or when some are sent.
        let tags = (request.replace_tags || !request.tags.is_empty()).then_some(request.tags);
        let new = NewVersion {
            resource_id: request.resource_id,
            version: request.version,
            content_json: request.content_json,
            dependencies: request.dependencies,
            description: request.description,
            tags,
        };
        let (resource, version) = published_pb(self.service.publish(&ctx, new).await?);
        Ok(Response::new(pb::PublishVersionResponse {
            resource: Some(resource),
            version: Some(version),
        }))
    }

    async fn get_resource(
        &self,
        request: Request<pb::GetResourceRequest>,
    ) -> Result<Response<pb::GetResourceResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let detail = self.service.get(&ctx, &request.resource_id, &request.version).await?;
        let mut resource = resource_pb(detail.resource);
        resource.versions = detail.versions.into_iter().map(version_info_pb).collect();
        Ok(Response::new(pb::GetResourceResponse {
            resource: Some(resource),
            version: Some(version_pb(detail.version)),
        }))
    }

    async fn list_resources(
        &self,
        request: Request<pb::ListResourcesRequest>,
    ) -> Result<Response<pb::ListResourcesResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.into_inner();
        let query = ListQuery {
            kind: optional_kind(request.kind)?,
            name: Some(request.name),
            tag: Some(request.tag),
            query: Some(request.query),
            page_size: request.page_size,
            page_token: Some(request.page_token),
        };
        let page = self.service.list(&ctx, query).await?;
        Ok(Response::new(pb::ListResourcesResponse {
            resources: page.resources.into_iter().map(resource_pb).collect(),
            next_page_token: page.next_page_token.unwrap_or_default(),
        }))
    }

    async fn delete_resource(
        &self,
        request: Request<pb::DeleteResourceRequest>,
    ) -> Result<Response<pb::DeleteResourceResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let deleted = self
            .service
            .delete(&ctx, &request.resource_id, &request.version, request.force)
            .await?;
        Ok(Response::new(pb::DeleteResourceResponse {
            deleted_versions: deleted.deleted_versions,
            resource_deleted: deleted.resource_deleted,
        }))
    }

    async fn resolve_resource(
        &self,
        request: Request<pb::ResolveResourceRequest>,
    ) -> Result<Response<pb::ResolveResourceResponse>, Status> {
        let ctx = caller(&request)?;
        let request = request.get_ref();
        let resolution = self
            .service
            .resolve(&ctx, &request.uri, &request.variables_json)
            .await?;
        Ok(Response::new(pb::ResolveResourceResponse {
            root: Some(version_pb(resolution.root)),
            dependencies: resolution.dependencies.into_iter().map(version_pb).collect(),
            rendered_prompt: resolution.rendered_prompt,
            public_uris: resolution.public_uris,
        }))
    }
}

fn kind_pb(kind: Kind) -> pb::Kind {
    match kind {
        Kind::Prompt => pb::Kind::Prompt,
        Kind::Tool => pb::Kind::Tool,
        Kind::Sandbox => pb::Kind::Sandbox,
        Kind::Agent => pb::Kind::Agent,
        Kind::Knowledge => pb::Kind::Knowledge,
    }
}

/// Reads a kind filter: unspecified means any.
fn optional_kind(kind: i32) -> Result<Option<Kind>, ResourceError> {
    match pb::Kind::try_from(kind) {
        Ok(pb::Kind::Unspecified) => Ok(None),
        Ok(pb::Kind::Prompt) => Ok(Some(Kind::Prompt)),
        Ok(pb::Kind::Tool) => Ok(Some(Kind::Tool)),
        Ok(pb::Kind::Sandbox) => Ok(Some(Kind::Sandbox)),
        Ok(pb::Kind::Agent) => Ok(Some(Kind::Agent)),
        Ok(pb::Kind::Knowledge) => Ok(Some(Kind::Knowledge)),
        Err(_) => Err(ResourceError::invalid("INVALID_KIND", format!("unknown kind {kind}"))),
    }
}

fn required_kind(kind: i32) -> Result<Kind, ResourceError> {
    optional_kind(kind)?.ok_or_else(|| {
        ResourceError::invalid(
            "INVALID_KIND",
            "kind is required: prompt, tool, sandbox, agent or knowledge",
        )
    })
}

fn visibility_pb(visibility: Visibility) -> pb::Visibility {
    match visibility {
        Visibility::Private => pb::Visibility::Private,
        Visibility::Public => pb::Visibility::Public,
    }
}

fn resource_pb(resource: ResourceRecord) -> pb::Resource {
    pb::Resource {
        uri: resource.uri().to_string(),
        resource_id: resource.resource_id,
        tenant_id: resource.tenant_id,
        kind: kind_pb(resource.kind).into(),
        name: resource.name,
        visibility: visibility_pb(resource.visibility).into(),
        description: resource.description,
        tags: resource.tags,
        latest_version: resource.latest_version,
        versions: Vec::new(),
        created_at_ms: resource.created_at_ms,
        updated_at_ms: resource.updated_at_ms,
    }
}

fn version_info_pb(info: VersionInfo) -> pb::VersionInfo {
    pb::VersionInfo {
        version: info.version,
        dependencies: info.dependencies.iter().map(ToString::to_string).collect(),
        created_at_ms: info.created_at_ms,
        created_by: info.created_by,
    }
}

fn version_pb(version: VersionRecord) -> pb::ResourceVersion {
    pb::ResourceVersion {
        uri: version.uri().to_string(),
        resource_id: version.resource_id,
        kind: kind_pb(version.kind).into(),
        name: version.name,
        version: version.version,
        content_json: version.content_json,
        dependencies: version.dependencies.iter().map(ToString::to_string).collect(),
        created_at_ms: version.created_at_ms,
        created_by: version.created_by,
    }
}

fn published_pb(published: Published) -> (pb::Resource, pb::ResourceVersion) {
    (resource_pb(published.resource), version_pb(published.version))
}
