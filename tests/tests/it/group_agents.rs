//! Agents in groups: a group message wakes the agents it concerns, each
//! reads its unread messages (with their senders) in one turn, replies into
//! the group and moves its read cursor; what is posted during a turn is read
//! by the next one; agents talking to each other stop at the runaway limit.

use std::time::Duration;

use anyhow::Context;
use avm_proto::session::v1 as ss;
use avm_proto::session::v1::session_service_client::SessionServiceClient;
use avm_tests::cluster::{Cluster, Llm, Mode, Options, bearer};
use avm_tests::mock_llm::{MockBehavior, MockFailure, MockLlm, MockToolCall, RecordedRequest, SYSTEM_PLACEHOLDER};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};
use tonic::transport::Endpoint;

use crate::both_modes;
use crate::groups::{group, image, text};
use crate::support::{SseStream, call, call_as};

/// A cluster whose LLM answers each agent with its own system prompt.
async fn prompted(mode: Mode, behavior: MockBehavior) -> anyhow::Result<(MockLlm, Cluster)> {
    let reply = Some(SYSTEM_PLACEHOLDER.to_owned());
    mocked(mode, MockBehavior { reply, ..behavior }).await
}

/// A cluster whose LLM is the mock, behaving so.
async fn mocked(mode: Mode, behavior: MockBehavior) -> anyhow::Result<(MockLlm, Cluster)> {
    let mock = MockLlm::start(behavior).await?;
    let cluster = Cluster::start(
        mode,
        Options::with_llm(Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        }),
    )
    .await?;
    Ok((mock, cluster))
}

/// Follows a group over SSE, from its first message.
async fn watch(cluster: &Cluster, group_id: &str) -> anyhow::Result<SseStream> {
    let response = cluster
        .http()?
        .get(cluster.url(&format!("/v1/groups/{group_id}/messages")))
        .header("accept", "text/event-stream")
        .send()
        .await?;
    anyhow::ensure!(response.status() == 200, "watch: {}", response.status());
    Ok(SseStream::new(response))
}

/// Events of a group until `reads` agents moved their read cursors.
async fn until_read(stream: &mut SseStream, reads: usize) -> anyhow::Result<Vec<(String, Value)>> {
    let mut events = Vec::new();
    let mut seen = 0;
    while seen < reads {
        let (_, kind, data) = stream.next_event().await?;
        anyhow::ensure!(kind != "system_error", "the group's stream failed: {data}");
        seen += usize::from(kind == "group_read");
        events.push((kind, data));
    }
    Ok(events)
}

fn messages_of(events: &[(String, Value)]) -> Vec<Value> {
    events
        .iter()
        .filter(|(kind, _)| kind == "group_message")
        .map(|(_, data)| data["data"].clone())
        .collect()
}

async fn post(cluster: &Cluster, group_id: &str, body: Value) -> anyhow::Result<Value> {
    let (status, posted) = call(cluster, "POST", &format!("/v1/groups/{group_id}/messages"), Some(body)).await?;
    anyhow::ensure!(status == 201, "post: {status} {posted}");
    Ok(posted)
}

/// The text of the last user message of an LLM request: what the turn read.
fn last_user_text(request: &RecordedRequest) -> String {
    let messages = request.body["messages"].as_array().cloned().unwrap_or_default();
    let last = messages.iter().rev().find(|message| message["role"] == "user");
    match last.map(|message| &message["content"]) {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(blocks)) => blocks.iter().filter_map(|block| block["text"].as_str()).collect(),
        _ => String::new(),
    }
}

/// A member's read cursor, as the group's member list shows it.
async fn read_seq(cluster: &Cluster, group_id: &str, member_id: &str) -> anyhow::Result<Option<Value>> {
    let (_, members) = call(cluster, "GET", &format!("/v1/groups/{group_id}/members"), None).await?;
    Ok(members["members"]
        .as_array()
        .and_then(|all| all.iter().find(|m| m["memberId"] == member_id))
        .map(|m| m["readSeq"].clone()))
}

/// Sends an image a direct message and checks it is refused with 409 `code`.
async fn refused_directly(cluster: &Cluster, image_id: &str, code: &str) -> anyhow::Result<()> {
    let (status, refusal) = call(
        cluster,
        "POST",
        &format!("/v1/images/{image_id}/messages"),
        Some(json!({"content": "psst"})),
    )
    .await?;
    assert_eq!((status, &refusal["error"]["code"]), (409, &json!(code)), "{refusal}");
    Ok(())
}

both_modes!(three_agents_answer_a_user_once_each, three_agents);

