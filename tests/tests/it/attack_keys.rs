//! Issue 26, credentials, keys and readiness: what an outside tester found
//! with normal credentials, several tenants and the per-component mesh, each
//! reproduced as they did it.
//!
//! - item 6: a WebSocket that authenticates again as someone else gets
//!   nothing more of the previous identity, and revoking a key ends the
//!   WebSocket and SSE streams opened with it, idle or not;
//! - item 15: the signing keys are sealed at rest, a token living longer
//!   than the auth service makes them is refused, and failed token
//!   exchanges are limited per client (across gateway replicas with Redis);
//! - item 20: a first start never overwrites an existing admin key file;
//! - item 21: a gateway or service whose service key the auth service
//!   refuses says it is not ready (`/ready`, gRPC health `ready`), and why.

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use avm_common::auth::{Claims, Limits, Principal, Role, Scopes};
use avm_tests::accounts::{create_key, create_tenant, create_user};
use avm_tests::cluster::{Cluster, Llm, Mode, Options, TEST_CONFIG_SECRET_KEY, TEST_SERVICE_KEY, http_client};
use avm_tests::mock_llm::{MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use jsonwebtoken::jwk::JwkSet;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tonic_health::pb::health_check_response::ServingStatus;

use crate::both_modes;
use crate::support::{SseStream, call_as, cluster, conversation, grpc_health, poll, serve, stop};

/// How long something promised "within seconds" may take on a loaded two-core
/// machine running both cluster modes.
const WITHIN_SECONDS: Duration = Duration::from_secs(10);

/// Sends a frame the server answers at once, in frame order, with a
/// `system_error` (`subscribe` without a session), and returns every frame
/// that arrived before that answer.
async fn frames_before_marker(client: &mut WsClient) -> anyhow::Result<Vec<Value>> {
    client.send_json(&json!({"type": "subscribe"})).await?;
    let mut frames = Vec::new();
    loop {
        let frame = client.next_frame().await?;
        if frame["type"] == "system_error" && frame["data"]["code"] == "MISSING_FIELD" {
            return Ok(frames);
        }
        frames.push(frame);
    }
}

/// Returns a cluster whose model streams as slowly as a message asks.
async fn cluster_with_mock(mode: Mode) -> anyhow::Result<(MockLlm, Cluster)> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let options = Options::with_llm(Llm::Anthropic {
        base_url: mock.anthropic_base_url(),
    });
    let cluster = Cluster::start(mode, options).await?;
    Ok((mock, cluster))
}

both_modes!(
    a_reauthenticated_socket_gets_nothing_more_of_the_previous_identity,
    reauthenticated_socket
);

