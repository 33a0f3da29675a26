//! Issue 29, acceptance 1: search finds last week's conversation by a
//! phrase in it; it is exported, imported into another container, and
//! continued there with its history as the model's context. And a
//! container's export goes into another container whole.

use anyhow::{Context, ensure};
use avm_tests::cluster::{Cluster, Llm, Mode, Options, http_client};
use avm_tests::mock_llm::{MockApi, MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{call, conversation, request_texts, send_and_finish};

/// `GET` with the admin key; returns the status, the content type and the body.
async fn download(cluster: &Cluster, path: &str) -> anyhow::Result<(u16, String, Vec<u8>)> {
    let response = http_client(&cluster.admin_key)?.get(cluster.url(path)).send().await?;
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    Ok((status, content_type, response.bytes().await?.to_vec()))
}

/// `POST`s raw bytes with the admin key; returns the status and the JSON body.
async fn upload(cluster: &Cluster, path: &str, body: Vec<u8>) -> anyhow::Result<(u16, Value)> {
    let response = http_client(&cluster.admin_key)?
        .post(cluster.url(path))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    Ok((
        status,
        serde_json::from_str(&text).with_context(|| format!("{path} answered {status} {text}"))?,
    ))
}

/// Announces a body of `length` bytes with `Expect: 100-continue` and returns
/// the head of what the server answers before any of it is sent.
async fn announce(cluster: &Cluster, path: &str, length: usize) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let url = reqwest::Url::parse(&cluster.url(path))?;
    let addr = format!("{}:{}", url.host_str().unwrap_or("127.0.0.1"), url.port().unwrap_or(80));
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\n\
         Content-Length: {length}\r\nExpect: 100-continue\r\n\r\n",
        url.authority(),
        cluster.admin_key,
    );
    stream.write_all(head.as_bytes()).await?;
    let mut answer = vec![0u8; 4096];
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), stream.read(&mut answer))
        .await
        .context("no answer to Expect: 100-continue")??;
    Ok(String::from_utf8_lossy(&answer[..read]).into_owned())
}

both_modes!(
    a_found_conversation_is_exported_imported_and_continued,
    found_exported_continued
);

