//! The LLM drivers against the mock LLM's real wire formats: what they send,
//! what they stream back, and how every failure class is reported.

use std::sync::Arc;
use std::time::Duration;

use avm_common::config::Secret;
use avm_runtime::config::{LlmConfig, ProviderKind};
use avm_runtime::llm::{
    LlmContent, LlmError, LlmErrorKind, LlmEvent, LlmMessage, LlmProvider, LlmRequest, LlmRole, LlmStream, StopReason,
    ToolCall, ToolOutput, ToolSpec, build_provider,
};
use avm_tests::mock_llm::{MockApi, MockBehavior, MockFailure, MockLlm};
use futures::StreamExt;
use serde_json::{Value, json};

/// A key distinctive enough that finding it anywhere is a leak.
const KEY: &str = "sk-test-7f3a9c1e-never-show-me";
const MODEL: &str = "test-model";
/// Bounds every wait so that a broken driver fails the test instead of hanging it.
const DEADLINE: Duration = Duration::from_secs(20);
const APIS: [MockApi; 2] = [MockApi::Anthropic, MockApi::OpenAi];

fn config(api: MockApi, mock: &MockLlm) -> LlmConfig {
    let (provider, base_url) = match api {
        MockApi::Anthropic => (ProviderKind::Anthropic, mock.anthropic_base_url()),
        MockApi::OpenAi => (ProviderKind::Openai, mock.openai_base_url()),
    };
    config_for(provider, base_url)
}

fn config_for(provider: ProviderKind, base_url: String) -> LlmConfig {
    LlmConfig {
        provider: Some(provider),
        api_key: Secret::new(KEY),
        base_url: Some(base_url),
        model: MODEL.to_owned(),
        max_tokens: 256,
        request_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(10),
        ..LlmConfig::default()
    }
}

fn provider(config: &LlmConfig) -> Arc<dyn LlmProvider> {
    build_provider(config).unwrap_or_else(|err| panic!("the provider does not build: {err}"))
}

fn text(text: &str) -> LlmContent {
    LlmContent::Text(text.to_owned())
}

fn message(role: LlmRole, content: Vec<LlmContent>) -> LlmMessage {
    LlmMessage { role, content }
}

fn ask(question: &str) -> LlmRequest {
    LlmRequest {
        model: MODEL.to_owned(),
        system: None,
        messages: std::sync::Arc::new(vec![message(LlmRole::User, vec![text(question)])]),
        max_tokens: 256,
        tools: Arc::default(),
    }
}

/// Reads the stream to its end; returns the events and the error that ended it, if any.
async fn drain(mut stream: LlmStream) -> (Vec<LlmEvent>, Option<LlmError>) {
    let mut events = Vec::new();
    let read = async {
        while let Some(item) = stream.next().await {
            match item {
                Ok(event) => events.push(event),
                Err(err) => return Some(err),
            }
        }
        None
    };
    match tokio::time::timeout(DEADLINE, read).await {
        Ok(err) => (events, err),
        Err(_) => panic!("the stream did not end within {DEADLINE:?}"),
    }
}

/// Streams `request` and returns the events and the error, whether it came
/// before the stream (HTTP status) or in it.
async fn run(provider: &dyn LlmProvider, request: LlmRequest) -> (Vec<LlmEvent>, Option<LlmError>) {
    match tokio::time::timeout(DEADLINE, provider.stream(request)).await {
        Ok(Ok(stream)) => drain(stream).await,
        Ok(Err(err)) => (Vec::new(), Some(err)),
        Err(_) => panic!("the provider did not answer within {DEADLINE:?}"),
    }
}

