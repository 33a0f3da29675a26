//! Resources: versioned prompts, tools, sandboxes, agent definitions and
//! knowledge, named by `resource://` URIs — register, discover, read,
//! publish, delete and resolve.

use avm_common::{ApiError, RequestContext};
use avm_proto::resource::v1 as pb;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::{IntoParams, ToSchema};

use super::{JsonObject, missing, reasoned};
use crate::peers::Peers;

/// What a resource is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase", try_from = "String")]
pub enum Kind {
    Prompt,
    Tool,
    Sandbox,
    Agent,
    Knowledge,
}

/// The kinds by their names and wire values.
const KINDS: [(&str, Kind, pb::Kind); 5] = [
    ("prompt", Kind::Prompt, pb::Kind::Prompt),
    ("tool", Kind::Tool, pb::Kind::Tool),
    ("sandbox", Kind::Sandbox, pb::Kind::Sandbox),
    ("agent", Kind::Agent, pb::Kind::Agent),
    ("knowledge", Kind::Knowledge, pb::Kind::Knowledge),
];

impl TryFrom<String> for Kind {
    type Error = KindError;

    fn try_from(name: String) -> Result<Self, Self::Error> {
        KINDS
            .iter()
            .find(|(known, ..)| *known == name)
            .map(|(_, kind, _)| *kind)
            .ok_or(KindError(name))
    }
}

/// An unknown kind, in the words [`super::decode`] reads as `INVALID_KIND`.
#[derive(Debug)]
pub struct KindError(String);

impl std::fmt::Display for KindError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "[INVALID_KIND] unknown kind {:?}; kinds are prompt, tool, sandbox, agent and knowledge",
            self.0
        )
    }
}

impl Kind {
    fn wire(self) -> pb::Kind {
        KINDS
            .iter()
            .find(|(_, kind, _)| *kind == self)
            .map_or(pb::Kind::Unspecified, |(.., wire)| *wire)
    }

    fn name(wire: i32) -> &'static str {
        KINDS
            .iter()
            .find(|(.., known)| *known as i32 == wire)
            .map_or("unknown", |(name, ..)| *name)
    }
}

/// A new resource with its first version (`POST /v1/resources`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RegisterResource {
    pub kind: Kind,
    pub name: String,
    /// A semantic version, e.g. `1.0.0`.
    pub version: String,
    /// What the kind holds (a prompt's `{template, variables}`, …).
    pub content: JsonObject,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub tags: Option<Vec<String>>,
    /// More `resource://` URIs it depends on.
    #[serde(default)]
    pub dependencies: Option<Vec<String>>,
    /// Readable by every tenant (operators only).
    #[serde(default)]
    pub public: Option<bool>,
}

/// A new version of a resource (`PUT /v1/resources/{id}`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PublishVersion {
    pub version: String,
    pub content: JsonObject,
    #[serde(default)]
    pub dependencies: Option<Vec<String>>,
    #[serde(default)]
    pub description: Option<String>,
    /// Replaces the tags when given.
    #[serde(default)]
    pub tags: Option<Vec<String>>,
}

/// Which resources to list.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ResourceFilter {
    /// prompt, tool, sandbox, agent or knowledge.
    pub kind: Option<String>,
    pub name: Option<String>,
    pub tag: Option<String>,
    /// Words to look for in names and descriptions.
    pub q: Option<String>,
    pub page_size: Option<u32>,
    pub page_token: Option<String>,
}

/// Names one version (`?version=`), and for deletes whether to delete what others depend on.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct VersionQuery {
    pub version: Option<String>,
    pub force: Option<bool>,
}

/// A URI to resolve and the prompt's variables, as a query (`variables` a JSON object).
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ResolveQuery {
    pub uri: Option<String>,
    /// A JSON object of strings.
    pub variables: Option<String>,
}

/// A URI to resolve and the prompt's variables, as a body.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResolveRequest {
    pub uri: String,
    #[serde(default, deserialize_with = "variables")]
    #[schema(value_type = Option<Object>)]
    pub variables: Option<Map<String, Value>>,
}

fn variables<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<Map<String, Value>>, D::Error> {
    match Value::deserialize(deserializer)? {
        Value::Null => Ok(None),
        Value::Object(map) => Ok(Some(map)),
        _ => Err(reasoned("INVALID_VARIABLES", "variables must be an object")),
    }
}

/// A resource and its versions.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Resource {
    pub resource_id: String,
    pub uri: String,
    pub kind: String,
    pub name: String,
    /// `private` or `public`.
    pub visibility: String,
    pub description: String,
    pub tags: Vec<String>,
    pub latest_version: String,
    pub versions: Vec<VersionInfo>,
    pub created_at: i64,
    pub updated_at: i64,
}

