//! Issue 27 item 5: a tenant's secrets for its agents' sandboxes. An admin
//! stores a value by name; a sandbox resource's `env` names it; the
//! agent's commands see it as an environment variable; no API response,
//! event, history entry, log line or metric shows it, and what tools
//! return to the model has it replaced by `[secret <name>]`.

use anyhow::Context;
use avm_tests::accounts::{create_tenant, create_user};
use avm_tests::cluster::{Cluster, Mode, Options};
use avm_tests::mock_llm::MockApi;
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{call_as, conversation, send_and_finish};
use crate::tools::start_with;

const CANARY: &str = "ghp-canary-7Qz3v9Lx2";

/// The results of a turn's tool calls, in order.
fn tool_results(frames: &[Value]) -> Vec<(String, bool)> {
    frames
        .iter()
        .filter(|frame| frame["type"] == "tool_result")
        .map(|frame| {
            (
                frame["data"]["result"].as_str().unwrap_or_default().to_owned(),
                frame["data"]["isError"].as_bool().unwrap_or(false),
            )
        })
        .collect()
}

/// Publishes a sandbox whose `env` is `env`, and an agent using it.
async fn agent_with_env(cluster: &Cluster, key: &str, name: &str, env: Value) -> anyhow::Result<String> {
    let resources = [
        json!({"kind": "sandbox", "name": name, "version": "1.0.0", "content": {"limits": {}, "env": env}}),
        json!({"kind": "prompt", "name": name, "version": "1.0.0", "content": {"template": "You run commands."}}),
        json!({"kind": "agent", "name": name, "version": "1.0.0", "content": {
            "prompt": format!("resource://prompts/{name}@1"), "sandbox": format!("resource://sandboxes/{name}@1")}}),
    ];
    for resource in resources {
        let (status, body) = call_as(cluster, key, "POST", "/v1/resources", Some(resource)).await?;
        anyhow::ensure!(status == 201, "{body}");
    }
    Ok(format!("resource://agents/{name}@1"))
}

both_modes!(
    a_secret_reaches_the_sandbox_and_nothing_else,
    secret_reaches_the_sandbox_only
);

async fn secret_reaches_the_sandbox_only(mode: Mode) -> anyhow::Result<()> {
    secret_reaches_the_sandbox_only_with(mode, false).await
}

/// The same with commands in an `avm sandbox` child: the secret reaches the
/// command there, and neither the sandbox's log nor anything else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_reaches_a_sandbox_process_and_nothing_else() -> anyhow::Result<()> {
    secret_reaches_the_sandbox_only_with(Mode::PerComponent, true).await
}