/// Issue 26 item 6: as the tester did it: A subscribes, a turn streams, the
/// socket sends a second `auth` frame as tenant B, then A's key is revoked;
/// no frame of A's turn arrives after the re-authentication, and the socket
/// acts as B. A refreshed credential of the same user keeps its subscriptions.
async fn reauthenticated_socket(mode: Mode) -> anyhow::Result<()> {
    let (_mock, cluster) = cluster_with_mock(mode).await?;
    let a = create_tenant(&cluster, "tenant-a", None).await?;
    let b = create_tenant(&cluster, "tenant-b", None).await?;
    let (_, a_other_key) = create_key(&cluster, &a.admin.key, json!({"name": "second"})).await?;

    let mut socket = WsClient::connect(&cluster.ws_url_as(&a.admin.key)).await?;
    let chat = conversation(&mut socket, "secrets", json!({})).await?;
    socket
        .send_request(
            "message_send",
            json!({"imageId": chat.image_id, "content": "a long answer [mock tokens=200 interval_ms=10]"}),
        )
        .await?;
    let started = socket.frames_until("text_delta").await?;
    ensure!(
        started.iter().any(|f| f["type"] == "message_send_response"),
        "{started:?}"
    );

    socket
        .send_json(&json!({"type": "auth", "headers": {"Authorization": format!("Bearer {}", b.admin.key)}}))
        .await?;
    let in_flight = frames_before_marker(&mut socket).await?;
    let deltas_before = in_flight.iter().filter(|f| f["type"] == "text_delta").count() + 1;
    let revoked = http_client(&a_other_key)?
        .delete(cluster.url(&format!("/v1/auth/keys/{}", a.admin.key_id)))
        .send()
        .await?;
    ensure!(revoked.status().as_u16() == 200, "revoke: {}", revoked.text().await?);

    // A's turn runs to its end on the server, which A's other key can see...
    let history = format!("/v1/images/{}/messages", chat.image_id);
    let reply: String = poll(Duration::from_secs(60), "A's turn to end", || async {
        let (_, body) = call_as(&cluster, &a_other_key, "GET", &history, None).await?;
        let messages = body["messages"].as_array().cloned().unwrap_or_default();
        Ok(messages
            .iter()
            .find(|m| m["role"] == "assistant")
            .and_then(|m| m["content"][0]["text"].as_str())
            .map(str::to_owned))
    })
    .await?;
    ensure!(
        deltas_before < 200,
        "the turn had streamed all {deltas_before} deltas before the re-authentication: nothing was tested"
    );
    // ...and none of it reached the socket after the `auth` frame.
    let after = frames_before_marker(&mut socket).await?;
    ensure!(
        after.is_empty(),
        "{} frames of A's turn ({} chars stored) arrived after the socket became B: {:?}",
        after.len(),
        reply.len(),
        after.iter().take(3).collect::<Vec<_>>()
    );
    // The socket is B's now: B's (empty) view, not A's container.
    let listed = socket.request("container_list", json!({})).await?;
    ensure!(listed["containerIds"] == json!([]), "as B: {listed}");

    // A refreshed credential of the same user keeps the subscriptions.
    let mut refreshed = WsClient::connect(&cluster.ws_url_as(&a_other_key)).await?;
    refreshed.subscribe(&chat.session_id, None).await?;
    let token = cluster.access_token(&a_other_key).await?;
    refreshed
        .send_json(&json!({"type": "auth", "headers": {"Authorization": format!("Bearer {token}")}}))
        .await?;
    frames_before_marker(&mut refreshed).await?;
    let streamed = http_client(&a_other_key)?
        .post(cluster.url(&history))
        .json(&json!({"content": "short [mock tokens=3]"}))
        .send()
        .await?;
    ensure!(streamed.status().as_u16() == 200, "send: {}", streamed.status());
    let frames = refreshed.frames_until("conversation_end").await?;
    ensure!(
        frames.iter().any(|f| f["type"] == "text_delta") && !frames.iter().any(|f| f["type"] == "system_error"),
        "the refreshed socket still follows its session: {frames:?}"
    );
    Ok(())
}

both_modes!(revoking_a_key_ends_its_open_streams_within_seconds, revoked_streams);

/// Returns whether the socket was closed with 1008 and `code` in its JSON
/// reason, reading what was still on its way; fails after `limit`.
async fn closed_with(socket: &mut WsClient, code: &str, limit: Duration) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let outcome = tokio::time::timeout(limit, async {
        loop {
            if socket.next_frame().await.is_err() {
                return;
            }
        }
    })
    .await;
    ensure!(outcome.is_ok(), "still open {limit:?} after the revocation");
    let (close, reason) = socket.closed.clone().context("ended without a close frame")?;
    ensure!(close == 1008, "closed with {close} {reason}");
    let reason: Value = serde_json::from_str(&reason).with_context(|| format!("a JSON reason: {reason}"))?;
    ensure!(reason["code"] == code, "closed for {reason}");
    Ok(start.elapsed())
}

