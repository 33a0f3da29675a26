//! Issue 29, item 6: a conversation that nears the model's window is
//! compacted. The model summarises the older turns (a metered call of its
//! own, not shown as a reply); what it is sent next holds the summary and
//! the recent turns, under the window, with every tool call paired with its
//! result (the mock refuses a request that is not); the stored history
//! stays whole; an agent started again loads the compaction, not the
//! whole history.

use anyhow::{Context, ensure};
use avm_tests::cluster::{Cluster, Llm, Mode, Options};
use avm_tests::mock_llm::{MockApi, MockBehavior, MockLlm, MockToolCall, RecordedRequest};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{call, conversation, request_texts, send_and_finish};

both_modes!(a_long_conversation_is_compacted_under_the_window, compacts);

/// The window set for the test's model, and the reply's room in it.
const WINDOW: u64 = 2_000;
const MAX_TOKENS: u64 = 200;
/// What the runtime tells the model when it asks for a summary.
const SUMMARY_ASK: &str = "You summarise a conversation";
const SUMMARY: &str = "Notes: the user is cataloguing birds, turn by turn.";

fn is_summary_request(request: &RecordedRequest) -> bool {
    request.body["system"].to_string().contains(SUMMARY_ASK)
}

/// The bytes of text a request's messages carry.
fn text_bytes(body: &Value) -> usize {
    let mut bytes = 0;
    for message in body["messages"].as_array().into_iter().flatten() {
        match &message["content"] {
            Value::String(text) => bytes += text.len(),
            Value::Array(blocks) => {
                for block in blocks {
                    bytes += block["text"].as_str().map_or(0, str::len)
                        + block["content"].to_string().len()
                        + block["input"].to_string().len();
                }
            }
            _ => {}
        }
    }
    bytes
}

async fn compacts(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior {
        reply: Some(SUMMARY.to_owned()),
        tool_calls: vec![MockToolCall {
            name: "read_file".to_owned(),
            input: json!({"path": "birds.txt"}),
            round: 1,
        }],
        offered_tools_only: true,
        ..MockBehavior::default()
    })
    .await?;
    let options = Options::with_llm(Llm::Anthropic {
        base_url: mock.anthropic_base_url(),
    });
    let cluster = Cluster::start(mode, options).await?;
    let (status, body) = call(
        &cluster,
        "PUT",
        "/v1/config",
        Some(json!({"llm.contextWindows": {"claude-": WINDOW}, "defaults.maxTokens": MAX_TOKENS})),
    )
    .await?;
    ensure!(status == 200, "{status} {body}");
    let (status, body) = call(
        &cluster,
        "PUT",
        "/v1/config",
        Some(json!({"llm.contextWindows": {"claude-": 999}})),
    )
    .await?;
    ensure!(
        status == 400 && !body.to_string().contains("999"),
        "a window out of bounds is refused: {status} {body}"
    );

    let mut ws = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut ws, "compact", json!({"tools": ["read_file"]})).await?;
    // Turns of about 250 tokens each: the window's 80 % is passed within
    // a few, once the settings have reached the runtime.
    let mut event = None;
    let mut turns = 0;
    while event.is_none() && turns < 40 {
        turns += 1;
        let text = format!("bird {turns}: {}", "heron osprey kite ".repeat(50));
        let frames = send_and_finish(&mut ws, &chat.image_id, json!(text)).await?;
        ensure!(
            frames.last().is_some_and(|frame| frame["type"] == "conversation_end"),
            "turn {turns} completed: {:?}",
            frames.last()
        );
        event = frames.into_iter().find(|frame| frame["type"] == "context_compacted");
    }
    let event = event.context("no compaction within 40 turns")?;
    let data = &event["data"];
    ensure!(
        data["method"] == "summarized"
            && data["compactedMessages"].as_u64() > Some(0)
            && data["tokensAfter"].as_u64() < data["tokensBefore"].as_u64()
            && data["imageId"] == chat.image_id.as_str(),
        "{event}"
    );

    // The summary was asked for without tools, and is not shown as a reply.
    let requests = mock.requests();
    let summaries: Vec<&RecordedRequest> = requests.iter().filter(|r| is_summary_request(r)).collect();
    ensure!(summaries.len() == 1, "one summary: {}", summaries.len());
    ensure!(
        summaries[0]
            .body
            .get("tools")
            .is_none_or(|tools| tools.as_array().is_some_and(Vec::is_empty)),
        "no tools offered to the summary: {}",
        summaries[0].body
    );
    // What the model was sent after it: the summary first, under the window.
    let after = requests
        .iter()
        .rposition(is_summary_request)
        .context("the summary's position")?;
    let next = requests[after + 1..]
        .iter()
        .find(|r| r.api == MockApi::Anthropic)
        .context("the turn went on after its compaction")?;
    let texts = request_texts(&next.body);
    ensure!(
        texts[0].starts_with("Summary of the conversation before this point:") && texts[0].contains(SUMMARY),
        "the summary leads: {texts:?}"
    );
    let room_bytes = usize::try_from((WINDOW - MAX_TOKENS) * 4)?;
    ensure!(
        text_bytes(&next.body) < room_bytes,
        "under the window: {} bytes of text",
        text_bytes(&next.body)
    );
    let before_compaction = requests[..after]
        .iter()
        .rfind(|r| !is_summary_request(r))
        .context("a request before")?;
    ensure!(
        text_bytes(&before_compaction.body) > text_bytes(&next.body),
        "the context shrank"
    );

    // The stored history is whole: four messages a turn (the question, the
    // tool call, its result, the answer).
    let (_, history) = call(&cluster, "GET", &format!("/v1/images/{}/messages", chat.image_id), None).await?;
    let stored = history["messages"].as_array().map_or(0, Vec::len);
    ensure!(stored == turns * 4, "{stored} messages stored for {turns} turns");

    // An agent started again loads the compaction and what follows it.
    let (status, stopped) = call(&cluster, "POST", &format!("/v1/images/{}/stop", chat.image_id), None).await?;
    ensure!(status == 200 && stopped["stopped"] == true, "{status} {stopped}");
    let before = mock.requests().len();
    send_and_finish(&mut ws, &chat.image_id, json!("one more bird: a gull")).await?;
    let requests = mock.requests();
    let first = requests[before..]
        .iter()
        .find(|r| r.api == MockApi::Anthropic && !is_summary_request(r))
        .context("the next turn")?;
    let texts = request_texts(&first.body);
    ensure!(
        texts[0].starts_with("Summary of the conversation before this point:"),
        "a restarted agent reads the summary first: {texts:?}"
    );
    ensure!(
        text_bytes(&first.body) < room_bytes,
        "and stays under the window: {}",
        text_bytes(&first.body)
    );

    // The summary was metered like any call: the ledger counts every request the model got.
    let calls = u64::try_from(mock.requests().len())?;
    crate::support::poll(std::time::Duration::from_secs(20), "the ledger", || async {
        let (_, usage) = call(&cluster, "GET", "/v1/usage", None).await?;
        Ok((usage["totals"]["calls"] == calls).then_some(()))
    })
    .await?;
    Ok(())
}