async fn secret_reaches_the_sandbox_only_with(mode: Mode, sandbox_process: bool) -> anyhow::Result<()> {
    let options = Options {
        log_level: Some("trace".into()),
        capture_logs: mode == Mode::PerComponent,
        sandbox_process,
        ..Options::default()
    };
    let (_mock, cluster) = start_with(mode, MockApi::OpenAi, options).await?;
    let tenant = create_tenant(&cluster, "secrets", None).await?;
    let admin = tenant.admin.key.clone();
    let member = create_user(&cluster, &tenant, "mia", "member").await?;

    // Stored by an admin, listed by name, never shown; refused to a member.
    let (status, body) = call_as(
        &cluster,
        &admin,
        "PUT",
        "/v1/secrets/github",
        Some(json!({"value": CANARY})),
    )
    .await?;
    assert_eq!((status, &body["name"]), (200, &json!("github")), "{body}");
    let (status, body) = call_as(&cluster, &admin, "GET", "/v1/secrets", None).await?;
    assert_eq!((status, &body), (200, &json!({"secrets": [{"name": "github"}]})));
    let (status, body) = call_as(
        &cluster,
        &member.key,
        "PUT",
        "/v1/secrets/github",
        Some(json!({"value": "member-overwrite"})),
    )
    .await?;
    assert_eq!(status, 403, "{body}");
    let (status, body) = call_as(
        &cluster,
        &admin,
        "PUT",
        "/v1/secrets/short",
        Some(json!({"value": "abc"})),
    )
    .await?;
    assert_eq!(
        (status, &body["error"]["code"]),
        (400, &json!("INVALID_SECRET")),
        "{body}"
    );
    for name in ["a%2Fb".to_owned(), "n".repeat(200), "a%00b".to_owned()] {
        let path = format!("/v1/secrets/{name}");
        let (status, body) = call_as(&cluster, &admin, "PUT", &path, Some(json!({"value": "abcdef"}))).await?;
        assert_eq!(status, 400, "{}: {body}", &name[..name.len().min(20)]);
    }

    // The agent's commands see it; the model sees its name.
    let agent = agent_with_env(
        &cluster,
        &admin,
        "deployer",
        json!({"REGION": "eu-west", "GH_TOKEN": {"secret": "github"}}),
    )
    .await?;
    let mut client = WsClient::connect(&cluster.ws_url_as(&admin)).await?;
    let chat = conversation(
        &mut client,
        "secrets",
        json!({"agent": agent, "tools": ["run_command", "read_file"]}),
    )
    .await?;
    let script = r#"[mock call='1:run_command:{"command": "echo region=$REGION token=$GH_TOKEN; echo $GH_TOKEN > kept.txt; echo ${#GH_TOKEN}"}' call='2:read_file:{"path": "kept.txt"}' rounds=2]"#;
    let frames = send_and_finish(&mut client, &chat.image_id, json!(script)).await?;
    let results = tool_results(&frames);
    assert_eq!(results.len(), 2, "{results:?}");
    let (command, failed) = &results[0];
    assert!(!failed, "{command}");
    assert!(command.contains("region=eu-west token=[secret github]"), "{command}");
    assert!(
        command.contains(&format!("\n{}\n", CANARY.len())),
        "the command saw the whole value: {command}"
    );
    assert_eq!(results[1], ("[secret github]\n".to_owned(), false));

    // Nowhere else: events, history, listings, metrics, logs.
    let events = serde_json::to_string(&frames)?;
    assert!(!events.contains(CANARY), "the value reached the turn's events");
    let (_, history) = call_as(
        &cluster,
        &admin,
        "GET",
        &format!("/v1/images/{}/messages", chat.image_id),
        None,
    )
    .await?;
    assert!(!history.to_string().contains(CANARY), "the value reached history");
    let (_, config) = call_as(&cluster, &admin, "GET", "/v1/config", None).await?;
    assert!(
        !config.to_string().contains(CANARY),
        "the value reached the configuration"
    );
    let metrics = cluster
        .http()?
        .get(cluster.url("/metrics"))
        .send()
        .await?
        .text()
        .await?;
    assert!(!metrics.contains(CANARY), "the value reached the metrics");
    if mode == Mode::PerComponent {
        let logs = cluster.logs();
        assert!(logs.contains("secret stored"), "the logs were captured");
        assert!(!logs.contains(CANARY), "the value reached a log line");
    }

    // A secret the tenant does not have: the command is refused, saying which.
    let missing = agent_with_env(&cluster, &admin, "unset", json!({"TOKEN": {"secret": "absent"}})).await?;
    let chat = conversation(
        &mut client,
        "secrets-missing",
        json!({"agent": missing, "tools": ["run_command"]}),
    )
    .await?;
    let script = r#"[mock call='run_command:{"command": "echo ran"}']"#;
    let frames = send_and_finish(&mut client, &chat.image_id, json!(script)).await?;
    let results = tool_results(&frames);
    let (refusal, failed) = results.first().context("the command's result")?;
    assert!(
        *failed && refusal.contains("PUT /v1/secrets/absent") && !refusal.contains("ran"),
        "{refusal}"
    );

    // Removed once; then not found.
    let (status, _) = call_as(&cluster, &admin, "DELETE", "/v1/secrets/github", None).await?;
    assert_eq!(status, 200);
    let (status, body) = call_as(&cluster, &admin, "DELETE", "/v1/secrets/github", None).await?;
    assert_eq!(
        (status, &body["error"]["code"]),
        (404, &json!("SECRET_NOT_FOUND")),
        "{body}"
    );
    Ok(())
}