/// Issue 26 item 6: revoking a key ends, within seconds, the subscriptions of
/// every connection authenticated with it, idle or streaming: the WebSocket
/// closes with 1008 and a JSON reason, the SSE stream ends with a typed
/// `system_error`; deleting a user ends theirs the same way.
async fn revoked_streams(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let tenant = create_tenant(&cluster, "revoked-streams", None).await?;
    let (key_id, key) = create_key(&cluster, &tenant.admin.key, json!({"name": "laptop"})).await?;
    let member = create_user(&cluster, &tenant, "leaver", "member").await?;

    let mut socket = WsClient::connect(&cluster.ws_url_as(&key)).await?;
    let chat = conversation(&mut socket, "watched", json!({})).await?;
    let events = http_client(&key)?
        .get(cluster.url(&format!("/v1/images/{}/events", chat.image_id)))
        .send()
        .await?;
    ensure!(events.status().as_u16() == 200, "events: {}", events.status());
    let mut events = SseStream::new(events);
    let mut leaver = WsClient::connect(&cluster.ws_url_as(&member.key)).await?;
    conversation(&mut leaver, "mine", json!({})).await?;
    // An unrelated key's revocation ends nothing.
    let (other_id, _) = create_key(&cluster, &tenant.admin.key, json!({"name": "other"})).await?;
    let (status, _) = call_as(
        &cluster,
        &tenant.admin.key,
        "DELETE",
        &format!("/v1/auth/keys/{other_id}"),
        None,
    )
    .await?;
    ensure!(status == 200);
    let listed = socket.request("container_list", json!({})).await?;
    ensure!(listed["containerIds"].is_array(), "still open: {listed}");

    let (status, _) = call_as(
        &cluster,
        &tenant.admin.key,
        "DELETE",
        &format!("/v1/auth/keys/{key_id}"),
        None,
    )
    .await?;
    ensure!(status == 200);
    let took = closed_with(&mut socket, "CREDENTIAL_REVOKED", WITHIN_SECONDS).await?;
    eprintln!("an idle socket of a revoked key closed after {took:?}");
    let (_, kind, data) = tokio::time::timeout(WITHIN_SECONDS, events.next_event())
        .await
        .context("the SSE stream of a revoked key is still open")??;
    ensure!(
        kind == "system_error" && data["data"]["code"] == "CREDENTIAL_REVOKED",
        "{kind}: {data}"
    );
    ensure!(
        events.next_event().await.is_err(),
        "the SSE stream ends after its error"
    );

    let (status, _) = call_as(
        &cluster,
        &tenant.admin.key,
        "DELETE",
        &format!("/v1/tenants/{}/users/{}", tenant.tenant_id, member.user_id),
        None,
    )
    .await?;
    ensure!(status == 200);
    closed_with(&mut leaver, "CREDENTIAL_REVOKED", WITHIN_SECONDS).await?;
    Ok(())
}

both_modes!(signing_keys_are_sealed_at_rest, sealed_signing_keys);

/// Issue 26 item 15: the Ed25519 key that signs access tokens is not in the
/// auth database in a form that signs: what a reader of the database gets
/// is no PKCS#8 key matching the published one.
async fn sealed_signing_keys(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let stored = cluster.stored_signing_key().await?;
    let jwks: JwkSet = http_client(&cluster.admin_key)?
        .get(cluster.url("/v1/auth/jwks.json"))
        .send()
        .await?
        .json()
        .await?;
    let published = jwks
        .keys
        .iter()
        .find(|jwk| jwk.common.key_id.as_deref() == Some(stored.kid.as_str()))
        .context("the current key is published")?;
    ensure!(
        stored.private_key.first() != Some(&0x30),
        "{} is stored as plain PKCS#8",
        stored.kid
    );
    if let Ok(read) = avm_common::auth::SigningKey::from_pkcs8(stored.kid.clone(), stored.private_key.clone()) {
        ensure!(
            read.public_jwk() != published,
            "the database holds the signing key in the clear"
        );
    }
    Ok(())
}

both_modes!(a_token_beyond_the_maximum_lifetime_is_refused, long_lived_tokens);

