//! Issue 26, item 8: a reply reported but never stored. The session service
//! was killed 1 s into a turn and restarted 7 s later: the client got
//! `assistant_message` and `conversation_end`, the history held only the
//! user message, forever, with no marker.
//!
//! Now a reply the session service cannot take is kept in the runtime's
//! outbox (Redis when configured, else memory) and stored, with its id and
//! time, once the service is back; the turn ends with `conversation_end`
//! only once the reply is stored or kept. A reply the outbox cannot keep
//! ends the turn with `REPLY_NOT_STORED` and leaves a marker in history.
//! The next message of the conversation runs on the whole history.
//!
//! The per-component mesh only: it is the mode where the session service
//! can die alone.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use avm_tests::cluster::{Cluster, Llm, Mode, Options};
use avm_tests::mock_llm::{MockBehavior, MockLlm, MockToolCall};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::support::{Conversation, assert_text_turn, call, conversation, poll, send_and_finish, streamed_text};

/// How long the kept reply may take to reach history once the session
/// service is back (its drainer backs off to a few seconds at most).
const STORED_WITHIN: Duration = Duration::from_secs(30);

/// A reply that streams for about three seconds: the session service dies
/// while it streams, and is dead when it ends.
fn slow() -> MockBehavior {
    MockBehavior {
        tokens: 150,
        token_interval: Duration::from_millis(20),
        ..MockBehavior::default()
    }
}

/// Where the outbox lives for a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Keeper {
    /// Redis (`AVM_TEST_REDIS_URL`): the runtime is also killed while the
    /// reply waits, and its next process stores it.
    Redis,
    /// The runtime's memory (no Redis).
    Memory,
}

mod item_8_a_reply_reported_while_the_session_service_is_down_is_stored_when_it_is_back {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kept_in_redis() -> anyhow::Result<()> {
        super::reply_kept(super::Keeper::Redis).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kept_in_memory() -> anyhow::Result<()> {
        super::reply_kept(super::Keeper::Memory).await
    }
}

/// Returns a per-component cluster over the mock LLM with the outbox in
/// `keeper`; `None` (said loudly) when Redis is asked for but not configured.
async fn mesh(mock: &MockLlm, keeper: Keeper, env: &[(&str, &str)]) -> anyhow::Result<Option<Cluster>> {
    let redis = std::env::var("AVM_TEST_REDIS_URL").is_ok_and(|url| !url.is_empty());
    if keeper == Keeper::Redis && !redis {
        if std::env::var("AVM_TEST_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1") {
            bail!("AVM_TEST_REQUIRE_EXTERNAL=1 but AVM_TEST_REDIS_URL is not set");
        }
        eprintln!("SKIPPED: AVM_TEST_REDIS_URL not set; the Redis outbox test did not run");
        return Ok(None);
    }
    let options = Options {
        without_redis: keeper == Keeper::Memory,
        env: env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        ..Options::with_llm(Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        })
    };
    Ok(Some(Cluster::start(Mode::PerComponent, options).await?))
}

/// Talks once, then starts a slow reply, kills the session service while it
/// streams, and returns the frames that ended the turn.
async fn cut_mid_turn(
    cluster: &mut Cluster,
    mock: &MockLlm,
    client: &mut WsClient,
    chat: &Conversation,
) -> anyhow::Result<Vec<Value>> {
    assert_text_turn(&send_and_finish(client, &chat.image_id, json!("before")).await?);
    mock.set_behavior(slow());
    client
        .send_request("message_send", json!({"imageId": chat.image_id, "content": "during"}))
        .await?;
    // Driven by the stream: the reply is under way when the service dies.
    client.frames_until("text_delta").await?;
    cluster.kill_component("session").await?;
    let frames = client.turn().await?;
    mock.set_behavior(MockBehavior::default());
    Ok(frames)
}

/// Returns the session's stored history over REST, `None` while the
/// session service does not answer.
async fn history(cluster: &Cluster, image_id: &str) -> anyhow::Result<Option<Vec<Value>>> {
    let (status, body) = call(cluster, "GET", &format!("/v1/images/{image_id}/messages"), None).await?;
    if status != 200 {
        return Ok(None);
    }
    Ok(body["messages"].as_array().cloned())
}