/// One version of a resource, in its list.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct VersionInfo {
    pub version: String,
    pub dependencies: Vec<String>,
    pub created_at: i64,
    /// Who published it (shown to its own tenant only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_by: Option<String>,
}

/// One version with its content.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceVersion {
    pub resource_id: String,
    pub uri: String,
    pub kind: String,
    pub name: String,
    pub version: String,
    #[schema(value_type = Object)]
    pub content: Value,
    pub dependencies: Vec<String>,
    pub created_at: i64,
    /// Who published it (shown to its own tenant only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_by: Option<String>,
}

/// A resource with one of its versions: what register, get and publish answer.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceWithVersion {
    pub resource: Option<Resource>,
    pub version: Option<ResourceVersion>,
    /// Whether the resource is new (register only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created: Option<bool>,
}

/// A page of resources.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourcePage {
    pub resources: Vec<Resource>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

/// What a delete removed.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceDeleted {
    pub resource_id: String,
    pub deleted_versions: Vec<String>,
    pub resource_deleted: bool,
}

/// A URI resolved to exact versions, with its closure of dependencies.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Resolved {
    pub uri: String,
    pub version: String,
    pub resource: ResourceVersion,
    pub dependencies: Vec<ResourceVersion>,
    /// A prompt's template filled with the variables.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rendered_prompt: Option<String>,
}

/// Renders a resource. Who published a version is shown only to its own
/// tenant: a public resource does not reveal the operator's users.
fn resource(ctx: &RequestContext, resource: pb::Resource) -> Resource {
    let own = resource.tenant_id == ctx.tenant_id;
    let visibility = if resource.visibility == pb::Visibility::Public as i32 {
        "public"
    } else {
        "private"
    };
    Resource {
        versions: resource
            .versions
            .into_iter()
            .map(|version| VersionInfo {
                version: version.version,
                dependencies: version.dependencies,
                created_at: version.created_at_ms,
                created_by: own.then_some(version.created_by),
            })
            .collect(),
        resource_id: resource.resource_id,
        uri: resource.uri,
        kind: Kind::name(resource.kind).to_owned(),
        name: resource.name,
        visibility: visibility.to_owned(),
        description: resource.description,
        tags: resource.tags,
        latest_version: resource.latest_version,
        created_at: resource.created_at_ms,
        updated_at: resource.updated_at_ms,
    }
}

fn version(ctx: &RequestContext, owner_tenant: Option<&str>, version: pb::ResourceVersion) -> ResourceVersion {
    ResourceVersion {
        content: serde_json::from_str(&version.content_json).unwrap_or(Value::Null),
        created_by: (owner_tenant == Some(ctx.tenant_id.as_str())).then_some(version.created_by),
        resource_id: version.resource_id,
        uri: version.uri,
        kind: Kind::name(version.kind).to_owned(),
        name: version.name,
        version: version.version,
        dependencies: version.dependencies,
        created_at: version.created_at_ms,
    }
}

fn with_version(
    ctx: &RequestContext,
    found: Option<pb::Resource>,
    found_version: Option<pb::ResourceVersion>,
) -> ResourceWithVersion {
    let owner = found.as_ref().map(|r| r.tenant_id.clone());
    ResourceWithVersion {
        version: found_version.map(|v| version(ctx, owner.as_deref(), v)),
        resource: found.map(|r| resource(ctx, r)),
        created: None,
    }
}

/// Registers a resource with its first version.
pub async fn register(
    peers: &Peers,
    ctx: &RequestContext,
    request: RegisterResource,
) -> Result<ResourceWithVersion, ApiError> {
    let call = pb::RegisterResourceRequest {
        kind: request.kind.wire() as i32,
        name: request.name,
        version: request.version,
        content_json: Value::Object(request.content.0).to_string(),
        description: request.description.unwrap_or_default(),
        tags: request.tags.unwrap_or_default(),
        dependencies: request.dependencies.unwrap_or_default(),
        public: request.public.unwrap_or(false),
    };
    let created = peers.resource.register_resource(ctx.request(call)).await?.into_inner();
    let mut answer = with_version(ctx, created.resource, created.version);
    answer.created = Some(created.created);
    Ok(answer)
}

