//! Issue 29 item 1, search: a user finds a conversation by words said in it,
//! over REST, the WebSocket and gRPC alike, and only what they may read: a
//! member their own containers and those shared with them, an admin the
//! whole tenant, never another tenant's text.

use anyhow::{Context, ensure};
use avm_proto::session::v1 as ss;
use avm_tests::accounts::{Account, create_tenant, create_user};
use avm_tests::cluster::{Cluster, Mode, http_client};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{call_as, cluster, conversation, send_and_finish};

/// Searches over REST as `account`; returns the status and body.
async fn search_as(cluster: &Cluster, account: &Account, query: &[(&str, &str)]) -> anyhow::Result<(u16, Value)> {
    let url = reqwest::Url::parse_with_params(&cluster.url("/v1/search"), query)?;
    let response = http_client(&account.key)?.get(url).send().await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    Ok((
        status,
        serde_json::from_str(&text).with_context(|| format!("search answered {status} {text}"))?,
    ))
}

/// The message ids of a result's hits, `name:<imageId>` for a name hit.
fn hits(result: &Value) -> Vec<String> {
    result["hits"]
        .as_array()
        .map(|hits| {
            hits.iter()
                .map(|hit| match hit["messageId"].as_str() {
                    Some(id) => id.to_owned(),
                    None => format!("name:{}", hit["imageId"].as_str().unwrap_or_default()),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Makes a conversation named `name` in `container_id` as `account` and says
/// `text` in it; returns the image id and the user message's id.
async fn talk(
    cluster: &Cluster,
    account: &Account,
    container_id: &str,
    name: &str,
    text: &str,
) -> anyhow::Result<(String, String)> {
    let mut ws = WsClient::connect(&cluster.ws_url_as(&account.key)).await?;
    let chat = conversation(&mut ws, container_id, json!({"name": name})).await?;
    let frames = send_and_finish(&mut ws, &chat.image_id, json!(text)).await?;
    let persisted = frames
        .iter()
        .find(|frame| frame["type"] == "message_persisted")
        .context("no message_persisted")?;
    let message_id = persisted["data"]["messageId"]
        .as_str()
        .context("no messageId")?
        .to_owned();
    Ok((chat.image_id, message_id))
}

both_modes!(search_finds_what_the_caller_may_read, search_scoped);

async fn search_scoped(mode: Mode) -> anyhow::Result<()> {
    let mut cluster = cluster(mode).await?;
    let tenant = create_tenant(&cluster, "search-t", None).await?;
    let other = create_tenant(&cluster, "search-u", None).await?;
    let alice = create_user(&cluster, &tenant, "alice", "member").await?;
    let bob = create_user(&cluster, &tenant, "bob", "member").await?;
    let (trip, said) = talk(
        &cluster,
        &alice,
        "alice-notes",
        "Lisbon trip",
        "Plan three days with a ferry ride to Cacilhas",
    )
    .await?;
    let (_, bobs) = talk(&cluster, &bob, "bob-notes", "Timetables", "the ferry timetable please").await?;
    let (_, foreign) = talk(&cluster, &other.admin, "alice-notes", "Elsewhere", "ferry ferry ferry").await?;

    // Each finds exactly what listing shows them. (The offline model's reply
    // quotes the user, so users' messages are asked for.)
    let user = ("role", "user");
    let (status, mine) = search_as(&cluster, &alice, &[("q", "FERRY"), user]).await?;
    ensure!(status == 200, "search answered {status} {mine}");
    ensure!(hits(&mine) == [said.clone()], "alice finds her message alone: {mine}");
    let hit = &mine["hits"][0];
    ensure!(
        hit["imageId"] == trip.as_str()
            && hit["containerId"] == "alice-notes"
            && hit["imageName"] == "Lisbon trip"
            && hit["role"] == "user"
            && hit["seq"] == 1
            && hit["snippet"] == "Plan three days with a <mark>ferry</mark> ride to Cacilhas",
        "the hit says where and what: {hit}"
    );
    let (_, replied) = search_as(&cluster, &alice, &[("q", "ferry")]).await?;
    let mut roles: Vec<&str> = replied["hits"]
        .as_array()
        .map(|hits| hits.iter().filter_map(|hit| hit["role"].as_str()).collect())
        .unwrap_or_default();
    roles.sort_unstable();
    ensure!(
        roles == ["assistant", "user"],
        "without a role the reply is found too: {replied}"
    );
    let (_, all) = search_as(&cluster, &tenant.admin, &[("q", "ferry"), user]).await?;
    let mut found = hits(&all);
    found.sort();
    let mut expected = vec![said.clone(), bobs.clone()];
    expected.sort();
    ensure!(found == expected, "the admin finds the tenant's: {all}");
    let (_, theirs) = search_as(&cluster, &other.admin, &[("q", "ferry"), user]).await?;
    ensure!(
        hits(&theirs) == [foreign],
        "the other tenant finds its own alone: {theirs}"
    );
    // A container of another, named, is as empty as a missing one.
    let (status, named) = search_as(&cluster, &alice, &[("q", "ferry"), ("containerId", "bob-notes")]).await?;
    ensure!(status == 200 && hits(&named).is_empty(), "{status} {named}");

    // Shared with her to read, bob's is found too.
    let (status, shared) = call_as(
        &cluster,
        &bob.key,
        "POST",
        "/v1/containers/bob-notes/shares",
        Some(json!({"userId": alice.user_id, "role": "read"})),
    )
    .await?;
    ensure!(status < 300, "share: {status} {shared}");
    let (_, now) = search_as(&cluster, &alice, &[("q", "ferry"), user]).await?;
    ensure!(hits(&now).len() == 2, "a read share is searchable: {now}");

    // The WebSocket takes the same request: a phrase, a role, a name.
    let mut ws = WsClient::connect(&cluster.ws_url_as(&alice.key)).await?;
    let phrase = ws
        .request("search", json!({"q": "\"ferry ride\"", "role": "user"}))
        .await?;
    ensure!(hits(&phrase) == [said.clone()], "a phrase over the WebSocket: {phrase}");
    let name = ws.request("search", json!({"q": "lisbon"})).await?;
    ensure!(
        hits(&name) == [format!("name:{trip}")],
        "a conversation by its name: {name}"
    );
    let refused = ws.request("search", json!({"q": "((( )))"})).await?;
    ensure!(refused["code"] == "INVALID_QUERY", "no words: {refused}");
    let refused = ws.request("search", json!({"q": "ferry", "pageSize": "many"})).await?;
    ensure!(refused["code"] == "INVALID_FIELD", "a wrong type: {refused}");

    // And gRPC, for internal callers, with the same scope.
    let token = cluster.access_token(&alice.key).await?;
    let mut grpc = ss::session_service_client::SessionServiceClient::connect(cluster.session_grpc.clone()).await?;
    let mut request = tonic::Request::new(ss::SearchMessagesRequest {
        query: "ferry".to_owned(),
        role: Some("user".to_owned()),
        ..Default::default()
    });
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse()?);
    let page = grpc.search_messages(request).await?.into_inner();
    let mut ids: Vec<String> = page.hits.into_iter().filter_map(|hit| hit.message_id).collect();
    ids.sort();
    ensure!(ids == expected, "gRPC finds the same: {ids:?}");

    // Bad input is a typed error, never an echo of it.
    let long = "x".repeat(20_000);
    let (status, body) = search_as(&cluster, &alice, &[("q", &long)]).await?;
    ensure!(status == 400 && body["error"]["code"] == "TOO_LONG", "{status} {body}");
    let (status, body) = search_as(&cluster, &alice, &[("q", &long[..1_000])]).await?;
    ensure!(
        status == 400 && body["error"]["code"] == "INVALID_QUERY",
        "{status} {body}"
    );
    ensure!(
        !body.to_string().contains(&long[..600]),
        "the error does not echo the query"
    );
    let refused = ws.request("search", json!({"q": long})).await?;
    ensure!(
        refused["code"] == "INVALID_QUERY",
        "a long query over the WebSocket: {refused}"
    );
    let (status, body) = search_as(&cluster, &alice, &[("q", "ferry"), ("role", "system")]).await?;
    ensure!(
        status == 400 && body["error"]["code"] == "INVALID_ROLE",
        "{status} {body}"
    );
    let (status, body) = search_as(&cluster, &alice, &[("q", "ferry"), ("pageToken", "x")]).await?;
    ensure!(
        status == 400 && body["error"]["code"] == "INVALID_PAGE_TOKEN",
        "{status} {body}"
    );
    let (status, body) = search_as(&cluster, &alice, &[]).await?;
    ensure!(status == 400, "q is required: {status} {body}");
    cluster.stop().await
}
