//! Containers and subscriptions keep conversations apart.

use avm_tests::cluster::Mode;
use avm_tests::ws_client::WsClient;
use serde_json::json;

use crate::both_modes;
use crate::support::{cluster, conversation, send_and_finish};

both_modes!(containers_and_sessions_do_not_leak, isolation);

async fn isolation(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let mut alice = WsClient::connect(&cluster.ws_url()).await?;
    let mut bob = WsClient::connect(&cluster.ws_url()).await?;
    let a = conversation(&mut alice, "container-a", json!({"name": "a"})).await?;
    let b = conversation(&mut bob, "container-b", json!({"name": "b"})).await?;
    send_and_finish(&mut alice, &a.image_id, json!("secret of a")).await?;

    let list_b = bob.request("image_list", json!({"containerId": "container-b"})).await?;
    let ids: Vec<String> = list_b["records"]
        .as_array()
        .map(|r| r.iter().map(|r| r["imageId"].to_string()).collect())
        .unwrap_or_default();
    assert_eq!(ids, [json!(b.image_id).to_string()]);
    assert_eq!(list_b["__subscriptions"], json!([b.session_id]));
    let agents_b = bob.request("agent_list", json!({"containerId": "container-b"})).await?;
    assert_eq!(agents_b["agents"], json!([]));
    let agents_a = alice
        .request("agent_list", json!({"containerId": "container-a"}))
        .await?;
    assert_eq!(agents_a["agents"].as_array().map(Vec::len), Some(1));
    assert_eq!(agents_a["agents"][0]["imageId"], a.image_id.as_str());

    // Bob never subscribed to a's session: nothing of a's turn reaches him
    // before the answer to his own next request. (Both connections use the
    // same key, so he hears that a's container and conversation were made:
    // a user's devices are told of those.)
    bob.send_request("container_list", json!({})).await?;
    loop {
        let next = bob.next_frame().await?;
        assert!(!next.to_string().contains("secret of a"), "bob received {next}");
        if next["type"] == "container_list_response" {
            break;
        }
        assert_eq!(next["category"], "lifecycle", "bob received {next}");
        assert!(
            ["container_created", "image_created"].contains(&next["type"].as_str().unwrap_or_default()),
            "bob received {next}"
        );
    }
    Ok(())
}