fn streamed_text(events: &[LlmEvent]) -> String {
    events
        .iter()
        .filter_map(|event| match event {
            LlmEvent::TextDelta(text) => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

fn deltas(events: &[LlmEvent]) -> usize {
    events
        .iter()
        .filter(|event| matches!(event, LlmEvent::TextDelta(_)))
        .count()
}

/// Asserts the failure's kind and that its message is useful and keyless.
fn assert_failure(err: Option<LlmError>, kind: LlmErrorKind, context: &str) -> LlmError {
    let err = err.unwrap_or_else(|| panic!("{context}: expected {kind:?}, the stream succeeded"));
    assert_eq!(err.kind, kind, "{context}: {}", err.message);
    assert!(
        !err.message.contains(KEY),
        "{context}: the key leaked into {:?}",
        err.message
    );
    assert!(
        err.message.starts_with(|c: char| c.is_lowercase()),
        "{context}: {:?}",
        err.message
    );
    err
}

#[tokio::test]
async fn streams_exactly_what_the_provider_sent_with_its_usage() {
    let reply = "Hello there, streamed in  pieces.\nDone.";
    let mock = MockLlm::start(MockBehavior {
        reply: Some(reply.to_owned()),
        input_tokens: Some(42),
        ..MockBehavior::default()
    })
    .await
    .unwrap();
    let pieces: Vec<LlmEvent> = ["Hello ", "there, ", "streamed ", "in  ", "pieces.\n", "Done."]
        .into_iter()
        .map(|piece| LlmEvent::TextDelta(piece.to_owned()))
        .collect();
    for api in APIS {
        let provider = provider(&config(api, &mock));
        let (events, err) = run(provider.as_ref(), ask("hi")).await;
        assert_eq!(err, None, "{api:?}");
        let (start_input, usage_input) = match api {
            // Anthropic reports the input count at the start; OpenAI only in the final usage chunk.
            MockApi::Anthropic => (Some(42), None),
            MockApi::OpenAi => (None, Some(42)),
        };
        let mut expected = vec![LlmEvent::Start {
            model: MODEL.to_owned(),
            input_tokens: start_input,
        }];
        expected.extend(pieces.iter().cloned());
        expected.push(LlmEvent::Usage {
            input_tokens: usage_input,
            output_tokens: Some(6),
        });
        expected.push(LlmEvent::Stop {
            reason: StopReason::EndTurn,
        });
        assert_eq!(events, expected, "{api:?}");
        assert_eq!(streamed_text(&events), reply);
    }
    let stats = mock
        .wait_for_stats(|stats| stats.streams_completed == 2, DEADLINE)
        .await
        .unwrap();
    assert_eq!(stats.deltas_sent, 12);
}

#[tokio::test]
async fn counts_the_default_reply_and_input_words() {
    let mock = MockLlm::start(MockBehavior {
        tokens: 7,
        ..MockBehavior::default()
    })
    .await
    .unwrap();
    let mut request = ask("one two three");
    request.system = Some("You are terse.".to_owned());
    for api in APIS {
        let (events, err) = run(provider(&config(api, &mock)).as_ref(), request.clone()).await;
        assert_eq!(err, None, "{api:?}");
        assert_eq!(
            streamed_text(&events),
            MockBehavior {
                tokens: 7,
                ..MockBehavior::default()
            }
            .reply_text()
        );
        let input = events.iter().find_map(|event| match event {
            LlmEvent::Start {
                input_tokens: Some(count),
                ..
            }
            | LlmEvent::Usage {
                input_tokens: Some(count),
                ..
            } => Some(*count),
            _ => None,
        });
        assert_eq!(
            input,
            Some(6),
            "{api:?}: the words of the system prompt and the message"
        );
        assert!(events.contains(&LlmEvent::Usage {
            input_tokens: input.filter(|_| api == MockApi::OpenAi),
            output_tokens: Some(7)
        }));
    }
}

#[tokio::test]
async fn sends_the_system_prompt_history_model_and_key() {
    let mock = MockLlm::start(MockBehavior::default()).await.unwrap();
    let request = LlmRequest {
        model: "claude-or-gpt".to_owned(),
        system: Some("You are terse.".to_owned()),
        messages: std::sync::Arc::new(vec![
            message(LlmRole::User, vec![text("first question")]),
            message(LlmRole::Assistant, vec![text("first answer")]),
            message(LlmRole::User, vec![text("second question")]),
        ]),
        max_tokens: 77,
        tools: Arc::default(),
    };
    for api in APIS {
        let (_, err) = run(provider(&config(api, &mock)).as_ref(), request.clone()).await;
        assert_eq!(err, None, "{api:?}");
    }
    let requests = mock.wait_for_requests(2, DEADLINE).await.unwrap();

    let anthropic = &requests[0];
    assert_eq!(anthropic.api, MockApi::Anthropic);
    assert_eq!(anthropic.api_key.as_deref(), Some(KEY), "x-api-key");
    assert_eq!(anthropic.anthropic_version.as_deref(), Some("2023-06-01"));
    assert_eq!(
        anthropic.body,
        json!({
            "model": "claude-or-gpt",
            "max_tokens": 77,
            "system": "You are terse.",
            "stream": true,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "first question"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "first answer"}]},
                {"role": "user", "content": [{"type": "text", "text": "second question"}]},
            ],
        })
    );

    let openai = &requests[1];
    assert_eq!(openai.api, MockApi::OpenAi);
    assert_eq!(openai.api_key.as_deref(), Some(KEY), "authorization: Bearer");
    assert_eq!(openai.anthropic_version, None);
    assert_eq!(
        openai.body,
        json!({
            "model": "claude-or-gpt",
            "max_tokens": 77,
            "stream": true,
            "stream_options": {"include_usage": true},
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "first question"},
                {"role": "assistant", "content": "first answer"},
                {"role": "user", "content": "second question"},
            ],
        })
    );
}

