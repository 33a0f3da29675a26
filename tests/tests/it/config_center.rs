//! The config center as an operator and a tenant meet it: a changed model
//! applies to the next turns without a restart, keys are never read back,
//! tenants override for themselves only.

use std::time::Duration;

use avm_tests::accounts::create_tenant;
use avm_tests::cluster::{Cluster, Llm, Mode, Options, TEST_API_KEY};
use avm_tests::mock_llm::{MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::json;

use crate::both_modes;
use crate::support::{call, call_as, conversation, send_and_finish};

/// How long a change may take to reach the runtime; it is one hop.
const PROPAGATION: Duration = Duration::from_secs(10);

both_modes!(a_changed_model_applies_without_a_restart, changed_model);

async fn changed_model(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let llm = Llm::Anthropic {
        base_url: mock.anthropic_base_url(),
    };
    let cluster = Cluster::start(mode, Options::with_llm(llm)).await?;
    let (status, config) = call(&cluster, "GET", "/v1/config", None).await?;
    assert_eq!(status, 200, "{config}");
    assert_eq!(config["config"]["llm"]["model"], "claude-sonnet-4-20250514");
    assert_eq!(config["config"]["llm"]["apiKey"], "<redacted>");
    assert!(!config.to_string().contains(TEST_API_KEY), "the API key is never shown");

    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({})).await?;
    send_and_finish(&mut client, &chat.image_id, json!("before")).await?;
    assert_eq!(mock.requests()[0].body["model"], "claude-sonnet-4-20250514");

    let (status, changed) = call(&cluster, "PUT", "/v1/config", Some(json!({"llm.model": "claude-next"}))).await?;
    assert_eq!(status, 200, "{changed}");
    let entry = changed["entries"]
        .as_array()
        .and_then(|entries| entries.iter().find(|entry| entry["key"] == "llm.model"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        (entry["value"].clone(), entry["source"].clone()),
        (json!("claude-next"), json!("system"))
    );
    assert!(!changed.to_string().contains(TEST_API_KEY));

    // The same agent, no restart: the next turns use the new model as soon
    // as the change has reached the runtime (one hop, polled).
    let deadline = tokio::time::Instant::now() + PROPAGATION;
    let mut turns = 0;
    loop {
        send_and_finish(&mut client, &chat.image_id, json!("after")).await?;
        turns += 1;
        let model = mock.requests().last().map(|request| request.body["model"].clone());
        if model == Some(json!("claude-next")) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the new model never reached the runtime"
        );
    }
    send_and_finish(&mut client, &chat.image_id, json!("and again")).await?;
    assert_eq!(
        mock.requests().last().map(|request| request.body["model"].clone()),
        Some(json!("claude-next")),
        "it stays"
    );
    eprintln!("the model change applied after {turns} turn(s)");

    // Putting back the redacted form keeps the key; a bad value names its key.
    let (status, _) = call(
        &cluster,
        "PUT",
        "/v1/config",
        Some(json!({"llm": {"apiKey": "<redacted>"}})),
    )
    .await?;
    assert_eq!(status, 200);
    send_and_finish(&mut client, &chat.image_id, json!("still authorized")).await?;
    assert_eq!(
        mock.requests().last().and_then(|r| r.api_key.clone()).as_deref(),
        Some(TEST_API_KEY)
    );
    let (status, refused) = call(
        &cluster,
        "PUT",
        "/v1/config",
        Some(json!({"defaults.maxTokens": "lots"})),
    )
    .await?;
    assert_eq!(status, 400);
    assert_eq!(refused["error"]["code"], "INVALID_CONFIG_VALUE");
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("defaults.maxTokens")
    );
    let (status, key) = call(&cluster, "GET", "/v1/config/llm.model", None).await?;
    assert_eq!(
        (status, key["value"].clone(), key["source"].clone()),
        (200, json!("claude-next"), json!("system"))
    );
    Ok(())
}

both_modes!(tenants_override_for_themselves_only, tenant_overrides);

async fn tenant_overrides(mode: Mode) -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let llm = Llm::OpenAi {
        base_url: mock.openai_base_url(),
    };
    let cluster = Cluster::start(mode, Options::with_llm(llm)).await?;
    let acme = create_tenant(&cluster, "acme", None).await?;
    let globex = create_tenant(&cluster, "globex", None).await?;
    let own_key = "sk-acme-own-key-41c9";
    let (status, body) = call_as(
        &cluster,
        &acme.admin.key,
        "PUT",
        "/v1/config",
        Some(json!({"llm": {"model": "acme-model", "apiKey": own_key}})),
    )
    .await?;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["config"]["llm"]["model"], "acme-model");
    assert_eq!(body["config"]["llm"]["apiKey"], "<redacted>");
    // Tenants cannot reach what belongs to the deployment, nor each other.
    let (status, refused) = call_as(
        &cluster,
        &acme.admin.key,
        "PUT",
        "/v1/config",
        Some(json!({"llm.baseUrl": "http://10.0.0.1"})),
    )
    .await?;
    assert_eq!(
        (status, refused["error"]["code"].clone()),
        (400, json!("NOT_TENANT_OVERRIDABLE"))
    );
    let (status, refused) = call_as(
        &cluster,
        &acme.admin.key,
        "PUT",
        "/v1/config?scope=system",
        Some(json!({"llm.model": "x"})),
    )
    .await?;
    assert_eq!(
        (status, refused["error"]["code"].clone()),
        (403, json!("OPERATOR_REQUIRED"))
    );
    let path = format!("/v1/config?tenantId={}", acme.tenant_id);
    let (status, refused) = call_as(&cluster, &globex.admin.key, "GET", &path, None).await?;
    assert_eq!(status, 403, "{refused}");
    let (_, globex_view) = call_as(&cluster, &globex.admin.key, "GET", "/v1/config", None).await?;
    assert!(!globex_view.to_string().contains("acme-model"), "{globex_view}");

    // Each tenant's turns run with its own settings.
    for (tenant, model, key) in [
        (&acme, "acme-model", own_key),
        (&globex, "claude-sonnet-4-20250514", TEST_API_KEY),
    ] {
        let mut client = WsClient::connect(&cluster.ws_url_as(&tenant.admin.key)).await?;
        let chat = conversation(&mut client, "default", json!({})).await?;
        send_and_finish(&mut client, &chat.image_id, json!("hi")).await?;
        let request = mock.requests().pop().unwrap_or_else(|| panic!("no request"));
        assert_eq!(request.body["model"], model);
        assert_eq!(request.api_key.as_deref(), Some(key));
    }
    // An operator sees the tenant's overrides, never its key.
    let (status, seen) = call(&cluster, "GET", &path, None).await?;
    assert_eq!(
        (status, seen["config"]["llm"]["model"].clone()),
        (200, json!("acme-model"))
    );
    assert!(!seen.to_string().contains(own_key));
    Ok(())
}
