//! Issue 26, streams and bills under load: what an outside tester found with
//! normal credentials, reproduced as they did it.
//!
//! - item 11: a reply of 3,000 deltas arriving at once reaches a client
//!   reading at normal speed whole, over SSE and WebSocket, ending in
//!   `conversation_end`, and the next message works; a client that stops
//!   reading is cut, and the turn still ends and stores its reply.

use std::time::Duration;

use anyhow::{Context, ensure};
use avm_tests::cluster::{Cluster, Llm, Mode, Options, http_client};
use avm_tests::mock_llm::{MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{SseStream, assistant_text, conversation, poll, send_and_finish, streamed_text};

/// Deltas of the reply that arrives at once (the tester's figure).
const FAST_REPLY_DELTAS: usize = 3_000;

/// Returns a cluster whose model behaves as told, and the full reply it streams.
async fn cluster_with_model(
    mode: Mode,
    behavior: MockBehavior,
    options: Options,
) -> anyhow::Result<(MockLlm, Cluster, String)> {
    let reply = behavior.deltas().concat();
    let mock = MockLlm::start(behavior).await?;
    let options = Options {
        llm: Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        },
        ..options
    };
    let cluster = Cluster::start(mode, options).await?;
    Ok((mock, cluster, reply))
}

/// Sends a message over REST and returns its turn's SSE stream.
async fn post_message(cluster: &Cluster, image_id: &str, content: &str) -> anyhow::Result<SseStream> {
    post_if_free(cluster, image_id, content)
        .await?
        .context("POST message answered 409 AGENT_BUSY")
}

/// Sends a message over REST and returns its turn's SSE stream, or `None`
/// when the agent is still answering (409 `AGENT_BUSY`).
async fn post_if_free(cluster: &Cluster, image_id: &str, content: &str) -> anyhow::Result<Option<SseStream>> {
    let response = http_client(&cluster.admin_key)?
        .post(cluster.url(&format!("/v1/images/{image_id}/messages")))
        .json(&json!({"content": content}))
        .send()
        .await?;
    let status = response.status().as_u16();
    if status == 409 {
        let refusal = response.text().await?;
        ensure!(refusal.contains("AGENT_BUSY"), "POST message answered 409: {refusal}");
        return Ok(None);
    }
    ensure!(
        status == 200,
        "POST message answered {status}: {}",
        response.text().await?
    );
    Ok(Some(SseStream::new(response)))
}

/// Reads an SSE turn to its end and returns its events as WebSocket frames
/// (type, data), failing on a `system_error` such as `SUBSCRIBER_TOO_SLOW`.
async fn read_sse_turn(events: &mut SseStream) -> anyhow::Result<Vec<Value>> {
    let mut frames = Vec::new();
    loop {
        let (_, kind, data) = events.next_event().await?;
        ensure!(
            kind != "system_error",
            "the stream was cut after {} events: {data}",
            frames.len()
        );
        frames.push(data);
        if kind == "conversation_end" || kind == "error_occurred" {
            return Ok(frames);
        }
    }
}

/// Asserts a turn ended normally and streamed the whole reply.
fn assert_whole_reply(frames: &[Value], reply: &str, over: &str) -> anyhow::Result<()> {
    let last = frames.last().context("no frames")?;
    ensure!(
        last["type"] == "conversation_end" && last["data"]["reason"] == "completed",
        "{over}: the turn ended with {last}"
    );
    let streamed = streamed_text(frames);
    ensure!(
        streamed == reply,
        "{over}: streamed {} of {} bytes",
        streamed.len(),
        reply.len()
    );
    ensure!(
        assistant_text(frames).as_deref() == Some(reply),
        "{over}: the assistant message is not the reply"
    );
    Ok(())
}

/// Returns the text of the last stored message when it is the assistant's.
async fn stored_reply(cluster: &Cluster, image_id: &str) -> anyhow::Result<Option<String>> {
    let history: Value = http_client(&cluster.admin_key)?
        .get(cluster.url(&format!("/v1/images/{image_id}/messages")))
        .send()
        .await?
        .json()
        .await?;
    let Some(last) = history["messages"].as_array().and_then(|messages| messages.last()) else {
        return Ok(None);
    };
    if last["role"] != "assistant" {
        return Ok(None);
    }
    let text = match &last["content"] {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts.iter().filter_map(|part| part["text"].as_str()).collect(),
        _ => String::new(),
    };
    Ok(Some(text))
}