async fn found_exported_continued(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior {
        reply: Some("Booked the sleeper.".to_owned()),
        ..MockBehavior::default()
    })
    .await?;
    let options = Options::with_llm(Llm::Anthropic {
        base_url: mock.anthropic_base_url(),
    });
    let mut cluster = Cluster::start(mode, options).await?;
    let mut ws = WsClient::connect(&cluster.ws_url()).await?;
    let trip = conversation(
        &mut ws,
        "last-week",
        json!({"name": "Travel", "systemPrompt": "Plan trips."}),
    )
    .await?;
    send_and_finish(
        &mut ws,
        &trip.image_id,
        json!("Book the overnight sleeper train to Vienna"),
    )
    .await?;
    let other = conversation(&mut ws, "last-week", json!({"name": "Groceries"})).await?;
    send_and_finish(
        &mut ws,
        &other.image_id,
        json!("a train of thought about sleeper cells"),
    )
    .await?;

    // Found by the phrase, not by its words apart.
    let (status, found) = call(&cluster, "GET", "/v1/search?q=%22sleeper%20train%22", None).await?;
    ensure!(status == 200, "search: {status} {found}");
    let hits = found["hits"].as_array().context("hits")?;
    ensure!(
        hits.len() == 1 && hits[0]["imageId"] == trip.image_id.as_str(),
        "the phrase finds the trip alone: {found}"
    );

    // Exported as one JSON document.
    let (status, content_type, document) = download(&cluster, &format!("/v1/images/{}/export", trip.image_id)).await?;
    ensure!(
        status == 200 && content_type == "application/json",
        "export: {status} {content_type}"
    );
    let parsed: Value = serde_json::from_slice(&document)?;
    ensure!(
        parsed["format"] == "agentvm.conversation" && parsed["messages"].as_array().map(Vec::len) == Some(2),
        "the document: {parsed}"
    );
    ensure!(
        parsed["usage"]["outputTokens"].as_u64() > Some(0),
        "usage totals: {}",
        parsed["usage"]
    );

    // Imported into another container, once however often it is sent.
    let (status, created) = call(
        &cluster,
        "POST",
        "/v1/containers",
        Some(json!({"containerId": "archive"})),
    )
    .await?;
    ensure!(status < 300, "container: {status} {created}");
    let (status, imported) = upload(&cluster, "/v1/containers/archive/import", document.clone()).await?;
    ensure!(status == 201, "import: {status} {imported}");
    let copy = &imported["conversations"][0];
    let image_id = copy["imageId"].as_str().context("imageId")?.to_owned();
    let session_id = copy["sessionId"].as_str().context("sessionId")?.to_owned();
    ensure!(
        image_id != trip.image_id && copy["containerId"] == "archive" && copy["name"] == "Travel",
        "{copy}"
    );
    let (status, again) = upload(&cluster, "/v1/containers/archive/import", document).await?;
    ensure!(
        status == 200 && again["conversations"][0]["imageId"] == image_id.as_str(),
        "{status} {again}"
    );

    // Continued there: the model is sent the imported history, then the new message.
    let (_, history) = call(&cluster, "GET", &format!("/v1/images/{}/messages", trip.image_id), None).await?;
    let (_, copied) = call(&cluster, "GET", &format!("/v1/images/{image_id}/messages"), None).await?;
    ensure!(
        history["messages"] == copied["messages"],
        "the copy's history is the original's:\n{history}\n{copied}"
    );
    ws.subscribe(&session_id, None).await?;
    let before = mock.requests().len();
    send_and_finish(&mut ws, &image_id, json!("And a taxi from the station")).await?;
    let requests = mock.requests();
    let last = requests[before..]
        .iter()
        .rfind(|request| request.api == MockApi::Anthropic)
        .context("the continued turn reached the model")?;
    ensure!(
        last.body["system"].to_string().contains("Plan trips."),
        "the copy's system prompt: {}",
        last.body
    );
    let texts = request_texts(&last.body);
    ensure!(
        texts
            == [
                "Book the overnight sleeper train to Vienna",
                "Booked the sleeper.",
                "And a taxi from the station"
            ],
        "the model sees the imported history: {texts:?}"
    );
    let (_, grown) = call(&cluster, "GET", &format!("/v1/images/{image_id}/messages"), None).await?;
    ensure!(grown["messages"].as_array().map(Vec::len) == Some(4), "{grown}");

    // The whole container, as JSON Lines, into a third container.
    let (status, content_type, lines) = download(&cluster, "/v1/containers/last-week/export").await?;
    ensure!(
        status == 200 && content_type == "application/x-ndjson",
        "{status} {content_type}"
    );
    let text = String::from_utf8(lines.clone())?;
    ensure!(text.lines().count() == 3, "a header and two conversations: {text}");
    call(&cluster, "POST", "/v1/containers", Some(json!({"containerId": "copy"}))).await?;
    let (status, whole) = upload(&cluster, "/v1/containers/copy/import", lines).await?;
    ensure!(
        status == 201 && whole["conversations"].as_array().map(Vec::len) == Some(2),
        "{status} {whole}"
    );
    let (_, listed) = call(&cluster, "GET", "/v1/containers/copy/images", None).await?;
    let mut names: Vec<&str> = listed["images"]
        .as_array()
        .map(|images| images.iter().filter_map(|image| image["name"].as_str()).collect())
        .unwrap_or_default();
    names.sort_unstable();
    ensure!(names == ["Groceries", "Travel"], "{listed}");

    // Refused documents: typed errors, nothing written; a missing image is 404.
    let (status, body) = upload(
        &cluster,
        "/v1/containers/copy/import",
        b"{\"format\":\"agentvm.conversation\",\"version\":9}".to_vec(),
    )
    .await?;
    ensure!(
        status == 400 && body["error"]["code"] == "UNSUPPORTED_VERSION",
        "{status} {body}"
    );
    let (status, body) = upload(&cluster, "/v1/containers/copy/import", b"not json".to_vec()).await?;
    ensure!(
        status == 400 && body["error"]["code"] == "INVALID_DOCUMENT",
        "{status} {body}"
    );
    // Imports may be larger than other bodies (here 2 MiB), up to 15 MiB.
    let mut padded = serde_json::to_vec(&parsed)?;
    padded.resize(2 * 1024 * 1024, b' ');
    let (status, body) = upload(&cluster, "/v1/containers/archive/import", padded).await?;
    ensure!(
        status == 200 && body["conversations"][0]["imageId"] == image_id.as_str(),
        "{status} {body}"
    );
    let answer = announce(&cluster, "/v1/containers/copy/import", 16 * 1024 * 1024).await?;
    ensure!(
        answer.starts_with("HTTP/1.1 413") && answer.contains("REQUEST_TOO_LARGE"),
        "over 15 MiB: {answer}"
    );
    let (status, _, _) = download(&cluster, "/v1/images/img_missing/export").await?;
    ensure!(status == 404, "a missing image: {status}");
    cluster.stop().await?;
    mock.shutdown().await;
    Ok(())
}