async fn three_agents(mode: Mode) -> anyhow::Result<()> {
    let (mock, cluster) = prompted(mode, MockBehavior::default()).await?;
    let names = ["alice", "bob", "carol"];
    let mut agents = Vec::new();
    for name in names {
        agents.push(image(&cluster, "crew", name).await?);
    }
    let ids: Vec<&str> = agents.iter().map(String::as_str).collect();
    let group_id = group(&cluster, "crew", "all", &ids).await?;
    let mut sse = watch(&cluster, &group_id).await?;
    let mut ws = WsClient::connect(&cluster.ws_url()).await?;
    ws.send_json(&json!({"type": "subscribe", "groupId": group_id})).await?;
    // Answered after the subscription opened: the same connection's frames run in order.
    ws.request("group_get", json!({"groupId": group_id})).await?;

    let question = post(&cluster, &group_id, json!({"content": "Hello team, who is here?"})).await?;
    assert_eq!(question["seq"], 1);

    // Over SSE: the question, each agent's streamed answer, its reply, its read.
    let events = until_read(&mut sse, 3).await?;
    let messages = messages_of(&events);
    assert_eq!(messages.len(), 4, "{messages:?}");
    assert_eq!(messages[0]["sender"]["kind"], "user");
    assert_eq!(messages[0]["content"], "Hello team, who is here?");
    let mut repliers = Vec::new();
    for (n, reply) in messages.iter().enumerate().skip(1) {
        assert_eq!(reply["seq"], n + 1, "in order: {messages:?}");
        assert_eq!(reply["sender"]["kind"], "agent");
        let sender = text(&reply["sender"]["memberId"]);
        let Some(index) = agents.iter().position(|id| *id == sender) else {
            anyhow::bail!("{sender} is not a member: {messages:?}");
        };
        let name = names[index];
        assert_eq!(reply["content"], format!("You are {name}."), "each answers as itself");
        repliers.push(sender);
    }
    repliers.sort();
    let mut expected = agents.clone();
    expected.sort();
    assert_eq!(repliers, expected, "each agent replies once");
    for agent in &agents {
        let streamed = events
            .iter()
            .any(|(kind, data)| kind == "text_delta" && data["context"]["imageId"] == agent.as_str());
        assert!(streamed, "{agent}'s answer streams to the group's watchers");
    }

    // Over the WebSocket: the same messages.
    let mut seen = Vec::new();
    while seen.len() < 4 {
        let frame = ws.next_frame().await?;
        if frame["type"] == "group_message" {
            assert_eq!(frame["context"]["sessionId"], group_id.as_str());
            seen.push(frame["data"]["seq"].as_u64().unwrap_or_default());
        }
    }
    assert_eq!(seen, [1, 2, 3, 4]);

    // The history holds every message with its sender; cursors moved.
    let (_, history) = call(&cluster, "GET", &format!("/v1/groups/{group_id}/messages"), None).await?;
    let history = history["messages"].as_array().cloned().unwrap_or_default();
    assert_eq!(history.len(), 4, "{history:?}");
    assert_eq!(
        history[1..].iter().map(|m| m["sender"].clone()).collect::<Vec<_>>(),
        messages[1..].iter().map(|m| m["sender"].clone()).collect::<Vec<_>>()
    );
    let (_, members) = call(&cluster, "GET", &format!("/v1/groups/{group_id}/members"), None).await?;
    for member in members["members"].as_array().cloned().unwrap_or_default() {
        assert!(member["readSeq"].as_u64() >= Some(1), "{member}");
    }

    // Each agent read the question with its sender, in one turn.
    let requests = mock.requests();
    assert_eq!(requests.len(), 3);
    for request in &requests {
        let read = last_user_text(request);
        assert!(
            read.contains("[user ") && read.contains("] Hello team, who is here?"),
            "{read}"
        );
    }
    Ok(())
}

both_modes!(a_mention_wakes_only_the_mentioned_agent, mention);

async fn mention(mode: Mode) -> anyhow::Result<()> {
    let (mock, cluster) = prompted(mode, MockBehavior::default()).await?;
    let alice = image(&cluster, "desk", "alice").await?;
    let bob = image(&cluster, "desk", "bob").await?;
    let group_id = group(&cluster, "desk", "mentions", &[&alice, &bob]).await?;
    let mut sse = watch(&cluster, &group_id).await?;

    post(
        &cluster,
        &group_id,
        json!({"content": "Bob, a word?", "mentions": [bob]}),
    )
    .await?;
    let events = until_read(&mut sse, 1).await?;
    let messages = messages_of(&events);
    assert_eq!(messages.len(), 2, "{messages:?}");
    assert_eq!(messages[1]["sender"]["memberId"], bob.as_str());
    assert_eq!(messages[1]["content"], "You are bob.");

    let requests = mock.requests();
    assert_eq!(requests.len(), 1, "only bob thought");
    assert_eq!(requests[0].body["system"], "You are bob.");
    let (_, history) = call(&cluster, "GET", &format!("/v1/images/{alice}/messages"), None).await?;
    assert_eq!(history["messages"].as_array().map(Vec::len), Some(0), "{history}");
    // Alice keeps the message unread, for when she is mentioned.
    assert_eq!(read_seq(&cluster, &group_id, &alice).await?, Some(json!(0)));
    assert_eq!(read_seq(&cluster, &group_id, &bob).await?, Some(json!(2)));
    Ok(())
}

