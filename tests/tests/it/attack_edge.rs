//! Issue 26, the edge: what an outside tester found with normal credentials,
//! several tenants and the per-component mesh, each reproduced as they did it.
//!
//! - item 5: one tenant's oversized ids, cursors and paths are refused at
//!   the edge with a typed 400 and cut no other tenant's stream;
//! - item 12: `avm serve --dev` answers this machine's own pages and tools
//!   only: no cross-site request, foreign `Host` or foreign-origin WebSocket;
//! - item 16 (part): a body beyond the limit is 413 with the error document,
//!   and one announced beyond it gets no `100 Continue`; NUL in an id or a
//!   text is the same typed 400 on SQLite (one process) and Postgres (per
//!   component, with `AVM_TEST_DATABASE_URL`).
//! - item 16 (rest): a malformed request line, an over-long URI, too many or
//!   too large headers and a bad header get the error document with a typed
//!   reason and their status, first on a connection or after a good request,
//!   and the connection is closed.

use anyhow::{Context, ensure};
use avm_tests::accounts::create_tenant;
use avm_tests::cluster::{Cluster, Llm, Mode, Options, http_client};
use avm_tests::mock_llm::{MockBehavior, MockLlm};
use avm_tests::raw_http::{ANSWER_TIMEOUT, read_response};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::both_modes;
use crate::support::{conversation, serve, stop};

/// Returns a cluster whose model streams as slowly as a message asks.
async fn cluster_with_mock(mode: Mode) -> anyhow::Result<(MockLlm, Cluster)> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let options = Options::with_llm(Llm::Anthropic {
        base_url: mock.anthropic_base_url(),
    });
    let cluster = Cluster::start(mode, options).await?;
    Ok((mock, cluster))
}

/// Returns at most 300 characters of `text`, so a failure does not print 17 kB ids.
fn short(text: impl std::fmt::Display) -> String {
    text.to_string().chars().take(300).collect()
}

/// Returns whether a REST answer is the error document with a 400 and a reason.
fn typed_400(status: u16, body: &str) -> anyhow::Result<String> {
    let body: Value =
        serde_json::from_str(body).with_context(|| format!("{status} is not the error document: {}", short(body)))?;
    let code = body["error"]["code"].as_str().unwrap_or_default().to_owned();
    ensure!(
        status == 400 && !code.is_empty() && body["error"]["requestId"].is_string(),
        "answered {status} {}",
        short(&body)
    );
    let message = body["error"]["message"].as_str().unwrap_or_default();
    ensure!(
        message.len() < 1024,
        "the error echoes the input: {} bytes",
        message.len()
    );
    Ok(code)
}

both_modes!(
    oversized_ids_get_a_typed_400_and_cut_no_other_tenants_stream,
    oversized_ids
);

