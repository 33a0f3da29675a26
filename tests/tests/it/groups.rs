//! Groups through the public API: REST and WebSocket over the session
//! service's groups (members, ordered messages, idempotent posts, read
//! cursors), with a foreign tenant's group answering like a missing one.

use avm_tests::accounts::create_tenant;
use avm_tests::cluster::{Cluster, Mode};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{call, call_as, cluster};

/// Creates a container and an image (an agent to be) in it; returns the image id.
pub(crate) async fn image(cluster: &Cluster, container_id: &str, name: &str) -> anyhow::Result<String> {
    let (status, _) = call(
        cluster,
        "POST",
        "/v1/containers",
        Some(json!({"containerId": container_id})),
    )
    .await?;
    anyhow::ensure!(status == 201 || status == 200, "container {container_id}: {status}");
    let (status, record) = call(
        cluster,
        "POST",
        &format!("/v1/containers/{container_id}/images"),
        Some(json!({"name": name, "systemPrompt": format!("You are {name}.")})),
    )
    .await?;
    anyhow::ensure!(status == 201, "image {name}: {status} {record}");
    Ok(record["imageId"].as_str().unwrap_or_default().to_owned())
}

pub(crate) fn text(value: &Value) -> String {
    value.as_str().unwrap_or_default().to_owned()
}

/// Creates a group of `agents` (and the caller) in `container_id`.
pub(crate) async fn group(
    cluster: &Cluster,
    container_id: &str,
    wake_mode: &str,
    agents: &[&str],
) -> anyhow::Result<String> {
    let members: Vec<Value> = agents
        .iter()
        .map(|id| json!({"kind": "agent", "memberId": id}))
        .collect();
    let (status, group) = call(
        cluster,
        "POST",
        &format!("/v1/containers/{container_id}/groups"),
        Some(json!({"name": "crew", "wakeMode": wake_mode, "members": members})),
    )
    .await?;
    anyhow::ensure!(status == 201, "group: {status} {group}");
    Ok(text(&group["groupId"]))
}

both_modes!(a_group_of_two_agents_and_its_user_talks_in_order, rest_groups);