both_modes!(a_message_posted_over_grpc_wakes_the_agents_it_concerns, grpc_post);

/// Issue 28: the session service owns group posting. A message posted
/// straight to it over gRPC, as an internal team would, wakes the agent it
/// mentions and moves its sender's read cursor, as one posted over REST does.
async fn grpc_post(mode: Mode) -> anyhow::Result<()> {
    let (mock, cluster) = prompted(mode, MockBehavior::default()).await?;
    let alice = image(&cluster, "desk", "alice").await?;
    let bob = image(&cluster, "desk", "bob").await?;
    let group_id = group(&cluster, "desk", "mentions", &[&alice, &bob]).await?;
    let (_, members) = call(&cluster, "GET", &format!("/v1/groups/{group_id}/members"), None).await?;
    let me = members["members"]
        .as_array()
        .and_then(|all| all.iter().find(|m| m["kind"] == "user"))
        .map(|m| text(&m["memberId"]))
        .context("the group's creator is a member")?;
    let mut sse = watch(&cluster, &group_id).await?;

    let token = cluster.access_token(&cluster.admin_key).await?;
    let channel = Endpoint::from_shared(cluster.session_grpc.clone())?.connect().await?;
    let mut session = SessionServiceClient::with_interceptor(channel, bearer(&token)?);
    let posted = session
        .post_group_message(ss::PostGroupMessageRequest {
            group_id: group_id.clone(),
            sender: Some(ss::GroupMemberRef {
                kind: ss::GroupMemberKind::User.into(),
                member_id: me.clone(),
            }),
            content: "Bob, over gRPC: a word?".into(),
            mentions: vec![bob.clone()],
            ..Default::default()
        })
        .await?
        .into_inner();
    assert!(posted.created);

    let events = until_read(&mut sse, 1).await?;
    let messages = messages_of(&events);
    assert_eq!(messages.len(), 2, "{messages:?}");
    assert_eq!(messages[0]["content"], "Bob, over gRPC: a word?");
    assert_eq!(messages[1]["sender"]["memberId"], bob.as_str());
    assert_eq!(messages[1]["content"], "You are bob.");
    assert_eq!(mock.requests().len(), 1, "only bob thought");
    assert_eq!(
        read_seq(&cluster, &group_id, &me).await?,
        Some(json!(1)),
        "the sender read its own"
    );
    assert_eq!(read_seq(&cluster, &group_id, &bob).await?, Some(json!(2)));
    assert_eq!(read_seq(&cluster, &group_id, &alice).await?, Some(json!(0)));
    Ok(())
}

both_modes!(a_mention_after_long_chatter_is_answered, busy_group);

/// More unread messages than a turn reads, none of the oldest for the agent:
/// it reads past them to the mention that woke it, in one turn.
async fn busy_group(mode: Mode) -> anyhow::Result<()> {
    const CHATTER: usize = 110;
    let (mock, cluster) = prompted(mode, MockBehavior::default()).await?;
    let alice = image(&cluster, "busy", "alice").await?;
    let group_id = group(&cluster, "busy", "mentions", &[&alice]).await?;
    for n in 1..=CHATTER {
        post(&cluster, &group_id, json!({"content": format!("chatter {n}")})).await?;
    }
    let mut sse = watch(&cluster, &group_id).await?;
    post(
        &cluster,
        &group_id,
        json!({"content": "Alice, your turn.", "mentions": [alice]}),
    )
    .await?;
    let events = until_read(&mut sse, 1).await?;
    let reply = messages_of(&events)
        .into_iter()
        .find(|message| message["sender"]["memberId"] == alice.as_str());
    assert_eq!(
        reply.map(|message| message["seq"].clone()),
        Some(json!(CHATTER + 2)),
        "alice answers after the mention"
    );
    let requests = mock.requests();
    assert_eq!(requests.len(), 1, "one turn");
    let read = last_user_text(&requests[0]);
    assert!(read.contains("] Alice, your turn."), "{read}");
    assert_eq!(read_seq(&cluster, &group_id, &alice).await?, Some(json!(CHATTER + 2)));
    Ok(())
}

both_modes!(messages_sent_during_a_turn_are_read_by_the_next, during_a_turn);