/// Issue 26 item 5: as the tester did it: while tenant A's turn streams,
/// tenant B sends 17 kB ids on every route that takes one (agent and image
/// ids, a workspace path, the `after` cursor and `Last-Event-ID`, a group
/// id, the WebSocket's `afterCursor`, `sessionId`, `groupId` and a request's
/// id field). Each is a typed 400 (or the frame's typed error); A's turn
/// goes on streaming and ends with `conversation_end`.
async fn oversized_ids(mode: Mode) -> anyhow::Result<()> {
    let (_mock, cluster) = cluster_with_mock(mode).await?;
    let a = create_tenant(&cluster, "victim", None).await?;
    let b = create_tenant(&cluster, "attacker", None).await?;

    let mut victim = WsClient::connect(&cluster.ws_url_as(&a.admin.key)).await?;
    let chat = conversation(&mut victim, "victim", json!({})).await?;
    let mut attacker = WsClient::connect(&cluster.ws_url_as(&b.admin.key)).await?;
    let own = conversation(&mut attacker, "attacker", json!({})).await?;

    victim
        .send_request(
            "message_send",
            json!({"imageId": chat.image_id, "content": "a long answer [mock tokens=400 interval_ms=20]"}),
        )
        .await?;
    victim.frames_until("text_delta").await?;

    let long = "x".repeat(17 * 1024);
    let http = http_client(&b.admin.key)?;
    let routes = [
        ("GET", format!("/v1/agents/{long}"), None),
        ("POST", format!("/v1/agents/{long}/pause"), None),
        ("GET", format!("/v1/images/{long}"), None),
        ("GET", format!("/v1/images/{long}/messages"), None),
        (
            "POST",
            format!("/v1/images/{long}/messages"),
            Some(json!({"content": "hi"})),
        ),
        (
            "GET",
            format!("/v1/images/{}/workspace/files/{long}", own.image_id),
            None,
        ),
        (
            "GET",
            format!("/v1/images/{}/workspace?path={long}", own.image_id),
            None,
        ),
        ("GET", format!("/v1/images/{}/events?after={long}", own.image_id), None),
        ("GET", format!("/v1/containers/{long}"), None),
        ("GET", format!("/v1/groups/{long}"), None),
        ("GET", format!("/v1/groups/{long}/events"), None),
        ("POST", "/v1/containers".to_owned(), Some(json!({"containerId": long}))),
        (
            "POST",
            format!("/v1/containers/{long}/groups"),
            Some(json!({"name": "g"})),
        ),
        (
            "POST",
            "/v1/containers/attacker/groups".to_owned(),
            Some(json!({"name": long})),
        ),
    ];
    for (method, path, body) in &routes {
        let mut request = http.request(method.parse()?, cluster.url(path));
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await?;
        let status = response.status().as_u16();
        let text = response.text().await?;
        typed_400(status, &text).with_context(|| format!("{method} {:.60}…", path))?;
    }
    let response = http
        .get(cluster.url(&format!("/v1/images/{}/events", own.image_id)))
        .header("last-event-id", &long)
        .send()
        .await?;
    let status = response.status().as_u16();
    typed_400(status, &response.text().await?).context("Last-Event-ID")?;

    // Over the WebSocket: subscriptions and requests.
    for frame in [
        json!({"type": "subscribe", "sessionId": own.session_id, "afterCursor": long}),
        json!({"type": "subscribe", "sessionId": long}),
        json!({"type": "subscribe", "groupId": long}),
    ] {
        attacker.send_json(&frame).await?;
        let error = loop {
            let next = attacker.next_frame().await?;
            if next["type"] == "system_error" {
                break next;
            }
        };
        let code = error["data"]["code"].as_str().unwrap_or_default();
        ensure!(
            !code.is_empty() && code != "INTERNAL" && code != "UNAVAILABLE",
            "{}",
            short(&error)
        );
    }
    let answer = attacker.request("image_get", json!({"imageId": long})).await?;
    let code = answer["code"].as_str().unwrap_or_default();
    ensure!(!code.is_empty() && code != "INTERNAL", "image_get: {}", short(&answer));

    // A's turn was still streaming and ends as it should.
    let rest = victim.turn().await?;
    ensure!(
        rest.iter().any(|f| f["type"] == "text_delta"),
        "A's turn had ended before B's requests: nothing was tested"
    );
    ensure!(
        rest.last().is_some_and(|f| f["type"] == "conversation_end")
            && !rest.iter().any(|f| f["type"] == "system_error"),
        "A's stream was cut: {:?}",
        rest.iter().rev().take(3).collect::<Vec<_>>()
    );
    Ok(())
}

