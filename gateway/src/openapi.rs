//! The OpenAPI 3.1 document of the REST surface, generated from the same
//! typed requests and responses the handlers use; served at
//! `/v1/openapi.json` and printed by `avm openapi`.

use utoipa::openapi::path::Operation;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityRequirement, SecurityScheme};
use utoipa::openapi::{ContentBuilder, OpenApi, Ref, ResponseBuilder};

use crate::http::ErrorDocument;

/// The document's fixed parts; the router adds every operation.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "AgentVM",
        description = "Hosts AI agents for many tenants: containers, conversations (images), their agents and \
                       events, groups, resources, configuration, tenants, keys and usage. Every error is \
                       `{\"error\":{\"code\",\"message\",\"requestId\"}}` with a stable `code`. The WebSocket \
                       protocol (AgentX 1.9 compatible) is at `/ws`."
    ),
    components(schemas(ErrorDocument)),
    paths(
        crate::rest::workspace::read_workspace_file,
        crate::rest::workspace::write_workspace_file,
        crate::rest::workspace::remove_workspace_file
    ),
    tags(
        (name = "containers", description = "A tenant's isolation units and who they are shared with"),
        (name = "images", description = "Conversations: their agents, messages and events"),
        (name = "groups", description = "Groups of agents and users in a container: members, messages, read cursors"),
        (name = "search", description = "Full-text search over the conversations the caller may read"),
        (name = "retention", description = "How long the tenant's messages and conversations are kept (usage records always are)"),
        (name = "agents", description = "Running agents"),
        (name = "resources", description = "Versioned prompts, tools, sandboxes, agents and knowledge"),
        (name = "config", description = "The configuration center"),
        (name = "credentials", description = "Credentials for remote MCP servers, per user or tenant (write-only)"),
        (name = "secrets", description = "The tenant's secrets for its agents' sandboxes, set by its admins (write-only)"),
        (name = "usage", description = "The usage ledger, budgets, the usage summary and logs"),
        (name = "tenants", description = "Tenants and their users (operators and admins)"),
        (name = "keys", description = "API keys, access tokens and the caller's identity"),
        (name = "system", description = "Health, readiness, metrics, this document and the WebSocket"),
    )
)]
pub struct ApiDoc;

/// Adds what every operation shares: bearer authentication (unless an
/// operation opts out with an empty requirement) and the error document as
/// the answer to every failure.
pub fn complete(mut api: OpenApi) -> OpenApi {
    let components = api.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .description(Some(
                    "An API key (`avm_…`), or an access token from `POST /v1/auth/token`",
                ))
                .build(),
        ),
    );
    api.security = Some(vec![SecurityRequirement::new("bearer", Vec::<String>::new())]);
    let failure = |what: &str| {
        ResponseBuilder::new()
            .description(what)
            .content(
                "application/json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("ErrorDocument")))
                    .build(),
            )
            .build()
    };
    for item in api.paths.paths.values_mut() {
        let operations: [&mut Option<Operation>; 5] = [
            &mut item.get,
            &mut item.post,
            &mut item.put,
            &mut item.patch,
            &mut item.delete,
        ];
        for operation in operations.into_iter().flatten() {
            let responses = &mut operation.responses.responses;
            responses.entry("4XX".to_owned()).or_insert_with(|| {
                failure("Refused: the `code` says why (e.g. `MISSING_FIELD`, `IMAGE_NOT_FOUND`, `RATE_LIMITED`)").into()
            });
            responses
                .entry("5XX".to_owned())
                .or_insert_with(|| failure("A service failed or is unavailable").into());
        }
    }
    api
}