async fn during_a_turn(mode: Mode) -> anyhow::Result<()> {
    // Each answer is held back long enough to post two more messages.
    let slow = MockBehavior {
        first_token_delay: Duration::from_secs(2),
        ..MockBehavior::default()
    };
    let (mock, cluster) = prompted(mode, slow).await?;
    let alice = image(&cluster, "desk", "alice").await?;
    let group_id = group(&cluster, "desk", "all", &[&alice]).await?;
    let mut sse = watch(&cluster, &group_id).await?;

    post(&cluster, &group_id, json!({"content": "first question"})).await?;
    mock.wait_for_requests(1, Duration::from_secs(15)).await?;
    post(&cluster, &group_id, json!({"content": "second question"})).await?;
    post(&cluster, &group_id, json!({"content": "third question"})).await?;

    let events = until_read(&mut sse, 2).await?;
    let replies: Vec<Value> = messages_of(&events)
        .into_iter()
        .filter(|m| m["sender"]["kind"] == "agent")
        .collect();
    assert_eq!(replies.len(), 2, "{replies:?}");
    let requests = mock.requests();
    assert_eq!(requests.len(), 2, "one turn per wake, the late messages together");
    let (first, second) = (last_user_text(&requests[0]), last_user_text(&requests[1]));
    assert!(
        first.contains("first question") && !first.contains("second question"),
        "{first}"
    );
    assert!(
        second.contains("second question") && second.contains("third question"),
        "{second}"
    );
    assert!(!second.contains("first question"), "read once: {second}");
    let (_, group) = call(&cluster, "GET", &format!("/v1/groups/{group_id}"), None).await?;
    assert_eq!(group["lastSeq"], 5, "{group}");
    Ok(())
}

both_modes!(agents_talking_to_each_other_stop_at_the_limit, runaway);

async fn runaway(mode: Mode) -> anyhow::Result<()> {
    // The offline LLM echoes what it read, mentions included: two agents
    // that mention each other answer each other until stopped. Each echo
    // holds the one before, so the six stream thousands of deltas: room
    // for them all, for a watcher slowed by the other tests.
    let cluster = Cluster::start(
        mode,
        Options {
            group_runaway_limit: Some(6),
            subscriber_queue: Some(65_536),
            ..Options::default()
        },
    )
    .await?;
    let alice = image(&cluster, "lab", "alice").await?;
    let bob = image(&cluster, "lab", "bob").await?;
    let group_id = group(&cluster, "lab", "mentions", &[&alice, &bob]).await?;
    let mut sse = watch(&cluster, &group_id).await?;
    post(
        &cluster,
        &group_id,
        json!({"content": format!("@{alice} @{bob} talk among yourselves"), "mentions": [alice]}),
    )
    .await?;

    let mut messages = Vec::new();
    let stopped = loop {
        let (_, kind, data) = sse.next_event().await?;
        anyhow::ensure!(kind != "system_error", "the group's stream failed: {data}");
        match kind.as_str() {
            "group_message" => messages.push(data["data"].clone()),
            "group_runaway_stopped" => break data["data"].clone(),
            _ => {}
        }
    };
    assert_eq!(stopped["limit"], 6);
    assert_eq!(stopped["consecutiveAgentMessages"], 6);
    let senders: Vec<String> = messages[1..].iter().map(|m| text(&m["sender"]["memberId"])).collect();
    assert_eq!(senders.len(), 6, "{senders:?}");
    for (n, sender) in senders.iter().enumerate() {
        let expected = if n % 2 == 0 { &alice } else { &bob };
        assert_eq!(sender, expected, "they take turns");
    }
    let (_, group) = call(&cluster, "GET", &format!("/v1/groups/{group_id}"), None).await?;
    assert_eq!(group["lastSeq"], 7, "nobody answers the last: {group}");
    assert_eq!(group["consecutiveAgentMessages"], 6);
    Ok(())
}

both_modes!(a_paused_agent_keeps_its_messages_until_resumed, pause_and_resume);

