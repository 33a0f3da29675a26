//! Issue 26, request fields: what an outside tester found by sending a
//! typo, reproduced as they did it.
//!
//! - item 22: a field the request does not know (`sytemPrompt` for
//!   `systemPrompt`) is refused with `UNKNOWN_FIELD` naming it, over REST and
//!   over the WebSocket, and nothing is created; the same body spelt right
//!   still works; so is a misspelt field inside an MCP server's definition
//!   or a message's content part;
//! - item 16, the WebSocket part: a frame the transport refuses closes the
//!   connection with the code RFC 6455 names for it (1002 a protocol error,
//!   1007 text that is not UTF-8), not always 1009 "frame too large".

use std::time::Duration;

use anyhow::{Context, bail};
use avm_tests::cluster::Mode;
use avm_tests::ws_client::WsClient;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, connect_async};

use crate::both_modes;
use crate::support::{call, cluster};

/// Asserts a REST answer is the 400 error document refusing `field` as unknown.
fn assert_unknown_rest(what: &str, status: u16, body: &Value, field: &str) {
    assert_eq!(status, 400, "{what}: {body}");
    assert_eq!(body["error"]["code"], "UNKNOWN_FIELD", "{what}: {body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(field), "{what}: the message names {field}: {body}");
}

/// Asserts a WebSocket answer refuses `field` as unknown.
fn assert_unknown_ws(what: &str, data: &Value, field: &str) {
    assert_eq!(data["code"], "UNKNOWN_FIELD", "{what}: {data}");
    let message = data["error"].as_str().unwrap_or_default();
    assert!(message.contains(field), "{what}: the message names {field}: {data}");
}

/// Returns how many images the container `default` holds.
async fn image_count(cluster: &avm_tests::cluster::Cluster) -> anyhow::Result<usize> {
    let (status, list) = call(cluster, "GET", "/v1/containers/default/images", None).await?;
    anyhow::ensure!(status == 200, "listing images answered {status} {list}");
    Ok(list["images"].as_array().map_or(0, Vec::len))
}

both_modes!(unknown_request_fields_are_refused, unknown_fields);

async fn unknown_fields(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let (status, body) = call(
        &cluster,
        "POST",
        "/v1/containers",
        Some(json!({"containerId": "default"})),
    )
    .await?;
    assert!(status == 200 || status == 201, "{status} {body}");
    let before = image_count(&cluster).await?;

    // The tester's typo over REST: refused, and no image without a prompt.
    let (status, body) = call(
        &cluster,
        "POST",
        "/v1/containers/default/images",
        Some(json!({"name": "x", "sytemPrompt": "be brief"})),
    )
    .await?;
    assert_unknown_rest("image create", status, &body, "sytemPrompt");
    assert_eq!(
        image_count(&cluster).await?,
        before,
        "a refused image create creates nothing"
    );

    // The same over the WebSocket, where `requestId` rides in `data` beside
    // the fields and must not count as unknown.
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let refused = client
        .request(
            "image_create",
            json!({"containerId": "default", "config": {"name": "x", "sytemPrompt": "be brief"}}),
        )
        .await?;
    assert_unknown_ws("ws image create", &refused, "sytemPrompt");
    let refused = client
        .request("image_create", json!({"containerId": "default", "contianer": "x"}))
        .await?;
    assert_unknown_ws("ws image create, top level", &refused, "contianer");
    let refused = client
        .request(
            "group_create",
            json!({"containerId": "default", "name": "g", "wakeMod": "all"}),
        )
        .await?;
    assert_unknown_ws("ws group create", &refused, "wakeMod");
    assert_eq!(
        image_count(&cluster).await?,
        before,
        "a refused image create creates nothing"
    );

    // Other routes alike.
    let (status, body) = call(
        &cluster,
        "POST",
        "/v1/containers",
        Some(json!({"containerId": "typo", "contianerName": "x"})),
    )
    .await?;
    assert_unknown_rest("container create", status, &body, "contianerName");
    let (_, containers) = call(&cluster, "GET", "/v1/containers", None).await?;
    assert!(
        !containers.to_string().contains("\"typo\""),
        "a refused container create creates nothing: {containers}"
    );
    let (status, body) = call(
        &cluster,
        "POST",
        "/v1/containers/default/groups",
        Some(json!({"name": "g", "wakeMod": "all"})),
    )
    .await?;
    assert_unknown_rest("group create", status, &body, "wakeMod");
    let (_, groups) = call(&cluster, "GET", "/v1/containers/default/groups", None).await?;
    assert_eq!(
        groups["groups"],
        json!([]),
        "a refused group create creates nothing: {groups}"
    );
    let (status, body) = call(
        &cluster,
        "PUT",
        "/v1/usage/budgets",
        Some(json!({"monthlyLimitUsd": "5.00", "montlyLimitUsd": "1.00"})),
    )
    .await?;
    assert_unknown_rest("budget set", status, &body, "montlyLimitUsd");
    let (_, budgets) = call(&cluster, "GET", "/v1/usage/budgets", None).await?;
    assert_eq!(
        budgets["budgets"],
        json!([]),
        "a refused budget sets nothing: {budgets}"
    );

    // Inside free-form values too: an MCP server's definition and a message's
    // content parts have fields of their own.
    let (status, body) = call(
        &cluster,
        "POST",
        "/v1/containers/default/images",
        Some(json!({"name": "x", "mcpServers": {"docs": {"type": "http", "url": "https://mcp.example/mcp", "header": {"Authorization": "Bearer t"}}}})),
    )
    .await?;
    assert_unknown_rest(
        "image create, mcpServers entry",
        status,
        &body,
        "mcpServers.docs.header",
    );
    let refused = client
        .request(
            "image_create",
            json!({"containerId": "default", "config": {"name": "x", "mcpServers": {"fs": {"command": "mcp-fs", "argv": ["-v"]}}}}),
        )
        .await?;
    assert_unknown_ws("ws image create, mcpServers entry", &refused, "mcpServers.fs.argv");
    assert_eq!(
        image_count(&cluster).await?,
        before,
        "a refused image create creates nothing"
    );
    let (status, plain) = call(
        &cluster,
        "POST",
        "/v1/containers/default/images",
        Some(json!({"name": "plain"})),
    )
    .await?;
    assert_eq!(status, 201, "{plain}");
    let plain_id = plain["imageId"].as_str().unwrap_or_default().to_owned();
    let (status, body) = call(
        &cluster,
        "POST",
        &format!("/v1/images/{plain_id}/messages"),
        Some(json!({"content": [{"type": "text", "txt": "hello"}]})),
    )
    .await?;
    assert_unknown_rest("message send, content part", status, &body, "txt");
    let refused = client
        .request(
            "message_send",
            json!({"imageId": plain_id, "content": [{"type": "image", "data": "AAA=", "mimeType": "image/png"}]}),
        )
        .await?;
    assert_unknown_ws("ws message send, content part", &refused, "mimeType");
    let (status, history) = call(&cluster, "GET", &format!("/v1/images/{plain_id}/messages"), None).await?;
    assert_eq!(status, 200, "{history}");
    assert_eq!(
        history["messages"],
        json!([]),
        "a refused message is not stored: {history}"
    );

    // Spelt right, the same bodies work on both surfaces.
    let (status, image) = call(
        &cluster,
        "POST",
        "/v1/containers/default/images",
        Some(json!({"name": "x", "systemPrompt": "be brief"})),
    )
    .await?;
    assert_eq!(status, 201, "{image}");
    assert_eq!(image["systemPrompt"], "be brief", "{image}");
    let created = client
        .request(
            "image_create",
            json!({"containerId": "default", "config": {"name": "y", "systemPrompt": "be brief"}}),
        )
        .await?;
    assert!(
        created.get("error").is_none() && created.get("code").is_none(),
        "{created}"
    );
    let created = client
        .request(
            "group_create",
            json!({"containerId": "default", "name": "g", "wakeMode": "all"}),
        )
        .await?;
    assert!(
        created.get("error").is_none() && created.get("code").is_none(),
        "{created}"
    );
    let (status, group) = call(
        &cluster,
        "POST",
        "/v1/containers/default/groups",
        Some(json!({"name": "h", "wakeMode": "all"})),
    )
    .await?;
    assert_eq!(status, 201, "{group}");
    let (status, budget) = call(
        &cluster,
        "PUT",
        "/v1/usage/budgets",
        Some(json!({"monthlyLimitUsd": "5.00"})),
    )
    .await?;
    assert_eq!(status, 200, "{budget}");
    assert_eq!(image_count(&cluster).await?, before + 3);
    Ok(())
}

both_modes!(refused_websocket_frames_close_with_their_own_code, close_codes);

/// Writes `raw` (one hand-built frame) on an authenticated WebSocket and
/// returns the code of the close the server answers with.
async fn close_code_for(url: &str, raw: &[u8]) -> anyhow::Result<u16> {
    let (mut socket, _) = connect_async(url).await.context("connect")?;
    match socket.get_mut() {
        MaybeTlsStream::Plain(tcp) => tcp.write_all(raw).await?,
        _ => bail!("the test cluster speaks plain TCP"),
    }
    // The server's own deadline bounds this; the timeout only keeps a broken
    // server from hanging the test.
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(message) = socket.next().await {
            match message {
                Ok(Message::Close(Some(frame))) => return Ok(u16::from(frame.code)),
                Ok(Message::Close(None)) => bail!("closed without a code"),
                Ok(_) => {}
                Err(err) => bail!("the connection broke without a close frame: {err}"),
            }
        }
        bail!("the connection ended without a close frame")
    })
    .await
    .context("no close within 10 s")?
}

async fn close_codes(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let url = cluster.ws_url();
    // A masked text frame (mask key 0, so the payload is as written) whose
    // payload is not UTF-8.
    let not_utf8 = [0x81, 0x80 | 2, 0, 0, 0, 0, 0xff, 0xfe];
    assert_eq!(close_code_for(&url, &not_utf8).await?, 1007, "text that is not UTF-8");
    // A text frame with a reserved bit set, no extension negotiated.
    let reserved_bit = [0x81 | 0x40, 0x80 | 1, 0, 0, 0, 0, b'x'];
    assert_eq!(close_code_for(&url, &reserved_bit).await?, 1002, "a reserved bit");
    // A client frame without a mask.
    let unmasked = [0x81, 1, b'x'];
    assert_eq!(close_code_for(&url, &unmasked).await?, 1002, "an unmasked client frame");
    // The gateway lives on and still answers.
    let mut client = WsClient::connect(&url).await?;
    let answer = client.request("container_list", json!({})).await?;
    assert!(answer.get("code").is_none(), "{answer}");
    Ok(())
}
