//! Interrupting a long reply, and the one-turn-at-a-time rule.

use std::time::Duration;

use avm_tests::cluster::{Cluster, Llm, Mode, Options};
use avm_tests::mock_llm::{MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::json;

use crate::both_modes;
use crate::support::{assert_text_turn, conversation, send_and_finish, streamed_text, types};

fn long_reply() -> MockBehavior {
    MockBehavior {
        tokens: 2000,
        token_interval: Duration::from_millis(5),
        ..MockBehavior::default()
    }
}

both_modes!(an_interrupt_stops_the_stream_and_keeps_the_partial_reply, interrupts);

async fn interrupts(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(long_reply()).await?;
    let cluster = Cluster::start(
        mode,
        Options::with_llm(Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        }),
    )
    .await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    client
        .send_request(
            "message_send",
            json!({"imageId": chat.image_id, "content": "tell me everything"}),
        )
        .await?;
    let mut frames = client.frames_until("text_delta").await?;

    let answer = client
        .request("agent_interrupt", json!({"imageId": chat.image_id}))
        .await?;
    assert_eq!(answer["interrupted"], true, "{answer}");
    frames.extend(client.frames_until("conversation_end").await?);
    let kinds = types(&frames);
    let tail: Vec<&str> = kinds
        .iter()
        .map(String::as_str)
        .filter(|k| *k != "text_delta" && *k != "conversation_responding")
        .collect();
    assert!(
        tail.ends_with(&["interrupted", "message_stop", "assistant_message", "conversation_end"]),
        "interrupt order: {tail:?}"
    );
    let end = frames.last().map(|f| f["data"]["reason"].clone());
    assert_eq!(end, Some(json!("interrupted")));
    let partial = streamed_text(&frames);
    assert!(partial.split_whitespace().count() < 2000, "the stream stopped early");

    // The partial reply is stored, marked interrupted, exactly as streamed.
    let history = client
        .request("image_messages", json!({"imageId": chat.image_id}))
        .await?;
    let last = history["messages"]
        .as_array()
        .and_then(|m| m.last())
        .cloned()
        .unwrap_or_default();
    assert_eq!(last["subtype"], "assistant");
    assert_eq!(last["interrupted"], true);
    assert_eq!(last["content"][0]["text"], partial.as_str());

    // The provider saw the request go away, and the conversation goes on.
    mock.wait_for_cancelled(1, Duration::from_secs(10)).await?;
    mock.set_behavior(MockBehavior::default());
    let frames = send_and_finish(&mut client, &chat.image_id, json!("shorter please")).await?;
    assert_text_turn(&frames);
    Ok(())
}

both_modes!(a_second_message_during_a_turn_is_refused_cleanly, busy);

async fn busy(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(long_reply()).await?;
    let cluster = Cluster::start(
        mode,
        Options::with_llm(Llm::OpenAi {
            base_url: mock.openai_base_url(),
        }),
    )
    .await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    let first = client
        .request("message_send", json!({"imageId": chat.image_id, "content": "one"}))
        .await?;
    assert!(first.get("error").is_none(), "{first}");
    let second = client
        .request("message_send", json!({"imageId": chat.image_id, "content": "two"}))
        .await?;
    assert_eq!(second["code"], "AGENT_BUSY", "{second}");
    assert!(second["error"].as_str().is_some_and(|e| !e.is_empty()));

    client
        .request("agent_interrupt", json!({"imageId": chat.image_id}))
        .await?;
    client.frames_until("conversation_end").await?;
    let history = client
        .request("image_messages", json!({"imageId": chat.image_id}))
        .await?;
    let roles: Vec<String> = history["messages"]
        .as_array()
        .map(|m| {
            m.iter()
                .map(|m| m["subtype"].as_str().unwrap_or("?").to_owned())
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(roles, ["user", "assistant"], "the refused message left no trace");
    Ok(())
}