async fn pause_and_resume(mode: Mode) -> anyhow::Result<()> {
    let (mock, cluster) = prompted(mode, MockBehavior::default()).await?;
    let alice = image(&cluster, "desk", "alice").await?;
    let group_id = group(&cluster, "desk", "all", &[&alice]).await?;
    let mut sse = watch(&cluster, &group_id).await?;

    let (status, paused) = call(&cluster, "POST", &format!("/v1/agents/{alice}/pause"), None).await?;
    assert_eq!((status, &paused["state"]), (200, &json!("paused")), "{paused}");
    post(&cluster, &group_id, json!({"content": "are you there?"})).await?;
    post(&cluster, &group_id, json!({"content": "hello?"})).await?;
    // A paused agent is not woken (the post answers after the wake) and
    // takes no direct message either.
    assert!(mock.requests().is_empty());
    refused_directly(&cluster, &alice, "AGENT_PAUSED").await?;
    assert_eq!(
        read_seq(&cluster, &group_id, &alice).await?,
        Some(json!(0)),
        "kept unread"
    );

    // Resumed, it reads both in one turn and answers.
    let (status, resumed) = call(&cluster, "POST", &format!("/v1/agents/{alice}/resume"), None).await?;
    assert_eq!(status, 200, "{resumed}");
    assert_ne!(resumed["state"], "paused");
    let events = until_read(&mut sse, 1).await?;
    let replies: Vec<Value> = messages_of(&events)
        .into_iter()
        .filter(|m| m["sender"]["kind"] == "agent")
        .collect();
    assert_eq!(replies.len(), 1, "{replies:?}");
    let requests = mock.requests();
    assert_eq!(requests.len(), 1);
    let read = last_user_text(&requests[0]);
    assert!(read.contains("are you there?") && read.contains("hello?"), "{read}");
    assert_eq!(read_seq(&cluster, &group_id, &alice).await?, Some(json!(3)));

    // Terminated, it never runs again.
    let (status, terminated) = call(&cluster, "POST", &format!("/v1/agents/{alice}/terminate"), None).await?;
    assert_eq!(status, 200, "{terminated}");
    assert_eq!(terminated["state"], "terminated");
    assert_eq!(terminated["terminatedImageIds"], json!([alice]));
    let (status, refused) = call(&cluster, "POST", &format!("/v1/agents/{alice}/resume"), None).await?;
    assert_eq!(
        (status, &refused["error"]["code"]),
        (409, &json!("AGENT_TERMINATED")),
        "{refused}"
    );
    post(&cluster, &group_id, json!({"content": "still there?"})).await?;
    assert_eq!(mock.requests().len(), 1);
    Ok(())
}

both_modes!(
    an_agent_failing_past_retrying_waits_in_error_until_resumed,
    failing_agent
);

async fn failing_agent(mode: Mode) -> anyhow::Result<()> {
    // The provider refuses the key: every turn fails alike.
    let refused = MockBehavior {
        failure: Some(MockFailure::Status(401)),
        ..MockBehavior::default()
    };
    let (mock, cluster) = prompted(mode, refused).await?;
    let alice = image(&cluster, "desk", "alice").await?;
    let group_id = group(&cluster, "desk", "all", &[&alice]).await?;
    let mut sse = watch(&cluster, &group_id).await?;
    let failed = |events: &[(String, Value)]| {
        events
            .iter()
            .find(|(kind, _)| kind == "agent_error")
            .map(|(_, data)| data["data"].clone())
    };
    let until_failed = async |sse: &mut SseStream| -> anyhow::Result<Value> {
        let mut events = Vec::new();
        loop {
            let (_, kind, data) = sse.next_event().await?;
            events.push((kind, data));
            if let Some(failure) = failed(&events) {
                return Ok(failure);
            }
        }
    };

    post(&cluster, &group_id, json!({"content": "first question"})).await?;
    let failure = until_failed(&mut sse).await?;
    assert_eq!(failure["imageId"], alice.as_str());
    assert_eq!(failure["agentState"], "error");
    assert!(
        failure["error"]
            .as_str()
            .is_some_and(|error| error.starts_with("LLM_UNAUTHENTICATED: ")),
        "{failure}"
    );
    let (_, record) = call(&cluster, "GET", &format!("/v1/images/{alice}"), None).await?;
    assert_eq!(record["agentState"], "error", "{record}");
    assert_eq!(record["agentError"], failure["error"]);
    // What it read stays unread, and it takes no direct message.
    assert_eq!(
        read_seq(&cluster, &group_id, &alice).await?,
        Some(json!(0)),
        "kept unread"
    );
    refused_directly(&cluster, &alice, "AGENT_ERROR").await?;

    // Resumed, it reads all that waited in one turn (which fails again here).
    post(&cluster, &group_id, json!({"content": "second question"})).await?;
    let (status, resumed) = call(&cluster, "POST", &format!("/v1/agents/{alice}/resume"), None).await?;
    assert_eq!(status, 200, "{resumed}");
    assert_ne!(resumed["state"], "error", "{resumed}");
    until_failed(&mut sse).await?;
    let requests = mock.requests();
    assert_eq!(requests.len(), 2, "one turn before and one after the resume");
    let read = last_user_text(&requests[1]);
    assert!(
        read.contains("first question") && read.contains("second question"),
        "{read}"
    );
    Ok(())
}

both_modes!(a_parent_delegates_to_a_child_that_uses_a_tool, delegate);