/// Returns the message stored right after the user message `text`.
fn after_user<'a>(history: &'a [Value], text: &str) -> Option<&'a Value> {
    let at = history
        .iter()
        .position(|m| m["role"] == "user" && m["content"] == text)?;
    history.get(at + 1)
}

/// Restarts the session service and checks that the turn cut during the
/// `during` message gets its `REPLY_NOT_STORED` marker right after it.
async fn marked_once_back(cluster: &mut Cluster, chat: &Conversation) -> anyhow::Result<()> {
    cluster.restart_component("session").await?;
    let cluster = &*cluster;
    let marker = poll(STORED_WITHIN, "the marker is stored", || async {
        let Some(history) = history(cluster, &chat.image_id).await.ok().flatten() else {
            return Ok(None);
        };
        Ok(after_user(&history, "during").cloned())
    })
    .await?;
    assert_eq!(marker["role"], "error", "{marker}");
    assert_eq!(marker["errorCode"], "REPLY_NOT_STORED", "{marker}");
    Ok(())
}

/// Sends the next message until it is taken (a restarted runtime may
/// briefly answer that the agent is moving) and checks that its turn
/// completes with a reply.
async fn next_turn(client: &mut WsClient, image_id: &str) -> anyhow::Result<()> {
    let request = json!({"imageId": image_id, "content": "after"});
    let deadline = std::time::Instant::now() + STORED_WITHIN;
    loop {
        let answer = client.request("message_send", request.clone()).await?;
        if answer.get("error").is_none() {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "the next message is still refused: {answer}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let frames = client.turn().await?;
    let end = frames.last().context("the next turn's last frame")?;
    ensure!(
        end["type"] == "conversation_end" && end["data"]["reason"] == "completed",
        "the next turn completes: {end}"
    );
    ensure!(!streamed_text(&frames).is_empty(), "the next turn streams a reply");
    Ok(())
}

async fn reply_kept(keeper: Keeper) -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let Some(mut cluster) = mesh(&mock, keeper, &[]).await? else {
        return Ok(());
    };
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "outbox", json!({})).await?;
    let frames = cut_mid_turn(&mut cluster, &mock, &mut client, &chat).await?;

    // The turn was reported completed: its reply is kept.
    let end = frames.last().context("the turn's last frame")?;
    ensure!(
        end["type"] == "conversation_end" && end["data"]["reason"] == "completed",
        "a kept reply completes its turn: {end}"
    );
    let reply = frames
        .iter()
        .find(|f| f["type"] == "assistant_message")
        .context("the reply was told")?["data"]
        .clone();

    if keeper == Keeper::Redis {
        // The runtime that kept it dies too; its next process stores it.
        cluster.kill_component("runtime").await?;
        cluster.restart_component("session").await?;
        cluster.restart_component("runtime").await?;
    } else {
        cluster.restart_component("session").await?;
    }

    // The reply reaches history, after its user message, as it was told.
    let stored = poll(STORED_WITHIN, "the kept reply is stored", || async {
        let Some(history) = history(&cluster, &chat.image_id).await.ok().flatten() else {
            return Ok(None);
        };
        Ok(after_user(&history, "during").cloned())
    })
    .await?;
    assert_eq!(stored["role"], "assistant", "{stored}");
    assert_eq!(stored["id"], reply["id"], "kept under its id: {stored}");
    assert_eq!(stored["timestamp"], reply["timestamp"], "kept with its time: {stored}");
    assert_eq!(stored["content"], reply["content"], "{stored}");

    // The next message runs on the whole history and is stored after it.
    let mut client = match keeper {
        Keeper::Memory => client,
        Keeper::Redis => {
            let mut fresh = WsClient::connect(&cluster.ws_url()).await?;
            fresh.subscribe(&chat.session_id, None).await?;
            fresh
        }
    };
    next_turn(&mut client, &chat.image_id).await?;
    let history = history(&cluster, &chat.image_id).await?.context("history")?;
    let roles: Vec<&str> = history.iter().filter_map(|m| m["role"].as_str()).collect();
    assert_eq!(
        roles,
        ["user", "assistant", "user", "assistant", "user", "assistant"],
        "{history:?}"
    );
    assert_eq!(history[3]["id"], reply["id"]);
    let sent = mock.requests();
    let last = sent.last().context("the next turn's LLM request")?;
    let told = last.body["messages"].to_string();
    ensure!(
        told.contains(reply["content"][0]["text"].as_str().unwrap_or("?")),
        "the next turn's request holds the kept reply: {told}"
    );
    Ok(())
}

