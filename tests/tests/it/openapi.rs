//! `/v1/openapi.json` is an OpenAPI 3.1 document of exactly the routes the
//! gateway serves: every public route is in it, and everything in it is served.

use std::collections::BTreeSet;

use avm_tests::cluster::{Cluster, Mode, Options};
use reqwest::StatusCode;
use serde_json::Value;

/// The public routes (README, "REST routes"), as `METHOD path`.
const ROUTES: &[&str] = &[
    "GET /health",
    "GET /ready",
    "GET /metrics",
    "GET /ws",
    "GET /v1/openapi.json",
    "POST /v1/containers",
    "GET /v1/containers",
    "GET /v1/containers/{id}",
    "DELETE /v1/containers/{id}",
    "POST /v1/containers/{id}/images",
    "GET /v1/containers/{id}/images",
    "POST /v1/containers/{id}/shares",
    "GET /v1/containers/{id}/shares",
    "DELETE /v1/containers/{id}/shares/{user}",
    "GET /v1/images/{id}",
    "PATCH /v1/images/{id}",
    "DELETE /v1/images/{id}",
    "POST /v1/images/{id}/run",
    "POST /v1/images/{id}/stop",
    "POST /v1/images/{id}/interrupt",
    "GET /v1/images/{id}/children",
    "GET /v1/images/{id}/messages",
    "POST /v1/images/{id}/messages",
    "GET /v1/images/{id}/events",
    "GET /v1/search",
    "GET /v1/images/{id}/export",
    "GET /v1/containers/{id}/export",
    "POST /v1/containers/{id}/import",
    "GET /v1/conversations/recent",
    "POST /v1/images/{id}/read",
    "POST /v1/images/{id}/rewind",
    "POST /v1/images/{id}/clear",
    "GET /v1/retention",
    "PUT /v1/retention",
    "POST /v1/retention/sweep",
    "POST /v1/containers/{id}/groups",
    "GET /v1/containers/{id}/groups",
    "GET /v1/groups/unread",
    "GET /v1/groups/{id}",
    "PATCH /v1/groups/{id}",
    "DELETE /v1/groups/{id}",
    "GET /v1/groups/{id}/members",
    "POST /v1/groups/{id}/members",
    "DELETE /v1/groups/{id}/members/{memberId}",
    "GET /v1/groups/{id}/messages",
    "POST /v1/groups/{id}/messages",
    "POST /v1/groups/{id}/read",
    "GET /v1/groups/{id}/events",
    "GET /v1/agents",
    "GET /v1/agents/{id}",
    "DELETE /v1/agents/{id}",
    "POST /v1/agents/{id}/pause",
    "POST /v1/agents/{id}/resume",
    "POST /v1/agents/{id}/terminate",
    "POST /v1/tenants",
    "GET /v1/tenants",
    "GET /v1/tenants/{id}",
    "PATCH /v1/tenants/{id}",
    "DELETE /v1/tenants/{id}",
    "POST /v1/tenants/{id}/users",
    "GET /v1/tenants/{id}/users",
    "GET /v1/tenants/{id}/users/{user}",
    "DELETE /v1/tenants/{id}/users/{user}",
    "POST /v1/auth/keys",
    "GET /v1/auth/keys",
    "GET /v1/auth/keys/{id}",
    "DELETE /v1/auth/keys/{id}",
    "POST /v1/auth/token",
    "GET /v1/auth/jwks.json",
    "GET /v1/auth/whoami",
    "GET /v1/auth/quota",
    "GET /v1/images/{id}/workspace",
    "GET /v1/images/{id}/workspace/files/{path}",
    "PUT /v1/images/{id}/workspace/files/{path}",
    "DELETE /v1/images/{id}/workspace/files/{path}",
    "POST /v1/auth/signing-keys/rotate",
    "POST /v1/resources",
    "GET /v1/resources",
    "GET /v1/resources/resolve",
    "POST /v1/resources/resolve",
    "GET /v1/resources/{id}",
    "PUT /v1/resources/{id}",
    "DELETE /v1/resources/{id}",
    "GET /v1/config",
    "PUT /v1/config",
    "GET /v1/config/{key}",
    "GET /v1/credentials",
    "PUT /v1/credentials/{server}",
    "DELETE /v1/credentials/{server}",
    "GET /v1/secrets",
    "PUT /v1/secrets/{name}",
    "DELETE /v1/secrets/{name}",
    "GET /v1/usage",
    "GET /v1/usage/records",
    "GET /v1/usage/budgets",
    "PUT /v1/usage/budgets",
    "GET /v1/metrics",
    "GET /v1/logs",
];

