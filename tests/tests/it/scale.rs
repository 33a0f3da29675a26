//! A replicated mesh: two gateways and two runtimes (spawned `avm`
//! processes) on Postgres and Redis. Conversations are served whichever
//! gateway a client uses and whichever runtime holds the agent; events reach
//! subscribers on the other gateway in order; one image never runs two turns
//! at once; a runtime killed mid-turn ends its turns with `RUNTIME_LOST` and
//! its conversations answer again; a runtime stopped with SIGTERM drains;
//! a group's agents on two runtimes each answer once, seen through either
//! gateway; a runtime that dies after its turn ended leaves no lost turn.

use std::time::{Duration, Instant};

use anyhow::Context;
use avm_tests::cluster::{Cluster, Llm, Mode, Options};
use avm_tests::mock_llm::{MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use futures::StreamExt;
use serde_json::{Value, json};

use crate::groups::{group, image};
use crate::support::{assert_text_turn, call, conversation, poll, send_and_finish, streamed_text};

/// Returns whether Postgres and Redis are configured, saying loudly when they
/// are not; with `AVM_TEST_REQUIRE_EXTERNAL=1` a missing one is a failure.
fn external_configured() -> anyhow::Result<bool> {
    let set = |name: &str| std::env::var(name).is_ok_and(|value| !value.is_empty());
    if set("AVM_TEST_DATABASE_URL") && set("AVM_TEST_REDIS_URL") {
        return Ok(true);
    }
    if std::env::var("AVM_TEST_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1") {
        anyhow::bail!("AVM_TEST_DATABASE_URL and AVM_TEST_REDIS_URL must be set with AVM_TEST_REQUIRE_EXTERNAL=1");
    }
    eprintln!("SKIPPED: AVM_TEST_DATABASE_URL or AVM_TEST_REDIS_URL not set; the replicated mesh tests did not run");
    Ok(false)
}

/// Starts two runtimes and two gateways over `mock`; returns the cluster and
/// the second gateway's WebSocket URL.
async fn mesh(mock: &MockLlm) -> anyhow::Result<(Cluster, String)> {
    let options = Options {
        runtimes: 2,
        ..Options::with_llm(Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        })
    };
    let mut cluster = Cluster::start(Mode::PerComponent, options).await?;
    let second = cluster.spawn_gateway().await?;
    let ws = format!(
        "{}/ws?token={}",
        second.replacen("http://", "ws://", 1),
        cluster.admin_key
    );
    Ok((cluster, ws))
}

/// Returns the agents a runtime holds, from its metrics.
async fn active_agents(runtime_url: &str) -> anyhow::Result<f64> {
    let text = reqwest::get(format!("{runtime_url}/metrics")).await?.text().await?;
    Ok(text
        .lines()
        .find(|line| line.starts_with("avm_runtime_active_agents"))
        .and_then(|line| line.split_whitespace().last())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0.0))
}

/// Returns the turn's frames a watcher on another connection sees: it
/// subscribes from the start of the session's retained events.
async fn watch_turn(url: &str, session_id: &str) -> anyhow::Result<Vec<Value>> {
    let mut watcher = WsClient::connect(url).await?;
    watcher.subscribe(session_id, Some("0")).await?;
    watcher.turn().await
}