/// A reply the outbox has no room for is not reported completed: the turn
/// ends with `REPLY_NOT_STORED`, and history gets a marker after the user's
/// message once the service is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn item_8_a_reply_the_outbox_cannot_keep_ends_its_turn_with_a_typed_error_and_a_marker() -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    // Room for no reply: the marker, a few hundred bytes, has its own reserve.
    let tiny = [("AVM_RUNTIME_OUTBOX_MAX_BYTES", "1")];
    let mut cluster = mesh(&mock, Keeper::Memory, &tiny).await?.context("a memory outbox")?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "outbox-full", json!({})).await?;
    let frames = cut_mid_turn(&mut cluster, &mock, &mut client, &chat).await?;

    let end = frames.last().context("the turn's last frame")?;
    ensure!(
        end["type"] == "error_occurred" && end["data"]["code"] == "REPLY_NOT_STORED",
        "an unkept reply is an error, not a completion: {end}"
    );
    ensure!(
        !frames.iter().any(|f| f["type"] == "conversation_end"),
        "no conversation_end for an unkept reply"
    );

    marked_once_back(&mut cluster, &chat).await?;
    next_turn(&mut client, &chat.image_id).await?;
    Ok(())
}

/// A tool call the outbox has no room for ends the turn the same way,
/// before its tool runs: history never holds a result without its call,
/// nor a turn that went on past a step it lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn item_8_a_tool_call_the_outbox_cannot_keep_ends_its_turn_before_the_tool_runs() -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let tiny = [("AVM_RUNTIME_OUTBOX_MAX_BYTES", "1")];
    let mut cluster = mesh(&mock, Keeper::Memory, &tiny).await?.context("a memory outbox")?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "outbox-tool", json!({})).await?;
    assert_text_turn(&send_and_finish(&mut client, &chat.image_id, json!("before")).await?);
    // The call's input streams in three pieces half a second apart: the
    // session service dies while it streams, and is dead when it completes.
    mock.set_behavior(MockBehavior {
        tool_calls: vec![MockToolCall {
            name: "run_command".to_owned(),
            input: json!({"command": "echo never"}),
            round: 1,
        }],
        token_interval: Duration::from_millis(500),
        ..MockBehavior::default()
    });
    let calls_before = mock.requests().len();
    client
        .send_request("message_send", json!({"imageId": chat.image_id, "content": "during"}))
        .await?;
    client.frames_until("input_json_delta").await?;
    cluster.kill_component("session").await?;
    let frames = client.turn().await?;
    mock.set_behavior(MockBehavior::default());

    let end = frames.last().context("the turn's last frame")?;
    ensure!(
        end["type"] == "error_occurred" && end["data"]["code"] == "REPLY_NOT_STORED",
        "an unkept tool call is an error: {end}"
    );
    ensure!(
        !frames.iter().any(|f| f["type"] == "conversation_end"),
        "no conversation_end for an unkept tool call"
    );
    // The call is answered as not run (calls always get a result), never run.
    for result in frames.iter().filter(|f| f["type"] == "tool_result") {
        let text = result["data"]["result"].as_str().unwrap_or_default();
        ensure!(
            text.starts_with("the tool call was not completed"),
            "the tool was not run: {result}"
        );
    }
    assert_eq!(
        mock.requests().len(),
        calls_before + 1,
        "no LLM call after the lost tool call"
    );

    marked_once_back(&mut cluster, &chat).await?;
    next_turn(&mut client, &chat.image_id).await?;
    Ok(())
}