async fn rest_groups(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let alice = image(&cluster, "team", "alice").await?;
    let bob = image(&cluster, "team", "bob").await?;

    // Created with both agents; the creator joins as a user member.
    let (status, group) = call(
        &cluster,
        "POST",
        "/v1/containers/team/groups",
        Some(json!({"name": "planning", "wakeMode": "mentions", "members": [
            {"kind": "agent", "memberId": alice},
            {"kind": "agent", "memberId": bob},
        ]})),
    )
    .await?;
    assert_eq!(status, 201, "{group}");
    let group_id = text(&group["groupId"]);
    assert!(group_id.starts_with("grp_"), "{group}");
    assert_eq!(group["containerId"], "team");
    assert_eq!(group["wakeMode"], "mentions");
    assert_eq!(group["lastSeq"], 0);

    let (status, members) = call(&cluster, "GET", &format!("/v1/groups/{group_id}/members"), None).await?;
    assert_eq!(status, 200, "{members}");
    let members = members["members"].as_array().cloned().unwrap_or_default();
    let kinds: Vec<(String, String)> = members
        .iter()
        .map(|m| (text(&m["kind"]), text(&m["memberId"])))
        .collect();
    assert_eq!(kinds.len(), 3, "{members:?}");
    let users: Vec<&(String, String)> = kinds.iter().filter(|(kind, _)| kind == "user").collect();
    assert_eq!(users.len(), 1, "the creator joins: {members:?}");
    let me = users[0].1.clone();
    assert!(kinds.contains(&("agent".to_owned(), alice.clone())));
    assert!(kinds.contains(&("agent".to_owned(), bob.clone())));

    // Listed, fetched and renamed.
    let (status, listed) = call(&cluster, "GET", "/v1/containers/team/groups", None).await?;
    assert_eq!(status, 200);
    assert_eq!(listed["groups"][0]["groupId"], group_id.as_str());
    assert!(listed.get("nextPageToken").is_none(), "{listed}");
    let (status, patched) = call(
        &cluster,
        "PATCH",
        &format!("/v1/groups/{group_id}"),
        Some(json!({"name": "plans"})),
    )
    .await?;
    assert_eq!(status, 200, "{patched}");
    assert_eq!(patched["name"], "plans");
    assert_eq!(patched["wakeMode"], "mentions", "left as it was");

    // Three messages by the user, in order, with sender, seq and mentions
    // (of the user, so no agent wakes and answers in between).
    let messages = format!("/v1/groups/{group_id}/messages");
    for (n, content) in ["first", "second", "third"].iter().enumerate() {
        let (status, posted) = call(
            &cluster,
            "POST",
            &messages,
            Some(json!({"content": content, "mentions": [me]})),
        )
        .await?;
        assert_eq!(status, 201, "{posted}");
        assert_eq!(posted["seq"], n as u64 + 1);
        assert_eq!(posted["sender"], json!({"kind": "user", "memberId": me}));
        assert_eq!(posted["mentions"], json!([me]));
    }
    let (status, history) = call(&cluster, "GET", &messages, None).await?;
    assert_eq!(status, 200);
    let contents: Vec<(u64, String, String)> = history["messages"]
        .as_array()
        .map(|all| {
            all.iter()
                .map(|m| {
                    (
                        m["seq"].as_u64().unwrap_or(0),
                        text(&m["content"]),
                        text(&m["sender"]["memberId"]),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        contents,
        [
            (1, "first".to_owned(), me.clone()),
            (2, "second".to_owned(), me.clone()),
            (3, "third".to_owned(), me.clone())
        ]
    );
    let (_, page) = call(&cluster, "GET", &format!("{messages}?after=1&limit=1"), None).await?;
    assert_eq!(page["messages"].as_array().map(Vec::len), Some(1));
    assert_eq!(page["messages"][0]["content"], "second");

    // A re-post of a message id answers the stored message, once.
    let body = json!({"content": "once", "messageId": "client-1"});
    let (status, first) = call(&cluster, "POST", &messages, Some(body.clone())).await?;
    assert_eq!(status, 201, "{first}");
    let (status, again) = call(&cluster, "POST", &messages, Some(body)).await?;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["seq"], first["seq"]);
    assert_eq!(again["messageId"], "client-1");
    let (_, group) = call(&cluster, "GET", &format!("/v1/groups/{group_id}"), None).await?;
    assert_eq!(group["lastSeq"], 4);

    // Membership errors.
    let (status, err) = call(
        &cluster,
        "POST",
        &messages,
        Some(json!({"content": "hi", "mentions": ["nobody"]})),
    )
    .await?;
    assert_eq!(
        (status, text(&err["error"]["code"])),
        (409, "MENTION_NOT_GROUP_MEMBER".to_owned())
    );
    let members_path = format!("/v1/groups/{group_id}/members");
    let (status, err) = call(
        &cluster,
        "POST",
        &members_path,
        Some(json!({"kind": "agent", "memberId": alice})),
    )
    .await?;
    assert_eq!(
        (status, text(&err["error"]["code"])),
        (409, "GROUP_MEMBER_EXISTS".to_owned())
    );
    let stranger = image(&cluster, "elsewhere", "stranger").await?;
    let (status, err) = call(
        &cluster,
        "POST",
        &members_path,
        Some(json!({"kind": "agent", "memberId": stranger})),
    )
    .await?;
    assert_eq!(
        (status, text(&err["error"]["code"])),
        (400, "IMAGE_NOT_IN_GROUP_CONTAINER".to_owned())
    );
    let (status, err) = call(
        &cluster,
        "POST",
        &members_path,
        Some(json!({"kind": "robot", "memberId": "x"})),
    )
    .await?;
    assert_eq!((status, text(&err["error"]["code"])), (400, "INVALID_FIELD".to_owned()));
    // A user member is a user of the tenant.
    let (status, err) = call(
        &cluster,
        "POST",
        &members_path,
        Some(json!({"kind": "user", "memberId": "usr_nobody"})),
    )
    .await?;
    assert_eq!(
        (status, text(&err["error"]["code"])),
        (404, "USER_NOT_FOUND".to_owned())
    );
    let (status, err) = call(&cluster, "DELETE", &format!("{members_path}/img_missing"), None).await?;
    assert_eq!(
        (status, text(&err["error"]["code"])),
        (404, "GROUP_MEMBER_NOT_FOUND".to_owned())
    );
    let (status, removed) = call(&cluster, "DELETE", &format!("{members_path}/{bob}"), None).await?;
    assert_eq!(status, 200, "{removed}");
    assert_eq!(removed["removed"], true);
    let (status, err) = call(
        &cluster,
        "POST",
        &messages,
        Some(json!({"content": "hi", "mentions": [bob]})),
    )
    .await?;
    assert_eq!(
        (status, text(&err["error"]["code"])),
        (409, "MENTION_NOT_GROUP_MEMBER".to_owned())
    );
    // A user who left cannot post until they join again.
    call(&cluster, "DELETE", &format!("{members_path}/{me}"), None).await?;
    let (status, err) = call(&cluster, "POST", &messages, Some(json!({"content": "hi"}))).await?;
    assert_eq!(
        (status, text(&err["error"]["code"])),
        (409, "SENDER_NOT_GROUP_MEMBER".to_owned())
    );
    let (status, joined) = call(
        &cluster,
        "POST",
        &members_path,
        Some(json!({"kind": "user", "memberId": me})),
    )
    .await?;
    assert_eq!(status, 201, "{joined}");
    assert_eq!(joined["readSeq"], 0);
    let (_, history) = call(&cluster, "GET", &messages, None).await?;
    assert_eq!(
        history["messages"].as_array().map(Vec::len),
        Some(4),
        "what the user posted stays"
    );

    // Deleted: gone for every route.
    let (status, deleted) = call(&cluster, "DELETE", &format!("/v1/groups/{group_id}"), None).await?;
    assert_eq!(status, 200);
    assert_eq!(deleted, json!({"groupId": group_id, "deleted": true}));
    for (method, path) in [("GET", format!("/v1/groups/{group_id}")), ("GET", messages.clone())] {
        let (status, err) = call(&cluster, method, &path, None).await?;
        assert_eq!(
            (status, text(&err["error"]["code"])),
            (404, "GROUP_NOT_FOUND".to_owned())
        );
    }
    Ok(())
}

both_modes!(read_cursors_count_what_the_caller_has_not_read, unread_groups);

async fn unread_groups(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    image(&cluster, "inbox", "helper").await?;
    let tenant = create_tenant(&cluster, "readers", None).await?;
    let key = tenant.admin.key.clone();
    let me = tenant.admin.user_id.clone();
    let (status, _) = call_as(
        &cluster,
        &key,
        "POST",
        "/v1/containers",
        Some(json!({"containerId": "inbox"})),
    )
    .await?;
    assert_eq!(status, 201);
    let (status, group) = call_as(
        &cluster,
        &key,
        "POST",
        "/v1/containers/inbox/groups",
        Some(json!({"name": "reading"})),
    )
    .await?;
    assert_eq!(status, 201, "{group}");
    let group_id = text(&group["groupId"]);
    let (status, unread) = call_as(&cluster, &key, "GET", "/v1/groups/unread", None).await?;
    assert_eq!(status, 200, "{unread}");
    assert_eq!(unread, json!({"groups": []}));

    // Another user of the tenant (shown the container) joins and posts; the creator has three unread.
    let other = avm_tests::accounts::create_user(&cluster, &tenant, "other", "member").await?;
    let (status, _) = call_as(
        &cluster,
        &key,
        "POST",
        "/v1/containers/inbox/shares",
        Some(json!({"userId": other.user_id})),
    )
    .await?;
    assert_eq!(status, 200);
    let members = format!("/v1/groups/{group_id}/members");
    let (status, _) = call_as(
        &cluster,
        &key,
        "POST",
        &members,
        Some(json!({"kind": "user", "memberId": other.user_id})),
    )
    .await?;
    assert_eq!(status, 201);
    let messages = format!("/v1/groups/{group_id}/messages");
    for content in ["one", "two", "three"] {
        let (status, posted) = call_as(
            &cluster,
            &other.key,
            "POST",
            &messages,
            Some(json!({"content": content})),
        )
        .await?;
        assert_eq!(status, 201, "{posted}");
        assert_eq!(posted["sender"], json!({"kind": "user", "memberId": other.user_id}));
    }
    let (_, unread) = call_as(&cluster, &key, "GET", "/v1/groups/unread?messageLimit=2", None).await?;
    assert_eq!(unread["groups"].as_array().map(Vec::len), Some(1), "{unread}");
    assert_eq!(unread["groups"][0]["group"]["groupId"], group_id.as_str());
    assert_eq!(unread["groups"][0]["unreadCount"], 3);
    assert_eq!(unread["groups"][0]["readSeq"], 0);
    let firsts: Vec<String> = unread["groups"][0]["messages"]
        .as_array()
        .map(|all| all.iter().map(|m| text(&m["content"])).collect())
        .unwrap_or_default();
    assert_eq!(firsts, ["one", "two"]);
    // The poster's own messages are read to them.
    let (_, theirs) = call_as(&cluster, &other.key, "GET", "/v1/groups/unread", None).await?;
    assert_eq!(theirs, json!({"groups": []}));

    // Reading up to 2 leaves one; reading without a seq reads everything.
    let read = format!("/v1/groups/{group_id}/read");
    let (status, cursor) = call_as(&cluster, &key, "POST", &read, Some(json!({"seq": 2}))).await?;
    assert_eq!(status, 200, "{cursor}");
    assert_eq!(cursor["readSeq"], 2);
    assert_eq!(cursor["memberId"], me.as_str());
    let (_, unread) = call_as(&cluster, &key, "GET", "/v1/groups/unread", None).await?;
    assert_eq!(unread["groups"][0]["unreadCount"], 1);
    assert_eq!(unread["groups"][0]["messages"], json!([]));
    let (_, cursor) = call_as(&cluster, &key, "POST", &read, Some(json!({"seq": 1}))).await?;
    assert_eq!(cursor["readSeq"], 2, "a cursor never moves back");
    let (_, cursor) = call_as(&cluster, &key, "POST", &read, None).await?;
    assert_eq!(cursor["readSeq"], 3);
    let (_, unread) = call_as(&cluster, &key, "GET", "/v1/groups/unread", None).await?;
    assert_eq!(unread, json!({"groups": []}));

    // The cluster's own tenant sees none of it: a foreign group answers
    // exactly as a missing one, on every route.
    let missing = "grp_doesnotexist";
    let routes = |id: &str| {
        [
            ("GET", format!("/v1/groups/{id}"), None),
            ("PATCH", format!("/v1/groups/{id}"), Some(json!({"name": "x"}))),
            ("GET", format!("/v1/groups/{id}/members"), None),
            (
                "POST",
                format!("/v1/groups/{id}/members"),
                Some(json!({"kind": "user", "memberId": "u"})),
            ),
            ("GET", format!("/v1/groups/{id}/messages"), None),
            (
                "POST",
                format!("/v1/groups/{id}/messages"),
                Some(json!({"content": "x"})),
            ),
            ("POST", format!("/v1/groups/{id}/read"), None),
            ("DELETE", format!("/v1/groups/{id}"), None),
        ]
    };
    for ((method, foreign, body), (_, absent, _)) in routes(&group_id).into_iter().zip(routes(missing)) {
        let (foreign_status, foreign_err) = call(&cluster, method, &foreign, body.clone()).await?;
        let (absent_status, absent_err) = call(&cluster, method, &absent, body).await?;
        assert_eq!(foreign_status, 404, "{method} {foreign}: {foreign_err}");
        assert_eq!(
            (foreign_status, &foreign_err["error"]["code"]),
            (absent_status, &absent_err["error"]["code"]),
            "{method} {foreign}"
        );
        assert_eq!(foreign_err["error"]["code"], "GROUP_NOT_FOUND");
    }
    let (_, listed) = call(&cluster, "GET", "/v1/containers/inbox/groups", None).await?;
    assert_eq!(listed["groups"], json!([]));
    let (_, still) = call_as(&cluster, &key, "GET", &format!("/v1/groups/{group_id}"), None).await?;
    assert_eq!(still["name"], "reading");
    Ok(())
}

both_modes!(groups_over_the_websocket, ws_groups);

async fn ws_groups(mode: Mode) -> anyhow::Result<()> {
    let cluster = cluster(mode).await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let created = client
        .request("container_create", json!({"containerId": "socket"}))
        .await?;
    assert_eq!(created["containerId"], "socket");
    let image = client
        .request(
            "image_create",
            json!({"containerId": "socket", "config": {"name": "agent"}}),
        )
        .await?;
    let image_id = text(&image["record"]["imageId"]);

    let created = client
        .request(
            "group_create",
            json!({"containerId": "socket", "name": "over ws", "wakeMode": "mentions",
                "members": [{"kind": "agent", "memberId": image_id}]}),
        )
        .await?;
    assert!(created.get("error").is_none(), "{created}");
    let group_id = text(&created["group"]["groupId"]);
    // Messages that mention nobody wake no agent here.
    assert_eq!(created["group"]["wakeMode"], "mentions");

    let listed = client.request("group_list", json!({"containerId": "socket"})).await?;
    assert_eq!(listed["groups"][0]["groupId"], group_id.as_str());
    let members = client
        .request("group_member_list", json!({"groupId": group_id}))
        .await?;
    assert_eq!(members["members"].as_array().map(Vec::len), Some(2), "{members}");

    for (n, content) in ["hello", "world"].iter().enumerate() {
        let sent = client
            .request(
                "group_message_send",
                json!({"groupId": group_id, "content": content, "messageId": format!("ws-{n}")}),
            )
            .await?;
        assert_eq!(sent["created"], true, "{sent}");
        assert_eq!(sent["message"]["seq"], n as u64 + 1);
        assert_eq!(sent["message"]["sender"]["kind"], "user");
    }
    let again = client
        .request(
            "group_message_send",
            json!({"groupId": group_id, "content": "hello", "messageId": "ws-0"}),
        )
        .await?;
    assert_eq!(again["created"], false);
    assert_eq!(again["message"]["seq"], 1);

    let list = client
        .request("group_message_list", json!({"groupId": group_id, "afterSeq": 0}))
        .await?;
    let contents: Vec<String> = list["messages"]
        .as_array()
        .map(|all| all.iter().map(|m| text(&m["content"])).collect())
        .unwrap_or_default();
    assert_eq!(contents, ["hello", "world"]);

    let missing = client.request("group_get", json!({"groupId": "grp_nope"})).await?;
    assert_eq!(missing["code"], "GROUP_NOT_FOUND", "{missing}");
    let invalid = client.request("group_create", json!({"containerId": "socket"})).await?;
    assert_eq!(invalid["code"], "MISSING_FIELD", "{invalid}");

    let deleted = client.request("group_delete", json!({"groupId": group_id})).await?;
    assert_eq!(
        (&deleted["groupId"], &deleted["deleted"]),
        (&json!(group_id), &json!(true)),
        "{deleted}"
    );
    let gone = client.request("group_get", json!({"groupId": group_id})).await?;
    assert_eq!(gone["code"], "GROUP_NOT_FOUND");
    Ok(())
}