/// Makes a container with one agent per name, started on the first runtime
/// (the one a test kills), and a group of them, and posts `question` into
/// it; returns the group's id and the agents' image ids.
async fn ask_group_on_first_runtime(
    cluster: &Cluster,
    container_id: &str,
    names: &[&str],
    question: &str,
) -> anyhow::Result<(String, Vec<String>)> {
    use avm_proto::runtime::v1 as rt;
    use avm_proto::runtime::v1::runtime_service_client::RuntimeServiceClient;
    let token = cluster.access_token(&cluster.admin_key).await?;
    let channel = tonic::transport::Endpoint::from_shared(cluster.runtimes[0].clone())?
        .connect()
        .await?;
    let mut first = RuntimeServiceClient::with_interceptor(channel, avm_tests::cluster::bearer(&token)?);
    let mut agents = Vec::new();
    for name in names {
        let image_id = image(cluster, container_id, name).await?;
        first
            .run_image(rt::RunImageRequest {
                image_id: image_id.clone(),
            })
            .await?;
        agents.push(image_id);
    }
    let ids: Vec<&str> = agents.iter().map(String::as_str).collect();
    let group_id = group(cluster, container_id, "all", &ids).await?;
    let (status, posted) = call(
        cluster,
        "POST",
        &format!("/v1/groups/{group_id}/messages"),
        Some(json!({"content": question})),
    )
    .await?;
    anyhow::ensure!(status == 201, "{posted}");
    Ok((group_id, agents))
}

