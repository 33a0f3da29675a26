//! The REST face of the resource service: register, discover, read, version,
//! delete and resolve `resource://` resources.

use std::sync::Arc;

use avm_common::{ApiError, RequestContext};
use avm_proto::resource::v1 as pb;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::GatewayState;
use crate::rest::{Ctx, json_body, query_fields, reply};
use crate::ws::{opt_str, req_str};

type AppState = State<Arc<GatewayState>>;

/// Returns the resource routes.
pub fn routes() -> Router<Arc<GatewayState>> {
    Router::new()
        .route("/v1/resources", post(register).get(list))
        .route("/v1/resources/resolve", get(resolve_query).post(resolve_body))
        .route(
            "/v1/resources/{id}",
            get(get_resource).put(publish).delete(delete_resource),
        )
}

/// The kinds by their REST names.
const KINDS: [(&str, pb::Kind); 5] = [
    ("prompt", pb::Kind::Prompt),
    ("tool", pb::Kind::Tool),
    ("sandbox", pb::Kind::Sandbox),
    ("agent", pb::Kind::Agent),
    ("knowledge", pb::Kind::Knowledge),
];

fn kind_name(kind: i32) -> &'static str {
    KINDS
        .iter()
        .find(|(_, known)| *known as i32 == kind)
        .map_or("unknown", |(name, _)| *name)
}

fn parse_kind(name: &str) -> Result<pb::Kind, ApiError> {
    KINDS
        .iter()
        .find(|(known, _)| *known == name)
        .map(|(_, kind)| *kind)
        .ok_or_else(|| {
            ApiError::invalid(
                "INVALID_KIND",
                format!("unknown kind {name:?}; kinds are prompt, tool, sandbox, agent and knowledge"),
            )
        })
}

/// Renders a resource. Who published a version is shown only to its own
/// tenant: a public resource does not reveal the operator's users.
fn resource_json(ctx: &RequestContext, resource: &pb::Resource) -> Value {
    let own = resource.tenant_id == ctx.tenant_id;
    let visibility = if resource.visibility == pb::Visibility::Public as i32 {
        "public"
    } else {
        "private"
    };
    let versions: Vec<Value> = resource
        .versions
        .iter()
        .map(|version| {
            let mut info = json!({
                "version": version.version,
                "dependencies": version.dependencies,
                "createdAt": version.created_at_ms,
            });
            if own {
                info["createdBy"] = json!(version.created_by);
            }
            info
        })
        .collect();
    json!({
        "resourceId": resource.resource_id,
        "uri": resource.uri,
        "kind": kind_name(resource.kind),
        "name": resource.name,
        "visibility": visibility,
        "description": resource.description,
        "tags": resource.tags,
        "latestVersion": resource.latest_version,
        "versions": versions,
        "createdAt": resource.created_at_ms,
        "updatedAt": resource.updated_at_ms,
    })
}

fn version_json(ctx: &RequestContext, owner_tenant: Option<&str>, version: &pb::ResourceVersion) -> Value {
    let content = serde_json::from_str::<Value>(&version.content_json).unwrap_or(Value::Null);
    let mut value = json!({
        "resourceId": version.resource_id,
        "uri": version.uri,
        "kind": kind_name(version.kind),
        "name": version.name,
        "version": version.version,
        "content": content,
        "dependencies": version.dependencies,
        "createdAt": version.created_at_ms,
    });
    if owner_tenant == Some(ctx.tenant_id.as_str()) {
        value["createdBy"] = json!(version.created_by);
    }
    value
}

/// Renders a resource with one of its versions, as register, get and publish answer.
fn with_version_json(
    ctx: &RequestContext,
    resource: Option<&pb::Resource>,
    version: Option<&pb::ResourceVersion>,
) -> Value {
    let owner = resource.map(|r| r.tenant_id.as_str());
    json!({
        "resource": resource.map(|r| resource_json(ctx, r)),
        "version": version.map(|v| version_json(ctx, owner, v)),
    })
}