#[tokio::test]
async fn encodes_images_and_documents_per_provider() {
    let mock = MockLlm::start(MockBehavior::default()).await.unwrap();
    let mut request = ask("unused");
    std::sync::Arc::make_mut(&mut request.messages)[0].content = vec![
        text("what is this?"),
        LlmContent::Image {
            media_type: "image/png".to_owned(),
            data: "iVBORw0KGgo=".to_owned(),
        },
        LlmContent::File {
            media_type: "application/pdf".to_owned(),
            data: "JVBERi0=".to_owned(),
            filename: Some("a.pdf".to_owned()),
        },
    ];
    for api in APIS {
        let (_, err) = run(provider(&config(api, &mock)).as_ref(), request.clone()).await;
        assert_eq!(err, None, "{api:?}");
    }
    let requests = mock.wait_for_requests(2, DEADLINE).await.unwrap();
    assert_eq!(
        requests[0].body["messages"][0]["content"],
        json!([
            {"type": "text", "text": "what is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}, "title": "a.pdf"},
        ])
    );
    assert_eq!(
        requests[1].body["messages"][0]["content"],
        json!([
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            {"type": "file", "file": {"filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0="}},
        ])
    );
}

#[tokio::test]
async fn stops_at_max_tokens() {
    let mock = MockLlm::start(MockBehavior {
        tokens: 10,
        ..MockBehavior::default()
    })
    .await
    .unwrap();
    let mut request = ask("go on");
    request.max_tokens = 3;
    for api in APIS {
        let (events, err) = run(provider(&config(api, &mock)).as_ref(), request.clone()).await;
        assert_eq!(err, None, "{api:?}");
        assert_eq!(streamed_text(&events), "mock-0 mock-1 mock-2 ", "{api:?}");
        assert_eq!(
            events.last(),
            Some(&LlmEvent::Stop {
                reason: StopReason::MaxTokens
            }),
            "{api:?}"
        );
    }
}

#[tokio::test]
async fn accepts_base_urls_with_a_trailing_slash() {
    let mock = MockLlm::start(MockBehavior::default()).await.unwrap();
    for (provider_kind, base_url) in [
        (ProviderKind::Anthropic, format!("{}/", mock.anthropic_base_url())),
        (ProviderKind::Openai, format!("{}/", mock.openai_base_url())),
    ] {
        let (events, err) = run(
            provider(&config_for(provider_kind, base_url.clone())).as_ref(),
            ask("hi"),
        )
        .await;
        assert_eq!(err, None, "{base_url}");
        assert_eq!(streamed_text(&events), MockBehavior::default().reply_text());
    }
}

#[tokio::test]
async fn http_failures_map_to_kinds_without_the_key() {
    let mock = MockLlm::start(MockBehavior::default()).await.unwrap();
    let cases = [
        (401, LlmErrorKind::Unauthenticated),
        (403, LlmErrorKind::Unauthenticated),
        (429, LlmErrorKind::RateLimited),
        (400, LlmErrorKind::InvalidRequest),
        (404, LlmErrorKind::InvalidRequest),
        (422, LlmErrorKind::InvalidRequest),
        (500, LlmErrorKind::Unavailable),
        (503, LlmErrorKind::Unavailable),
        (529, LlmErrorKind::Unavailable),
    ];
    for api in APIS {
        let provider = provider(&config(api, &mock));
        for (status, kind) in cases {
            mock.set_behavior(MockBehavior {
                failure: Some(MockFailure::Status(status)),
                ..MockBehavior::default()
            });
            let context = format!("{api:?} HTTP {status}");
            let err = match tokio::time::timeout(DEADLINE, provider.stream(ask("hi")))
                .await
                .unwrap()
            {
                Ok(_) => panic!("{context}: the provider accepted a failed request"),
                Err(err) => err,
            };
            let err = assert_failure(Some(err), kind, &context);
            assert!(
                err.message.contains(&format!("(HTTP {status})")),
                "{context}: {}",
                err.message
            );
            match status {
                // The mock echoes the key in its 401 body; the driver passes the explanation on, scrubbed.
                401 => assert!(
                    err.message.contains("invalid API key: <redacted>"),
                    "{context}: {}",
                    err.message
                ),
                429 => assert!(err.message.contains("retry in 1s"), "{context}: {}", err.message),
                _ => {}
            }
        }
    }
}

#[tokio::test]
async fn a_malformed_stream_is_a_bad_response() {
    let mock = MockLlm::start(MockBehavior {
        failure: Some(MockFailure::MalformedStream),
        tokens: 10,
        ..MockBehavior::default()
    })
    .await
    .unwrap();
    for api in APIS {
        let (events, err) = run(provider(&config(api, &mock)).as_ref(), ask("hi")).await;
        assert_eq!(
            streamed_text(&events),
            "mock-0 mock-1 ",
            "{api:?}: the good deltas before the bad line"
        );
        assert_failure(err, LlmErrorKind::BadResponse, &format!("{api:?}"));
    }
}

#[tokio::test]
async fn a_dropped_connection_is_reported_after_the_text_received() {
    let mock = MockLlm::start(MockBehavior {
        failure: Some(MockFailure::DropAfter(3)),
        tokens: 10,
        ..MockBehavior::default()
    })
    .await
    .unwrap();
    for api in APIS {
        let (events, err) = run(provider(&config(api, &mock)).as_ref(), ask("hi")).await;
        assert_eq!(deltas(&events), 3, "{api:?}");
        assert!(
            !events.iter().any(|event| matches!(event, LlmEvent::Stop { .. })),
            "{api:?}"
        );
        let err = assert_failure(err, LlmErrorKind::Unreachable, &format!("{api:?}"));
        assert!(err.message.contains("broke mid-reply"), "{api:?}: {}", err.message);
    }
}

#[tokio::test]
async fn a_closed_port_is_unreachable() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    for (provider_kind, base_url) in [
        (ProviderKind::Anthropic, format!("http://{addr}")),
        (ProviderKind::Openai, format!("http://{addr}/v1")),
    ] {
        let (_, err) = run(provider(&config_for(provider_kind, base_url)).as_ref(), ask("hi")).await;
        let err = assert_failure(err, LlmErrorKind::Unreachable, &format!("{provider_kind:?}"));
        assert_eq!(
            err.message,
            format!("cannot reach the LLM provider at {addr}: connection refused")
        );
    }
}