/// Issue 26 item 15: a token signed with the real key (as someone who got it
/// would) but living 10 years, or without `iat`, or claiming `op` for a
/// member, is refused at REST and at the WebSocket handshake; the same claims
/// within the rules pass.
async fn long_lived_tokens(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let tenant = create_tenant(&cluster, "long-lived", None).await?;
    let member = create_user(&cluster, &tenant, "member", "member").await?;
    let key = cluster.signing_key().await?;
    let now = u64::try_from(avm_common::now_ms() / 1000)?;
    let admin = Principal {
        tenant_id: tenant.tenant_id.clone(),
        user_id: tenant.admin.user_id.clone(),
        role: Role::Admin,
        operator: false,
        key_id: Some(tenant.admin.key_id.clone()),
        scopes: Scopes::ALL,
        tenant_limits: Limits::default(),
        key_limits: Limits::default(),
    };
    let member = Principal {
        user_id: member.user_id.clone(),
        role: Role::Member,
        key_id: Some(member.key_id.clone()),
        scopes: Scopes::READ.union(Scopes::WRITE),
        ..admin.clone()
    };
    let sign = |principal: &Principal, changes: Value| -> anyhow::Result<String> {
        let mut claims = serde_json::to_value(Claims::new(principal, "agentvm", now, Duration::from_secs(600)))?;
        if let (Some(claims), Some(changes)) = (claims.as_object_mut(), changes.as_object()) {
            for (name, value) in changes {
                if value.is_null() {
                    claims.remove(name);
                } else {
                    claims.insert(name.clone(), value.clone());
                }
            }
        }
        let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::EdDSA);
        header.kid = Some(key.kid().to_owned());
        let encoding = jsonwebtoken::EncodingKey::from_ed_der(key.pkcs8_der());
        Ok(jsonwebtoken::encode(&header, &claims, &encoding)?)
    };
    let status = |token: String| {
        let cluster = &cluster;
        async move {
            let response = http_client(&token)?.get(cluster.url("/v1/auth/whoami")).send().await?;
            let status = response.status().as_u16();
            let body: Value = response.json().await?;
            let handshake = WsClient::connect(&cluster.ws_url_as(&token)).await;
            anyhow::Ok((status, body["error"]["code"].clone(), handshake.is_ok()))
        }
    };
    let ten_years = 10 * 365 * 24 * 3600;
    let accepted = status(sign(&admin, json!({}))?).await?;
    ensure!(accepted == (200, Value::Null, true), "the honest token: {accepted:?}");
    let forged = [
        ("a 10-year exp", sign(&admin, json!({"exp": now + ten_years}))?),
        (
            "a 10-year exp with op",
            sign(&admin, json!({"exp": now + ten_years, "op": true}))?,
        ),
        ("no iat", sign(&admin, json!({"iat": null}))?),
        ("op for a member", sign(&member, json!({"op": true}))?),
    ];
    let mut accepted = Vec::new();
    for (what, token) in forged {
        let seen = status(token).await?;
        if seen != (401, json!("INVALID_TOKEN"), false) {
            accepted.push(format!("{what}: {seen:?}"));
        }
    }
    ensure!(accepted.is_empty(), "forged tokens not refused: {accepted:?}");
    Ok(())
}

both_modes!(failed_token_exchanges_are_rate_limited_per_client, failed_exchanges);

