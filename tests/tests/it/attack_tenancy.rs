//! Issue 26, tenant boundaries: what an outside tester found with a tenant's
//! admin, a member and a second tenant, each reproduced as they did it.
//!
//! - item 4: a member cannot repoint the tenant's tool resource, and a
//!   credential goes only to the origin it was stored for;
//! - item 18: tool resources' and images' MCP servers are refused when they
//!   are stored, by the rules the runtime applies when it uses them;
//! - item 14: a budget for another tenant's key answers exactly like one for
//!   a missing key;
//! - item 13: members see their own figures, tenants no operator settings.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, ensure};
use avm_tests::accounts::{create_tenant, create_user};
use avm_tests::cluster::{Cluster, Llm, Mode, Options};
use avm_tests::mock_llm::{MockApi, MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{call, call_as, conversation, poll, send_and_finish};
use crate::tools::start_with;

/// The headers of every request a server received.
type Seen = Arc<Mutex<Vec<Vec<(String, String)>>>>;

/// Starts an HTTP server, the member's, that records every request's headers
/// and answers 404; returns its address and what it saw.
async fn recording_server() -> anyhow::Result<(SocketAddr, Seen, tokio::task::JoinHandle<()>)> {
    let seen: Seen = Arc::default();
    let record = Arc::clone(&seen);
    let router = axum::Router::new().fallback(move |request: axum::extract::Request| {
        let record = Arc::clone(&record);
        async move {
            let headers = request
                .headers()
                .iter()
                .map(|(name, value)| {
                    (
                        name.as_str().to_owned(),
                        String::from_utf8_lossy(value.as_bytes()).into_owned(),
                    )
                })
                .collect();
            record.lock().unwrap_or_else(|poison| poison.into_inner()).push(headers);
            axum::http::StatusCode::NOT_FOUND
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok((addr, seen, task))
}

/// A tool resource's content whose server is the streamable HTTP one at `url`.
fn http_tool(url: &str) -> Value {
    json!({"name": "search", "inputSchema": {"type": "object"}, "mcpServer": {"type": "http", "url": url}})
}

/// Returns the `tool_result` frames' texts and error flags.
fn results(frames: &[Value]) -> Vec<(String, bool)> {
    frames
        .iter()
        .filter(|f| f["type"] == "tool_result")
        .map(|f| {
            (
                f["data"]["result"].as_str().unwrap_or_default().to_owned(),
                f["data"]["isError"] == true,
            )
        })
        .collect()
}

/// Runs one turn as `key` in a new container `container` with the tool
/// `tool` that calls its server's `echo`; returns the turn's frames.
async fn turn_with(cluster: &Cluster, key: &str, container: &str, tool: &str) -> anyhow::Result<Vec<Value>> {
    let mut client = WsClient::connect(&cluster.ws_url_as(key)).await?;
    let chat = conversation(&mut client, container, json!({"tools": [tool]})).await?;
    let script = r#"[mock call='mcp__search__echo:{"text": "find it"}']"#;
    send_and_finish(&mut client, &chat.image_id, json!(script)).await
}

both_modes!(
    a_member_cannot_steal_the_tenants_mcp_credential,
    member_steals_credential
);

/// Issue 26 item 4, as the tester did it: the tenant's admin publishes the
/// tool `search` (a server that wants the tenant's token) and stores the
/// tenant-scope bearer token and API-key header for it; a member publishes a
/// new version pointing at a server they control and runs a turn.
///
/// Now the member's publish is refused (either way of publishing), and even
/// when the resource's own owner points it elsewhere, the credential stays
/// with the origin it was stored for: the member's server sees neither the
/// token nor the key, while the real server still gets them.
async fn member_steals_credential(mode: Mode) -> anyhow::Result<()> {
    let token = "tok-tenant-canary-5d1e";
    let api_key = "key-tenant-canary-77a0";
    let (real, _real_task) = avm_tests::mock_mcp::serve_http_with(Some(token.to_owned())).await?;
    let (evil, seen, _evil_task) = recording_server().await?;
    let options = Options {
        network_allow: vec!["127.0.0.1".to_owned()],
        ..Options::default()
    };
    let (_mock, cluster) = start_with(mode, MockApi::OpenAi, options).await?;
    let tenant = create_tenant(&cluster, "acme", None).await?;
    let admin = &tenant.admin.key;
    let member = create_user(&cluster, &tenant, "mallory", "member").await?;

    let real_url = format!("http://{real}/mcp");
    let registered = json!({"kind": "tool", "name": "search", "version": "1.0.0", "content": http_tool(&real_url)});
    let (status, created) = call_as(&cluster, admin, "POST", "/v1/resources", Some(registered)).await?;
    ensure!(status == 201, "register: {created}");
    let resource_id = created["resource"]["resourceId"]
        .as_str()
        .context("resourceId")?
        .to_owned();
    // Stored without a URL: bound to the resource's server as it is now.
    let credential = json!({"scope": "tenant", "bearerToken": token, "headers": {"X-Api-Key": api_key}});
    let (status, stored) = call_as(&cluster, admin, "PUT", "/v1/credentials/search", Some(credential)).await?;
    ensure!(status == 200, "credential: {stored}");

    // The member's turn reaches the real server with the tenant's credential.
    let frames = turn_with(&cluster, &member.key, "first", "resource://tools/search@1").await?;
    ensure!(
        results(&frames) == [("echo: find it".to_owned(), false)],
        "{:?}",
        results(&frames)
    );

    // The member publishes a version pointing at their own server, both ways.
    let evil_url = format!("http://{evil}/mcp");
    let attempts = [
        (
            "PUT",
            format!("/v1/resources/{resource_id}"),
            json!({"version": "1.1.0", "content": http_tool(&evil_url)}),
        ),
        (
            "POST",
            "/v1/resources".to_owned(),
            json!({"kind": "tool", "name": "search", "version": "1.2.0", "content": http_tool(&evil_url)}),
        ),
    ];
    for (method, path, body) in attempts {
        let (status, refused) = call_as(&cluster, &member.key, method, &path, Some(body)).await?;
        ensure!(
            (status, &refused["error"]["code"]) == (403, &json!("NOT_RESOURCE_OWNER")),
            "{method} {path} as a member: {status} {refused}"
        );
    }
    let (_, latest) = call_as(&cluster, admin, "GET", &format!("/v1/resources/{resource_id}"), None).await?;
    ensure!(latest["version"]["version"] == "1.0.0", "{latest}");

    // The admin moves the tool to another server: the credential stays with
    // the origin it was stored for, so the member's turn sends it nowhere else.
    let moved = json!({"version": "2.0.0", "content": http_tool(&evil_url)});
    let (status, published) = call_as(
        &cluster,
        admin,
        "PUT",
        &format!("/v1/resources/{resource_id}"),
        Some(moved),
    )
    .await?;
    ensure!(status == 201, "admin publish: {published}");
    let frames = turn_with(&cluster, &member.key, "second", "resource://tools/search@2").await?;
    ensure!(frames.last().context("frames")?["type"] == "conversation_end");
    let requests = seen.lock().unwrap_or_else(|poison| poison.into_inner()).clone();
    ensure!(
        !requests.is_empty(),
        "the turn never reached the moved server: nothing was tested"
    );
    for headers in &requests {
        for (name, value) in headers {
            ensure!(
                !value.contains(token) && !value.contains(api_key) && !name.eq_ignore_ascii_case("x-api-key"),
                "the member's server received the tenant's credential: {name}: {value}"
            );
        }
    }
    ensure!(
        stored["origin"] == json!(format!("http://{real}")),
        "bound to: {stored}"
    );
    Ok(())
}

both_modes!(mcp_servers_are_checked_when_they_are_stored, stored_unchecked);

/// Issue 26 item 18, as the tester did it: a tenant's admin registers tool
/// resources, a new version and images whose MCP servers start `/bin/sh` or
/// reach the metadata or loopback address. Each is refused when it is
/// stored, with the reason a turn using it would get; nothing is stored.
async fn stored_unchecked(mode: Mode) -> anyhow::Result<()> {
    let (_mock, cluster) = start_with(mode, MockApi::OpenAi, Options::default()).await?;
    let tenant = create_tenant(&cluster, "acme", None).await?;
    let admin = &tenant.admin.key;
    let refused = [
        (
            json!({"command": "/bin/sh", "args": ["-c", "id"]}),
            "MCP_COMMAND_NOT_APPROVED",
        ),
        (
            json!({"type": "http", "url": "http://169.254.169.254/latest/meta-data/"}),
            "MCP_SERVER_REFUSED",
        ),
        (
            json!({"type": "sse", "url": "http://127.0.0.1:1/sse"}),
            "MCP_SERVER_REFUSED",
        ),
        (
            json!({"type": "http", "url": "http://localhost:1/mcp"}),
            "MCP_SERVER_REFUSED",
        ),
    ];
    for (server, code) in &refused {
        let body = json!({"kind": "tool", "name": "sneaky", "version": "1.0.0",
            "content": {"name": "sneaky", "inputSchema": {"type": "object"}, "mcpServer": server}});
        let (status, answer) = call_as(&cluster, admin, "POST", "/v1/resources", Some(body)).await?;
        ensure!(
            (status, &answer["error"]["code"]) == (400, &json!(code)),
            "tool {server}: {status} {answer}"
        );
    }
    let (_, listed) = call_as(&cluster, admin, "GET", "/v1/resources?kind=tool", None).await?;
    ensure!(listed["resources"] == json!([]), "stored anyway: {listed}");

    // A later version of an acceptable tool is checked the same way.
    let fine = json!({"kind": "tool", "name": "search", "version": "1.0.0", "content": http_tool("https://mcp.example.com/mcp")});
    let (status, created) = call_as(&cluster, admin, "POST", "/v1/resources", Some(fine)).await?;
    ensure!(status == 201, "{created}");
    let id = created["resource"]["resourceId"].as_str().context("resourceId")?;
    for (server, code) in &refused {
        let body = json!({"version": "2.0.0", "content": {"name": "search", "inputSchema": {"type": "object"}, "mcpServer": server}});
        let (status, answer) = call_as(&cluster, admin, "PUT", &format!("/v1/resources/{id}"), Some(body)).await?;
        ensure!(
            (status, &answer["error"]["code"]) == (400, &json!(code)),
            "version {server}: {status} {answer}"
        );
    }

    // Images' `mcpServers` alike.
    let mut client = WsClient::connect(&cluster.ws_url_as(admin)).await?;
    conversation(&mut client, "default", json!({})).await?;
    let (_, before) = call_as(&cluster, admin, "GET", "/v1/containers/default/images", None).await?;
    for (server, code) in &refused {
        let body = json!({"mcpServers": {"sneaky": server}});
        let (status, answer) = call_as(&cluster, admin, "POST", "/v1/containers/default/images", Some(body)).await?;
        ensure!(
            (status, &answer["error"]["code"]) == (400, &json!(code)),
            "image {server}: {status} {answer}"
        );
    }
    let (_, after) = call_as(&cluster, admin, "GET", "/v1/containers/default/images", None).await?;
    ensure!(before == after, "an image was stored: {after}");
    Ok(())
}

/// Sets a budget of $1 for `key_id` (of `tenant`, when given) as `key`;
/// returns the status, the error code and message with the id left out.
async fn budget_answer(
    cluster: &Cluster,
    key: &str,
    tenant: Option<&str>,
    key_id: &str,
) -> anyhow::Result<(u16, Value, String)> {
    let mut body = json!({"monthlyLimitUsd": "1", "keyId": key_id});
    if let Some(tenant) = tenant {
        body["tenantId"] = json!(tenant);
    }
    let (status, body) = call_as(cluster, key, "PUT", "/v1/usage/budgets", Some(body)).await?;
    let message = body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .replace(key_id, "<id>");
    Ok((status, body["error"]["code"].clone(), message))
}

both_modes!(a_budget_for_a_foreign_key_answers_like_a_missing_one, foreign_budget);

/// Issue 26 item 14 (budgets): a tenant's admin sets a budget for another
/// tenant's key, then for a key that does not exist: both answer alike
/// (404 `API_KEY_NOT_FOUND`, the same message but for the id), as does an
/// operator naming one tenant and another tenant's key; nothing is stored.
async fn foreign_budget(mode: Mode) -> anyhow::Result<()> {
    let cluster = crate::support::cluster(mode).await?;
    let a = create_tenant(&cluster, "tenant-a", None).await?;
    let b = create_tenant(&cluster, "tenant-b", None).await?;
    // A missing key of the same shape: B's id with every digit changed.
    let (prefix, digits) = b.admin.key_id.split_once('_').context("a key id")?;
    let changed: String = digits.chars().map(|c| if c == '0' { '1' } else { '0' }).collect();
    let missing = format!("{prefix}_{changed}");
    let foreign = budget_answer(&cluster, &a.admin.key, None, &b.admin.key_id).await?;
    let absent = budget_answer(&cluster, &a.admin.key, None, &missing).await?;
    ensure!(foreign.0 == 404, "a foreign key: {foreign:?}");
    ensure!(foreign == absent, "foreign {foreign:?} != missing {absent:?}");
    // Removing one (a limit of 0) is no different.
    let (status, removed) = call_as(
        &cluster,
        &a.admin.key,
        "PUT",
        "/v1/usage/budgets",
        Some(json!({"monthlyLimitUsd": "0", "keyId": b.admin.key_id})),
    )
    .await?;
    ensure!(status == 404, "{removed}");
    // An operator naming tenant A and B's key gets the same answer.
    let crossed = budget_answer(&cluster, &cluster.admin_key, Some(&a.tenant_id), &b.admin.key_id).await?;
    ensure!(crossed == absent, "operator: {crossed:?} != {absent:?}");
    // Nothing was stored; A's own key still takes a budget.
    let (_, budgets) = call_as(&cluster, &a.admin.key, "GET", "/v1/usage/budgets", None).await?;
    ensure!(budgets["budgets"] == json!([]), "{budgets}");
    let (_, budgets) = call_as(&cluster, &b.admin.key, "GET", "/v1/usage/budgets", None).await?;
    ensure!(budgets["budgets"] == json!([]), "{budgets}");
    let own = budget_answer(&cluster, &a.admin.key, None, &a.admin.key_id).await?;
    ensure!(own.0 == 200, "{own:?}");
    Ok(())
}

both_modes!(
    members_see_their_own_figures_and_tenants_no_operator_settings,
    own_figures
);

/// Issue 26 item 13, as the tester did it: the tenant's admin spends, with
/// budgets set for the tenant, the admin's key and the member's key; the
/// member then reads `/v1/usage/budgets` and `/v1/auth/quota` and sees only
/// the figures of their own key; tenants read `/v1/config` and see neither
/// the operator's LLM base URL nor the data directory, which the operator
/// still sees.
async fn own_figures(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let base_url = mock.anthropic_base_url();
    let options = Options::with_llm(Llm::Anthropic {
        base_url: base_url.clone(),
    });
    let cluster = Cluster::start(mode, options).await?;
    let tenant = create_tenant(&cluster, "acme", None).await?;
    let admin = tenant.admin.key.clone();
    let member = create_user(&cluster, &tenant, "mel", "member").await?;
    for key_id in [None, Some(&tenant.admin.key_id), Some(&member.key_id)] {
        let body = match key_id {
            Some(key_id) => json!({"monthlyLimitUsd": "100", "keyId": key_id}),
            None => json!({"monthlyLimitUsd": "100"}),
        };
        let (status, set) = call_as(&cluster, &admin, "PUT", "/v1/usage/budgets", Some(body)).await?;
        ensure!(status == 200, "{set}");
    }

    // The admin spends; the tenant's figures show it.
    let mut client = WsClient::connect(&cluster.ws_url_as(&admin)).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    send_and_finish(&mut client, &chat.image_id, json!("spend something")).await?;
    let tenant_used: u64 = poll(Duration::from_secs(20), "the tenant's use", || async {
        let (_, quota) = call_as(&cluster, &admin, "GET", "/v1/auth/quota", None).await?;
        Ok(quota["tokensUsed"].as_u64().filter(|used| *used > 0))
    })
    .await?;
    // The member sees their own key's budget and use only.
    let (status, budgets) = call_as(&cluster, &member.key, "GET", "/v1/usage/budgets", None).await?;
    ensure!(status == 200, "{budgets}");
    let seen = budgets["budgets"].as_array().context("budgets")?;
    ensure!(
        seen.len() == 1 && seen[0]["keyId"] == json!(member.key_id),
        "the member sees others' figures: {budgets}"
    );
    let (status, quota) = call_as(&cluster, &member.key, "GET", "/v1/auth/quota", None).await?;
    ensure!(status == 200, "{quota}");
    ensure!(
        quota["tokensUsed"] == json!(0),
        "the member sees the tenant's use ({tenant_used} tokens): {quota}"
    );
    // Their own turn counts, and only it.
    let mut own = WsClient::connect(&cluster.ws_url_as(&member.key)).await?;
    let chat = conversation(&mut own, "mine", json!({})).await?;
    send_and_finish(&mut own, &chat.image_id, json!("my turn")).await?;
    let member_used: u64 = poll(Duration::from_secs(20), "the member's use", || async {
        let (_, quota) = call_as(&cluster, &member.key, "GET", "/v1/auth/quota", None).await?;
        Ok(quota["tokensUsed"].as_u64().filter(|used| *used > 0))
    })
    .await?;
    let (_, quota) = call_as(&cluster, &admin, "GET", "/v1/auth/quota", None).await?;
    let total = quota["tokensUsed"].as_u64().context("tokensUsed")?;
    ensure!(member_used < total, "member {member_used} of the tenant's {total}");

    // Tenants see their own settings, not the operator's.
    let data_dir = cluster.data_dir().display().to_string();
    for key in [&admin, &member.key] {
        let (status, config) = call_as(&cluster, key, "GET", "/v1/config", None).await?;
        ensure!(status == 200, "{config}");
        let text = config.to_string();
        ensure!(
            !text.contains(base_url.trim_end_matches('/')) && !text.contains(&data_dir),
            "a tenant sees operator settings: {config}"
        );
        ensure!(config["config"]["llm"]["model"].is_string(), "{config}");
        for hidden in ["llm.baseUrl", "system.dataDir"] {
            let (status, refused) = call_as(&cluster, key, "GET", &format!("/v1/config/{hidden}"), None).await?;
            ensure!(
                (status, &refused["error"]["code"]) == (403, &json!("OPERATOR_REQUIRED")),
                "{hidden}: {status} {refused}"
            );
        }
    }
    let (status, config) = call(&cluster, "GET", "/v1/config/llm.baseUrl", None).await?;
    ensure!(status == 200 && config["key"] == "llm.baseUrl", "operator: {config}");
    Ok(())
}
