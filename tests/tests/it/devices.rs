//! Issue 29 item 3 and acceptance 2: a phone and a laptop on the same
//! account. A conversation created, renamed, answered and deleted on one
//! appears live on the other, every event once; another user of the tenant
//! and another tenant hear none of it.

use anyhow::{Context, ensure};
use avm_tests::accounts::{create_tenant, create_user};
use avm_tests::cluster::Mode;
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{call_as, cluster, types};

/// The lifecycle events a user's other devices are told of.
const LIFECYCLE: [&str; 5] = [
    "container_created",
    "image_created",
    "image_updated",
    "image_deleted",
    "session_destroyed",
];

/// Reads frames until one of type `kind`, keeping every frame read in `seen`.
async fn until(client: &mut WsClient, kind: &str, seen: &mut Vec<Value>) -> anyhow::Result<Value> {
    loop {
        let frame = client.next_frame().await?;
        seen.push(frame.clone());
        if frame["type"] == kind {
            return Ok(frame);
        }
    }
}

both_modes!(a_second_device_follows_every_change_once, second_device);

async fn second_device(mode: Mode) -> anyhow::Result<()> {
    let mut cluster = cluster(mode).await?;
    let tenant = create_tenant(&cluster, "devices", None).await?;
    let alice = create_user(&cluster, &tenant, "alice", "member").await?;
    let bob = create_user(&cluster, &tenant, "bob", "member").await?;
    let other = create_tenant(&cluster, "devices-other", None).await?;
    let mut phone = WsClient::connect(&cluster.ws_url_as(&alice.key)).await?;
    let mut laptop = WsClient::connect(&cluster.ws_url_as(&alice.key)).await?;
    let mut bobs = WsClient::connect(&cluster.ws_url_as(&bob.key)).await?;
    let mut theirs = WsClient::connect(&cluster.ws_url_as(&other.admin.key)).await?;
    // Each connection answers once its feed is live.
    for client in [&mut phone, &mut laptop, &mut bobs, &mut theirs] {
        let listed = client.request("container_list", json!({})).await?;
        ensure!(listed.get("error").is_none(), "{listed}");
    }

    // Created on the laptop: the phone hears the container and the conversation.
    let mut heard = Vec::new();
    laptop
        .request("container_create", json!({"containerId": "trips"}))
        .await?;
    let created = until(&mut phone, "container_created", &mut heard).await?;
    ensure!(
        created["data"]["containerId"] == "trips" && created["context"]["containerId"] == "trips",
        "{created}"
    );
    let image = laptop
        .request(
            "image_create",
            json!({"containerId": "trips", "config": {"name": "Lisbon"}}),
        )
        .await?;
    let image_id = image["record"]["imageId"].as_str().context("imageId")?.to_owned();
    let session_id = image["record"]["sessionId"].as_str().context("sessionId")?.to_owned();
    let shown = until(&mut phone, "image_created", &mut heard).await?;
    let record = &shown["data"]["record"];
    ensure!(
        record["imageId"] == image_id.as_str()
            && record["sessionId"] == session_id.as_str()
            && record["name"] == "Lisbon"
            && record["containerId"] == "trips"
            && shown["category"] == "lifecycle",
        "{shown}"
    );

    // Renamed on the laptop.
    let renamed = laptop
        .request(
            "image_update",
            json!({"imageId": image_id, "updates": {"name": "Lisbon in May"}}),
        )
        .await?;
    ensure!(renamed.get("error").is_none(), "{renamed}");
    let updated = until(&mut phone, "image_updated", &mut heard).await?;
    ensure!(updated["data"]["record"]["name"] == "Lisbon in May", "{updated}");

    // Answered: the phone, subscribed, sees what the laptop said and the reply.
    phone.subscribe(&session_id, None).await?;
    laptop.subscribe(&session_id, None).await?;
    let accepted = laptop
        .request(
            "message_send",
            json!({"imageId": image_id, "content": "Book a tram tour"}),
        )
        .await?;
    ensure!(accepted.get("error").is_none(), "{accepted}");
    let said = until(&mut phone, "user_message", &mut heard).await?;
    ensure!(
        said["data"]["content"] == "Book a tram tour"
            && said["data"]["role"] == "user"
            && said["context"]["imageId"] == image_id.as_str()
            && said["cursor"].is_string(),
        "the user's message, with its content: {said}"
    );
    until(&mut phone, "conversation_end", &mut heard).await?;
    let mut laptop_saw = laptop.turn().await?;

    // The recent list on the phone: this conversation first, answered, unread
    // until the phone reads it.
    let recent = phone.request("conversation_recent", json!({})).await?;
    let first = &recent["conversations"][0];
    ensure!(
        first["imageId"] == image_id.as_str()
            && first["name"] == "Lisbon in May"
            && first["lastMessage"]["role"] == "assistant"
            && first["unreadCount"] == 2
            && first["agentState"] == "active"
            && first["online"] == true,
        "{recent}"
    );
    let read = phone.request("image_read", json!({"imageId": image_id})).await?;
    ensure!(read["readSeq"] == 2, "{read}");
    let (status, listed) = call_as(&cluster, &alice.key, "GET", "/v1/conversations/recent?pageSize=5", None).await?;
    ensure!(
        status == 200 && listed["conversations"][0]["unreadCount"] == 0,
        "{status} {listed}"
    );
    let (status, _) = call_as(
        &cluster,
        &bob.key,
        "POST",
        &format!("/v1/images/{image_id}/read"),
        Some(json!({})),
    )
    .await?;
    ensure!(status == 404, "another member marks nothing of alice's: {status}");

    // Deleted on the laptop.
    let deleted = laptop.request("image_delete", json!({"imageId": image_id})).await?;
    ensure!(deleted.get("error").is_none(), "{deleted}");
    let gone = until(&mut phone, "image_deleted", &mut heard).await?;
    ensure!(
        gone["data"]["imageId"] == image_id.as_str() && gone["data"]["sessionId"] == session_id.as_str(),
        "{gone}"
    );
    let destroyed = until(&mut phone, "session_destroyed", &mut heard).await?;
    ensure!(destroyed["context"]["sessionId"] == session_id.as_str(), "{destroyed}");

    // Every event once: each lifecycle event, and each message of the turn.
    let kinds = types(&heard);
    for kind in LIFECYCLE.iter().chain(&[
        "message_persisted",
        "user_message",
        "assistant_message",
        "conversation_end",
    ]) {
        let count = kinds.iter().filter(|seen| seen == kind).count();
        ensure!(count == 1, "{kind} {count} times on the phone: {kinds:?}");
    }
    // The laptop, which did it all, has its answers and is not told again.
    let own = laptop.request("container_list", json!({})).await?;
    ensure!(own.get("error").is_none(), "{own}");
    laptop_saw.extend(laptop.take_queued());
    let mine = types(&laptop_saw);
    ensure!(
        !mine.iter().any(|kind| LIFECYCLE.contains(&kind.as_str())),
        "the laptop was told of its own changes: {mine:?}"
    );
    // A change made elsewhere (REST, with the same key) reaches both devices.
    let (status, _) = call_as(
        &cluster,
        &alice.key,
        "POST",
        "/v1/containers",
        Some(json!({"containerId": "rest-made"})),
    )
    .await?;
    ensure!(status == 201, "{status}");
    for device in [&mut phone, &mut laptop] {
        let made = until(device, "container_created", &mut Vec::new()).await?;
        ensure!(made["data"]["containerId"] == "rest-made", "{made}");
    }

    // Nobody else: another user of the tenant, another tenant.
    for (who, client) in [("bob", &mut bobs), ("another tenant", &mut theirs)] {
        client.request("container_list", json!({})).await?;
        let kinds = types(&client.take_queued());
        ensure!(
            !kinds
                .iter()
                .any(|kind| LIFECYCLE.contains(&kind.as_str()) || kind == "user_message"),
            "{who} heard {kinds:?}"
        );
    }
    cluster.stop().await
}