both_modes!(a_fast_reply_reaches_a_reader_whole, fast_reply);

/// Issue 26 item 11: a reply of 3,000 deltas arriving at once used to end in
/// `SUBSCRIBER_TOO_SLOW` with no `conversation_end`; a client reading at
/// normal speed now gets every delta's text and the turn's end, over the
/// WebSocket and over SSE, and its next message is taken.
async fn fast_reply(mode: Mode) -> anyhow::Result<()> {
    let behavior = MockBehavior {
        tokens: FAST_REPLY_DELTAS,
        ..MockBehavior::default()
    };
    let (_mock, cluster, reply) = cluster_with_model(mode, behavior, Options::default()).await?;

    let mut socket = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut socket, "fast", json!({})).await?;
    for round in ["first", "next"] {
        let frames = send_and_finish(&mut socket, &chat.image_id, json!(round)).await?;
        assert_whole_reply(&frames, &reply, &format!("WebSocket, {round} message"))?;
    }
    // Closed, not merely idle: it must not stand for a stalled reader here.
    drop(socket);

    for round in ["first", "next"] {
        let mut events = post_message(&cluster, &chat.image_id, round).await?;
        let frames = read_sse_turn(&mut events).await?;
        assert_whole_reply(&frames, &reply, &format!("SSE, {round} message"))?;
    }
    Ok(())
}

both_modes!(a_reader_that_stops_is_cut_and_the_turn_still_ends, stalled_reader);

/// Issue 26 item 11, the other side: a client that stops reading in the
/// middle of a long reply (more than the sockets on the way buffer) is cut
/// off once it read nothing for the stall timeout; the turn goes on, its
/// reply is stored, and the next message is taken, not `409 AGENT_BUSY`.
async fn stalled_reader(mode: Mode) -> anyhow::Result<()> {
    // 3,000 words of 2 KiB, one a millisecond: 6 MiB over 3 s or more.
    let word = "x".repeat(2048);
    let behavior = MockBehavior {
        reply: Some(vec![word.as_str(); FAST_REPLY_DELTAS].join(" ")),
        token_interval: Duration::from_millis(1),
        ..MockBehavior::default()
    };
    let options = Options {
        subscriber_queue: Some(16),
        subscriber_stall_timeout: Some(Duration::from_millis(500)),
        ..Options::default()
    };
    let (_mock, cluster, reply) = cluster_with_model(mode, behavior, options).await?;
    let mut socket = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut socket, "stalled", json!({})).await?;
    drop(socket);

    let mut stalled = post_message(&cluster, &chat.image_id, "first").await?;
    let (_, kind, _) = stalled.next_event().await?;
    ensure!(kind == "message_send_response", "first event: {kind}");
    // It reads nothing more while the turn runs and is stored.
    let stored = poll(Duration::from_secs(90), "the reply stored", || {
        stored_reply(&cluster, &chat.image_id)
    })
    .await?;
    ensure!(stored == reply, "stored {} of {} bytes", stored.len(), reply.len());
    // The reply is stored a moment before its turn ends (a message sent in
    // between is refused as AGENT_BUSY, as it would be over any surface); a
    // turn kept open by its stalled reader would never take the next one.
    let mut next = poll(Duration::from_secs(30), "the next message taken", || {
        post_if_free(&cluster, &chat.image_id, "next")
    })
    .await?;
    let frames = read_sse_turn(&mut next).await?;
    assert_whole_reply(&frames, &reply, "SSE, the message after a stalled reader's")?;

    // What the stalled stream still holds ends typed: the turn's end, or the cut.
    let ended = loop {
        let (_, kind, data) = stalled.next_event().await?;
        match kind.as_str() {
            "conversation_end" => break "conversation_end".to_owned(),
            "system_error" => {
                ensure!(data["data"]["code"] == "SUBSCRIBER_TOO_SLOW", "{data}");
                break "SUBSCRIBER_TOO_SLOW".to_owned();
            }
            _ => {}
        }
    };
    eprintln!("the stalled reader's stream ended with {ended}");
    Ok(())
}
