//! Real provider wire formats through the whole system, against the mock LLM.

use avm_tests::cluster::{Cluster, Llm, Mode, Options, TEST_API_KEY};
use avm_tests::mock_llm::{MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{assert_text_turn, conversation, send_and_finish};

const REPLY: &str = "Hello from the mock, streamed in pieces.";

async fn relays_exactly(mode: Mode, anthropic: bool) -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior {
        reply: Some(REPLY.into()),
        tokens: 7,
        ..MockBehavior::default()
    })
    .await?;
    let llm = if anthropic {
        Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        }
    } else {
        Llm::OpenAi {
            base_url: mock.openai_base_url(),
        }
    };
    let cluster = Cluster::start(mode, Options::with_llm(llm)).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({"systemPrompt": "You are terse."})).await?;

    let frames = send_and_finish(&mut client, &chat.image_id, json!("first question")).await?;
    assert_eq!(
        assert_text_turn(&frames),
        REPLY,
        "the streamed text is exactly what the provider streamed"
    );
    let usage = frames
        .iter()
        .find(|f| f["type"] == "message_delta")
        .map(|f| f["data"]["usage"].clone());
    assert_eq!(
        usage.as_ref().map(|u| u["outputTokens"].clone()),
        Some(json!(7)),
        "usage as the provider counted it"
    );

    let frames = send_and_finish(&mut client, &chat.image_id, json!("second question")).await?;
    assert_eq!(assert_text_turn(&frames), REPLY);

    let requests = mock.requests();
    assert_eq!(requests.len(), 2);
    let second = &requests[1];
    assert_eq!(second.api_key.as_deref(), Some(TEST_API_KEY));
    let texts = conversation_texts(&second.body, anthropic);
    assert_eq!(
        texts,
        [
            ("user", "first question".to_owned()),
            ("assistant", REPLY.to_owned()),
            ("user", "second question".to_owned())
        ],
        "the second turn sends the first turn's history"
    );
    let system = if anthropic {
        second.body["system"].as_str().map(str::to_owned)
    } else {
        second.body["messages"][0]["content"].as_str().map(str::to_owned)
    };
    assert_eq!(system.as_deref(), Some("You are terse."));
    Ok(())
}

/// Returns (role, text) of the conversation messages of a provider request.
fn conversation_texts(body: &Value, anthropic: bool) -> Vec<(&'static str, String)> {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    messages
        .iter()
        .filter(|m| anthropic || m["role"] != "system")
        .map(|m| {
            let role = if m["role"] == "assistant" { "assistant" } else { "user" };
            let text = match &m["content"] {
                Value::String(text) => text.clone(),
                Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
                _ => String::new(),
            };
            (role, text)
        })
        .collect()
}

async fn anthropic(mode: Mode) -> anyhow::Result<()> {
    relays_exactly(mode, true).await
}

async fn openai(mode: Mode) -> anyhow::Result<()> {
    relays_exactly(mode, false).await
}

both_modes!(anthropic_streams_are_relayed_exactly, anthropic);
both_modes!(openai_streams_are_relayed_exactly, openai);