/// Reads an optional list of strings.
fn str_list(body: &Value, field: &str) -> Result<Vec<String>, ApiError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| {
                item.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| ApiError::invalid("INVALID_FIELD", format!("{field} must be a list of strings")))
            })
            .collect(),
        Some(_) => Err(ApiError::invalid(
            "INVALID_FIELD",
            format!("{field} must be a list of strings"),
        )),
    }
}

/// Reads the required `content` object as JSON text.
fn content_json(body: &Value) -> Result<String, ApiError> {
    match body.get("content") {
        Some(content @ Value::Object(_)) => Ok(content.to_string()),
        Some(_) => Err(ApiError::invalid("INVALID_FIELD", "content must be an object")),
        None => Err(ApiError::invalid("MISSING_FIELD", "content is required")),
    }
}

async fn register(State(state): AppState, Ctx(ctx): Ctx, body: Result<Bytes, BytesRejection>) -> Response {
    let result = async {
        let body = json_body(body)?;
        let public = match body.get("public") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(public)) => *public,
            Some(_) => return Err(ApiError::invalid("INVALID_FIELD", "public must be a boolean")),
        };
        let request = pb::RegisterResourceRequest {
            kind: parse_kind(&req_str(&body, "kind")?)? as i32,
            name: req_str(&body, "name")?,
            version: req_str(&body, "version")?,
            content_json: content_json(&body)?,
            description: opt_str(&body, "description")?.unwrap_or_default(),
            tags: str_list(&body, "tags")?,
            dependencies: str_list(&body, "dependencies")?,
            public,
        };
        let created = state
            .backends
            .resource
            .clone()
            .register_resource(ctx.request(request))
            .await?
            .into_inner();
        let mut body = with_version_json(&ctx, created.resource.as_ref(), created.version.as_ref());
        body["created"] = json!(created.created);
        Ok(body)
    }
    .await;
    reply(&ctx, StatusCode::CREATED, result)
}

/// Query of `GET /v1/resources`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListQuery {
    kind: Option<String>,
    name: Option<String>,
    tag: Option<String>,
    q: Option<String>,
    page_size: Option<u32>,
    page_token: Option<String>,
}