/// Issue 26 item 15: 300 `POST /v1/auth/token` with a wrong key from one
/// client: a small burst of 401s, then 429 with `Retry-After`, even for a
/// right key (a guess cannot tell); another client is not held back; with
/// Redis, another gateway replica refuses the same client too.
async fn failed_exchanges(mode: Mode) -> anyhow::Result<()> {
    let mut cluster = cluster(mode).await?;
    let tenant = create_tenant(&cluster, "guessed", None).await?;
    let wrong = format!("{}x", &tenant.admin.key[..tenant.admin.key.len() - 1]);
    let http = reqwest::Client::new();
    let token = |base: String, key: String| {
        let http = http.clone();
        async move {
            let response = http
                .post(format!("{base}/v1/auth/token"))
                .json(&json!({"apiKey": key}))
                .send()
                .await?;
            let status = response.status().as_u16();
            let retry_after = response
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            let body: Value = response.json().await?;
            anyhow::Ok((status, retry_after, body["error"]["code"].as_str().map(str::to_owned)))
        }
    };
    let mut statuses = Vec::new();
    for _ in 0..300 {
        statuses.push(token(cluster.gateway_url.clone(), wrong.clone()).await?);
    }
    let unauthorized = statuses.iter().filter(|(status, _, _)| *status == 401).count();
    let limited: Vec<_> = statuses.iter().filter(|(status, _, _)| *status == 429).collect();
    ensure!(
        unauthorized + limited.len() == 300,
        "only 401 and 429: {:?}",
        statuses.iter().find(|(status, _, _)| *status != 401 && *status != 429)
    );
    ensure!(
        (1..=20).contains(&unauthorized),
        "a small burst of 401s, then 429: {unauthorized} × 401"
    );
    ensure!(
        limited
            .iter()
            .all(|(_, retry, code)| retry.is_some_and(|s| s >= 1) && code.as_deref() == Some("RATE_LIMITED")),
        "429 with Retry-After and RATE_LIMITED: {:?}",
        limited.first()
    );
    let right = token(cluster.gateway_url.clone(), tenant.admin.key.clone()).await?;
    ensure!(right.0 == 429, "a right key from the same client waits too: {right:?}");

    // Another client (another loopback address) exchanges at once.
    let elsewhere = reqwest::Client::builder()
        .local_address(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)))
        .build()?;
    let response = elsewhere
        .post(cluster.url("/v1/auth/token"))
        .json(&json!({"apiKey": tenant.admin.key}))
        .send()
        .await?;
    ensure!(
        response.status().as_u16() == 200,
        "another client: {}",
        response.status()
    );

    // Replicas share the count through Redis.
    if mode == Mode::PerComponent && std::env::var("AVM_TEST_REDIS_URL").is_ok_and(|url| !url.is_empty()) {
        let replica = cluster.spawn_replica("gateway", &[]).await?;
        let seen = token(replica, tenant.admin.key.clone()).await?;
        ensure!(seen.0 == 429, "another gateway replica: {seen:?}");
    }
    Ok(())
}

/// A service key no auth service of the tests accepts.
const WRONG_SERVICE_KEY: &str = "wrong-service-key-0123456789abcdef0123456789ab";

/// Returns the status and body of a gateway's `/ready`.
async fn readiness(gateway: &str) -> anyhow::Result<(u16, Value)> {
    let response = reqwest::get(format!("{gateway}/ready")).await?;
    let status = response.status().as_u16();
    Ok((status, response.json().await?))
}