async fn delegate(mode: Mode) -> anyhow::Result<()> {
    // The model calls the tools it is offered: the parent spawns a child
    // (and lists its files), the child lists its own; each then answers
    // with what its tools returned.
    let spawn = json!({
        "task": "List your files and report.",
        "prompt": "You are a careful child.",
        "name": "lister",
        "tools": ["list_files"],
        "newGroup": "pair",
    });
    let calls = vec![
        MockToolCall {
            name: "spawn_agent".to_owned(),
            input: spawn,
            round: 1,
        },
        MockToolCall {
            name: "list_files".to_owned(),
            input: json!({}),
            round: 1,
        },
    ];
    let (mock, cluster) = mocked(
        mode,
        MockBehavior {
            tool_calls: calls,
            offered_tools_only: true,
            ..MockBehavior::default()
        },
    )
    .await?;
    let (status, parent) = call(
        &cluster,
        "POST",
        "/v1/containers",
        Some(json!({"containerId": "office"})),
    )
    .await?;
    assert_eq!(status, 201, "{parent}");
    let (status, parent) = call(
        &cluster,
        "POST",
        "/v1/containers/office/images",
        Some(json!({"name": "lead", "systemPrompt": "You delegate.", "tools": ["spawn_agent", "list_files"]})),
    )
    .await?;
    assert_eq!(status, 201, "{parent}");
    let parent_id = text(&parent["imageId"]);

    let response = cluster
        .http()?
        .post(cluster.url(&format!("/v1/images/{parent_id}/messages")))
        .json(&json!({"content": "Delegate the listing."}))
        .send()
        .await?;
    assert_eq!(response.status(), 200);
    let mut turn = SseStream::new(response);
    let mut events = Vec::new();
    loop {
        let (_, kind, data) = turn.next_event().await?;
        let done = kind == "conversation_end" || kind == "error_occurred";
        events.push((kind, data));
        if done {
            break;
        }
    }
    assert_eq!(
        events.last().map(|(kind, _)| kind.as_str()),
        Some("conversation_end"),
        "{events:?}"
    );
    let spawned = events
        .iter()
        .find(|(kind, _)| kind == "agent_spawned")
        .map(|(_, data)| data["data"].clone())
        .ok_or_else(|| anyhow::anyhow!("no agent_spawned: {events:?}"))?;
    assert_eq!(spawned["parentImageId"], parent_id.as_str());
    assert_eq!(spawned["depth"], 1);
    let child_id = text(&spawned["childImageId"]);
    // It and its parent (and the user who asked) make the new group.
    let pair = text(&spawned["groupId"]);
    let (status, members) = call(&cluster, "GET", &format!("/v1/groups/{pair}/members"), None).await?;
    assert_eq!(status, 200, "{members}");
    let mut kinds: Vec<(String, String)> = members["members"]
        .as_array()
        .map(|all| all.iter().map(|m| (text(&m["kind"]), text(&m["memberId"]))).collect())
        .unwrap_or_default();
    kinds.retain(|(kind, _)| kind == "agent");
    kinds.sort();
    let mut expected = vec![
        ("agent".to_owned(), parent_id.clone()),
        ("agent".to_owned(), child_id.clone()),
    ];
    expected.sort();
    assert_eq!(kinds, expected);
    assert_eq!(members["members"].as_array().map(Vec::len), Some(3), "{members}");

    // The child used its tool and answered; that answer is the parent's tool result.
    let (_, history) = call(&cluster, "GET", &format!("/v1/images/{child_id}/messages"), None).await?;
    let history = history["messages"].as_array().cloned().unwrap_or_default();
    let used: Vec<String> = history
        .iter()
        .filter(|message| message["subtype"] == "tool-result")
        .map(|message| message.to_string())
        .collect();
    assert!(!used.is_empty(), "the child ran a tool: {history:?}");
    let answer = history
        .iter()
        .rev()
        .find(|message| message["subtype"] == "assistant")
        .map(|message| text(&message["content"][0]["text"]))
        .unwrap_or_default();
    assert!(answer.starts_with("Tool results:"), "{history:?}");
    let results: Vec<String> = events
        .iter()
        .filter(|(kind, _)| kind == "tool_result")
        .map(|(_, data)| text(&data["data"]["result"]))
        .collect();
    assert!(
        results.contains(&answer),
        "the spawn's result is the child's answer: {results:?} vs {answer:?}"
    );
    let reply = events
        .iter()
        .rev()
        .find(|(kind, _)| kind == "assistant_message")
        .map(|(_, data)| data["data"]["content"].to_string())
        .unwrap_or_default();
    assert!(reply.contains("Tool results:"), "{reply}");

    // The child's model was offered only its own tool, with its own prompt.
    let requests = mock.requests();
    let child_request = requests
        .iter()
        .find(|request| request.body["system"] == "You are a careful child.")
        .ok_or_else(|| anyhow::anyhow!("the child never asked its model"))?;
    let offered: Vec<&str> = child_request.body["tools"]
        .as_array()
        .map(|tools| tools.iter().filter_map(|tool| tool["name"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(offered, ["list_files"]);

    // Listed under its parent, and nowhere else as a child.
    let (status, children) = call(&cluster, "GET", &format!("/v1/images/{parent_id}/children"), None).await?;
    assert_eq!(status, 200, "{children}");
    let listed: Vec<String> = children["images"]
        .as_array()
        .map(|images| images.iter().map(|image| text(&image["imageId"])).collect())
        .unwrap_or_default();
    assert_eq!(listed, std::slice::from_ref(&child_id));
    assert_eq!(children["images"][0]["parentImageId"], parent_id.as_str());
    let (_, grandchildren) = call(&cluster, "GET", &format!("/v1/images/{child_id}/children"), None).await?;
    assert_eq!(grandchildren["images"], json!([]));
    let (status, _) = call(&cluster, "GET", "/v1/images/img_missing/children", None).await?;
    assert_eq!(status, 404);

    // Terminated with its parent.
    let (status, terminated) = call(&cluster, "POST", &format!("/v1/agents/{parent_id}/terminate"), None).await?;
    assert_eq!(status, 200, "{terminated}");
    assert_eq!(terminated["terminatedImageIds"], json!([parent_id, child_id]));
    Ok(())
}

both_modes!(a_thousand_sleeping_members_hold_no_agents, sleeping_members);

async fn sleeping_members(mode: Mode) -> anyhow::Result<()> {
    use futures::StreamExt;
    const MEMBERS: usize = 1000;
    let (mock, cluster) = prompted(mode, MockBehavior::default()).await?;
    let (status, _) = call(&cluster, "POST", "/v1/containers", Some(json!({"containerId": "hall"}))).await?;
    assert_eq!(status, 201);
    let tasks = || tokio::runtime::Handle::current().metrics().num_alive_tasks();
    let tasks_before = tasks();
    let created: Vec<anyhow::Result<(u16, Value)>> = futures::stream::iter(0..MEMBERS)
        .map(|n| {
            let cluster = &cluster;
            async move {
                call(
                    cluster,
                    "POST",
                    "/v1/containers/hall/images",
                    Some(json!({"name": format!("sleeper {n}"), "systemPrompt": format!("You are sleeper {n}.")})),
                )
                .await
            }
        })
        .buffered(16)
        .collect()
        .await;
    let mut agents = Vec::with_capacity(MEMBERS);
    for image in created {
        let (status, image) = image?;
        anyhow::ensure!(status == 201, "{image}");
        agents.push(text(&image["imageId"]));
    }
    // In groups of at most 64 (what one creation takes), woken by mentions.
    let mut groups = Vec::new();
    for members in agents.chunks(50) {
        let ids: Vec<&str> = members.iter().map(String::as_str).collect();
        groups.push(group(&cluster, "hall", "mentions", &ids).await?);
    }
    for group_id in &groups {
        let posted = post(&cluster, group_id, json!({"content": "good night"})).await?;
        assert_eq!(posted["seq"], 1);
    }
    let (_, running) = call(&cluster, "GET", "/v1/agents?containerId=hall", None).await?;
    assert_eq!(running["agents"].as_array().map(Vec::len), Some(0), "asleep: rows only");
    let tasks_asleep = tasks();

    // One mention wakes one agent among the thousand.
    let mut sse = watch(&cluster, &groups[3]).await?;
    let sleeper = &agents[3 * 50 + 7];
    post(
        &cluster,
        &groups[3],
        json!({"content": "wake up", "mentions": [sleeper]}),
    )
    .await?;
    let events = until_read(&mut sse, 1).await?;
    let replies = messages_of(&events);
    assert_eq!(
        replies.last().map(|m| m["content"].clone()),
        Some(json!("You are sleeper 157."))
    );
    assert_eq!(mock.requests().len(), 1);
    let (_, running) = call(&cluster, "GET", "/v1/agents?containerId=hall", None).await?;
    let running = running["agents"].as_array().cloned().unwrap_or_default();
    assert_eq!(running.len(), 1, "{running:?}");
    assert_eq!(running[0]["imageId"], sleeper.as_str());
    let tasks_after = tasks();
    println!(
        "{MEMBERS} members in {} groups: {} agent in memory; tasks alive: {tasks_before} before, \
         {tasks_asleep} with every member asleep, {tasks_after} after one answered ({mode:?})",
        groups.len(),
        running.len()
    );
    // In one process the server's tasks are counted here: a thousand
    // sleeping members hold none (the few counted are connections closing).
    if mode == Mode::OneProcess {
        assert!(tasks_asleep < tasks_before + 50, "{tasks_before} → {tasks_asleep}");
    }
    Ok(())
}

both_modes!(a_hundred_wakes_of_three_tenants_run_within_the_pool_limits, pool_limits);

async fn pool_limits(mode: Mode) -> anyhow::Result<()> {
    use futures::StreamExt;
    const PER_REPLICA: usize = 4;
    const PER_TENANT: usize = 2;
    let mock = MockLlm::start(MockBehavior {
        reply: Some(SYSTEM_PLACEHOLDER.to_owned()),
        first_token_delay: Duration::from_millis(30),
        ..MockBehavior::default()
    })
    .await?;
    let options = Options {
        max_running_agents: Some((PER_REPLICA, PER_TENANT)),
        ..Options::with_llm(Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        })
    };
    let cluster = Cluster::start(mode, options).await?;
    // Three tenants, 34 + 33 + 33 agents, each tenant's in one group.
    let mut tenants = Vec::new();
    for (t, agents) in [34usize, 33, 33].into_iter().enumerate() {
        let tenant = avm_tests::accounts::create_tenant(&cluster, &format!("pool-{t}"), None).await?;
        let key = tenant.admin.key.clone();
        let (status, _) = call_as(
            &cluster,
            &key,
            "POST",
            "/v1/containers",
            Some(json!({"containerId": "crowd"})),
        )
        .await?;
        anyhow::ensure!(status == 201);
        let mut members = Vec::new();
        for n in 0..agents {
            let (status, image) = call_as(
                &cluster,
                &key,
                "POST",
                "/v1/containers/crowd/images",
                Some(json!({"name": format!("a{n}"), "systemPrompt": format!("tenant {t} agent {n}")})),
            )
            .await?;
            anyhow::ensure!(status == 201, "{image}");
            members.push(json!({"kind": "agent", "memberId": image["imageId"]}));
        }
        let (status, group) = call_as(
            &cluster,
            &key,
            "POST",
            "/v1/containers/crowd/groups",
            Some(json!({"name": "crowd", "members": members})),
        )
        .await?;
        anyhow::ensure!(status == 201, "{group}");
        let response = avm_tests::cluster::http_client(&key)?
            .get(cluster.url(&format!("/v1/groups/{}/messages", text(&group["groupId"]))))
            .header("accept", "text/event-stream")
            .send()
            .await?;
        anyhow::ensure!(response.status() == 200);
        tenants.push((key, text(&group["groupId"]), agents, SseStream::new(response)));
    }
    // A hundred wakes at once: one message into each group, together.
    let cluster = &cluster;
    let posts = tenants.iter().map(|(key, group_id, _, _)| async move {
        let path = format!("/v1/groups/{group_id}/messages");
        call_as(
            cluster,
            key,
            "POST",
            &path,
            Some(json!({"content": "Everyone, answer."})),
        )
        .await
    });
    for posted in futures::future::join_all(posts).await {
        let (status, posted) = posted?;
        anyhow::ensure!(status == 201, "{posted}");
    }
    let answered: Vec<anyhow::Result<usize>> = futures::stream::iter(tenants.iter_mut())
        .map(|(_, _, agents, stream)| async move {
            let events = until_read(stream, *agents).await?;
            Ok(messages_of(&events).len() - 1)
        })
        .buffer_unordered(3)
        .collect()
        .await;
    let answered: Vec<usize> = answered.into_iter().collect::<anyhow::Result<_>>()?;
    assert_eq!(
        answered.iter().sum::<usize>(),
        100,
        "every agent answered once: {answered:?}"
    );

    let stats = mock.stats();
    println!(
        "100 wakes of 3 tenants: at most {} LLM streams at once (limit {PER_REPLICA} per runtime, {PER_TENANT} per tenant) ({mode:?})",
        stats.most_streams_open
    );
    assert!(stats.most_streams_open <= PER_REPLICA, "{stats:?}");
    // Every tenant was served before any was done: none waited for another.
    let order: Vec<usize> = mock
        .requests()
        .iter()
        .filter_map(|request| {
            let system = request.body["system"].as_str()?;
            system.strip_prefix("tenant ")?.split(' ').next()?.parse().ok()
        })
        .collect();
    assert_eq!(order.len(), 100);
    let first = |t: usize| order.iter().position(|&o| o == t).unwrap_or(usize::MAX);
    let last = |t: usize| order.iter().rposition(|&o| o == t).unwrap_or(0);
    let latest_start = (0..3).map(first).max().unwrap_or(usize::MAX);
    let earliest_end = (0..3).map(last).min().unwrap_or(0);
    assert!(latest_start < earliest_end, "a tenant was starved: {order:?}");
    Ok(())
}
