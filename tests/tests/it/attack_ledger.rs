//! Issue 26, the ledger: what an outside tester found in the bills.
//!
//! - item 23: an offline reply streamed and was recorded under the configured
//!   model (`claude-sonnet-…`), so usage by model mixed it with real calls;
//!   the reply and its ledger record now name the
//!   provider and model that answered, usage groups by provider, and the
//!   configuration shows the provider the caller's turns run with.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use avm_tests::cluster::Mode;
use avm_tests::ws_client::WsClient;
use serde_json::json;

use crate::both_modes;
use crate::support::{call, cluster, conversation, send_and_finish};

/// How long a call may take to reach the ledger on a loaded machine.
const LEDGER_DEADLINE: Duration = Duration::from_secs(20);

both_modes!(
    item_23_the_ledger_names_the_provider_and_model_that_answered,
    answering_model
);

async fn answering_model(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    // The configuration names a real model (`llm.model` has a default), but
    // no provider is configured: the offline provider is what answers.
    let chat = conversation(&mut client, "ledger", json!({})).await?;
    let frames = send_and_finish(&mut client, &chat.image_id, json!("hello")).await?;
    let start = frames
        .iter()
        .find(|frame| frame["type"] == "message_start")
        .context("a message_start")?;
    assert_eq!(
        start["data"]["model"], "offline",
        "the reply names who answered: {start}"
    );

    let path = "/v1/usage?groupBy=provider,model";
    let deadline = Instant::now() + LEDGER_DEADLINE;
    let usage = loop {
        let (status, usage) = call(&cluster, "GET", path, None).await?;
        ensure!(status == 200, "GET {path}: {status} {usage}");
        if usage["totals"]["calls"] == 1 {
            break usage;
        }
        ensure!(Instant::now() < deadline, "the call never reached the ledger: {usage}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let groups = usage["groups"].as_array().context("groups")?;
    assert_eq!(groups.len(), 1, "{usage}");
    assert_eq!(
        (&groups[0]["provider"], &groups[0]["model"]),
        (&json!("offline"), &json!("offline")),
        "{usage}"
    );

    // The configuration shows the provider the caller's turns run with.
    let (status, config) = call(&cluster, "GET", "/v1/config", None).await?;
    ensure!(status == 200, "config: {status} {config}");
    assert_eq!(config["config"]["llm"]["provider"], "offline", "{config}");
    Ok(())
}
