//! History survives restarts; idle agents are dropped and rehydrated.

use std::time::Duration;

use avm_tests::cluster::{Cluster, Llm, Mode, Options};
use avm_tests::mock_llm::{MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{assert_text_turn, conversation, grpc_health, poll, send_and_finish, types};

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

/// Issue 28 item 5: a component answers health from the moment its port is
/// bound, while it still starts. Here a resource service waits on its
/// Postgres schema (another session holds the lock its creation takes):
/// liveness is SERVING, `ready` NOT_SERVING, its service unknown to health,
/// and a call UNAVAILABLE with reason `STARTING`; once the lock goes, it
/// serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starting_component_answers_health_and_refuses_calls_until_it_serves() -> anyhow::Result<()> {
    use avm_proto::resource::v1::resource_service_client::ResourceServiceClient;
    use sqlx::Connection;
    use tonic_health::pb::health_check_response::ServingStatus;

    if !crate::postgres::postgres_configured()? {
        return Ok(());
    }
    let url = std::env::var("AVM_TEST_DATABASE_URL")?;
    let mut cluster = Cluster::start(Mode::PerComponent, Options::default()).await?;
    let base = avm_common::ids::new_id("avm_e2e");
    let _schema = DroppedSchema(url.clone(), format!("{base}_resource"));
    let separator = if url.contains('?') { '&' } else { '?' };
    let database = format!("{url}{separator}options=-c%20search_path%3D{base}");

    // What `avm resource` takes before creating its schema, held here.
    let mut holder = sqlx::PgConnection::connect(&url).await?;
    let mut held = holder.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
        .bind(format!("avm create schema {base}_resource"))
        .execute(&mut *held)
        .await?;

    let addr = cluster
        .spawn_starting("resource", &[("AVM_DATABASE_URL", database.as_str())])
        .await?;
    assert_eq!(
        grpc_health(&addr, "").await?,
        ServingStatus::Serving,
        "a starting process lives"
    );
    assert_eq!(grpc_health(&addr, "ready").await?, ServingStatus::NotServing);
    let channel = tonic::transport::Endpoint::from_shared(addr.clone())?.connect().await?;
    let unknown = tonic_health::pb::health_client::HealthClient::new(channel.clone())
        .check(tonic_health::pb::HealthCheckRequest {
            service: "avm.resource.v1.ResourceService".into(),
        })
        .await
        .expect_err("the service is not there yet");
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    let refused = ResourceServiceClient::new(channel.clone())
        .list_resources(avm_proto::resource::v1::ListResourcesRequest::default())
        .await
        .expect_err("a starting component serves no call");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert_eq!(avm_common::ApiError::from_status(&refused).reason, "STARTING");
    // Still starting while the lock is held: nothing moved on its own.
    assert_eq!(grpc_health(&addr, "ready").await?, ServingStatus::NotServing);

    held.rollback().await?;
    poll(Duration::from_secs(30), "the resource service to be ready", || async {
        Ok((grpc_health(&addr, "ready").await? == ServingStatus::Serving).then_some(()))
    })
    .await?;
    assert_eq!(
        grpc_health(&addr, "avm.resource.v1.ResourceService").await?,
        ServingStatus::Serving
    );
    // Served now: a call without a token is the service's own refusal.
    let unauthenticated = ResourceServiceClient::new(channel)
        .list_resources(avm_proto::resource::v1::ListResourcesRequest::default())
        .await
        .expect_err("no token");
    assert_eq!(
        unauthenticated.code(),
        tonic::Code::Unauthenticated,
        "{unauthenticated:?}"
    );
    Ok(())
}

/// Drops a Postgres schema when the test ends.
struct DroppedSchema(String, String);

impl Drop for DroppedSchema {
    fn drop(&mut self) {
        avm_store::testing::drop_schemas(&self.0, std::slice::from_ref(&self.1));
    }
}
