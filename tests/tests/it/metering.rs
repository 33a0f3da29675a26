//! Usage metering as the business relies on it: every LLM call in the ledger
//! exactly once with the provider's own counts — completed, interrupted,
//! failed, or with its client gone — billed at cost times the markup;
//! budgets that stop further calls; usage and logs kept per tenant.

use std::time::Duration;

use anyhow::{Context, ensure};
use avm_common::money::parse_usd;
use avm_tests::accounts::create_tenant;
use avm_tests::cluster::{Cluster, Llm, Mode, Options};
use avm_tests::mock_llm::{MockBehavior, MockFailure, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{assert_text_turn, call, call_as, conversation, send_and_finish};

/// How long the ledger may take to show a call: the runtime's batch, then
/// the ledger's write, both a fraction of a second.
const LEDGER_DEADLINE: Duration = Duration::from_secs(15);

/// Input tokens the mock reports for every request.
const INPUT: u64 = 40;
/// Deltas (and so output tokens) of a complete mock reply.
const OUTPUT: u64 = 6;

/// Pico-dollars per token of claude-sonnet-4 in the built-in price table.
const INPUT_PRICE: i64 = 3_000_000;
const OUTPUT_PRICE: i64 = 15_000_000;

fn behavior() -> MockBehavior {
    MockBehavior {
        tokens: OUTPUT as usize,
        input_tokens: Some(INPUT),
        ..MockBehavior::default()
    }
}

async fn anthropic_cluster(mode: Mode, mock: &MockLlm) -> anyhow::Result<Cluster> {
    let llm = Llm::Anthropic {
        base_url: mock.anthropic_base_url(),
    };
    Cluster::start(mode, Options::with_llm(llm)).await
}

/// Polls `GET path` with `key` until `done` holds of the body, within the deadline.
async fn eventually(cluster: &Cluster, key: &str, path: &str, done: impl Fn(&Value) -> bool) -> anyhow::Result<Value> {
    let deadline = tokio::time::Instant::now() + LEDGER_DEADLINE;
    loop {
        let (status, body) = call_as(cluster, key, "GET", path, None).await?;
        ensure!(status == 200, "GET {path}: {status} {body}");
        if done(&body) {
            return Ok(body);
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "GET {path} never got there: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Returns the group of a usage answer whose `field` is `value`.
fn group<'a>(usage: &'a Value, field: &str, value: &str) -> anyhow::Result<&'a Value> {
    usage["groups"]
        .as_array()
        .and_then(|groups| groups.iter().find(|g| g[field] == value))
        .with_context(|| format!("no {field}={value} group in {usage}"))
}

fn pico(amount: &Value) -> anyhow::Result<i64> {
    amount
        .as_str()
        .and_then(parse_usd)
        .with_context(|| format!("not an amount: {amount}"))
}

both_modes!(every_call_is_metered_exactly_once, metered);

async fn metered(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(behavior()).await?;
    let cluster = anthropic_cluster(mode, &mock).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;

    // Three completed turns.
    for n in 0..3 {
        assert_text_turn(&send_and_finish(&mut client, &chat.image_id, json!(format!("question {n}"))).await?);
    }
    // One interrupted after its first delta: the provider never sent its
    // final count, so the output is estimated (and says so).
    mock.set_behavior(MockBehavior {
        tokens: 200,
        token_interval: Duration::from_millis(50),
        ..behavior()
    });
    client
        .send_request("message_send", json!({"imageId": chat.image_id, "content": "long one"}))
        .await?;
    client.frames_until("text_delta").await?;
    client
        .request("agent_interrupt", json!({"imageId": chat.image_id}))
        .await?;
    client.frames_until("conversation_end").await?;
    // One failed: the stream breaks after two deltas.
    mock.set_behavior(MockBehavior {
        failure: Some(MockFailure::DropAfter(2)),
        ..behavior()
    });
    client
        .send_request("message_send", json!({"imageId": chat.image_id, "content": "breaks"}))
        .await?;
    client.frames_until("error_occurred").await?;
    // One whose client leaves mid-stream: the turn goes on and is counted.
    mock.set_behavior(MockBehavior {
        token_interval: Duration::from_millis(20),
        ..behavior()
    });
    let mut leaving = WsClient::connect(&cluster.ws_url()).await?;
    leaving.subscribe(&chat.session_id, None).await?;
    leaving
        .send_request("message_send", json!({"imageId": chat.image_id, "content": "bye"}))
        .await?;
    leaving.frames_until("text_delta").await?;
    drop(leaving);

    let usage = eventually(&cluster, &cluster.admin_key, "/v1/usage?groupBy=status", |usage| {
        usage["totals"]["calls"] == 6
    })
    .await?;
    let completed = group(&usage, "status", "completed")?;
    assert_eq!(completed["calls"], 4, "{usage}");
    assert_eq!(completed["inputTokens"], 4 * INPUT, "the provider's own counts");
    assert_eq!(completed["outputTokens"], 4 * OUTPUT);
    assert_eq!(completed["estimatedCalls"], 0);
    let interrupted = group(&usage, "status", "interrupted")?;
    assert_eq!(
        (interrupted["calls"].clone(), interrupted["inputTokens"].clone()),
        (json!(1), json!(INPUT))
    );
    assert_eq!(
        interrupted["estimatedCalls"], 1,
        "an unreported output is estimated, flagged"
    );
    let failed = group(&usage, "status", "failed")?;
    assert_eq!(
        (failed["calls"].clone(), failed["inputTokens"].clone()),
        (json!(1), json!(INPUT))
    );
    assert_eq!(failed["estimatedCalls"], 1);

    // Billed is cost times 1.05, to the pico-dollar; cost is the list price.
    let by_model = eventually(&cluster, &cluster.admin_key, "/v1/usage?groupBy=model", |u| {
        u["totals"]["calls"] == 6
    })
    .await?;
    let model = group(&by_model, "model", "claude-sonnet-4-20250514")?;
    let (input, output) = (model["inputTokens"].as_i64(), model["outputTokens"].as_i64());
    let (input, output) = (input.context("input")?, output.context("output")?);
    let cost = pico(&model["costUsd"])?;
    assert_eq!(cost, input * INPUT_PRICE + output * OUTPUT_PRICE, "{model}");
    assert_eq!(pico(&model["billedUsd"])? * 100, cost * 105, "{model}");
    let requests = mock.requests().len();
    assert_eq!(requests, 6, "one record per provider call");

    // Each record once, whoever retried: the records add up to the totals.
    let records = eventually(&cluster, &cluster.admin_key, "/v1/usage/records?pageSize=100", |r| {
        r["records"].as_array().is_some_and(|records| records.len() == 6)
    })
    .await?;
    let ids: std::collections::HashSet<&str> = records["records"]
        .as_array()
        .map(|records| records.iter().filter_map(|r| r["callId"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(ids.len(), 6, "six distinct calls");
    let summary = eventually(&cluster, &cluster.admin_key, "/v1/metrics", |s| s["requests"] == 6).await?;
    assert_eq!(
        (summary["completed"].clone(), summary["failed"].clone()),
        (json!(4), json!(1))
    );
    assert!(summary["firstTokenLatency"]["p50Ms"].is_i64(), "{summary}");
    assert_eq!(summary["activeAgents"], 1, "{summary}");
    Ok(())
}

both_modes!(a_budget_stops_further_llm_calls, budget);

async fn budget(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(behavior()).await?;
    let cluster = anthropic_cluster(mode, &mock).await?;
    let tenant = create_tenant(&cluster, "frugal", None).await?;
    // A cap far below one call: the first call is allowed (nothing is spent
    // yet), and spends it.
    let (status, set) = call_as(
        &cluster,
        &tenant.admin.key,
        "PUT",
        "/v1/usage/budgets",
        Some(json!({"monthlyLimitUsd": "0.000001"})),
    )
    .await?;
    assert_eq!(status, 200, "{set}");
    assert_eq!(
        (set["monthlyLimitUsd"].clone(), set["exhausted"].clone()),
        (json!("0.000001"), json!(false))
    );
    let mut client = WsClient::connect(&cluster.ws_url_as(&tenant.admin.key)).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    assert_text_turn(&send_and_finish(&mut client, &chat.image_id, json!("first")).await?);
    assert_eq!(mock.requests().len(), 1);

    // The next one is refused before any LLM call, with a typed error event.
    let frames = send_and_finish(&mut client, &chat.image_id, json!("second")).await?;
    let occurred = frames
        .iter()
        .find(|frame| frame["type"] == "error_occurred")
        .with_context(|| format!("no error_occurred in {frames:?}"))?;
    assert_eq!(occurred["data"]["code"], "BUDGET_EXCEEDED", "{occurred}");
    assert_eq!(occurred["data"]["recoverable"], false);
    assert_eq!(mock.requests().len(), 1, "no further LLM call was made");
    let (_, budgets) = call_as(&cluster, &tenant.admin.key, "GET", "/v1/usage/budgets", None).await?;
    assert_eq!(budgets["budgets"][0]["exhausted"], true, "{budgets}");

    // Raising it lets the tenant talk again; other tenants never noticed.
    call_as(
        &cluster,
        &tenant.admin.key,
        "PUT",
        "/v1/usage/budgets",
        Some(json!({"monthlyLimitUsd": "100"})),
    )
    .await?;
    assert_text_turn(&send_and_finish(&mut client, &chat.image_id, json!("third")).await?);
    let mut operator = WsClient::connect(&cluster.ws_url()).await?;
    let other = conversation(&mut operator, "default", json!({})).await?;
    assert_text_turn(&send_and_finish(&mut operator, &other.image_id, json!("hi")).await?);
    assert_eq!(mock.requests().len(), 3);
    Ok(())
}

both_modes!(usage_and_logs_stay_with_their_tenant, tenant_scoping);

async fn tenant_scoping(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(behavior()).await?;
    // Tenant logs leave through the process's log subscriber, which is
    // global: a one-process cluster runs as its own `avm serve` here.
    let options = Options {
        serve_process: true,
        ..Options::with_llm(Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        })
    };
    let cluster = Cluster::start(mode, options).await?;
    let acme = create_tenant(&cluster, "acme", None).await?;
    let globex = create_tenant(&cluster, "globex", None).await?;
    let mut client = WsClient::connect(&cluster.ws_url_as(&acme.admin.key)).await?;
    let chat = conversation(&mut client, "secret-project", json!({})).await?;
    assert_text_turn(&send_and_finish(&mut client, &chat.image_id, json!("hello")).await?);

    let acme_usage = eventually(&cluster, &acme.admin.key, "/v1/usage", |u| u["totals"]["calls"] == 1).await?;
    assert_eq!(acme_usage["totals"]["inputTokens"], INPUT);
    // Acme's turn logged under acme: the runtime's "turn completed", say.
    let acme_logs = eventually(&cluster, &acme.admin.key, "/v1/logs", |logs| {
        logs["events"]
            .as_array()
            .is_some_and(|events| events.iter().any(|e| e["message"] == "turn completed"))
    })
    .await?;
    assert!(acme_logs.to_string().contains(&chat.image_id), "{acme_logs}");

    for path in [
        "/v1/usage",
        "/v1/usage/records",
        "/v1/logs",
        "/v1/metrics",
        "/v1/usage/budgets",
    ] {
        let (status, body) = call_as(&cluster, &globex.admin.key, "GET", path, None).await?;
        assert_eq!(status, 200, "{path}: {body}");
        let text = body.to_string();
        for secret in [
            chat.image_id.as_str(),
            chat.session_id.as_str(),
            acme.tenant_id.as_str(),
            "secret-project",
        ] {
            assert!(!text.contains(secret), "{path} shows acme's {secret}: {text}");
        }
    }
    let (_, globex_usage) = call_as(&cluster, &globex.admin.key, "GET", "/v1/usage", None).await?;
    assert_eq!(globex_usage["totals"]["calls"], 0);
    let foreign = format!("/v1/usage?tenantId={}", acme.tenant_id);
    let (status, refused) = call_as(&cluster, &globex.admin.key, "GET", &foreign, None).await?;
    assert_eq!(
        (status, refused["error"]["code"].clone()),
        (403, json!("OPERATOR_REQUIRED"))
    );
    // Operators see any tenant's.
    let (status, seen) = call(&cluster, "GET", &foreign, None).await?;
    assert_eq!((status, seen["totals"]["calls"].clone()), (200, json!(1)));
    Ok(())
}