async fn list(State(state): AppState, Ctx(ctx): Ctx, query: Result<Query<ListQuery>, QueryRejection>) -> Response {
    let result = async {
        let query = query_fields(query)?;
        let request = pb::ListResourcesRequest {
            kind: query
                .kind
                .as_deref()
                .map(parse_kind)
                .transpose()?
                .map_or(0, |kind| kind as i32),
            name: query.name.unwrap_or_default(),
            tag: query.tag.unwrap_or_default(),
            query: query.q.unwrap_or_default(),
            page_size: query.page_size.unwrap_or_default(),
            page_token: query.page_token.unwrap_or_default(),
        };
        let page = state
            .backends
            .resource
            .clone()
            .list_resources(ctx.request(request))
            .await?
            .into_inner();
        let resources: Vec<Value> = page.resources.iter().map(|r| resource_json(&ctx, r)).collect();
        let mut body = json!({"resources": resources});
        if !page.next_page_token.is_empty() {
            body["nextPageToken"] = json!(page.next_page_token);
        }
        Ok(body)
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

/// Query naming one version (`?version=`), and for deletes `?force=true`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct VersionQuery {
    version: Option<String>,
    force: Option<bool>,
}

async fn get_resource(
    State(state): AppState,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    query: Result<Query<VersionQuery>, QueryRejection>,
) -> Response {
    let result = async {
        let query = query_fields(query)?;
        let request = pb::GetResourceRequest {
            resource_id: id,
            version: query.version.unwrap_or_default(),
        };
        let found = state
            .backends
            .resource
            .clone()
            .get_resource(ctx.request(request))
            .await?
            .into_inner();
        Ok(with_version_json(&ctx, found.resource.as_ref(), found.version.as_ref()))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

/// Publishes a new version (`PUT` never changes an existing one).
async fn publish(
    State(state): AppState,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let body = json_body(body)?;
        let tags = body.get("tags").map(|_| str_list(&body, "tags")).transpose()?;
        let request = pb::PublishVersionRequest {
            resource_id: id,
            version: req_str(&body, "version")?,
            content_json: content_json(&body)?,
            dependencies: str_list(&body, "dependencies")?,
            description: opt_str(&body, "description")?,
            replace_tags: tags.is_some(),
            tags: tags.unwrap_or_default(),
        };
        let published = state
            .backends
            .resource
            .clone()
            .publish_version(ctx.request(request))
            .await?
            .into_inner();
        Ok(with_version_json(
            &ctx,
            published.resource.as_ref(),
            published.version.as_ref(),
        ))
    }
    .await;
    reply(&ctx, StatusCode::CREATED, result)
}

async fn delete_resource(
    State(state): AppState,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    query: Result<Query<VersionQuery>, QueryRejection>,
) -> Response {
    let result = async {
        let query = query_fields(query)?;
        let request = pb::DeleteResourceRequest {
            resource_id: id.clone(),
            version: query.version.unwrap_or_default(),
            force: query.force.unwrap_or(false),
        };
        let deleted = state
            .backends
            .resource
            .clone()
            .delete_resource(ctx.request(request))
            .await?
            .into_inner();
        Ok(json!({
            "resourceId": id,
            "deletedVersions": deleted.deleted_versions,
            "resourceDeleted": deleted.resource_deleted,
        }))
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

/// Query of `GET /v1/resources/resolve`: the URI and, optionally, the
/// prompt's variables as a JSON object.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResolveQuery {
    uri: Option<String>,
    variables: Option<String>,
}

async fn resolve_query(
    State(state): AppState,
    Ctx(ctx): Ctx,
    query: Result<Query<ResolveQuery>, QueryRejection>,
) -> Response {
    let result = async {
        let query = query_fields(query)?;
        let uri = query
            .uri
            .ok_or_else(|| ApiError::invalid("MISSING_FIELD", "uri is required"))?;
        resolve(&state, &ctx, &uri, query.variables.unwrap_or_default()).await
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

/// `POST /v1/resources/resolve` with `{"uri", "variables"?}`, for variables
/// that do not fit a query string.
async fn resolve_body(State(state): AppState, Ctx(ctx): Ctx, body: Result<Bytes, BytesRejection>) -> Response {
    let result = async {
        let body = json_body(body)?;
        let variables = match body.get("variables") {
            None | Some(Value::Null) => String::new(),
            Some(variables @ Value::Object(_)) => variables.to_string(),
            Some(_) => return Err(ApiError::invalid("INVALID_VARIABLES", "variables must be an object")),
        };
        resolve(&state, &ctx, &req_str(&body, "uri")?, variables).await
    }
    .await;
    reply(&ctx, StatusCode::OK, result)
}

async fn resolve(state: &GatewayState, ctx: &RequestContext, uri: &str, variables: String) -> Result<Value, ApiError> {
    let resolved = state.backends.resolve_resource(ctx, uri, &variables).await?;
    let root = resolved
        .root
        .ok_or_else(|| ApiError::internal("the resource service resolved nothing"))?;
    let dependencies: Vec<Value> = resolved
        .dependencies
        .iter()
        .map(|dependency| version_json(ctx, None, dependency))
        .collect();
    let mut body = json!({
        "uri": root.uri,
        "version": root.version,
        "resource": version_json(ctx, None, &root),
        "dependencies": dependencies,
    });
    if let Some(prompt) = resolved.rendered_prompt {
        body["renderedPrompt"] = json!(prompt);
    }
    Ok(body)
}
