//! Issue 29, item 4: a conversation rewound to after one of its replies, or
//! cleared. Refused while a turn runs; after it the model is sent what was
//! kept and nothing else; subscribers hear of it; the ledger keeps every
//! call it recorded.

use std::time::Duration;

use anyhow::{Context, ensure};
use avm_tests::cluster::{Cluster, Llm, Mode, Options};
use avm_tests::mock_llm::{MockApi, MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{call, conversation, poll, request_texts, send_and_finish};

both_modes!(a_rewound_conversation_goes_on_from_what_was_kept, rewinds);

fn noted() -> MockBehavior {
    MockBehavior {
        reply: Some("Noted.".to_owned()),
        ..MockBehavior::default()
    }
}

/// The texts of the last request the model got after `before` requests.
fn last_request_texts(mock: &MockLlm, before: usize) -> anyhow::Result<Vec<String>> {
    let requests = mock.requests();
    let last = requests[before..]
        .iter()
        .rfind(|request| request.api == MockApi::Anthropic)
        .context("the turn reached the model")?;
    Ok(request_texts(&last.body))
}

/// The ledger's count of LLM calls, once it holds `calls` of them.
async fn ledger_calls(cluster: &Cluster, calls: u64) -> anyhow::Result<Value> {
    poll(Duration::from_secs(20), "the ledger", || async {
        let (status, usage) = call(cluster, "GET", "/v1/usage", None).await?;
        ensure!(status == 200, "{status} {usage}");
        Ok((usage["totals"]["calls"] == calls).then_some(usage))
    })
    .await
}

async fn rewinds(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(noted()).await?;
    let options = Options::with_llm(Llm::Anthropic {
        base_url: mock.anthropic_base_url(),
    });
    let cluster = Cluster::start(mode, options).await?;
    let mut ws = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut ws, "rewind", json!({"name": "Birds"})).await?;
    for text in ["first: herons", "second: ospreys", "third: kites"] {
        send_and_finish(&mut ws, &chat.image_id, json!(text)).await?;
    }
    let messages_path = format!("/v1/images/{}/messages", chat.image_id);
    let (_, history) = call(&cluster, "GET", &messages_path, None).await?;
    let ids: Vec<String> = history["messages"]
        .as_array()
        .context("messages")?
        .iter()
        .filter_map(|message| message["id"].as_str().map(str::to_owned))
        .collect();
    ensure!(ids.len() == 6, "three turns: {history}");
    let (first_question, first_reply) = (ids[0].clone(), ids[1].clone());

    // While a turn runs, a rewind is refused and nothing is deleted.
    mock.set_behavior(MockBehavior {
        tokens: 2000,
        token_interval: Duration::from_millis(5),
        ..MockBehavior::default()
    });
    ws.send_request(
        "message_send",
        json!({"imageId": chat.image_id, "content": "fourth: tell me everything"}),
    )
    .await?;
    ws.frames_until("text_delta").await?;
    let rewind_path = format!("/v1/images/{}/rewind", chat.image_id);
    let (status, refused) = call(
        &cluster,
        "POST",
        &rewind_path,
        Some(json!({"afterMessageId": first_reply})),
    )
    .await?;
    ensure!(
        status == 409 && refused["error"]["code"] == "TURN_RUNNING",
        "{status} {refused}"
    );
    let refused = ws.request("image_clear", json!({"imageId": chat.image_id})).await?;
    ensure!(refused["code"] == "TURN_RUNNING", "{refused}");
    ws.request("agent_interrupt", json!({"imageId": chat.image_id})).await?;
    ws.turn().await?;
    let (_, history) = call(&cluster, "GET", &messages_path, None).await?;
    ensure!(
        history["messages"].as_array().map(Vec::len) == Some(8),
        "the interrupted turn is stored whole: {history}"
    );

    // Where a rewind may not stop, and what it may not name.
    let (status, body) = call(
        &cluster,
        "POST",
        &rewind_path,
        Some(json!({"afterMessageId": first_question})),
    )
    .await?;
    ensure!(
        status == 409 && body["error"]["code"] == "REWIND_POINT_OPENS_TURN",
        "{status} {body}"
    );
    let (status, body) = call(
        &cluster,
        "POST",
        &rewind_path,
        Some(json!({"afterMessageId": "x".repeat(20_000)})),
    )
    .await?;
    ensure!(status == 400 && body["error"]["code"] == "TOO_LONG", "{status} {body}");
    ensure!(!body.to_string().contains("xxxxxxxx"), "the id is not echoed: {body}");
    let (status, body) = call(
        &cluster,
        "POST",
        &rewind_path,
        Some(json!({"afterMessageId": "bad id\u{0}"})),
    )
    .await?;
    ensure!(
        status == 400 && body["error"]["code"] == "NUL_CHARACTER",
        "a NUL: {status} {body}"
    );
    let (status, body) = call(
        &cluster,
        "POST",
        &rewind_path,
        Some(json!({"afterMessageId": "bad id"})),
    )
    .await?;
    ensure!(
        status == 400 && body["error"]["code"] == "INVALID_MESSAGE_ID",
        "a space: {status} {body}"
    );
    let (status, body) = call(&cluster, "POST", &rewind_path, Some(json!({"afterMessageId": 7}))).await?;
    ensure!(status == 400, "a wrong type: {status} {body}");
    let (status, body) = call(
        &cluster,
        "POST",
        "/v1/images/img_nope/rewind",
        Some(json!({"afterMessageId": first_reply})),
    )
    .await?;
    ensure!(
        status == 404 && body["error"]["code"] == "IMAGE_NOT_FOUND",
        "{status} {body}"
    );

    // Rewound over the WebSocket to after the first reply; subscribers hear it.
    let rewound = ws
        .request(
            "image_rewind",
            json!({"imageId": chat.image_id, "afterMessageId": first_reply}),
        )
        .await?;
    ensure!(rewound["removedMessages"] == 6, "{rewound}");
    let frames = ws.frames_until("conversation_rewound").await?;
    let event = frames.last().context("the event")?;
    ensure!(
        event["data"]["afterMessageId"] == first_reply.as_str() && event["data"]["removedMessages"] == 6,
        "{event}"
    );
    let (_, history) = call(&cluster, "GET", &messages_path, None).await?;
    let kept: Vec<&str> = history["messages"]
        .as_array()
        .context("messages")?
        .iter()
        .filter_map(|message| message["id"].as_str())
        .collect();
    ensure!(kept == [first_question.as_str(), first_reply.as_str()], "{history}");

    // The next turn sends the model what was kept, then the new message.
    mock.set_behavior(noted());
    let before = mock.requests().len();
    send_and_finish(&mut ws, &chat.image_id, json!("after the rewind: gulls")).await?;
    let texts = last_request_texts(&mock, before)?;
    ensure!(
        texts == ["first: herons", "Noted.", "after the rewind: gulls"],
        "the model sees the truncated context: {texts:?}"
    );

    // Cleared over REST: the record stays, the model starts from nothing.
    let (status, cleared) = call(&cluster, "POST", &format!("/v1/images/{}/clear", chat.image_id), None).await?;
    ensure!(status == 200 && cleared["removedMessages"] == 4, "{status} {cleared}");
    let (status, record) = call(&cluster, "GET", &format!("/v1/images/{}", chat.image_id), None).await?;
    ensure!(status == 200 && record["name"] == "Birds", "{status} {record}");
    let before = mock.requests().len();
    send_and_finish(&mut ws, &chat.image_id, json!("a fresh start")).await?;
    ensure!(
        last_request_texts(&mock, before)? == ["a fresh start"],
        "a cleared conversation sends no history"
    );

    // Every call made is still in the ledger: three turns, the interrupted
    // one, and the two after.
    let usage = ledger_calls(&cluster, 6).await?;
    ensure!(usage["totals"]["outputTokens"].as_u64() > Some(0), "{usage}");
    Ok(())
}