#[tokio::test]
async fn a_hanging_provider_times_out() {
    let mock = MockLlm::start(MockBehavior {
        failure: Some(MockFailure::Hang),
        ..MockBehavior::default()
    })
    .await
    .unwrap();
    for api in APIS {
        let mut config = config(api, &mock);
        config.request_timeout = Duration::from_millis(300);
        let (events, err) = run(provider(&config).as_ref(), ask("hi")).await;
        assert!(events.is_empty());
        let err = assert_failure(err, LlmErrorKind::Timeout, &format!("{api:?}"));
        assert!(err.message.contains("did not answer within 300ms"), "{}", err.message);
    }
    assert_eq!(mock.wait_for_requests(2, DEADLINE).await.unwrap().len(), 2);
    // Shutting down ends the requests still hanging.
    tokio::time::timeout(DEADLINE, mock.shutdown())
        .await
        .expect("the mock shuts down in time");
}

#[tokio::test]
async fn silence_mid_reply_times_out() {
    // The mock sends its headers and first events, then waits far longer than the idle timeout.
    let mock = MockLlm::start(MockBehavior {
        first_token_delay: Duration::from_secs(60),
        ..MockBehavior::default()
    })
    .await
    .unwrap();
    for api in APIS {
        let mut config = config(api, &mock);
        config.idle_timeout = Duration::from_millis(300);
        let (events, err) = run(provider(&config).as_ref(), ask("hi")).await;
        assert!(
            matches!(events.first(), Some(LlmEvent::Start { .. })),
            "{api:?}: {events:?}"
        );
        assert_eq!(deltas(&events), 0);
        let err = assert_failure(err, LlmErrorKind::Timeout, &format!("{api:?}"));
        assert!(err.message.contains("sent nothing for 300ms"), "{}", err.message);
    }
    mock.wait_for_stats(|stats| stats.streams_cancelled == 2, DEADLINE)
        .await
        .unwrap();
}

