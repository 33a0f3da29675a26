//! The end-to-end conversation with the session service on Postgres.

use avm_tests::cluster::{Cluster, Mode, Options};
use avm_tests::ws_client::WsClient;
use serde_json::json;

use crate::support::{assert_text_turn, conversation, send_and_finish};

/// Returns a database URL bound to a fresh schema, or `None` (loudly) when
/// `AVM_TEST_DATABASE_URL` is unset; with `AVM_TEST_REQUIRE_EXTERNAL=1` that is a failure.
async fn fresh_schema() -> anyhow::Result<Option<String>> {
    let Ok(base) = std::env::var("AVM_TEST_DATABASE_URL") else {
        if std::env::var("AVM_TEST_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1") {
            anyhow::bail!("AVM_TEST_DATABASE_URL is not set but AVM_TEST_REQUIRE_EXTERNAL=1");
        }
        eprintln!("SKIPPED: AVM_TEST_DATABASE_URL not set; the Postgres end-to-end test did not run");
        return Ok(None);
    };
    let schema = format!("avm_e2e_{:x}", rand_suffix());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&base)
        .await?;
    sqlx::query(&format!("CREATE SCHEMA {schema}")).execute(&pool).await?;
    let separator = if base.contains('?') { '&' } else { '?' };
    Ok(Some(format!("{base}{separator}options=-c%20search_path%3D{schema}")))
}

fn rand_suffix() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    (nanos as u64) ^ u64::from(std::process::id()).rotate_left(32)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_on_postgres_survives_a_restart() -> anyhow::Result<()> {
    let Some(url) = fresh_schema().await? else {
        return Ok(());
    };
    let options = Options {
        database_url: Some(url),
        ..Options::default()
    };
    let cluster = Cluster::start(Mode::PerComponent, options).await?;
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