fn text_deltas(frames: &[Value]) -> Vec<String> {
    frames
        .iter()
        .filter(|frame| frame["type"] == "text_delta")
        .filter_map(|frame| frame["data"]["text"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn either_gateway_serves_every_conversation_and_its_events() -> anyhow::Result<()> {
    if !external_configured()? {
        return Ok(());
    }
    let behavior = MockBehavior {
        tokens: 8,
        ..MockBehavior::default()
    };
    let expected = behavior.deltas();
    let mock = MockLlm::start(behavior).await?;
    let (cluster, second) = mesh(&mock).await?;
    let gateways = [cluster.ws_url(), second];
    let results = futures::stream::iter(0..100_usize)
        .map(|index| {
            let sender_url = gateways[index % 2].clone();
            let watcher_url = gateways[(index + 1) % 2].clone();
            async move {
                let mut sender = WsClient::connect(&sender_url).await?;
                let chat = conversation(&mut sender, &format!("mesh-{index}"), json!({})).await?;
                let watched = tokio::spawn({
                    let session_id = chat.session_id.clone();
                    async move { watch_turn(&watcher_url, &session_id).await }
                });
                let frames = send_and_finish(&mut sender, &chat.image_id, json!(format!("hello {index}"))).await?;
                let seen = watched.await??;
                anyhow::Ok((text_deltas(&frames), text_deltas(&seen), seen))
            }
        })
        .buffer_unordered(10)
        .collect::<Vec<_>>()
        .await;
    for result in results {
        let (sent, seen, frames) = result?;
        assert_eq!(sent, expected, "the sender's deltas");
        assert_eq!(
            seen, expected,
            "the watcher on the other gateway gets every delta, in order"
        );
        let cursors: Vec<u64> = frames
            .iter()
            .filter_map(|frame| frame["cursor"].as_str().and_then(|c| c.parse().ok()))
            .collect();
        assert!(
            cursors.windows(2).all(|pair| pair[0] < pair[1]),
            "cursors rise: {cursors:?}"
        );
    }
    // Both runtimes hold agents: the gateways spread the new conversations.
    for runtime in &cluster.runtimes {
        assert!(active_agents(runtime).await? > 0.0, "runtime {runtime} holds no agent");
    }
    // Whichever runtime answers, it lists and finds every replica's agents.
    let (status, listed) = call(&cluster, "GET", "/v1/agents", None).await?;
    assert_eq!(status, 200, "{listed}");
    let agents = listed["agents"].as_array().cloned().unwrap_or_default();
    assert_eq!(agents.len(), 100, "every agent is listed: {listed}");
    for agent in agents.iter().take(10) {
        let id = agent["agentId"].as_str().unwrap_or_default();
        let (status, found) = call(&cluster, "GET", &format!("/v1/agents/{id}"), None).await?;
        assert_eq!((status, found["agentId"].as_str()), (200, Some(id)), "{found}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sends_through_two_gateways_run_one_turn() -> anyhow::Result<()> {
    if !external_configured()? {
        return Ok(());
    }
    let mock = MockLlm::start(MockBehavior {
        tokens: 40,
        token_interval: Duration::from_millis(25),
        ..MockBehavior::default()
    })
    .await?;
    let (cluster, second) = mesh(&mock).await?;
    let mut first = WsClient::connect(&cluster.ws_url()).await?;
    let mut other = WsClient::connect(&second).await?;
    let chat = conversation(&mut first, "busy", json!({})).await?;
    for round in 0..5 {
        let (a, b) = tokio::join!(
            first.request(
                "message_send",
                json!({"imageId": chat.image_id, "content": format!("a{round}")})
            ),
            other.request(
                "message_send",
                json!({"imageId": chat.image_id, "content": format!("b{round}")})
            ),
        );
        let (a, b) = (a?, b?);
        let busy = [&a, &b].iter().filter(|answer| answer["code"] == "AGENT_BUSY").count();
        let accepted = [&a, &b].iter().filter(|answer| answer.get("error").is_none()).count();
        assert_eq!((accepted, busy), (1, 1), "one runs, one is busy: {a} / {b}");
        first.frames_until("conversation_end").await?;
    }
    let history = first
        .request("image_messages", json!({"imageId": chat.image_id}))
        .await?;
    let users = history["messages"]
        .as_array()
        .map(|messages| messages.iter().filter(|m| m["role"] == "user").count())
        .unwrap_or_default();
    assert_eq!(users, 5, "one user message per round: {history}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_runtime_ends_its_turns_and_the_conversations_go_on() -> anyhow::Result<()> {
    if !external_configured()? {
        return Ok(());
    }
    let slow = MockBehavior {
        tokens: 400,
        token_interval: Duration::from_millis(20),
        ..MockBehavior::default()
    };
    let mock = MockLlm::start(slow).await?;
    let (mut cluster, second) = mesh(&mock).await?;
    let mut senders = Vec::new();
    let mut watchers = Vec::new();
    for index in 0..20 {
        let mut sender = WsClient::connect(&cluster.ws_url()).await?;
        let chat = conversation(&mut sender, &format!("lost-{index}"), json!({})).await?;
        let mut watcher = WsClient::connect(&second).await?;
        watcher.subscribe(&chat.session_id, Some("0")).await?;
        let accepted = sender
            .request(
                "message_send",
                json!({"imageId": chat.image_id, "content": format!("keep me {index}")}),
            )
            .await?;
        assert!(accepted.get("error").is_none(), "{accepted}");
        sender.frames_until("text_delta").await?;
        senders.push((sender, chat));
        watchers.push(watcher);
    }
    cluster.kill_runtime(0).await?;
    let killed = Instant::now();

    let mut lost = 0;
    for ((sender, chat), watcher) in senders.iter_mut().zip(watchers.iter_mut()) {
        let mine = sender.turn().await?;
        let theirs = watcher.turn().await?;
        let end = mine.last().cloned().unwrap_or_default();
        assert_eq!(
            theirs.last().map(|f| f["type"].clone()),
            Some(end["type"].clone()),
            "the watcher sees the same end"
        );
        if end["type"] == "error_occurred" {
            assert_eq!(end["data"]["code"], "RUNTIME_LOST", "{end}");
            lost += 1;
        } else {
            assert_eq!(end["type"], "conversation_end", "{end}");
        }
        let history = sender
            .request("image_messages", json!({"imageId": chat.image_id}))
            .await?;
        let messages = history["messages"].as_array().cloned().unwrap_or_default();
        assert!(
            messages.iter().any(|m| m["role"] == "user"),
            "the acknowledged user message is kept: {history}"
        );
        if end["type"] == "error_occurred" {
            assert!(
                history.to_string().contains("RUNTIME_LOST"),
                "history records the lost turn: {history}"
            );
        }
    }
    assert!(lost > 0, "the killed runtime ran some of the turns");
    println!("lost turns ended {:?} after the kill", killed.elapsed());

    mock.set_behavior(MockBehavior::default());
    for (sender, chat) in &mut senders {
        let started = Instant::now();
        let frames = send_and_finish(sender, &chat.image_id, json!("again")).await?;
        assert_eq!(
            frames.last().map(|f| f["type"].clone()),
            Some(json!("conversation_end"))
        );
        assert!(!streamed_text(&frames).is_empty());
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "answered again in {:?}",
            started.elapsed()
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_saw_nothing_yet_misses_nothing_when_its_runtime_goes() -> anyhow::Result<()> {
    if !external_configured()? {
        return Ok(());
    }
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let (mut cluster, second) = mesh(&mock).await?;
    // Each conversation is followed live (no cursor) by its sender and by a
    // watcher on the other gateway, through either runtime, before it has
    // any event.
    let mut chats = Vec::new();
    for index in 0..6 {
        let mut sender = WsClient::connect(&cluster.ws_url()).await?;
        let chat = conversation(&mut sender, &format!("fresh-{index}"), json!({})).await?;
        let mut watcher = WsClient::connect(&second).await?;
        watcher.subscribe(&chat.session_id, None).await?;
        chats.push((sender, watcher, chat));
    }
    // The turns start while the gateways follow again the streams the
    // killed runtime carried.
    cluster.kill_runtime(0).await?;
    for (sender, _, chat) in &mut chats {
        sender
            .send_request("message_send", json!({"imageId": chat.image_id, "content": "hello"}))
            .await?;
    }
    for (sender, watcher, _) in &mut chats {
        let mine = sender.turn().await?;
        let text = assert_text_turn(&mine);
        let theirs = watcher.turn().await?;
        let kinds = |frames: &[Value]| -> Vec<String> {
            let kinds = crate::support::types(frames);
            let start = kinds
                .iter()
                .position(|kind| kind == "message_start")
                .unwrap_or(kinds.len());
            kinds[start..].to_vec()
        };
        assert_eq!(kinds(&theirs), kinds(&mine), "the watcher sees the whole turn");
        assert_eq!(streamed_text(&theirs), text);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_stopped_with_sigterm_drains() -> anyhow::Result<()> {
    if !external_configured()? {
        return Ok(());
    }
    let mock = MockLlm::start(MockBehavior {
        tokens: 40,
        token_interval: Duration::from_millis(25),
        ..MockBehavior::default()
    })
    .await?;
    let (mut cluster, _) = mesh(&mock).await?;
    let mut senders = Vec::new();
    for index in 0..10 {
        let mut sender = WsClient::connect(&cluster.ws_url()).await?;
        let chat = conversation(&mut sender, &format!("drain-{index}"), json!({})).await?;
        let accepted = sender
            .request(
                "message_send",
                json!({"imageId": chat.image_id, "content": "finish me"}),
            )
            .await?;
        assert!(accepted.get("error").is_none(), "{accepted}");
        senders.push((sender, chat));
    }
    // Exits 0 once its turns finished and its agents are released.
    cluster.terminate_runtime(0).await?;
    for (sender, chat) in &mut senders {
        let frames = sender.turn().await?;
        let end = frames.last().cloned().unwrap_or_default();
        assert_eq!(end["type"], "conversation_end", "drained turns finish: {end}");
        assert_eq!(end["data"]["reason"], "completed", "{end}");
        let again = send_and_finish(sender, &chat.image_id, json!("still there?")).await?;
        assert_eq!(again.last().map(|f| f["type"].clone()), Some(json!("conversation_end")));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_of_one_group_on_two_runtimes_answer_once_each() -> anyhow::Result<()> {
    use avm_proto::runtime::v1 as rt;
    use avm_proto::runtime::v1::runtime_service_client::RuntimeServiceClient;
    if !external_configured()? {
        return Ok(());
    }
    let mock = MockLlm::start(MockBehavior {
        reply: Some(avm_tests::mock_llm::SYSTEM_PLACEHOLDER.to_owned()),
        ..MockBehavior::default()
    })
    .await?;
    let (mut cluster, _) = mesh(&mock).await?;
    let second = cluster.spawn_gateway().await?;
    call(
        &cluster,
        "POST",
        "/v1/containers",
        Some(json!({"containerId": "split"})),
    )
    .await?;
    let mut agents = Vec::new();
    for name in ["alice", "bob"] {
        let (status, image) = call(
            &cluster,
            "POST",
            "/v1/containers/split/images",
            Some(json!({"name": name, "systemPrompt": format!("You are {name}.")})),
        )
        .await?;
        anyhow::ensure!(status == 201, "{image}");
        agents.push(image["imageId"].as_str().unwrap_or_default().to_owned());
    }
    // Alice starts on the first runtime, bob on the second.
    let token = cluster.access_token(&cluster.admin_key).await?;
    for (agent, runtime) in agents.iter().zip(&cluster.runtimes) {
        let channel = tonic::transport::Endpoint::from_shared(runtime.clone())?
            .connect()
            .await?;
        let mut client = RuntimeServiceClient::with_interceptor(channel, avm_tests::cluster::bearer(&token)?);
        client
            .run_image(rt::RunImageRequest {
                image_id: agent.clone(),
            })
            .await?;
    }
    for runtime in &cluster.runtimes {
        assert_eq!(active_agents(runtime).await?, 1.0, "one agent on {runtime}");
    }
    let (status, group) = call(
        &cluster,
        "POST",
        "/v1/containers/split/groups",
        Some(json!({"name": "split", "members": [
            {"kind": "agent", "memberId": agents[0]},
            {"kind": "agent", "memberId": agents[1]},
        ]})),
    )
    .await?;
    anyhow::ensure!(status == 201, "{group}");
    let group_id = group["groupId"].as_str().unwrap_or_default().to_owned();

    // Watched through the other gateway; posted through the first.
    let response = avm_tests::cluster::http_client(&cluster.admin_key)?
        .get(format!("{second}/v1/groups/{group_id}/messages"))
        .header("accept", "text/event-stream")
        .send()
        .await?;
    assert_eq!(response.status(), 200);
    let mut stream = crate::support::SseStream::new(response);
    let (status, posted) = call(
        &cluster,
        "POST",
        &format!("/v1/groups/{group_id}/messages"),
        Some(json!({"content": "Who is where?"})),
    )
    .await?;
    assert_eq!(status, 201, "{posted}");
    let mut replies = Vec::new();
    let mut reads = 0;
    while reads < 2 {
        let (_, kind, data) = stream.next_event().await?;
        anyhow::ensure!(kind != "system_error", "{data}");
        match kind.as_str() {
            "group_read" => reads += 1,
            "group_message" if data["data"]["sender"]["kind"] == "agent" => replies.push(data["data"].clone()),
            _ => {}
        }
    }
    let mut said: Vec<String> = replies
        .iter()
        .map(|reply| reply["content"].as_str().unwrap_or_default().to_owned())
        .collect();
    said.sort();
    assert_eq!(said, ["You are alice.", "You are bob."], "{replies:?}");
    let (_, history) = call(&cluster, "GET", &format!("/v1/groups/{group_id}/messages"), None).await?;
    assert_eq!(history["messages"].as_array().map(Vec::len), Some(3), "{history}");
    assert_eq!(mock.requests().len(), 2, "one turn each");
    for runtime in &cluster.runtimes {
        assert_eq!(
            active_agents(runtime).await?,
            1.0,
            "each stayed where it was: {runtime}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_message_whose_runtime_is_killed_is_answered_once_by_a_survivor() -> anyhow::Result<()> {
    if !external_configured()? {
        return Ok(());
    }
    // Slow enough that the runtime dies while the answer streams.
    let mock = MockLlm::start(MockBehavior {
        tokens: 200,
        token_interval: Duration::from_millis(20),
        ..MockBehavior::default()
    })
    .await?;
    let (mut cluster, _) = mesh(&mock).await?;
    // Alice runs on the first runtime, the one to die.
    let (group_id, agents) = ask_group_on_first_runtime(&cluster, "fail", &["alice"], "Answer me once.").await?;
    let alice = &agents[0];
    mock.wait_for_requests(1, Duration::from_secs(15)).await?;
    cluster.kill_runtime(0).await?;
    let killed = Instant::now();

    // The survivor finds the lost turn, wakes alice, and she answers: her
    // read cursor moves past her reply once it is stored.
    let members = format!("/v1/groups/{group_id}/members");
    loop {
        let (_, listed) = call(&cluster, "GET", &members, None).await?;
        let read = listed["members"]
            .as_array()
            .and_then(|all| all.iter().find(|m| m["memberId"] == alice.as_str()))
            .and_then(|m| m["readSeq"].as_u64());
        if read == Some(2) {
            break;
        }
        anyhow::ensure!(
            killed.elapsed() < Duration::from_secs(30),
            "no answer after the runtime died: {listed}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("answered {:?} after the kill", killed.elapsed());
    let (_, history) = call(&cluster, "GET", &format!("/v1/groups/{group_id}/messages"), None).await?;
    let all = history["messages"].as_array().cloned().unwrap_or_default();
    assert_eq!(all.len(), 2, "one answer: {all:?}");
    assert_eq!(all[1]["sender"]["memberId"], alice.as_str());
    assert_eq!(all[1]["messageId"], format!("reply.{alice}.1"));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_waiting_on_a_killed_runtime_is_taken_over_by_a_survivor() -> anyhow::Result<()> {
    if !external_configured()? {
        return Ok(());
    }
    // One group turn at a time per runtime, slow enough that the runtime
    // dies with one agent answering and the other still waiting its turn:
    // that one had no turn yet, so only its wake, left unacknowledged on
    // the bus, says it has a message to answer.
    let mock = MockLlm::start(MockBehavior {
        tokens: 200,
        token_interval: Duration::from_millis(20),
        ..MockBehavior::default()
    })
    .await?;
    let options = Options {
        runtimes: 2,
        max_running_agents: Some((1, 1)),
        ..Options::with_llm(Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        })
    };
    let mut cluster = Cluster::start(Mode::PerComponent, options).await?;
    // Both on the runtime to die.
    let (group_id, agents) =
        ask_group_on_first_runtime(&cluster, "queue", &["alice", "bob"], "Both of you, answer once.").await?;
    mock.wait_for_requests(1, Duration::from_secs(15)).await?;
    assert_eq!(mock.requests().len(), 1, "the other agent waits for its turn");
    cluster.kill_runtime(0).await?;
    let killed = Instant::now();

    let messages = format!("/v1/groups/{group_id}/messages");
    let all = loop {
        let (_, history) = call(&cluster, "GET", &messages, None).await?;
        let all = history["messages"].as_array().cloned().unwrap_or_default();
        if all.len() >= 3 {
            break all;
        }
        anyhow::ensure!(
            killed.elapsed() < Duration::from_secs(60),
            "not both answered after the runtime died: {history}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("both answered {:?} after the kill", killed.elapsed());
    let mut senders: Vec<String> = all[1..]
        .iter()
        .map(|message| message["sender"]["memberId"].as_str().unwrap_or_default().to_owned())
        .collect();
    senders.sort();
    let mut expected = agents.clone();
    expected.sort();
    assert_eq!(senders, expected, "each answers once: {all:?}");
    let metrics = reqwest::get(format!("{}/metrics", cluster.runtimes[1]))
        .await?
        .text()
        .await?;
    let reclaimed = metrics
        .lines()
        .find(|line| line.starts_with("avm_runtime_wakes_reclaimed_total"))
        .and_then(|line| line.split_whitespace().last())
        .and_then(|value| value.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(reclaimed >= 1.0, "the survivor took a wake over: {reclaimed}");
    Ok(())
}

/// A replica can die after its turn ended but before its record of the turn
/// left Redis (the record is removed after the turn's last event). A
/// survivor finding that record must not mark the finished turn lost: its
/// conversation gets no `RUNTIME_LOST` in history or on its events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_that_dies_after_its_turn_ended_leaves_no_lost_turn() -> anyhow::Result<()> {
    if !external_configured()? {
        return Ok(());
    }
    let mock = MockLlm::start(MockBehavior {
        tokens: 50,
        token_interval: Duration::from_millis(20),
        ..MockBehavior::default()
    })
    .await?;
    let cluster = Cluster::start(
        Mode::PerComponent,
        Options::with_llm(Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        }),
    )
    .await?;
    let (url, prefix) = cluster.redis().context("a replicated mesh has Redis")?;
    let mut redis = redis::Client::open(url)?.get_multiplexed_async_connection().await?;
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "ended", json!({})).await?;

    // The record the runtime keeps while the turn runs, as a survivor reads it.
    client
        .send_request("message_send", json!({"imageId": chat.image_id, "content": "hello"}))
        .await?;
    client.frames_until("text_delta").await?;
    let pattern = format!("{prefix}runtime:turns:*");
    let record = poll(Duration::from_secs(10), "the running turn is recorded", || {
        let mut redis = redis.clone();
        let pattern = pattern.clone();
        async move {
            let keys: Vec<String> = redis::cmd("KEYS").arg(&pattern).query_async(&mut redis).await?;
            for key in keys {
                let turns: Vec<(String, String)> = redis::cmd("HGETALL").arg(&key).query_async(&mut redis).await?;
                if let Some(turn) = turns.into_iter().next() {
                    return Ok(Some(turn));
                }
            }
            Ok(None)
        }
    })
    .await?;
    let first = client.turn().await?;
    assert_eq!(
        first.last().map(|f| f["type"].clone()),
        Some(json!("conversation_end")),
        "{first:?}"
    );

    // A replica that died right after that turn ended left its record.
    let dead = "replica-died-after-its-turn";
    let dead_turns = format!("{prefix}runtime:turns:{dead}");
    let replicas = format!("{prefix}runtime:replicas");
    redis::pipe()
        .cmd("HSET")
        .arg(&dead_turns)
        .arg(&record.0)
        .arg(&record.1)
        .ignore()
        .cmd("SADD")
        .arg(&replicas)
        .arg(dead)
        .ignore()
        .query_async::<()>(&mut redis)
        .await?;
    poll(
        Duration::from_secs(30),
        "the survivor takes the dead replica's turns",
        || {
            let mut redis = redis.clone();
            let (dead_turns, replicas) = (dead_turns.clone(), replicas.clone());
            async move {
                let (left, member): (u64, bool) = redis::pipe()
                    .cmd("HLEN")
                    .arg(&dead_turns)
                    .cmd("SISMEMBER")
                    .arg(&replicas)
                    .arg(dead)
                    .query_async(&mut redis)
                    .await?;
                Ok((left == 0 && !member).then_some(()))
            }
        },
    )
    .await?;

    // The finished turn stays finished; the next one runs as usual.
    mock.set_behavior(MockBehavior::default());
    let frames = send_and_finish(&mut client, &chat.image_id, json!("again")).await?;
    assert_text_turn(&frames);
    assert!(
        !frames.iter().any(|f| f["type"] == "error_occurred"),
        "no error reaches the conversation: {frames:?}"
    );
    let (_, history) = call(&cluster, "GET", &format!("/v1/images/{}/messages", chat.image_id), None).await?;
    let roles: Vec<&str> = history["messages"]
        .as_array()
        .context("history")?
        .iter()
        .filter_map(|m| m["role"].as_str())
        .collect();
    assert_eq!(roles, ["user", "assistant", "user", "assistant"], "{history}");
    Ok(())
}
