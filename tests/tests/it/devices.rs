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

both_modes!(
    a_device_subscribing_mid_turn_gets_the_history_then_the_rest_once,
    history_then_live
);

/// The ids of the message objects a frame carries: a history's, or a live
/// message event's.
fn message_ids(frame: &Value) -> Vec<String> {
    let id = |message: &Value| message["id"].as_str().map(str::to_owned);
    match frame["type"].as_str() {
        Some("conversation_history") => frame["data"]["messages"]
            .as_array()
            .map(|messages| messages.iter().filter_map(id).collect())
            .unwrap_or_default(),
        Some("user_message" | "assistant_message" | "tool_call_message" | "tool_result_message" | "error_message") => {
            id(&frame["data"]).into_iter().collect()
        }
        _ => Vec::new(),
    }
}

/// Phones subscribe with `withHistory` while the laptop's turn runs, each at
/// another moment of it: before the reply starts, while it streams, and
/// once it is stored. Each gets the history first, then live events, and
/// between them every stored message exactly once.
async fn history_then_live(mode: Mode) -> anyhow::Result<()> {
    use avm_tests::cluster::{Cluster, Llm, Options};
    use avm_tests::mock_llm::{MockBehavior, MockLlm};
    use std::time::Duration;

    let mock = MockLlm::start(MockBehavior::default()).await?;
    let options = Options::with_llm(Llm::Anthropic {
        base_url: mock.anthropic_base_url(),
    });
    let cluster = Cluster::start(mode, options).await?;
    let mut laptop = WsClient::connect(&cluster.ws_url()).await?;
    let chat = crate::support::conversation(&mut laptop, "history", json!({})).await?;
    for text in ["one", "two"] {
        crate::support::send_and_finish(&mut laptop, &chat.image_id, json!(text)).await?;
    }
    mock.set_behavior(MockBehavior {
        tokens: 60,
        token_interval: Duration::from_millis(20),
        ..MockBehavior::default()
    });
    let subscribe = json!({"type": "subscribe", "sessionId": chat.session_id, "withHistory": true});
    laptop
        .send_request("message_send", json!({"imageId": chat.image_id, "content": "three"}))
        .await?;
    let mut phones = Vec::new();
    for moment in ["message_persisted", "text_delta", "assistant_message"] {
        laptop.frames_until(moment).await?;
        let mut phone = WsClient::connect(&cluster.ws_url()).await?;
        phone.send_json(&subscribe).await?;
        phones.push((moment, phone));
    }
    laptop.turn().await?;
    let (_, stored) =
        crate::support::call(&cluster, "GET", &format!("/v1/images/{}/messages", chat.image_id), None).await?;
    let stored: Vec<String> = stored["messages"]
        .as_array()
        .context("messages")?
        .iter()
        .filter_map(|message| message["id"].as_str().map(str::to_owned))
        .collect();
    ensure!(stored.len() == 6, "three turns stored: {stored:?}");

    for (moment, mut phone) in phones {
        // Every stored message shown, then whatever else is queued: the
        // turn ended before the history was listed, so a request's answer
        // comes after every event of it.
        let mut frames = Vec::new();
        while frames.iter().flat_map(message_ids).count() < stored.len() {
            frames.push(
                phone
                    .next_frame()
                    .await
                    .with_context(|| format!("subscribed at {moment}, after {:?}", types(&frames)))?,
            );
        }
        let request_id = phone.send_request("conversation_recent", json!({})).await?;
        loop {
            let frame = phone.next_frame().await?;
            if frame["category"] == "response" && frame["data"]["requestId"] == request_id.as_str() {
                break;
            }
            frames.push(frame);
        }
        ensure!(
            frames[0]["type"] == "conversation_history",
            "subscribed at {moment}: the history comes first: {:?}",
            types(&frames)
        );
        crate::support::assert_typed_events(&frames);
        let seen: Vec<String> = frames.iter().flat_map(message_ids).collect();
        ensure!(
            seen == stored,
            "subscribed at {moment}: every message once, in order:\n{seen:?}\n{stored:?}"
        );
    }

    // A history is for a session followed from now: not with a cursor, not
    // of a group, and only a boolean.
    let mut phone = WsClient::connect(&cluster.ws_url()).await?;
    for bad in [
        json!({"type": "subscribe", "sessionId": chat.session_id, "withHistory": true, "afterCursor": "1"}),
        json!({"type": "subscribe", "sessionId": chat.session_id, "withHistory": "yes"}),
    ] {
        phone.send_json(&bad).await?;
        let refused = phone.next_frame().await?;
        ensure!(
            refused["type"] == "system_error" && refused["data"]["code"] == "INVALID_FIELD",
            "{bad}: {refused}"
        );
    }
    Ok(())
}