/// Sends a request to a `--dev` server with the given headers and body and
/// returns its status and body.
async fn dev_request(
    url: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> anyhow::Result<(u16, String)> {
    let mut request = reqwest::Client::new().request(method.parse()?, format!("{url}{path}"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    if let Some(body) = body {
        request = request.body(body.to_owned());
    }
    let response = request.send().await?;
    Ok((response.status().as_u16(), response.text().await?))
}

/// Issue 26 item 12: as the tester did it, against `avm serve --dev`: a
/// cross-site POST (`Origin: https://evil.example`, `text/plain`), a simple
/// `text/plain` POST without `Origin`, `Sec-Fetch-Site: cross-site`, a
/// foreign `Host` (DNS rebinding) and a foreign-origin WebSocket are each
/// refused with the error document, and create nothing; the server's own
/// origin, `localhost` and tools sending no `Origin` still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_mode_refuses_cross_site_requests_and_foreign_hosts() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (child, _, url) = serve(dir.path(), &["--dev"], &[]).await?;
    let port = url.rsplit(':').next().unwrap_or_default().to_owned();
    let evil_post = r#"{"containerId":"evil"}"#;
    let refused: [(&str, Vec<(&str, String)>); 5] = [
        (
            "cross-site text/plain POST",
            vec![
                ("origin", "https://evil.example".into()),
                ("content-type", "text/plain".into()),
            ],
        ),
        (
            "a simple POST without Origin",
            vec![("content-type", "text/plain".into())],
        ),
        (
            "a form POST",
            vec![("content-type", "application/x-www-form-urlencoded".into())],
        ),
        (
            "Sec-Fetch-Site: cross-site",
            vec![
                ("sec-fetch-site", "cross-site".into()),
                ("content-type", "application/json".into()),
            ],
        ),
        (
            "a rebound Host",
            vec![
                ("host", format!("evil.example:{port}")),
                ("content-type", "application/json".into()),
            ],
        ),
    ];
    for (what, headers) in &refused {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
        let (status, body) = dev_request(&url, "POST", "/v1/containers", &headers, Some(evil_post)).await?;
        let doc: Value = serde_json::from_str(&body).with_context(|| format!("{what}: {status} {body}"))?;
        ensure!(
            (status == 403 || status == 400) && doc["error"]["code"].is_string(),
            "{what}: {status} {body}"
        );
    }
    let (status, body) = dev_request(&url, "GET", "/v1/containers", &[("host", "attacker.example")], None).await?;
    ensure!(status == 403, "a rebound GET: {status} {body}");
    let (status, _) = dev_request(&url, "GET", "/v1/containers", &[("origin", "null")], None).await?;
    ensure!(status == 403, "Origin: null: {status}");

    // A foreign page's WebSocket is refused at the upgrade.
    let ws_url = format!("{}/ws", url.replacen("http", "ws", 1));
    let mut upgrade = tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(ws_url.as_str())?;
    upgrade.headers_mut().insert("origin", "https://evil.example".parse()?);
    match tokio_tungstenite::connect_async(upgrade).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            ensure!(
                response.status().as_u16() == 403,
                "a foreign-origin WebSocket: {}",
                response.status()
            );
        }
        Err(err) => anyhow::bail!("a foreign-origin WebSocket: {err}"),
        Ok(_) => anyhow::bail!("a foreign-origin WebSocket was accepted"),
    }

    // Nothing was created; the server's own origin and plain tools work.
    let (status, body) = dev_request(&url, "GET", "/v1/containers", &[], None).await?;
    ensure!(status == 200 && !body.contains("evil"), "{status} {body}");
    let own = format!("http://127.0.0.1:{port}");
    let (status, body) = dev_request(
        &url,
        "POST",
        "/v1/containers",
        &[
            ("origin", own.as_str()),
            ("sec-fetch-site", "same-origin"),
            ("content-type", "application/json"),
        ],
        Some(r#"{"containerId":"mine"}"#),
    )
    .await?;
    ensure!(status == 201, "same origin: {status} {body}");
    let localhost = format!("localhost:{port}");
    let (status, _) = dev_request(&url, "GET", "/v1/containers", &[("host", localhost.as_str())], None).await?;
    ensure!(status == 200, "Host: localhost: {status}");
    let mut socket = WsClient::connect(&ws_url).await?;
    let listed = socket.request("container_list", json!({})).await?;
    ensure!(listed["containerIds"] == json!(["mine"]), "{listed}");
    stop(child).await
}

/// Issue 26 item 16, the bodies: a 2 MB body is 413 with the error document
/// (it was 400), and `Expect: 100-continue` with a 99 MB `Content-Length` is
/// answered 413 at once, never `100 Continue` (the client is not invited to
/// send what will be refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_bodies_get_413_and_no_100_continue() -> anyhow::Result<()> {
    let cluster = crate::support::cluster(Mode::OneProcess).await?;
    let tenant = create_tenant(&cluster, "bodies", None).await?;
    let http = http_client(&tenant.admin.key)?;
    let body = format!(r#"{{"containerId":"c","pad":"{}"}}"#, "x".repeat(2 * 1024 * 1024));
    let response = http
        .post(cluster.url("/v1/containers"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    let doc: Value = serde_json::from_str(&text).with_context(|| format!("{status} {}", short(&text)))?;
    ensure!(
        status == 413 && doc["error"]["code"] == "REQUEST_TOO_LARGE",
        "{status} {}",
        short(&text)
    );

    let url = reqwest::Url::parse(&cluster.url("/v1/containers"))?;
    let addr = format!("{}:{}", url.host_str().unwrap_or("127.0.0.1"), url.port().unwrap_or(80));
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let head = format!(
        "POST /v1/containers HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        url.authority(),
        tenant.admin.key,
        99 * 1024 * 1024
    );
    stream.write_all(head.as_bytes()).await?;
    let mut answer = vec![0u8; 4096];
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), stream.read(&mut answer))
        .await
        .context("no answer to Expect: 100-continue")??;
    let answer = String::from_utf8_lossy(&answer[..read]);
    ensure!(answer.starts_with("HTTP/1.1 413"), "answered {}", short(&answer));
    ensure!(answer.contains("REQUEST_TOO_LARGE"), "{}", short(&answer));
    Ok(())
}

both_modes!(nul_characters_are_refused_alike_on_every_backend, nul_characters);

/// Issue 26 item 16, NUL: an id, a name or a message holding NUL was a 500 on
/// Postgres only (SQLite stored it); now each is `NUL_CHARACTER`, a 400 at
/// the edge, whatever the backend.
async fn nul_characters(mode: Mode) -> anyhow::Result<()> {
    let cluster = crate::support::cluster(mode).await?;
    let tenant = create_tenant(&cluster, "nul", None).await?;
    let mut socket = WsClient::connect(&cluster.ws_url_as(&tenant.admin.key)).await?;
    let chat = conversation(&mut socket, "nul", json!({})).await?;
    let http = http_client(&tenant.admin.key)?;
    let requests = [
        (
            "POST",
            "/v1/containers".to_owned(),
            Some(json!({"containerId": "a\u{0}b"})),
        ),
        (
            "POST",
            "/v1/containers/nul/images".to_owned(),
            Some(json!({"name": "a\u{0}b"})),
        ),
        (
            "POST",
            format!("/v1/images/{}/messages", chat.image_id),
            Some(json!({"content": "hi\u{0}there"})),
        ),
        ("GET", "/v1/images/img_%00x".to_owned(), None),
    ];
    for (method, path, body) in &requests {
        let mut request = http.request(method.parse()?, cluster.url(path));
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await?;
        let status = response.status().as_u16();
        let code = typed_400(status, &response.text().await?).with_context(|| format!("{method} {path}"))?;
        ensure!(code == "NUL_CHARACTER", "{method} {path}: {code}");
    }
    Ok(())
}

both_modes!(malformed_request_heads_get_a_typed_error_and_close, malformed_heads);

/// Issue 26 item 16, the heads: each was an empty 400 or 431 from hyper, or
/// (a 40 kB URI, a 100 kB header) was served; now each is the error document
/// with its reason and status, on a fresh connection and after a good request
/// on a keep-alive one, and the connection is then closed.
async fn malformed_heads(mode: Mode) -> anyhow::Result<()> {
    let cluster = crate::support::cluster(mode).await?;
    let url = reqwest::Url::parse(&cluster.url("/health"))?;
    let addr = format!("{}:{}", url.host_str().unwrap_or("127.0.0.1"), url.port().unwrap_or(80));
    let fields: String = (0..200).map(|i| format!("x-field-{i}: v\r\n")).collect();
    let cases: [(&str, Vec<u8>, u16, &str); 7] = [
        (
            "a bad request line",
            b"GET /health HTTP/1.1 extra\r\n\r\n".to_vec(),
            400,
            "MALFORMED_REQUEST_LINE",
        ),
        (
            "a TLS hello",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n".to_vec(),
            400,
            "MALFORMED_REQUEST_LINE",
        ),
        (
            "a 40 kB URI",
            format!("GET /health?x={} HTTP/1.1\r\nhost: h\r\n\r\n", "a".repeat(40_000)).into_bytes(),
            414,
            "URI_TOO_LONG",
        ),
        (
            "200 headers",
            format!("GET /health HTTP/1.1\r\nhost: h\r\n{fields}\r\n").into_bytes(),
            431,
            "HEADERS_TOO_LARGE",
        ),
        (
            "a 100 kB header",
            format!(
                "GET /health HTTP/1.1\r\nhost: h\r\nx-big: {}\r\n\r\n",
                "a".repeat(100_000)
            )
            .into_bytes(),
            431,
            "HEADERS_TOO_LARGE",
        ),
        (
            "a NUL in a header",
            b"GET /health HTTP/1.1\r\nhost: h\r\nx-a: a\0b\r\n\r\n".to_vec(),
            400,
            "MALFORMED_HEADER",
        ),
        (
            "a bad header name",
            b"GET /health HTTP/1.1\r\nhost: h\r\nx(a): b\r\n\r\n".to_vec(),
            400,
            "MALFORMED_HEADER",
        ),
    ];
    for (what, bad, status, reason) in cases {
        for after_good in [false, true] {
            let context = format!("{what}{}", if after_good { " after a good request" } else { "" });
            let mut stream = tokio::net::TcpStream::connect(&addr).await?;
            if after_good {
                stream.write_all(b"GET /health HTTP/1.1\r\nhost: h\r\n\r\n").await?;
                let (good, _) = read_response(&mut stream).await.context(context.clone())?;
                ensure!(good == 200, "{context}: the good request answered {good}");
            }
            let (mut reader, mut writer) = stream.into_split();
            // The server may answer before reading all of it: send while reading.
            let bad = bad.clone();
            let sending = tokio::spawn(async move {
                let _ = writer.write_all(&bad).await;
                let _ = writer.shutdown().await;
                writer
            });
            let (got, body) = read_response(&mut reader).await.context(context.clone())?;
            let doc: Value = serde_json::from_slice(&body)
                .with_context(|| format!("{context}: {got} {}", short(String::from_utf8_lossy(&body))))?;
            ensure!(
                got == status && doc["error"]["code"] == reason && doc["error"]["requestId"].is_string(),
                "{context}: {got} {}",
                short(&doc)
            );
            let mut rest = Vec::new();
            tokio::time::timeout(ANSWER_TIMEOUT, reader.read_to_end(&mut rest))
                .await
                .with_context(|| format!("{context}: the connection stayed open"))??;
            ensure!(
                rest.is_empty(),
                "{context}: more followed: {}",
                short(String::from_utf8_lossy(&rest))
            );
            drop(sending.await?);
        }
    }
    // A request asking to upgrade that is not upgraded ends its connection
    // with the answer: what follows it would reach the HTTP layer unchecked
    // (it could have been the upgraded protocol's). Before, the malformed
    // head after it got hyper's empty 400.
    let mut stream = tokio::net::TcpStream::connect(&addr).await?;
    stream
        .write_all(b"GET /health HTTP/1.1\r\nhost: h\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n")
        .await?;
    let (answered, _) = read_response(&mut stream).await.context("the upgrade request")?;
    ensure!(answered == 200, "/health does not upgrade: {answered}");
    // Sent after the answer, as a client that took it for a refusal would.
    let _ = stream
        .write_all(b"GET /health HTTP/1.1 extra\r\nx-a: a\0b\r\n\r\n")
        .await;
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(ANSWER_TIMEOUT, stream.read_to_end(&mut rest))
        .await
        .context("the connection stayed open after an upgrade request that was not upgraded")?;
    // Bytes the server closed without reading may make its end reset it.
    if let Err(err) = ended {
        ensure!(err.kind() == std::io::ErrorKind::ConnectionReset, "{err}");
    }
    ensure!(
        rest.is_empty(),
        "a head after a request not upgraded was answered: {}",
        short(String::from_utf8_lossy(&rest))
    );
    Ok(())
}