/// Issue 26 item 21: a gateway whose service key the auth service refuses
/// (so its revocation stream is down and revoked keys would keep working
/// there) answers `/ready` with 503 naming `auth.credentials` and
/// `auth.events`, and a service's gRPC health name `ready` is NOT_SERVING;
/// once the auth service accepts their key, they are ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mis_keyed_gateway_is_not_ready() -> anyhow::Result<()> {
    let mut cluster = Cluster::start(Mode::PerComponent, Options::default()).await?;
    let mis_keyed = cluster
        .spawn_replica("gateway", &[("AVM_AUTH_SERVICE_KEY", WRONG_SERVICE_KEY)])
        .await?;
    let failing = |body: &Value| -> Vec<String> {
        body["failing"]
            .as_array()
            .map(|names| names.iter().filter_map(|n| n.as_str().map(str::to_owned)).collect())
            .unwrap_or_default()
    };
    let body = poll(
        WITHIN_SECONDS,
        "the mis-keyed gateway to say it is not ready",
        || async {
            let (status, body) = readiness(&mis_keyed).await?;
            Ok((status == 503).then_some(body))
        },
    )
    .await?;
    let names = failing(&body);
    ensure!(
        names.contains(&"auth.credentials".to_owned()) && names.contains(&"auth.events".to_owned()),
        "{body}"
    );
    let codes: Vec<&str> = body["problems"]
        .as_array()
        .map(|problems| problems.iter().filter_map(|p| p["code"].as_str()).collect())
        .unwrap_or_default();
    ensure!(codes.contains(&"SERVICE_KEY_REFUSED"), "{body}");
    ensure!(
        !body.to_string().contains(WRONG_SERVICE_KEY) && !body.to_string().contains(TEST_SERVICE_KEY),
        "no key in the answer"
    );
    ensure!(
        readiness(&cluster.gateway_url).await?.0 == 200,
        "the well-keyed gateway is ready"
    );

    // A service behind it alike: its gRPC health name `ready` (what the
    // chart's readiness probe asks) is NOT_SERVING, while the process lives.
    let mis_keyed_session = cluster
        .spawn_replica("session", &[("AVM_AUTH_SERVICE_KEY", WRONG_SERVICE_KEY)])
        .await?;
    poll(
        WITHIN_SECONDS,
        "the mis-keyed session service to say it is not ready",
        || async { Ok((grpc_health(&mis_keyed_session, "ready").await? == ServingStatus::NotServing).then_some(())) },
    )
    .await?;
    ensure!(
        grpc_health(&mis_keyed_session, "").await? == ServingStatus::Serving,
        "a mis-keyed service still lives (liveness asks the empty name)"
    );
    poll(WITHIN_SECONDS, "the well-keyed session service to be ready", || async {
        Ok((grpc_health(&cluster.session_grpc, "ready").await? == ServingStatus::Serving).then_some(()))
    })
    .await?;

    // The auth service now takes the other key: readiness follows.
    cluster.kill_component("auth").await?;
    cluster
        .restart_component_with("auth", &[("AVM_AUTH_SERVICE_KEY", WRONG_SERVICE_KEY)])
        .await?;
    poll(
        Duration::from_secs(20),
        "the gateway to be ready once its key works",
        || async { Ok((readiness(&mis_keyed).await?.0 == 200).then_some(())) },
    )
    .await?;
    poll(
        Duration::from_secs(20),
        "the session service to be ready once its key works",
        || async { Ok((grpc_health(&mis_keyed_session, "ready").await? == ServingStatus::Serving).then_some(())) },
    )
    .await?;
    Ok(())
}

/// Issue 26 item 20: following "Run it", then "One component per process"
/// with the same HOME (an `avm auth` on an empty database), or starting `avm
/// auth` without `AVM_DATABASE_URL` where only `admin.key` is left: the new
/// database gets its own operator tenant, its key is saved beside the
/// existing `admin.key` (never over it), and the output says where.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_admin_key_is_never_overwritten() -> anyhow::Result<()> {
    let parent = tempfile::tempdir()?;
    let home = parent.path().join(".agentvm");
    let (child, _, _) = serve(&home, &[], &[]).await?;
    stop(child).await?;
    let admin_file = home.join(avm::ADMIN_KEY_FILE);
    let first = std::fs::read_to_string(&admin_file)?;

    // "One component per process": an empty database, the same data dir.
    let elsewhere = parent.path().join("mesh");
    std::fs::create_dir_all(&elsewhere)?;
    let (database, _schema) = empty_auth_database(&elsewhere)?;
    let printed = start_auth(&home, Some(&database)).await?;
    let written = check_written_beside(&home, &printed)?;
    ensure!(
        std::fs::read_to_string(&admin_file)? == first,
        "admin.key was overwritten"
    );

    // Without AVM_DATABASE_URL, in a data dir where only admin.key is left.
    let left = parent.path().join("left");
    std::fs::create_dir_all(&left)?;
    #[cfg(unix)]
    std::fs::set_permissions(&left, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    std::fs::copy(&admin_file, left.join(avm::ADMIN_KEY_FILE))?;
    let printed = start_auth(&left, None).await?;
    let again = check_written_beside(&left, &printed)?;
    ensure!(again != written, "two databases, two operators");
    ensure!(
        std::fs::read_to_string(left.join(avm::ADMIN_KEY_FILE))? == first,
        "admin.key was overwritten"
    );
    Ok(())
}

