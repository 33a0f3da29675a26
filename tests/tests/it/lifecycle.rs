//! History survives restarts; idle agents are dropped and rehydrated.

use std::time::Duration;

use avm_tests::cluster::{Cluster, Llm, Mode, Options};
use avm_tests::mock_llm::{MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{assert_text_turn, conversation, send_and_finish, types};

/// Returns the number of user/assistant messages of the provider's last request.
fn last_request_len(mock: &MockLlm) -> usize {
    mock.requests()
        .last()
        .and_then(|r| r.body["messages"].as_array().map(Vec::len))
        .unwrap_or(0)
}

both_modes!(history_survives_a_restart, restart);

async fn restart(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let cluster = Cluster::start(
        mode,
        Options::with_llm(Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        }),
    )
    .await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({"name": "kept"})).await?;
    assert_text_turn(&send_and_finish(&mut client, &chat.image_id, json!("remember me")).await?);
    let images_before = client.request("image_list", json!({"containerId": "default"})).await?;
    let messages_before = client
        .request("image_messages", json!({"imageId": chat.image_id}))
        .await?;
    drop(client);

    let cluster = cluster.restart().await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let images_after = client.request("image_list", json!({"containerId": "default"})).await?;
    let messages_after = client
        .request("image_messages", json!({"imageId": chat.image_id}))
        .await?;
    let strip = |records: &Value| -> Vec<Value> {
        records["records"]
            .as_array()
            .map(|list| {
                list.iter()
                    .map(|r| json!({"imageId": r["imageId"], "name": r["name"], "sessionId": r["sessionId"], "createdAt": r["createdAt"]}))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(strip(&images_after), strip(&images_before));
    assert_eq!(messages_after["messages"], messages_before["messages"]);

    client.subscribe(&chat.session_id, None).await?;
    let frames = send_and_finish(&mut client, &chat.image_id, json!("do you remember?")).await?;
    assert!(
        types(&frames).contains(&"agent_registered".to_owned()),
        "a new agent after the restart"
    );
    assert_text_turn(&frames);
    assert_eq!(
        last_request_len(&mock),
        3,
        "the rehydrated agent sends the earlier turn"
    );
    Ok(())
}

both_modes!(an_idle_agent_is_dropped_and_rehydrated, idle);

async fn idle(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let mut options = Options::with_llm(Llm::OpenAi {
        base_url: mock.openai_base_url(),
    });
    options.agent_idle_timeout = Some(Duration::from_millis(200));
    let cluster = Cluster::start(mode, options).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "c1", json!({})).await?;
    assert_text_turn(&send_and_finish(&mut client, &chat.image_id, json!("first")).await?);

    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let agents = client.request("agent_list", json!({"containerId": "c1"})).await?;
        if agents["agents"].as_array().is_some_and(Vec::is_empty) {
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the idle agent was never dropped"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let frames = send_and_finish(&mut client, &chat.image_id, json!("second")).await?;
    assert!(
        types(&frames).contains(&"agent_unregistered".to_owned())
            || types(&frames).contains(&"agent_registered".to_owned())
    );
    assert_text_turn(&frames);
    // user, assistant, user: the history came back from the session service.
    let openai_messages = mock.requests().last().and_then(|r| {
        r.body["messages"]
            .as_array()
            .map(|m| m.iter().filter(|m| m["role"] != "system").count())
    });
    assert_eq!(openai_messages, Some(3));
    Ok(())
}
