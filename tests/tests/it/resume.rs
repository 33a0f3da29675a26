//! A client that reconnects with its last cursor gets exactly what it missed.

use avm_tests::cluster::Mode;
use avm_tests::ws_client::WsClient;
use serde_json::json;

use crate::both_modes;
use crate::support::{cluster, conversation, send_and_finish, types};

both_modes!(subscribing_after_a_cursor_replays_what_was_missed, resume);

async fn resume(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let mut first = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut first, "default", json!({})).await?;
    let frames = send_and_finish(&mut first, &chat.image_id, json!("replay me")).await?;
    let start = frames
        .iter()
        .position(|f| f["type"] == "message_start")
        .unwrap_or_default();
    let cursor = frames[start]["cursor"].as_str().unwrap_or_default().to_owned();
    drop(first);

    let mut second = WsClient::connect(&cluster.ws_url()).await?;
    second.subscribe(&chat.session_id, Some(&cursor)).await?;
    let replayed = second.frames_until("conversation_end").await?;
    let missed: Vec<_> = frames[start + 1..]
        .iter()
        .filter(|f| f["category"] != "response")
        .cloned()
        .collect();
    assert_eq!(types(&replayed), types(&missed));
    assert_eq!(replayed, missed, "the replay is byte-for-byte what was missed");

    second.subscribe(&chat.session_id, Some("not-a-cursor")).await?;
    let error = second.next_frame().await?;
    assert_eq!(error["data"]["code"], "INVALID_CURSOR");
    Ok(())
}