/// Drops a Postgres schema when the test ends.
struct SchemaGuard(Option<(String, String)>);

impl Drop for SchemaGuard {
    fn drop(&mut self) {
        if let Some((url, schema)) = self.0.take() {
            avm_store::testing::drop_schemas(&url, &[schema]);
        }
    }
}

/// Returns an empty database for an auth service: a fresh schema of the test
/// Postgres when there is one, else a SQLite file in `dir`.
fn empty_auth_database(dir: &std::path::Path) -> anyhow::Result<(String, SchemaGuard)> {
    match std::env::var("AVM_TEST_DATABASE_URL")
        .ok()
        .filter(|url| !url.is_empty())
    {
        Some(url) => {
            let base = avm_common::ids::new_id("avm_e2e");
            let separator = if url.contains('?') { '&' } else { '?' };
            let database = format!("{url}{separator}options=-c%20search_path%3D{base}");
            Ok((database, SchemaGuard(Some((url, format!("{base}_auth"))))))
        }
        None => Ok((format!("sqlite://{}", dir.join("auth.db").display()), SchemaGuard(None))),
    }
}

/// Starts `avm auth` on `data_dir` (and `database`, else the data dir's
/// SQLite), returns what it printed up to listening, and stops it.
async fn start_auth(data_dir: &std::path::Path, database: Option<&str>) -> anyhow::Result<Vec<String>> {
    let mut command = avm_tests::cluster::avm_command()?;
    command
        .args(["auth", "--listen", "127.0.0.1:0"])
        .env("AVM_SERVER_DATA_DIR", data_dir)
        .env("AVM_AUTH_SERVICE_KEY", TEST_SERVICE_KEY)
        .env("AVM_CONFIG_SECRET_KEY", TEST_CONFIG_SECRET_KEY)
        .env("AVM_LOG_LEVEL", "error")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    if let Some(database) = database {
        command.env("AVM_DATABASE_URL", database);
    }
    let mut child = command.spawn()?;
    let mut lines = BufReader::new(child.stdout.take().context("no stdout")?).lines();
    let mut printed = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(line) = lines.next_line().await? {
            let done = line.starts_with("listening: ");
            printed.push(line);
            if done {
                return Ok(());
            }
        }
        bail!("avm auth exited before listening: {printed:?}")
    })
    .await
    .context("avm auth did not start")??;
    stop(child).await?;
    Ok(printed)
}

/// Checks that a new operator's key went to `admin-<tenantId>.key` beside
/// `admin.key`, readable only by the user, and that the output says so;
/// returns the key.
fn check_written_beside(data_dir: &std::path::Path, printed: &[String]) -> anyhow::Result<String> {
    let tenant = printed
        .iter()
        .find_map(|line| line.strip_prefix("created the operator tenant "))
        .and_then(|rest| rest.split_whitespace().next())
        .with_context(|| format!("a new operator tenant: {printed:?}"))?;
    let beside = data_dir.join(format!("admin-{tenant}.key"));
    let key = std::fs::read_to_string(&beside)
        .with_context(|| format!("no {}: {printed:?}", beside.display()))?
        .trim()
        .to_owned();
    ensure!(printed.iter().any(|line| line.trim() == key), "the key is shown once");
    ensure!(
        printed.iter().any(|line| line.contains(&beside.display().to_string())),
        "the output names {}: {printed:?}",
        beside.display()
    );
    ensure!(
        printed.iter().any(|line| line.contains("was left as it is")),
        "the output says admin.key was kept: {printed:?}"
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&beside)?.permissions().mode() & 0o777;
        ensure!(mode == 0o600, "readable only by the user: {mode:o}");
    }
    Ok(key)
}
