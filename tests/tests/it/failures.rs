//! Provider failures become typed error events; the next message works.

use std::time::Duration;

use avm_tests::cluster::{Cluster, Llm, Mode, Options, TEST_API_KEY};
use avm_tests::mock_llm::{MockBehavior, MockFailure, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{assert_text_turn, conversation, send_and_finish, types};

/// Asserts a failed turn's order and returns the error code.
fn assert_failed_turn(frames: &[Value]) -> String {
    let kinds = types(frames);
    let tail: Vec<&str> = kinds
        .iter()
        .map(String::as_str)
        .skip_while(|k| *k != "error_received")
        .collect();
    assert_eq!(tail, ["error_received", "error_message", "error_occurred"], "{kinds:?}");
    assert!(!kinds.contains(&"conversation_end".to_owned()));
    for frame in frames {
        assert!(!frame.to_string().contains(TEST_API_KEY), "the API key leaked: {frame}");
    }
    let occurred = &frames[frames.len() - 1]["data"];
    let received = &frames[frames.len() - 3]["data"];
    assert_eq!(received["errorCode"], occurred["code"]);
    assert!(occurred["message"].as_str().is_some_and(|m| !m.is_empty()));
    let stored = &frames[frames.len() - 2]["data"];
    assert_eq!(stored["subtype"], "error");
    occurred["code"].as_str().unwrap_or_default().to_owned()
}

both_modes!(provider_failures_are_typed_and_recoverable, failures);

async fn failures(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let mut options = Options::with_llm(Llm::Anthropic {
        base_url: mock.anthropic_base_url(),
    });
    options.llm_idle_timeout = Some(Duration::from_millis(500));
    let cluster = Cluster::start(mode, options).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    let cases = [
        (MockFailure::Status(401), "LLM_UNAUTHENTICATED"),
        (MockFailure::Status(429), "LLM_RATE_LIMITED"),
        (MockFailure::Status(500), "LLM_UNAVAILABLE"),
        (MockFailure::MalformedStream, "LLM_BAD_RESPONSE"),
        (MockFailure::DropAfter(2), "LLM_BAD_RESPONSE"),
        (MockFailure::Hang, "LLM_TIMEOUT"),
    ];
    for (failure, code) in cases {
        mock.set_behavior(MockBehavior {
            failure: Some(failure.clone()),
            ..MockBehavior::default()
        });
        let frames = send_and_finish(&mut client, &chat.image_id, json!("hi")).await?;
        let got = assert_failed_turn(&frames);
        assert!(
            got == code || (matches!(failure, MockFailure::DropAfter(_)) && got == "LLM_UNREACHABLE"),
            "{failure:?} gave {got}, expected {code}"
        );
    }
    mock.set_behavior(MockBehavior::default());
    let frames = send_and_finish(&mut client, &chat.image_id, json!("and now?")).await?;
    assert_text_turn(&frames);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_provider_is_reported() -> anyhow::Result<()> {
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?;
    let base_url = format!("http://{}", closed.local_addr()?);
    drop(closed);
    let cluster = Cluster::start(Mode::OneProcess, Options::with_llm(Llm::OpenAi { base_url })).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    let frames = send_and_finish(&mut client, &chat.image_id, json!("anyone there?")).await?;
    assert_eq!(assert_failed_turn(&frames), "LLM_UNREACHABLE");
    Ok(())
}
