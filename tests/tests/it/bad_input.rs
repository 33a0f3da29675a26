//! Every class of bad input gets a typed answer; the connection and server keep working.

use avm_tests::cluster::{Cluster, Mode, Options};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{assert_text_turn, cluster, conversation, send_and_finish};

async fn expect_system_error(client: &mut WsClient, code: &str) -> anyhow::Result<()> {
    let frame = client.next_frame().await?;
    assert_eq!(frame["type"], "system_error", "{frame}");
    assert_eq!(frame["data"]["code"], code, "{frame}");
    assert!(frame["data"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    Ok(())
}

fn code(data: &Value) -> &str {
    data["code"].as_str().unwrap_or_default()
}

both_modes!(bad_input_gets_typed_errors, bad_input);

async fn bad_input(mode: Mode) -> anyhow::Result<()> {
    let options = Options {
        max_frame_bytes: Some(64 * 1024),
        ..Options::default()
    };
    let cluster = Cluster::start(mode, options).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;

    client.send_text("this is not json").await?;
    expect_system_error(&mut client, "INVALID_JSON").await?;
    client.send_text("[1, 2, 3]").await?;
    expect_system_error(&mut client, "INVALID_JSON").await?;
    client.send_json(&json!({"data": {}})).await?;
    expect_system_error(&mut client, "MISSING_TYPE").await?;
    client.send_json(&json!({"type": "hello"})).await?;
    expect_system_error(&mut client, "UNKNOWN_TYPE").await?;
    client.send_binary(vec![0, 1, 2]).await?;
    expect_system_error(&mut client, "BINARY_NOT_SUPPORTED").await?;
    client.send_json(&json!({"type": "subscribe"})).await?;
    expect_system_error(&mut client, "MISSING_FIELD").await?;
    client.subscribe("sess_doesnotexist", None).await?;
    expect_system_error(&mut client, "SESSION_NOT_FOUND").await?;

    // An unknown request type still gets its response.
    let request_id = client.send_request("frobnicate", json!({})).await?;
    let frame = client.next_frame().await?;
    assert_eq!(frame["type"], "frobnicate_response");
    assert_eq!(frame["data"]["requestId"], request_id.as_str());
    assert_eq!(code(&frame["data"]), "UNKNOWN_REQUEST");

    client
        .send_json(&json!({"type": "container_list_request", "data": {}}))
        .await?;
    let frame = client.next_frame().await?;
    assert_eq!(frame["type"], "container_list_response");
    assert_eq!(code(&frame["data"]), "MISSING_REQUEST_ID");

    // Missing fields, wrong types, invalid and unknown ids.
    assert_eq!(
        code(&client.request("container_create", json!({})).await?),
        "MISSING_FIELD"
    );
    assert_eq!(
        code(&client.request("container_create", json!({"containerId": 42})).await?),
        "INVALID_FIELD"
    );
    assert_eq!(
        code(
            &client
                .request("container_create", json!({"containerId": "no spaces!"}))
                .await?
        ),
        "INVALID_CONTAINER_ID"
    );
    assert_eq!(
        code(&client.request("image_create", json!({"containerId": "nope"})).await?),
        "CONTAINER_NOT_FOUND"
    );
    assert_eq!(
        client.request("image_get", json!({"imageId": "img_missing"})).await?["record"],
        Value::Null
    );
    assert_eq!(
        code(
            &client
                .request("image_messages", json!({"imageId": "img_missing"}))
                .await?
        ),
        "IMAGE_NOT_FOUND"
    );
    assert_eq!(
        code(&client.request("image_run", json!({"imageId": "img_missing"})).await?),
        "IMAGE_NOT_FOUND"
    );
    assert_eq!(
        code(
            &client
                .request("image_delete", json!({"imageId": "img_missing"}))
                .await?
        ),
        "IMAGE_NOT_FOUND"
    );
    assert_eq!(
        code(
            &client
                .request("message_send", json!({"imageId": "img_missing", "content": "x"}))
                .await?
        ),
        "IMAGE_NOT_FOUND"
    );
    assert_eq!(
        code(
            &client
                .request("agent_interrupt", json!({"agentId": "agent_missing"}))
                .await?
        ),
        "AGENT_NOT_FOUND"
    );
    assert_eq!(
        client.request("agent_get", json!({"agentId": "agent_missing"})).await?["exists"],
        false
    );
    assert_eq!(
        client.request("container_get", json!({"containerId": "nope"})).await?["exists"],
        false
    );

    let chat = conversation(&mut client, "default", json!({})).await?;
    for content in [
        json!(42),
        json!({"text": "x"}),
        json!([{"type": "video"}]),
        json!(""),
        json!([]),
    ] {
        let answer = client
            .request("message_send", json!({"imageId": chat.image_id, "content": content}))
            .await?;
        assert!(
            ["INVALID_CONTENT", "EMPTY_CONTENT"].contains(&code(&answer)),
            "{content} answered {answer}"
        );
    }
    let answer = client
        .request(
            "image_create",
            json!({"containerId": "default", "config": {"mcpServers": [1]}}),
        )
        .await?;
    assert_eq!(code(&answer), "INVALID_MCP_SERVERS");

    // An oversized frame is refused, and the connection goes on.
    let big = json!({"type": "container_list_request", "data": {"requestId": "big", "pad": "x".repeat(100 * 1024)}});
    client.send_json(&big).await?;
    expect_system_error(&mut client, "FRAME_TOO_LARGE").await?;
    assert!(client.request("container_list", json!({})).await?["containerIds"].is_array());

    // The conversation still works after all of that.
    assert_text_turn(&send_and_finish(&mut client, &chat.image_id, json!("still there?")).await?);

    // Beyond the hard limit the connection is closed with 1009 after a typed error, and the server lives on.
    client.send_text("y".repeat(300 * 1024)).await?;
    expect_system_error(&mut client, "FRAME_TOO_LARGE").await?;
    let closed = client.next_frame().await;
    assert!(closed.is_err());
    assert_eq!(client.closed.as_ref().map(|(code, _)| *code), Some(1009));
    let mut again = WsClient::connect(&cluster.ws_url()).await?;
    assert!(again.request("container_list", json!({})).await?["containerIds"].is_array());
    Ok(())
}

both_modes!(a_rate_limited_request_still_gets_its_response, rate_limited);

async fn rate_limited(mode: Mode) -> anyhow::Result<()> {
    let options = Options {
        messages_per_second: Some(5),
        ..Options::default()
    };
    let cluster = Cluster::start(mode, options).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let mut ids = Vec::new();
    for _ in 0..12 {
        ids.push(client.send_request("container_list", json!({})).await?);
    }
    let mut limited = 0;
    for id in &ids {
        let answer = client.response(id).await?;
        match answer.get("code") {
            Some(code) => {
                assert_eq!(code, "RATE_LIMITED", "{answer}");
                limited += 1;
            }
            None => assert!(answer["containerIds"].is_array(), "{answer}"),
        }
    }
    // Five frames per one-second window: even a burst that straddles two
    // windows lets at most ten of the twelve through.
    assert!(limited >= 2, "{limited} of 12 requests were limited");
    Ok(())
}

/// Fails unless `response` is the API's error document with `status` and `code`.
async fn assert_error_document(response: reqwest::Response, status: u16, code: &str) -> anyhow::Result<()> {
    let url = response.url().to_string();
    assert_eq!(response.status().as_u16(), status, "{url}");
    let content_type = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(content_type.starts_with("application/json"), "{url}: {content_type}");
    let body: Value = response.json().await?;
    assert_eq!(body["error"]["code"], code, "{url}: {body}");
    assert!(
        body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(
        body["error"]["requestId"].as_str().is_some_and(|id| !id.is_empty()),
        "{body}"
    );
    Ok(())
}

/// Every request the router or an extractor refuses — a path segment that
/// is not UTF-8, a bad query, a body that is not JSON, a route or method
/// that does not exist, a plain GET of the WebSocket — answers the same
/// JSON error document as the API's own refusals (the schema fuzzer's
/// findings, kept).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_of_the_router_are_error_documents() -> anyhow::Result<()> {
    let cluster = cluster(Mode::OneProcess).await?;
    let http = cluster.http()?;
    for path in [
        "/v1/containers/%ff/images",
        "/v1/containers/%ff",
        "/v1/images/%c3%28",
        "/v1/images/img_1/workspace/files/a/%ff",
        "/v1/tenants/%ff/users/%fe",
        "/v1/config/%80",
    ] {
        assert_error_document(http.get(cluster.url(path)).send().await?, 400, "INVALID_PATH").await?;
    }
    let response = http
        .get(cluster.url("/v1/agents?containerId=a&containerId=b"))
        .send()
        .await?;
    assert_error_document(response, 400, "INVALID_QUERY").await?;
    let response = http.get(cluster.url("/ws?ack=1&ack=1")).send().await?;
    assert_error_document(response, 400, "INVALID_QUERY").await?;
    let response = http.get(cluster.url("/ws")).send().await?;
    assert_error_document(response, 400, "NOT_A_WEBSOCKET_UPGRADE").await?;
    let response = http
        .post(cluster.url("/v1/containers"))
        .body("{not json")
        .send()
        .await?;
    assert_error_document(response, 400, "INVALID_JSON").await?;
    let response = http.patch(cluster.url("/v1/containers")).send().await?;
    assert_error_document(response, 405, "METHOD_NOT_ALLOWED").await?;
    let response = http.get(cluster.url("/v2/nothing")).send().await?;
    assert_error_document(response, 404, "ROUTE_NOT_FOUND").await?;
    // The server goes on answering.
    let listed: Value = http.get(cluster.url("/v1/containers")).send().await?.json().await?;
    assert!(listed["containers"].is_array(), "{listed}");
    Ok(())
}

/// Configuration from the environment (the property tests' findings, kept):
/// digits given to a key that wants text stay text, and a value its key
/// refuses is named by the variable that set it.
#[tokio::test]
async fn configuration_values_are_read_as_written_or_refused_by_their_variable() -> anyhow::Result<()> {
    let output = avm_tests::cluster::avm_command()?
        .args(["serve", "--print-config"])
        .env("AVM_REDIS_KEY_PREFIX", "123")
        .env("AVM_AUTH_ISSUER", "2026")
        .env("AVM_SERVER_PORT", "8181")
        .output()
        .await?;
    let stdout = String::from_utf8(output.stdout)?;
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let config: toml::Table = toml::from_str(&stdout)?;
    assert_eq!(config["redis"]["key_prefix"].as_str(), Some("123"), "{stdout}");
    assert_eq!(config["auth"]["issuer"].as_str(), Some("2026"), "{stdout}");
    assert_eq!(config["server"]["port"].as_integer(), Some(8181), "{stdout}");

    for (variable, value, key) in [
        ("AVM_GATEWAY_AUTH_TIMEOUT", "soon", "gateway.auth_timeout"),
        ("AVM_SERVER_PORT", "99999", "server.port"),
        ("AVM_RUNTIME_ADDR", "[1, 2]", "peers.runtime"),
        ("LLM_MAX_TOKENS", "many", "llm.max_tokens"),
    ] {
        let output = avm_tests::cluster::avm_command()?
            .args(["serve", "--print-config"])
            .env(variable, value)
            .output()
            .await?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{variable}={value} was accepted");
        assert!(
            stderr.contains(key) && stderr.contains(variable),
            "{variable}={value}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    Ok(())
}