/// Lists the resources the caller may read.
pub async fn list(peers: &Peers, ctx: &RequestContext, filter: ResourceFilter) -> Result<ResourcePage, ApiError> {
    let kind = match filter.kind {
        Some(name) => Kind::try_from(name)
            .map_err(|err| ApiError::invalid("INVALID_KIND", err.to_string().replacen("[INVALID_KIND] ", "", 1)))?
            .wire() as i32,
        None => 0,
    };
    let call = pb::ListResourcesRequest {
        kind,
        name: filter.name.unwrap_or_default(),
        tag: filter.tag.unwrap_or_default(),
        query: filter.q.unwrap_or_default(),
        page_size: filter.page_size.unwrap_or_default(),
        page_token: filter.page_token.unwrap_or_default(),
    };
    let page = peers.resource.list_resources(ctx.request(call)).await?.into_inner();
    Ok(ResourcePage {
        resources: page.resources.into_iter().map(|r| resource(ctx, r)).collect(),
        next_page_token: Some(page.next_page_token).filter(|token| !token.is_empty()),
    })
}

/// Returns a resource with one version (the latest unless `?version=`).
pub async fn get(
    peers: &Peers,
    ctx: &RequestContext,
    resource_id: String,
    query: VersionQuery,
) -> Result<ResourceWithVersion, ApiError> {
    let call = pb::GetResourceRequest {
        resource_id,
        version: query.version.unwrap_or_default(),
    };
    let found = peers.resource.get_resource(ctx.request(call)).await?.into_inner();
    Ok(with_version(ctx, found.resource, found.version))
}

/// Publishes a new version (an existing version never changes).
pub async fn publish(
    peers: &Peers,
    ctx: &RequestContext,
    resource_id: String,
    request: PublishVersion,
) -> Result<ResourceWithVersion, ApiError> {
    let call = pb::PublishVersionRequest {
        resource_id,
        version: request.version,
        content_json: Value::Object(request.content.0).to_string(),
        dependencies: request.dependencies.unwrap_or_default(),
        description: request.description,
        replace_tags: request.tags.is_some(),
        tags: request.tags.unwrap_or_default(),
    };
    let published = peers.resource.publish_version(ctx.request(call)).await?.into_inner();
    Ok(with_version(ctx, published.resource, published.version))
}

/// Deletes one version, or the whole resource.
pub async fn delete(
    peers: &Peers,
    ctx: &RequestContext,
    resource_id: String,
    query: VersionQuery,
) -> Result<ResourceDeleted, ApiError> {
    let call = pb::DeleteResourceRequest {
        resource_id: resource_id.clone(),
        version: query.version.unwrap_or_default(),
        force: query.force.unwrap_or(false),
    };
    let deleted = peers.resource.delete_resource(ctx.request(call)).await?.into_inner();
    Ok(ResourceDeleted {
        resource_id,
        deleted_versions: deleted.deleted_versions,
        resource_deleted: deleted.resource_deleted,
    })
}

/// Resolves a URI given in a query string.
pub async fn resolve_query(peers: &Peers, ctx: &RequestContext, query: ResolveQuery) -> Result<Resolved, ApiError> {
    let uri = query
        .uri
        .ok_or_else(|| ApiError::invalid("MISSING_FIELD", "uri is required"))?;
    resolve(peers, ctx, uri, query.variables.unwrap_or_default()).await
}

/// Resolves a URI given in a body.
pub async fn resolve_body(peers: &Peers, ctx: &RequestContext, request: ResolveRequest) -> Result<Resolved, ApiError> {
    let variables = request
        .variables
        .map(|map| Value::Object(map).to_string())
        .unwrap_or_default();
    resolve(peers, ctx, request.uri, variables).await
}

async fn resolve(
    peers: &Peers,
    ctx: &RequestContext,
    uri: String,
    variables_json: String,
) -> Result<Resolved, ApiError> {
    let call = pb::ResolveResourceRequest { uri, variables_json };
    let resolved = peers.resource.resolve_resource(ctx.request(call)).await?.into_inner();
    let root = resolved.root.ok_or_else(|| missing("resolved resource"))?;
    Ok(Resolved {
        uri: root.uri.clone(),
        version: root.version.clone(),
        resource: version(ctx, None, root),
        dependencies: resolved
            .dependencies
            .into_iter()
            .map(|dependency| version(ctx, None, dependency))
            .collect(),
        rendered_prompt: resolved.rendered_prompt,
    })
}

/// Fails unless `uri` resolves, rendered with `variables_json` (a JSON object, or empty).
pub async fn check_reference(
    peers: &Peers,
    ctx: &RequestContext,
    uri: &str,
    variables_json: &str,
) -> Result<(), ApiError> {
    let render_with = if variables_json.is_empty() {
        "{}"
    } else {
        variables_json
    };
    let call = pb::ResolveResourceRequest {
        uri: uri.to_owned(),
        variables_json: render_with.to_owned(),
    };
    peers.resource.resolve_resource(ctx.request(call)).await?;
    Ok(())
}
