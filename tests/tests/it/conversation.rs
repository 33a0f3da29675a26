//! The first real conversation over WebSocket, as PROTOCOL.md describes it.

use avm_tests::cluster::Mode;
use avm_tests::ws_client::WsClient;
use serde_json::json;

use crate::both_modes;
use crate::support::{assert_text_turn, cluster, conversation, send_and_finish, types};

both_modes!(a_message_streams_its_reply_in_protocol_order, streams_reply);

async fn streams_reply(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(
        &mut client,
        "default",
        json!({"name": "first", "systemPrompt": "be brief"}),
    )
    .await?;
    assert_eq!(chat.record["name"], "first");
    assert_eq!(chat.record["online"], false);
    assert!(chat.image_id.starts_with("img_") && chat.session_id.starts_with("sess_"));

    let frames = send_and_finish(&mut client, &chat.image_id, json!("hello there")).await?;
    let reply = assert_text_turn(&frames);
    assert!(
        reply.contains("hello there"),
        "the offline provider echoes the message: {reply}"
    );
    let kinds = types(&frames);
    assert_eq!(kinds.first().map(String::as_str), Some("agent_registered"), "{kinds:?}");
    for frame in frames.iter().filter(|f| f["category"] != "response") {
        assert_eq!(frame["context"]["imageId"], chat.image_id.as_str(), "{frame}");
        assert_eq!(frame["context"]["sessionId"], chat.session_id.as_str());
        assert!(frame["cursor"].is_string());
    }
    let cursors: Vec<u64> = frames
        .iter()
        .filter_map(|f| f["cursor"].as_str()?.parse().ok())
        .collect();
    assert!(
        cursors.windows(2).all(|pair| pair[0] < pair[1]),
        "cursors rise: {cursors:?}"
    );

    // The history holds the user message and the reply, in order.
    let history = client
        .request("image_messages", json!({"imageId": chat.image_id}))
        .await?;
    let messages = history["messages"].as_array().cloned().unwrap_or_default();
    assert_eq!(messages.len(), 2, "{history}");
    assert_eq!(messages[0]["role"], "user");
    assert_eq!(messages[0]["content"], "hello there");
    assert_eq!(messages[1]["subtype"], "assistant");
    assert_eq!(messages[1]["content"][0]["text"], reply.as_str());

    // The image is online now, with its agent.
    let got = client.request("image_get", json!({"imageId": chat.image_id})).await?;
    assert_eq!(got["record"]["online"], true);
    assert!(
        got["record"]["agentId"]
            .as_str()
            .is_some_and(|id| id.starts_with("agent_"))
    );
    Ok(())
}

both_modes!(a_second_turn_continues_the_conversation, second_turn);

async fn second_turn(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    assert_eq!(chat.record["name"], "New Conversation");
    send_and_finish(&mut client, &chat.image_id, json!("one")).await?;
    let frames = send_and_finish(&mut client, &chat.image_id, json!([{"type": "text", "text": "two"}])).await?;
    assert!(
        !types(&frames).contains(&"agent_registered".to_owned()),
        "the agent is reused"
    );
    assert_text_turn(&frames);
    let history = client
        .request("image_messages", json!({"imageId": chat.image_id}))
        .await?;
    assert_eq!(history["messages"].as_array().map(Vec::len), Some(4));
    Ok(())
}

both_modes!(
    a_message_sent_on_conversation_end_never_finds_the_agent_busy,
    back_to_back
);

async fn back_to_back(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    for turn in 0..40 {
        let accepted = client
            .request(
                "message_send",
                json!({"imageId": chat.image_id, "content": format!("turn {turn}")}),
            )
            .await?;
        assert_eq!(accepted["code"], serde_json::Value::Null, "turn {turn}: {accepted}");
        let frames = client.turn().await?;
        assert_eq!(
            frames.last().map(|frame| frame["type"].clone()),
            Some(json!("conversation_end")),
            "turn {turn}: {:?}",
            types(&frames)
        );
    }
    Ok(())
}

both_modes!(acknowledged_delivery_wraps_every_frame, acknowledged);

async fn acknowledged(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let mut client = WsClient::connect(&format!("{}&ack=1", cluster.ws_url())).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    assert_text_turn(&send_and_finish(&mut client, &chat.image_id, json!("wrapped")).await?);
    assert_eq!(client.plain, 0, "every frame is wrapped");
    assert!(client.acknowledged.len() > 10);
    let (connection, _) = client.acknowledged[0].rsplit_once('_').unwrap_or_default();
    for (n, msg_id) in client.acknowledged.iter().enumerate() {
        assert_eq!(msg_id, &format!("{connection}_{}", n + 1), "ids are <connId>_<n>");
    }
    // Acknowledgements are taken silently: the next answer is the next frame.
    assert!(client.request("container_list", json!({})).await?["containerIds"].is_array());
    Ok(())
}