/// Returns the document's operations as `METHOD path`.
fn operations(document: &Value) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (path, item) in document["paths"].as_object().into_iter().flatten() {
        for method in ["get", "post", "put", "patch", "delete"] {
            if item.get(method).is_some() {
                found.insert(format!("{} {path}", method.to_uppercase()));
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_document_lists_exactly_the_served_routes() -> anyhow::Result<()> {
    let cluster = Cluster::start(Mode::OneProcess, Options::default()).await?;
    // The document is public, like the probes: no credential needed.
    let response = reqwest::get(cluster.url("/v1/openapi.json")).await?;
    assert_eq!(response.status(), StatusCode::OK);
    let document: Value = response.json().await?;
    assert_eq!(document["openapi"], "3.1.0");
    assert!(document["info"]["title"].is_string());
    assert!(
        document["components"]["securitySchemes"]["bearer"].is_object(),
        "bearer authentication is declared"
    );

    let documented = operations(&document);
    let public: BTreeSet<String> = ROUTES.iter().map(|route| (*route).to_owned()).collect();
    let undocumented: Vec<_> = public.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "routes missing from the document: {undocumented:?}"
    );
    let unknown: Vec<_> = documented.difference(&public).collect();
    assert!(
        unknown.is_empty(),
        "documented routes the README does not list: {unknown:?}"
    );

    // Everything documented is served: no documented operation falls through
    // to the fallbacks, whatever the placeholder ids answer.
    let http = cluster.http()?;
    for route in &documented {
        let (method, path) = route.split_once(' ').unwrap_or_default();
        if path == "/ws" {
            continue;
        }
        let concrete = path
            .replace("{id}", "x_placeholder")
            .replace("{user}", "x_placeholder")
            .replace("{path}", "dir/x_placeholder")
            .replace("{key}", "llm.model");
        let method = reqwest::Method::from_bytes(method.as_bytes())?;
        let mut request = http.request(method.clone(), cluster.url(&concrete));
        if method != reqwest::Method::GET && method != reqwest::Method::DELETE {
            request = request.json(&serde_json::json!({}));
        }
        if concrete.ends_with("/messages") && method == reqwest::Method::POST || concrete.ends_with("/events") {
            // Streams: the status line is all this needs.
            request = request.timeout(std::time::Duration::from_secs(5));
        }
        let response = request.send().await?;
        assert_ne!(
            response.status(),
            StatusCode::METHOD_NOT_ALLOWED,
            "{route} is not served"
        );
        if response.status() == StatusCode::NOT_FOUND {
            let body: Value = response.json().await.unwrap_or_default();
            assert_ne!(body["error"]["code"], "ROUTE_NOT_FOUND", "{route} is not served");
        }
    }

    // Every operation says how it fails (the error document), under an id of its own.
    let mut ids = BTreeSet::new();
    for (path, item) in document["paths"].as_object().into_iter().flatten() {
        for (method, operation) in item.as_object().into_iter().flatten() {
            let id = operation["operationId"].as_str().unwrap_or_default();
            assert!(
                !id.is_empty() && ids.insert(id.to_owned()),
                "{method} {path}: operationId {id:?} is not unique"
            );
            if path == "/ws" {
                continue;
            }
            assert!(
                operation["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"]
                    .as_str()
                    .is_some_and(|r| r.ends_with("/ErrorDocument")),
                "{method} {path} does not document its errors"
            );
        }
    }
    Ok(())
}
