//! Workspaces that follow their agent (`[runtime] workspace_store`): what an
//! agent and a client wrote through one runtime is there for the next
//! runtime that runs the image, once the first one stopped.
//!
//! The store is a real S3-compatible server (moto's, started by the test);
//! without one the test says loudly it was skipped (and fails under
//! `AVM_TEST_REQUIRE_EXTERNAL=1`). The one-process cluster runs as a spawned
//! `avm serve`, which takes the store's settings from its environment as an
//! operator's would.

use std::path::Path;

use avm_common::testing::S3Server;
use avm_tests::cluster::{Mode, Options};
use avm_tests::mock_llm::MockApi;
use avm_tests::ws_client::WsClient;
use serde_json::json;

use crate::both_modes;
use crate::support::{call, send_and_finish, streamed_text};
use crate::tools::{open_chat, start_with};

const BUCKET: &str = "agentvm";

both_modes!(a_workspace_follows_its_image_to_the_next_runtime, follows);

async fn follows(mode: Mode) -> anyhow::Result<()> {
    let Some(s3) = S3Server::start().await else {
        return Ok(());
    };
    s3.create_bucket(BUCKET).await;
    let options = Options {
        workspace_store: Some(format!("s3://{BUCKET}/workspaces")),
        env: s3.env(),
        serve_process: true,
        // Short, so the agent is dropped between turns while the test watches.
        agent_idle_timeout: Some(std::time::Duration::from_millis(400)),
        ..Options::default()
    };
    let (_mock, cluster) = start_with(mode, MockApi::Anthropic, options).await?;
    let local = cluster.data_dir().join("workspaces");
    let (mut client, chat) = open_chat(&cluster, json!({"tools": ["write_file", "read_file"]})).await?;
    let file_url = |cluster: &avm_tests::cluster::Cluster, path: &str| {
        cluster.url(&format!("/v1/images/{}/workspace/files/{path}", chat.image_id))
    };

    // Runtime 1: the agent writes a file, a client another.
    let write = r#"[mock call='write_file:{"path": "notes/todo.txt", "content": "remember the milk"}']"#;
    let frames = send_and_finish(&mut client, &chat.image_id, json!(write)).await?;
    assert_eq!(streamed_text(&frames), "Tool results: wrote 17 bytes to notes/todo.txt");
    let put = cluster
        .http()?
        .put(file_url(&cluster, "docs/brief.txt"))
        .body("ship on friday")
        .send()
        .await?;
    assert_eq!(put.status().as_u16(), 200);

    // Idle, the agent is dropped: its workspace is saved and the local copy removed.
    let image_dir = local.join(tenant_dir(&local)?).join(&chat.image_id);
    wait_until_gone(&image_dir).await?;
    let stored = s3.keys(BUCKET, "workspaces/").await;
    assert!(
        stored
            .iter()
            .any(|key| key.ends_with(&format!("{}/manifest.json", chat.image_id))),
        "{stored:?}"
    );

    // The next agent restores it before its first tool call; then the
    // runtime stops right after its turn, which saves what it wrote.
    let frames = send_and_finish(
        &mut client,
        &chat.image_id,
        json!(r#"[mock call='read_file:{"path": "notes/todo.txt"}' call='write_file:{"path": "notes/later.txt", "content": "and eggs"}']"#),
    )
    .await?;
    assert_eq!(
        streamed_text(&frames),
        "Tool results: remember the milk | wrote 8 bytes to notes/later.txt"
    );
    drop(client);
    let mut cluster = cluster;
    cluster.stop().await?;

    // Runtime 2: a new runtime process, on a disk without runtime 1's files
    // (the same services and database, the same store).
    if local.exists() {
        std::fs::remove_dir_all(&local)?;
    }
    let cluster = cluster.restart().await?;
    let http = cluster.http()?;
    for (path, content) in [
        ("notes/todo.txt", "remember the milk"),
        ("notes/later.txt", "and eggs"),
        ("docs/brief.txt", "ship on friday"),
    ] {
        let got = http.get(file_url(&cluster, path)).send().await?;
        assert_eq!(got.status().as_u16(), 200, "{path}");
        assert_eq!(got.text().await?, content, "{path}");
    }
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    client.subscribe(&chat.session_id, None).await?;
    let read = r#"[mock call='read_file:{"path": "docs/brief.txt"}']"#;
    let frames = send_and_finish(&mut client, &chat.image_id, json!(read)).await?;
    assert_eq!(streamed_text(&frames), "Tool results: ship on friday");

    // Deleting the image deletes its workspace from the store too, once
    // the runtime hears of the deletion from the session service.
    let (status, deleted) = call(&cluster, "DELETE", &format!("/v1/images/{}", chat.image_id), None).await?;
    assert_eq!(status, 200, "{deleted}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let left: Vec<String> = s3
            .keys(BUCKET, "workspaces/")
            .await
            .into_iter()
            .filter(|key| key.contains(&chat.image_id))
            .collect();
        if left.is_empty() {
            return Ok(());
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the workspace outlived its image in the store: {left:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Returns the one tenant directory under the workspace root.
fn tenant_dir(root: &Path) -> anyhow::Result<std::ffi::OsString> {
    let mut tenants = std::fs::read_dir(root)?;
    let tenant = tenants.next().ok_or_else(|| anyhow::anyhow!("no tenant directory"))??;
    Ok(tenant.file_name())
}

/// Waits, within a deadline, until `dir` is gone.
async fn wait_until_gone(dir: &Path) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    while dir.exists() {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{} is still there: the idle agent's workspace was not released",
            dir.display()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    Ok(())
}
