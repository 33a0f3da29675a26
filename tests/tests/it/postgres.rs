//! The end-to-end conversation on Postgres, across a restart. (With the
//! external test services configured, every per-component scenario runs on
//! Postgres and Redis too; this one insists on it.)

use avm_tests::cluster::{Cluster, Mode, Options};
use avm_tests::ws_client::WsClient;
use serde_json::json;

use crate::support::{assert_text_turn, conversation, send_and_finish};

/// Returns whether `AVM_TEST_DATABASE_URL` is set, saying loudly when it is
/// not; with `AVM_TEST_REQUIRE_EXTERNAL=1` a missing database is a failure.
pub(crate) fn postgres_configured() -> anyhow::Result<bool> {
    if std::env::var("AVM_TEST_DATABASE_URL").is_ok_and(|url| !url.is_empty()) {
        return Ok(true);
    }
    if std::env::var("AVM_TEST_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1") {
        anyhow::bail!("AVM_TEST_DATABASE_URL is not set but AVM_TEST_REQUIRE_EXTERNAL=1");
    }
    eprintln!("SKIPPED: AVM_TEST_DATABASE_URL not set; the Postgres end-to-end test did not run");
    Ok(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_on_postgres_survives_a_restart() -> anyhow::Result<()> {
    if !postgres_configured()? {
        return Ok(());
    }
    // A per-component cluster puts every service in its own fresh schemas.
    let cluster = Cluster::start(Mode::PerComponent, Options::default()).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({"name": "pg"})).await?;
    assert_text_turn(&send_and_finish(&mut client, &chat.image_id, json!("stored in postgres")).await?);
    drop(client);
    let cluster = cluster.restart().await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let history = client
        .request("image_messages", json!({"imageId": chat.image_id}))
        .await?;
    let messages = history["messages"].as_array().cloned().unwrap_or_default();
    assert_eq!(messages.len(), 2, "{history}");
    assert_eq!(messages[0]["content"], "stored in postgres");
    Ok(())
}