#[tokio::test]
async fn dropping_the_stream_stops_the_provider_sending() {
    let total = 100_000;
    let mock = MockLlm::start(MockBehavior {
        tokens: total,
        token_interval: Duration::from_millis(2),
        ..MockBehavior::default()
    })
    .await
    .unwrap();
    for (round, api) in APIS.into_iter().enumerate() {
        let provider = provider(&config(api, &mock));
        let mut stream = provider.stream(ask("talk a lot")).await.unwrap();
        let mut seen = 0;
        while seen < 3 {
            let event = tokio::time::timeout(DEADLINE, stream.next()).await.unwrap();
            if let Some(Ok(LlmEvent::TextDelta(_))) = event {
                seen += 1;
            }
        }
        drop(stream);
        let stats = mock.wait_for_cancelled(round + 1, DEADLINE).await.unwrap();
        assert!(stats.deltas_sent < total, "{api:?}: the mock streamed to the end");
    }
    assert_eq!(mock.stats().streams_completed, 0);
}

/// Returns the complete tool calls of a reply.
fn tool_calls(events: &[LlmEvent]) -> Vec<ToolCall> {
    events
        .iter()
        .filter_map(|event| match event {
            LlmEvent::ToolUseStop(call) => Some(call.clone()),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn tool_calls_stream_and_their_results_go_back_in_each_format() {
    let mock = MockLlm::start(MockBehavior::default()).await.unwrap();
    let tools = Arc::new(vec![ToolSpec {
        name: "read_file".into(),
        description: "Reads a file of the workspace.".into(),
        input_schema: json!({"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}),
    }]);
    let question = r#"what is in it? [mock call='read_file:{"path": "notes.txt"}' call=read_file:{"path":"b"}]"#;
    for api in APIS {
        let provider = provider(&config(api, &mock));
        let mut request = ask(question);
        request.tools = tools.clone();
        let (events, err) = run(provider.as_ref(), request.clone()).await;
        assert_eq!(err, None, "{api:?}");
        let calls = tool_calls(&events);
        assert_eq!(
            calls
                .iter()
                .map(|call| (call.name.as_str(), call.input.clone()))
                .collect::<Vec<_>>(),
            [
                ("read_file", json!({"path": "notes.txt"})),
                ("read_file", json!({"path": "b"}))
            ],
            "{api:?}: {events:?}"
        );
        assert!(
            events
                .iter()
                .filter(|event| matches!(event, LlmEvent::ToolInputDelta { .. }))
                .count()
                > 2,
            "{api:?}: the input streams in pieces: {events:?}"
        );
        assert!(
            matches!(
                events.last(),
                Some(LlmEvent::Stop {
                    reason: StopReason::ToolUse
                })
            ),
            "{api:?}"
        );
        // The tools' results go back, and the reply uses them.
        let messages = Arc::make_mut(&mut request.messages);
        messages.push(message(
            LlmRole::Assistant,
            calls.iter().cloned().map(LlmContent::ToolUse).collect(),
        ));
        let results = calls
            .iter()
            .zip(["remember the milk", "no such file"])
            .map(|(call, text)| {
                LlmContent::ToolResult(ToolOutput {
                    tool_call_id: call.id.clone(),
                    text: text.into(),
                    is_error: text.starts_with("no "),
                })
            })
            .collect();
        messages.push(message(LlmRole::User, results));
        let (events, err) = run(provider.as_ref(), request.clone()).await;
        assert_eq!(err, None, "{api:?}");
        assert_eq!(
            streamed_text(&events),
            "Tool results: remember the milk | no such file",
            "{api:?}"
        );
        // A call left without its result is refused, as the real APIs refuse it.
        let messages = Arc::make_mut(&mut request.messages);
        messages.pop();
        messages.push(message(LlmRole::User, vec![text("never mind")]));
        let (_, err) = run(provider.as_ref(), request).await;
        assert_failure(err, LlmErrorKind::InvalidRequest, "an unpaired tool call");
    }
    let sent = mock.requests();
    assert_eq!(sent[0].body["tools"][0]["input_schema"]["required"], json!(["path"]));
    assert_eq!(sent[3].body["tools"][0]["function"]["name"], "read_file");
}

#[tokio::test]
async fn a_directive_in_the_last_user_message_overrides_the_behavior() {
    let mock = MockLlm::start(MockBehavior::default()).await.unwrap();
    let mut request = ask(r#"please [mock reply="custom words here" input_tokens=9] thanks"#);
    std::sync::Arc::make_mut(&mut request.messages).insert(0, message(LlmRole::User, vec![text("[mock fail=500]")]));
    std::sync::Arc::make_mut(&mut request.messages).insert(1, message(LlmRole::Assistant, vec![text("ok")]));
    for api in APIS {
        let (events, err) = run(provider(&config(api, &mock)).as_ref(), request.clone()).await;
        assert_eq!(err, None, "{api:?}: only the last user message counts");
        assert_eq!(streamed_text(&events), "custom words here");
        assert!(
            events.iter().any(|event| matches!(
                event,
                LlmEvent::Start {
                    input_tokens: Some(9),
                    ..
                } | LlmEvent::Usage {
                    input_tokens: Some(9),
                    ..
                }
            )),
            "{api:?}: {events:?}"
        );
    }
    let (_, err) = run(
        provider(&config(MockApi::OpenAi, &mock)).as_ref(),
        ask("[mock fail=429]"),
    )
    .await;
    assert_failure(err, LlmErrorKind::RateLimited, "directive fail=429");
    let (events, err) = run(
        provider(&config(MockApi::Anthropic, &mock)).as_ref(),
        ask("[mock tokens=lots]"),
    )
    .await;
    assert_eq!(err, None, "a bad directive is ignored");
    assert_eq!(streamed_text(&events), MockBehavior::default().reply_text());
}

#[tokio::test]
async fn the_mock_rejects_what_the_real_apis_reject() {
    let mock = MockLlm::start(MockBehavior::default()).await.unwrap();
    let client = reqwest::Client::new();
    let anthropic = format!("{}/v1/messages", mock.anthropic_base_url());
    let openai = format!("{}/chat/completions", mock.openai_base_url());
    let good = json!({"model": "m", "max_tokens": 5, "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let post = |url: &str, body: String, version: bool| {
        let mut request = client.post(url).header("content-type", "application/json").body(body);
        if version {
            request = request.header("anthropic-version", "2023-06-01");
        }
        request.send()
    };
    let without = |field: &str| {
        let mut body = good.clone();
        body.as_object_mut().unwrap().remove(field);
        body.to_string()
    };

    let cases = [
        (&anthropic, "{not json".to_owned(), true, "not valid JSON"),
        (&anthropic, good.to_string(), false, "anthropic-version"),
        (&anthropic, without("max_tokens"), true, "max_tokens"),
        (&anthropic, without("model"), true, "model"),
        (
            &anthropic,
            json!({"model": "m", "max_tokens": 5, "stream": true, "messages": [{"role": "system", "content": "x"}]})
                .to_string(),
            true,
            "unexpected role",
        ),
        (&openai, without("messages"), false, "messages"),
        (&openai, without("stream"), false, "stream"),
    ];
    for (url, body, version, expected) in cases {
        let response = post(url, body.clone(), version).await.unwrap();
        assert_eq!(response.status(), 400, "{url} {body}");
        let error: Value = response.json().await.unwrap();
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(expected), "{url} {body}: {error}");
        if url == &anthropic {
            assert_eq!(error["type"], "error");
            assert_eq!(error["error"]["type"], "invalid_request_error");
        } else {
            assert_eq!(error["error"]["type"], "invalid_request_error");
        }
    }
    let response = post(&anthropic, good.to_string(), true).await.unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let body = response.text().await.unwrap();
    let names: Vec<&str> = body.lines().filter_map(|line| line.strip_prefix("event: ")).collect();
    assert_eq!(
        names,
        [
            "message_start",
            "content_block_start",
            "ping",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let body = post(&openai, good.to_string(), false)
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    assert_eq!(mock.stats().requests, 9);
}

#[tokio::test]
async fn offline_is_deterministic_and_echoes_the_user() {
    let config = LlmConfig {
        model: "offline-model".to_owned(),
        ..LlmConfig::default()
    };
    let provider = provider(&config);
    assert_eq!(provider.name(), "offline");
    let mut request = ask("earlier");
    request.system = Some("be kind".to_owned());
    std::sync::Arc::make_mut(&mut request.messages).push(message(LlmRole::Assistant, vec![text("sure")]));
    std::sync::Arc::make_mut(&mut request.messages)
        .push(message(LlmRole::User, vec![text("hello  world"), text("again")]));

    let (events, err) = run(provider.as_ref(), request.clone()).await;
    assert_eq!(err, None);
    let (again, _) = run(provider.as_ref(), request).await;
    assert_eq!(events, again, "the same request gets the same reply");

    assert_eq!(
        events.first(),
        Some(&LlmEvent::Start {
            model: "offline".to_owned(),
            input_tokens: Some(7)
        })
    );
    let text = streamed_text(&events);
    assert!(text.starts_with("AgentVM is running offline"), "{text}");
    assert!(text.contains("LLM_PROVIDER") && text.contains("LLM_API_KEY"), "{text}");
    assert!(text.ends_with("You said: hello  world again"), "{text}");
    let count = deltas(&events);
    assert!(count > 10, "the reply streams in small pieces");
    let tail = &events[events.len() - 2..];
    assert_eq!(
        tail,
        [
            LlmEvent::Usage {
                input_tokens: Some(7),
                output_tokens: Some(count as u64)
            },
            LlmEvent::Stop {
                reason: StopReason::EndTurn
            }
        ]
    );
}
