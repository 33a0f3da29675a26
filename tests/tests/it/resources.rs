//! Versioned resources as a user meets them: register prompts and agent
//! definitions over REST, resolve them by `resource://` URI, and hold
//! conversations that run exactly the resolved versions.

use anyhow::Context;
use avm_tests::cluster::{Cluster, Llm, Mode, Options};
use avm_tests::mock_llm::{MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{assert_text_turn, call, conversation, send_and_finish};

/// Registers a prompt version and returns the created body.
async fn register_prompt(cluster: &Cluster, name: &str, version: &str, template: &str) -> anyhow::Result<Value> {
    let body = json!({
        "kind": "prompt",
        "name": name,
        "version": version,
        "content": {"template": template, "variables": [{"name": "company"}]},
        "tags": ["sales"],
    });
    let (status, created) = call(cluster, "POST", "/v1/resources", Some(body)).await?;
    anyhow::ensure!(status == 201, "register {name}@{version}: {status} {created}");
    Ok(created)
}

const V1: &str = "You are the sales assistant of {{company}} (v1).";
const V2: &str = "You sell for {{ company }}, politely (v2.1).";

both_modes!(a_conversation_runs_the_resolved_prompt_version, resolved_prompt);

async fn resolved_prompt(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let llm = Llm::Anthropic {
        base_url: mock.anthropic_base_url(),
    };
    let cluster = Cluster::start(mode, Options::with_llm(llm)).await?;
    let first = register_prompt(&cluster, "sales-assistant", "1.0.0", V1).await?;
    assert_eq!(first["created"], true);
    let second = register_prompt(&cluster, "sales-assistant", "2.1.0", V2).await?;
    assert_eq!(second["created"], false, "a second version of the same resource");
    assert_eq!(second["resource"]["latestVersion"], "2.1.0");

    let uri = "resource://prompts/sales-assistant@^2";
    let (status, resolved) = call(&cluster, "GET", &format!("/v1/resources/resolve?uri={uri}"), None).await?;
    assert_eq!(status, 200, "{resolved}");
    assert_eq!(resolved["version"], "2.1.0");
    assert_eq!(resolved["uri"], "resource://prompts/sales-assistant@2.1.0");
    assert_eq!(resolved["resource"]["content"]["template"], V2);
    let (_, exact) = call(
        &cluster,
        "GET",
        "/v1/resources/resolve?uri=resource://prompts/sales-assistant@1.0.0",
        None,
    )
    .await?;
    assert_eq!(exact["version"], "1.0.0");

    // A conversation whose system prompt is the URI, with its variables.
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let config = json!({"systemPrompt": uri, "variables": {"company": "Acme"}});
    let chat = conversation(&mut client, "default", config).await?;
    assert_eq!(chat.record["systemPrompt"], uri, "the image keeps the reference");
    assert_eq!(chat.record["variables"]["company"], "Acme");
    let frames = send_and_finish(&mut client, &chat.image_id, json!("what do you sell?")).await?;
    assert_text_turn(&frames);
    let requests = mock.requests();
    assert_eq!(
        requests.last().map(|request| request.body["system"].clone()),
        Some(json!("You sell for Acme, politely (v2.1).")),
        "the provider saw the 2.1.0 prompt, rendered"
    );
    let exact = json!(["resource://prompts/sales-assistant@2.1.0"]);
    let reply = frames
        .iter()
        .find(|f| f["type"] == "assistant_message")
        .context("reply")?;
    assert_eq!(reply["data"]["resources"], exact, "the turn records what it ran");
    let (_, history) = call(&cluster, "GET", &format!("/v1/images/{}/messages", chat.image_id), None).await?;
    assert_eq!(history["messages"][1]["resources"], exact, "and the history keeps it");

    // Published versions never change, so the conversation can be explained later.
    let (status, republish) = call(
        &cluster,
        "PUT",
        &format!(
            "/v1/resources/{}",
            first["resource"]["resourceId"].as_str().unwrap_or_default()
        ),
        Some(json!({"version": "2.1.0", "content": {"template": "changed"}})),
    )
    .await?;
    assert_eq!(
        (status, republish["error"]["code"].clone()),
        (409, json!("VERSION_EXISTS"))
    );

    // References are checked when the image is made: a clear error, no image.
    let cases = [
        (json!({"systemPrompt": "resource://prompts/nope"}), "RESOURCE_NOT_FOUND"),
        (
            json!({"systemPrompt": "resource://prompts/sales-assistant@^3"}),
            "VERSION_NOT_FOUND",
        ),
        (json!({"systemPrompt": uri}), "MISSING_VARIABLE"),
        (json!({"agent": "resource://agents/nope"}), "RESOURCE_NOT_FOUND"),
    ];
    for (config, code) in cases {
        let answer = client
            .request("image_create", json!({"containerId": "default", "config": config}))
            .await?;
        assert_eq!(answer["code"], code, "{config}: {answer}");
    }
    Ok(())
}

both_modes!(an_agent_definition_brings_its_prompt_and_model, agent_definition);

async fn agent_definition(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let llm = Llm::OpenAi {
        base_url: mock.openai_base_url(),
    };
    let cluster = Cluster::start(mode, Options::with_llm(llm)).await?;
    register_prompt(&cluster, "support", "1.0.0", "Help the customers of {{company}}.").await?;
    let agent = json!({
        "kind": "agent",
        "name": "support-bot",
        "version": "1.2.0",
        "content": {
            "prompt": "resource://prompts/support@^1",
            "model": "agent-model-7",
            "variables": {"company": "Initech"},
            "parameters": {"maxTokens": 321},
        },
    });
    let (status, created) = call(&cluster, "POST", "/v1/resources", Some(agent)).await?;
    assert_eq!(status, 201, "{created}");
    assert_eq!(
        created["version"]["dependencies"],
        json!(["resource://prompts/support@^1"]),
        "an agent depends on its prompt"
    );
    let (_, resolved) = call(
        &cluster,
        "GET",
        "/v1/resources/resolve?uri=resource://agents/support-bot",
        None,
    )
    .await?;
    assert_eq!(resolved["dependencies"][0]["uri"], "resource://prompts/support@1.0.0");
    assert_eq!(resolved["renderedPrompt"], "Help the customers of Initech.");

    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(
        &mut client,
        "default",
        json!({"agent": "resource://agents/support-bot@1"}),
    )
    .await?;
    let frames = send_and_finish(&mut client, &chat.image_id, json!("hello")).await?;
    assert_text_turn(&frames);
    let request = mock.requests().pop().context("the provider was called")?;
    assert_eq!(request.body["model"], "agent-model-7");
    assert_eq!(request.body["max_tokens"], 321);
    assert_eq!(request.body["messages"][0]["role"], "system");
    assert_eq!(request.body["messages"][0]["content"], "Help the customers of Initech.");
    let reply = frames
        .iter()
        .find(|f| f["type"] == "assistant_message")
        .context("reply")?;
    assert_eq!(
        reply["data"]["resources"],
        json!([
            "resource://agents/support-bot@1.2.0",
            "resource://prompts/support@1.0.0"
        ])
    );

    // The prompt is in use: deleting it is refused unless forced.
    let prompt_id = resolved["dependencies"][0]["resourceId"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let (status, refused) = call(&cluster, "DELETE", &format!("/v1/resources/{prompt_id}"), None).await?;
    assert_eq!(
        (status, refused["error"]["code"].clone()),
        (409, json!("RESOURCE_IN_USE")),
        "{refused}"
    );
    let (status, forced) = call(
        &cluster,
        "DELETE",
        &format!("/v1/resources/{prompt_id}?force=true"),
        None,
    )
    .await?;
    assert_eq!((status, forced["resourceDeleted"].clone()), (200, json!(true)));
    Ok(())
}
