//! Agents that act: a model that calls tools gets them run in the image's
//! workspace, sees their results and answers with them; the calls and results
//! are in the history, the events in the documented order.

use std::path::Path;

use anyhow::Context;
use avm_tests::cluster::{Cluster, Llm, Mode, Options};
use avm_tests::mock_llm::{MockApi, MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{Conversation, call, conversation, send_and_finish, streamed_text, types};

/// Publishes built-in tool resources and an agent definition that uses them;
/// returns the agent's URI.
async fn tool_agent(cluster: &Cluster, tools: &[&str]) -> anyhow::Result<String> {
    let prompt = json!({"kind": "prompt", "name": "worker", "version": "1.0.0",
        "content": {"template": "You work in your workspace."}});
    let (status, created) = call(cluster, "POST", "/v1/resources", Some(prompt)).await?;
    anyhow::ensure!(status == 201, "prompt: {created}");
    let mut uris = Vec::new();
    for tool in tools {
        let body = json!({"kind": "tool", "name": tool, "version": "1.0.0", "content": {
            "name": tool, "inputSchema": {"type": "object"}, "builtin": tool}});
        let (status, created) = call(cluster, "POST", "/v1/resources", Some(body)).await?;
        anyhow::ensure!(status == 201, "tool {tool}: {created}");
        uris.push(format!("resource://tools/{tool}@1"));
    }
    let agent = json!({"kind": "agent", "name": "worker", "version": "1.0.0",
        "content": {"prompt": "resource://prompts/worker@1", "tools": uris}});
    let (status, created) = call(cluster, "POST", "/v1/resources", Some(agent)).await?;
    anyhow::ensure!(status == 201, "agent: {created}");
    Ok("resource://agents/worker@1".to_owned())
}

/// Starts the mock LLM speaking `api` and a cluster using it.
async fn start(mode: Mode, api: MockApi) -> anyhow::Result<(MockLlm, Cluster)> {
    start_with(mode, api, Options::default()).await
}

/// Starts the mock LLM speaking `api` and a cluster of `options` using it.
pub(crate) async fn start_with(mode: Mode, api: MockApi, options: Options) -> anyhow::Result<(MockLlm, Cluster)> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let llm = match api {
        MockApi::Anthropic => Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        },
        MockApi::OpenAi => Llm::OpenAi {
            base_url: mock.openai_base_url(),
        },
    };
    let cluster = Cluster::start(mode, Options { llm, ..options }).await?;
    Ok((mock, cluster))
}

/// Connects a WebSocket client and opens a conversation of `config`.
pub(crate) async fn open_chat(cluster: &Cluster, config: Value) -> anyhow::Result<(WsClient, Conversation)> {
    let mut client = WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", config).await?;
    Ok((client, chat))
}

both_modes!(an_agent_writes_a_file_and_reads_it_back, write_and_read);

async fn write_and_read(mode: Mode) -> anyhow::Result<()> {
    for api in [MockApi::Anthropic, MockApi::OpenAi] {
        let (_mock, cluster) = start(mode, api).await?;
        let agent = tool_agent(&cluster, &["write_file", "read_file", "list_files"]).await?;
        let (mut client, chat) = open_chat(&cluster, json!({"agent": agent})).await?;

        let write = r#"note it [mock call='write_file:{"path": "notes/todo.txt", "content": "remember the milk"}']"#;
        let frames = send_and_finish(&mut client, &chat.image_id, json!(write)).await?;
        let order = types(&frames);
        let order: Vec<&str> = order.iter().map(String::as_str).collect();
        let expected_tool_block = [
            "message_start",
            "conversation_start",
            "tool_use_start",
            "tool_planned",
            "tool_executing",
        ];
        let start = order
            .iter()
            .position(|kind| *kind == "message_start")
            .context("message_start")?;
        assert_eq!(order[start..start + 5], expected_tool_block, "{api:?}: {order:?}");
        // Input pieces and text deltas vary in number: each run shows once.
        let mut tail: Vec<&str> = Vec::new();
        for kind in &order[start + 5..] {
            let kind = match *kind {
                "conversation_responding" => continue,
                other => other,
            };
            if tail.last() != Some(&kind) {
                tail.push(kind);
            }
        }
        assert_eq!(
            tail,
            [
                "input_json_delta",
                "tool_use_stop",
                "tool_call_message",
                "message_delta",
                "message_stop",
                "tool_result",
                "tool_result_message",
                "message_start",
                "conversation_start",
                "text_delta",
                "message_delta",
                "message_stop",
                "assistant_message",
                "conversation_end",
            ],
            "{api:?}: {order:?}"
        );
        assert!(
            order
                .windows(2)
                .all(|pair| pair[0] != "text_delta" || pair[1] == "conversation_responding"),
            "each text delta is followed by conversation_responding: {order:?}"
        );
        let stop = frames
            .iter()
            .find(|f| f["type"] == "tool_use_stop")
            .context("tool_use_stop")?;
        assert_eq!(stop["data"]["toolName"], "write_file");
        assert_eq!(
            stop["data"]["input"],
            json!({"path": "notes/todo.txt", "content": "remember the milk"})
        );
        let first_stop = frames
            .iter()
            .find(|f| f["type"] == "message_stop")
            .context("message_stop")?;
        assert_eq!(first_stop["data"]["stopReason"], "tool_use");
        let result = frames
            .iter()
            .find(|f| f["type"] == "tool_result")
            .context("tool_result")?;
        assert_eq!(result["data"]["isError"], false, "{result}");
        assert_eq!(result["data"]["toolCallId"], stop["data"]["toolCallId"]);
        assert_eq!(streamed_text(&frames), "Tool results: wrote 17 bytes to notes/todo.txt");
        let workspace = cluster.data_dir().join("workspaces");
        let written = find_file(&workspace, "todo.txt").context("the file is in the workspace")?;
        assert_eq!(std::fs::read_to_string(&written)?, "remember the milk");

        // The next turn reads it back: its request carries the first turn's
        // call paired with its result (the mock refuses it otherwise).
        let read = "and now? [mock call=read_file:{\"path\":\"notes/todo.txt\"}]";
        let frames = send_and_finish(&mut client, &chat.image_id, json!(read)).await?;
        assert_eq!(
            streamed_text(&frames),
            "Tool results: remember the milk",
            "{api:?}: {:?}",
            types(&frames)
        );

        // The history holds the calls and results as message objects.
        let history = client
            .request("image_messages", json!({"imageId": chat.image_id}))
            .await?;
        let subtypes: Vec<&str> = history["messages"]
            .as_array()
            .context("messages")?
            .iter()
            .filter_map(|message| message["subtype"].as_str())
            .collect();
        assert_eq!(
            subtypes,
            [
                "user",
                "tool-call",
                "tool-result",
                "assistant",
                "user",
                "tool-call",
                "tool-result",
                "assistant"
            ],
            "{history}"
        );
        let result = &history["messages"][6];
        assert_eq!(result["role"], "tool");
        assert_eq!(result["toolResult"]["name"], "read_file");
        assert_eq!(
            result["toolResult"]["output"],
            json!({"type": "text", "value": "remember the milk"})
        );
        let call_message = &history["messages"][5];
        assert_eq!(call_message["toolCall"]["input"], json!({"path": "notes/todo.txt"}));
        assert_eq!(result["toolCallId"], call_message["toolCall"]["id"]);

        // The workspace goes with its image, once the runtime hears of the
        // deletion from the session service.
        let image_dir = written
            .parent()
            .and_then(Path::parent)
            .context("the image's workspace")?
            .to_owned();
        assert!(image_dir.ends_with(&chat.image_id), "{}", image_dir.display());
        let (status, deleted) = call(&cluster, "DELETE", &format!("/v1/images/{}", chat.image_id), None).await?;
        assert_eq!(status, 200, "{deleted}");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while image_dir.exists() {
            anyhow::ensure!(std::time::Instant::now() < deadline, "the workspace outlived its image");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    Ok(())
}

/// Returns the path of a file of this name below `dir`.
fn find_file(dir: &Path, name: &str) -> Option<std::path::PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if let Some(found) = find_file(&path, name) {
                return Some(found);
            }
        } else if path.file_name().is_some_and(|file| file == name) {
            return Some(path);
        }
    }
    None
}

both_modes!(nothing_outside_the_workspace_is_reachable, confinement);

async fn confinement(mode: Mode) -> anyhow::Result<()> {
    let (_mock, cluster) = start(mode, MockApi::Anthropic).await?;
    let agent = tool_agent(&cluster, &["read_file", "write_file"]).await?;
    let (mut client, chat) = open_chat(&cluster, json!({"agent": agent})).await?;
    let admin_key = std::fs::read_to_string(cluster.data_dir().join("admin.key"))?;
    let outside = "try [mock call=read_file:{\"path\":\"../../../admin.key\"} \
        call=read_file:{\"path\":\"/etc/passwd\"} call=write_file:{\"path\":\"../../escape.txt\",\"content\":\"x\"}]";
    let frames = send_and_finish(&mut client, &chat.image_id, json!(outside)).await?;
    let results: Vec<&Value> = frames.iter().filter(|f| f["type"] == "tool_result").collect();
    assert_eq!(results.len(), 3, "{:?}", types(&frames));
    for result in &results {
        assert_eq!(result["data"]["isError"], true, "{result}");
    }
    assert!(
        results[0]["data"]["result"]
            .as_str()
            .is_some_and(|text| text.contains("..")),
        "{}",
        results[0]
    );
    assert!(
        results[1]["data"]["result"]
            .as_str()
            .is_some_and(|text| text.contains("absolute")),
        "{}",
        results[1]
    );
    let everything = serde_json::to_string(&frames)?;
    assert!(
        !everything.contains(admin_key.trim()),
        "the admin key leaked into the events"
    );
    assert!(!cluster.data_dir().join("workspaces").join("escape.txt").exists());
    assert!(
        frames.last().is_some_and(|f| f["type"] == "conversation_end"),
        "a tool failure is not a failed turn"
    );
    Ok(())
}

both_modes!(a_model_that_never_stops_calling_tools_hits_the_step_limit, step_limit);

async fn step_limit(mode: Mode) -> anyhow::Result<()> {
    let (mock, cluster) = start(mode, MockApi::OpenAi).await?;
    let agent = tool_agent(&cluster, &["list_files"]).await?;
    let (mut client, chat) = open_chat(&cluster, json!({"agent": agent})).await?;
    let frames = send_and_finish(
        &mut client,
        &chat.image_id,
        json!("loop [mock call=list_files rounds=1000]"),
    )
    .await?;
    let last = frames.last().context("frames")?;
    assert_eq!(last["type"], "error_occurred");
    assert_eq!(last["data"]["code"], "TOOL_LOOP_LIMIT");
    // The default limit is 25 LLM calls, each of which called the tool once.
    let calls = frames.iter().filter(|f| f["type"] == "tool_result").count();
    assert_eq!(calls, 25);
    assert_eq!(mock.requests().len(), 25);
    // Every call has its result, so the conversation goes on.
    let frames = send_and_finish(&mut client, &chat.image_id, json!("enough")).await?;
    assert_eq!(
        frames.last().context("frames")?["type"],
        "conversation_end",
        "{:?}",
        types(&frames)
    );
    Ok(())
}

both_modes!(a_conversation_without_tools_creates_no_workspace, tool_free);

async fn tool_free(mode: Mode) -> anyhow::Result<()> {
    let (mock, cluster) = start(mode, MockApi::Anthropic).await?;
    let (mut client, chat) = open_chat(&cluster, json!({})).await?;
    let frames = send_and_finish(&mut client, &chat.image_id, json!("hello")).await?;
    assert_eq!(frames.last().context("frames")?["type"], "conversation_end");
    let request = mock.requests().pop().context("the provider was called")?;
    assert_eq!(request.body.get("tools"), None, "no tools are offered");
    assert!(
        !cluster.data_dir().join("workspaces").exists(),
        "no workspace without tools"
    );
    Ok(())
}

both_modes!(a_tool_conversation_continues_after_a_restart, after_restart);

async fn after_restart(mode: Mode) -> anyhow::Result<()> {
    for api in [MockApi::Anthropic, MockApi::OpenAi] {
        let (mock, cluster) = start(mode, api).await?;
        let agent = tool_agent(&cluster, &["write_file", "read_file"]).await?;
        let (mut client, chat) = open_chat(&cluster, json!({"agent": agent})).await?;
        let write = r#"[mock call='write_file:{"path": "plan.md", "content": "step one"}']"#;
        send_and_finish(&mut client, &chat.image_id, json!(write)).await?;
        drop(client);

        let cluster = cluster.restart().await?;
        let mut client = WsClient::connect(&cluster.ws_url()).await?;
        client.subscribe(&chat.session_id, None).await?;
        let read = "[mock call=read_file:{\"path\":\"plan.md\"}]";
        let frames = send_and_finish(&mut client, &chat.image_id, json!(read)).await?;
        assert_eq!(
            streamed_text(&frames),
            "Tool results: step one",
            "{api:?}: {:?}",
            types(&frames)
        );
        // The rehydrated agent sent the stored call with its result.
        let request = mock.requests().pop().context("the provider was called")?;
        let sent = serde_json::to_string(&request.body["messages"])?;
        assert!(
            sent.contains("plan.md") && sent.contains("wrote 8 bytes to plan.md"),
            "{api:?}: {sent}"
        );
    }
    Ok(())
}

both_modes!(a_command_reads_what_the_agent_wrote_and_sees_no_secret, commands);

async fn commands(mode: Mode) -> anyhow::Result<()> {
    let (_mock, cluster) = start(mode, MockApi::OpenAi).await?;
    let agent = tool_agent(&cluster, &["write_file", "run_command"]).await?;
    let (mut client, chat) = open_chat(&cluster, json!({"agent": agent})).await?;
    // One turn, two replies that call tools: write a file, then a command reads it.
    let script = r#"[mock call='write_file:{"path": "in.txt", "content": "forty two"}' call='2:run_command:{"command": "tr a-z A-Z < in.txt"}']"#;
    let frames = send_and_finish(&mut client, &chat.image_id, json!(script)).await?;
    assert_eq!(
        streamed_text(&frames),
        "Tool results: exit code 0\nstdout:\nFORTY TWO",
        "{:?}",
        types(&frames)
    );
    assert_eq!(frames.iter().filter(|f| f["type"] == "message_start").count(), 3);

    // The command's environment is its own: none of the server's variables.
    let frames = send_and_finish(
        &mut client,
        &chat.image_id,
        json!("[mock call=run_command:{\"command\":\"env\"}]"),
    )
    .await?;
    let result = frames
        .iter()
        .find(|f| f["type"] == "tool_result")
        .context("tool_result")?;
    let env = result["data"]["result"].as_str().context("result text")?;
    assert!(env.contains("PATH="), "{env}");
    for secret in [
        "AVM_",
        "LLM_",
        avm_tests::cluster::TEST_API_KEY,
        avm_tests::cluster::TEST_SERVICE_KEY,
    ] {
        assert!(!env.contains(secret), "{secret} is visible to commands: {env}");
    }
    let admin_key = std::fs::read_to_string(cluster.data_dir().join("admin.key"))?;
    assert!(!env.contains(admin_key.trim()));

    // Nor its files: the data directory (keys, databases, other workspaces)
    // is out of sight, and so are its processes and their environments.
    let peek = format!(
        "cat {data}/admin.key; ls {data}; cat /proc/*/environ 2>/dev/null | grep -ac LLM_",
        data = cluster.data_dir().display()
    );
    let frames = send_and_finish(
        &mut client,
        &chat.image_id,
        json!(format!("[mock call='run_command:{}']", json!({"command": peek}))),
    )
    .await?;
    let result = frames
        .iter()
        .find(|f| f["type"] == "tool_result")
        .context("tool_result")?;
    let seen = result["data"]["result"].as_str().context("result text")?;
    assert!(!seen.contains(admin_key.trim()), "{seen}");
    assert!(seen.contains("No such file") && seen.contains("\n0\n"), "{seen}");

    // A failing command is a result the model reads, not a failed turn.
    let frames = send_and_finish(
        &mut client,
        &chat.image_id,
        json!("[mock call='run_command:{\"command\": \"ls no-such-file\"}']"),
    )
    .await?;
    let result = frames
        .iter()
        .find(|f| f["type"] == "tool_result")
        .context("tool_result")?;
    assert_eq!(result["data"]["isError"], true, "{result}");
    assert!(
        result["data"]["result"]
            .as_str()
            .is_some_and(|text| text.starts_with("exit code 2")),
        "{result}"
    );
    assert_eq!(frames.last().context("frames")?["type"], "conversation_end");
    Ok(())
}

both_modes!(an_interrupt_kills_a_running_command, interrupt_command);

async fn interrupt_command(mode: Mode) -> anyhow::Result<()> {
    let (_mock, cluster) = start(mode, MockApi::Anthropic).await?;
    let agent = tool_agent(&cluster, &["run_command"]).await?;
    let (mut client, chat) = open_chat(&cluster, json!({"agent": agent})).await?;
    let script = r#"[mock call='run_command:{"command": "sleep 30 & echo $! > sleeper.pid; wait"}']"#;
    client
        .send_request("message_send", json!({"imageId": chat.image_id, "content": script}))
        .await?;
    client.frames_until("message_stop").await?;
    // The command has started once it wrote its pid (in its own PID
    // namespace): find its sleeper from here by what it runs and where.
    let pid_file = find_file_eventually(&cluster.data_dir().join("workspaces"), "sleeper.pid").await?;
    wait_for_content(&pid_file).await?;
    let workspace = pid_file.parent().context("the workspace")?;
    // Its pid is known as soon as it is forked; it runs `sleep` once it execs.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut sleepers = processes_in(workspace, "sleep");
    while sleepers.is_empty() && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        sleepers = processes_in(workspace, "sleep");
    }
    assert_eq!(sleepers.len(), 1, "the command runs");
    let proc_dir = sleepers[0].clone();

    let started = std::time::Instant::now();
    let answer = client
        .request("agent_interrupt", json!({"imageId": chat.image_id}))
        .await?;
    assert_eq!(answer["interrupted"], true, "{answer}");
    let frames = client.frames_until("conversation_end").await?;
    let took = started.elapsed();
    eprintln!("the interrupt ended the turn in {took:?}");
    assert_eq!(frames.last().context("frames")?["data"]["reason"], "interrupted");
    assert!(
        took < std::time::Duration::from_secs(10),
        "the turn waited for the command: {took:?}"
    );
    let result = frames
        .iter()
        .find(|f| f["type"] == "tool_result")
        .context("an error result")?;
    assert_eq!(result["data"]["isError"], true);
    // The command's whole process group was killed.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while is_running(&proc_dir) {
        anyhow::ensure!(std::time::Instant::now() < deadline, "the command outlived its turn");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // The conversation goes on, its history valid for the provider.
    let frames = send_and_finish(&mut client, &chat.image_id, json!("and now?")).await?;
    assert_eq!(
        frames.last().context("frames")?["type"],
        "conversation_end",
        "{:?}",
        types(&frames)
    );
    Ok(())
}

/// Returns whether a process exists and is not a zombie.
/// Listens on a loopback port, counting the connections it accepts: an
/// internal service that must not be reached.
pub(crate) async fn counting_listener() -> anyhow::Result<(u16, std::sync::Arc<std::sync::atomic::AtomicUsize>)> {
    let internal = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = internal.local_addr()?.port();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = std::sync::Arc::clone(&accepted);
    tokio::spawn(async move {
        while internal.accept().await.is_ok() {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    Ok((port, accepted))
}

/// Returns the live processes (their `/proc` directories) running `program`
/// with `dir` as their working directory (the same directory: a command sees
/// its workspace at another path, in a root of its own).
pub(crate) fn processes_in(dir: &Path, program: &str) -> Vec<std::path::PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let Ok(wanted) = std::fs::metadata(dir).map(|meta| (meta.dev(), meta.ino())) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|entry| entry.path())
        .filter(|proc_dir| {
            let runs = std::fs::read(proc_dir.join("cmdline")).is_ok_and(|cmdline| {
                cmdline
                    .split(|byte| *byte == 0)
                    .next()
                    .is_some_and(|first| first.ends_with(program.as_bytes()))
            });
            runs && std::fs::metadata(proc_dir.join("cwd")).is_ok_and(|cwd| (cwd.dev(), cwd.ino()) == wanted)
                && is_running(proc_dir)
        })
        .collect()
}

pub(crate) fn is_running(proc_dir: &Path) -> bool {
    std::fs::read_to_string(proc_dir.join("stat")).is_ok_and(|stat| {
        stat.rsplit(')')
            .next()
            .is_some_and(|rest| !rest.trim_start().starts_with('Z'))
    })
}

/// Waits (bounded) for a file a command writes to appear below `dir`.
pub(crate) async fn find_file_eventually(dir: &Path, name: &str) -> anyhow::Result<std::path::PathBuf> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        if let Some(found) = find_file(dir, name) {
            return Ok(found);
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "{name} never appeared");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Waits (bounded) for a file to have a complete line.
pub(crate) async fn wait_for_content(path: &Path) -> anyhow::Result<String> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.ends_with('\n') {
            return Ok(text);
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "{} stayed empty", path.display());
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

both_modes!(an_image_names_its_tools, image_tools);

async fn image_tools(mode: Mode) -> anyhow::Result<()> {
    let (mock, cluster) = start(mode, MockApi::Anthropic).await?;
    let (mut client, chat) = open_chat(
        &cluster,
        json!({"name": "scratch", "tools": ["write_file", "list_files"]}),
    )
    .await?;
    assert_eq!(
        chat.record["tools"],
        json!(["write_file", "list_files"]),
        "{}",
        chat.record
    );
    let script = r#"[mock call='write_file:{"path": "a.txt", "content": "x"}' call='2:list_files:{}']"#;
    let frames = send_and_finish(&mut client, &chat.image_id, json!(script)).await?;
    assert_eq!(streamed_text(&frames), "Tool results: a.txt", "{:?}", types(&frames));
    let offered = &mock.requests()[0].body["tools"];
    let names: Vec<&str> = offered
        .as_array()
        .context("tools offered")?
        .iter()
        .filter_map(|tool| tool["name"].as_str())
        .collect();
    assert_eq!(names, ["write_file", "list_files"]);
    assert!(offered[0]["input_schema"]["required"].is_array(), "{offered}");

    // Unknown names are refused at creation, over REST as over the WebSocket.
    let (status, refused) = call(
        &cluster,
        "POST",
        "/v1/containers/default/images",
        Some(json!({"tools": ["format_disk"]})),
    )
    .await?;
    assert_eq!(
        (status, refused["error"]["code"].clone()),
        (400, json!("UNKNOWN_TOOL")),
        "{refused}"
    );
    let refused = client
        .request(
            "image_create",
            json!({"containerId": "default", "config": {"tools": ["resource://tools/nope"]}}),
        )
        .await?;
    assert_eq!(refused["code"], "RESOURCE_NOT_FOUND", "{refused}");
    let (status, refused) = call(
        &cluster,
        "POST",
        "/v1/containers/default/images",
        Some(json!({"tools": "read_file"})),
    )
    .await?;
    assert_eq!(
        (status, refused["error"]["code"].clone()),
        (400, json!("INVALID_FIELD")),
        "{refused}"
    );
    Ok(())
}

both_modes!(clients_reach_the_workspace_as_they_reach_the_image, workspace_routes);

async fn workspace_routes(mode: Mode) -> anyhow::Result<()> {
    let (_mock, cluster) = start(mode, MockApi::Anthropic).await?;
    let (mut client, chat) = open_chat(&cluster, json!({"tools": ["read_file", "write_file"]})).await?;
    let http = cluster.http()?;
    let file_url = |path: &str| cluster.url(&format!("/v1/images/{}/workspace/files/{path}", chat.image_id));

    // Nothing yet, and listing makes nothing.
    let (status, listing) = call(
        &cluster,
        "GET",
        &format!("/v1/images/{}/workspace", chat.image_id),
        None,
    )
    .await?;
    assert_eq!((status, listing["entries"].clone()), (200, json!([])), "{listing}");
    assert!(!cluster.data_dir().join("workspaces").exists());

    // A client uploads a file; the agent reads it.
    let put = http
        .put(file_url("docs/brief.txt"))
        .body("ship on friday")
        .send()
        .await?;
    assert_eq!(put.status().as_u16(), 200);
    let written: Value = put.json().await?;
    assert_eq!(
        (
            written["path"].clone(),
            written["type"].clone(),
            written["size"].clone()
        ),
        (json!("docs/brief.txt"), json!("file"), json!(14))
    );
    let read = "[mock call=read_file:{\"path\":\"docs/brief.txt\"}]";
    let frames = send_and_finish(&mut client, &chat.image_id, json!(read)).await?;
    assert_eq!(streamed_text(&frames), "Tool results: ship on friday");

    // The agent writes one; the client reads it over REST and the WebSocket.
    let write = r#"[mock call='write_file:{"path": "docs/answer.txt", "content": "on it"}']"#;
    send_and_finish(&mut client, &chat.image_id, json!(write)).await?;
    let got = http.get(file_url("docs/answer.txt")).send().await?;
    assert_eq!(got.status().as_u16(), 200);
    assert_eq!(got.text().await?, "on it");
    let over_ws = client
        .request(
            "workspace_read",
            json!({"imageId": chat.image_id, "path": "docs/answer.txt"}),
        )
        .await?;
    assert_eq!(
        (over_ws["content"].clone(), over_ws["encoding"].clone()),
        (json!("on it"), json!("utf-8")),
        "{over_ws}"
    );
    let listed = client
        .request("workspace_list", json!({"imageId": chat.image_id, "path": "docs"}))
        .await?;
    let paths: Vec<&str> = listed["entries"]
        .as_array()
        .context("entries")?
        .iter()
        .filter_map(|entry| entry["path"].as_str())
        .collect();
    assert_eq!(paths, ["docs/answer.txt", "docs/brief.txt"], "{listed}");
    let binary = client
        .request(
            "workspace_write",
            json!({"imageId": chat.image_id, "path": "bin/blob", "content": "AP8=", "encoding": "base64"}),
        )
        .await?;
    assert_eq!(binary["size"], 2, "{binary}");
    let blob = http.get(file_url("bin/blob")).send().await?.bytes().await?;
    assert_eq!(blob.as_ref(), [0x00, 0xff]);

    // Paths stay inside; a missing file is not found.
    let refused = client
        .request(
            "workspace_read",
            json!({"imageId": chat.image_id, "path": "../../admin.key"}),
        )
        .await?;
    assert_eq!(refused["code"], "INVALID_WORKSPACE_PATH", "{refused}");
    assert_eq!(http.get(file_url("docs/none.txt")).send().await?.status().as_u16(), 404);
    // A name no file system holds (256 bytes) is refused, never a 500:
    // listed, read or written.
    let long_name = "%C3%A9".repeat(128);
    let listed = http
        .get(cluster.url(&format!("/v1/images/{}/workspace?path={long_name}", chat.image_id)))
        .send()
        .await?;
    assert_eq!(listed.status().as_u16(), 400);
    let listed: Value = listed.json().await?;
    assert_eq!(listed["error"]["code"], "INVALID_WORKSPACE_PATH", "{listed}");
    assert_eq!(http.get(file_url(&long_name)).send().await?.status().as_u16(), 400);
    assert_eq!(
        http.put(file_url(&format!("docs/{long_name}")))
            .body("x")
            .send()
            .await?
            .status()
            .as_u16(),
        400
    );

    // A client removes a file, then a directory with what it holds; the
    // agent sees them gone. Never the workspace itself, nothing outside it.
    let removed: Value = http.delete(file_url("docs/brief.txt")).send().await?.json().await?;
    assert_eq!(
        removed,
        json!({"imageId": chat.image_id, "path": "docs/brief.txt", "removed": true})
    );
    assert_eq!(
        http.get(file_url("docs/brief.txt")).send().await?.status().as_u16(),
        404
    );
    assert_eq!(http.delete(file_url("docs")).send().await?.status().as_u16(), 200);
    let read = "[mock call=read_file:{\"path\":\"docs/answer.txt\"}]";
    let frames = send_and_finish(&mut client, &chat.image_id, json!(read)).await?;
    assert!(
        streamed_text(&frames).contains("no such file"),
        "{}",
        streamed_text(&frames)
    );
    assert_eq!(http.delete(file_url("docs")).send().await?.status().as_u16(), 404);
    // The same over the WebSocket.
    http.put(file_url("tmp/scratch.txt")).body("x").send().await?;
    let over_ws = client
        .request("workspace_delete", json!({"imageId": chat.image_id, "path": "tmp"}))
        .await?;
    assert_eq!(over_ws["removed"], true, "{over_ws}");
    assert_eq!(
        http.get(file_url("tmp/scratch.txt")).send().await?.status().as_u16(),
        404
    );
    let refused = client
        .request(
            "workspace_delete",
            json!({"imageId": chat.image_id, "path": "../../admin.key"}),
        )
        .await?;
    assert_eq!(refused["code"], "INVALID_WORKSPACE_PATH", "{refused}");
    for outside in ["x%2F..%2F..%2Fadmin.key", "%2Fetc%2Fpasswd", "a%00b"] {
        let refused = http.delete(file_url(outside)).send().await?;
        assert_eq!(refused.status().as_u16(), 400, "{outside}");
    }
    let root = http
        .delete(cluster.url(&format!("/v1/images/{}/workspace/files/", chat.image_id)))
        .send()
        .await?;
    assert!(matches!(root.status().as_u16(), 400 | 404), "{}", root.status());
    assert!(cluster.data_dir().join("admin.key").exists());
    assert_eq!(http.get(file_url("bin/blob")).send().await?.status().as_u16(), 200);

    // Another tenant's admin finds nothing, on every route.
    let other = avm_tests::accounts::create_tenant(&cluster, "other", None).await?;
    let foreign = avm_tests::cluster::http_client(&other.admin.key)?;
    assert_eq!(
        foreign.get(file_url("docs/answer.txt")).send().await?.status().as_u16(),
        404
    );
    assert_eq!(
        foreign.put(file_url("x.txt")).body("x").send().await?.status().as_u16(),
        404
    );
    assert_eq!(
        foreign.delete(file_url("bin/blob")).send().await?.status().as_u16(),
        404
    );
    assert_eq!(http.get(file_url("bin/blob")).send().await?.status().as_u16(), 200);
    let listing = foreign
        .get(cluster.url(&format!("/v1/images/{}/workspace", chat.image_id)))
        .send()
        .await?;
    assert_eq!(listing.status().as_u16(), 404);
    Ok(())
}

both_modes!(fetch_url_refuses_internal_addresses_without_connecting, fetch_refused);

async fn fetch_refused(mode: Mode) -> anyhow::Result<()> {
    let (_mock, cluster) = start(mode, MockApi::Anthropic).await?;
    // An internal service the agent must not reach; it counts connections.
    let (port, accepted) = counting_listener().await?;
    let (mut client, chat) = open_chat(&cluster, json!({"tools": ["fetch_url"]})).await?;
    // Two calls in one reply: the loopback service, by name, and the cloud metadata address.
    let script = format!(
        r#"[mock call='fetch_url:{{"url": "http://localhost:{port}/admin"}}' call='fetch_url:{{"url": "http://169.254.169.254/latest/meta-data/"}}']"#
    );
    let frames = send_and_finish(&mut client, &chat.image_id, json!(script)).await?;
    let results: Vec<&Value> = frames.iter().filter(|f| f["type"] == "tool_result").collect();
    assert_eq!(results.len(), 2, "{:?}", types(&frames));
    for result in &results {
        assert_eq!(result["data"]["isError"], true, "{result}");
        assert!(
            result["data"]["result"]
                .as_str()
                .is_some_and(|text| text.starts_with("refused: ")),
            "{result}"
        );
    }
    let answer = streamed_text(&frames);
    assert!(
        answer.contains("localhost is a loopback address") && answer.contains("169.254.169.254 is a link-local"),
        "the model read both refusals: {answer}"
    );
    assert_eq!(frames.last().context("frames")?["type"], "conversation_end");
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "no connection was made"
    );
    Ok(())
}

both_modes!(a_sandbox_environment_gives_its_interpreter, sandbox_environment);

/// Issue 27 item 4, locally: a sandbox resource naming the `python` or
/// `node` environment gets the host's interpreter, and the model is told.
async fn sandbox_environment(mode: Mode) -> anyhow::Result<()> {
    let (mock, cluster) = start(mode, MockApi::OpenAi).await?;
    for (environment, command, said) in [
        ("python", "python3 -c 'print(6 * 7)'", "Python 3 is installed"),
        ("node", "node -e 'console.log(6 * 7)'", "Node.js is installed"),
    ] {
        let sandbox = json!({"kind": "sandbox", "name": environment, "version": "1.0.0",
            "content": {"limits": {"network": false}, "environment": environment}});
        let prompt = json!({"kind": "prompt", "name": environment, "version": "1.0.0",
            "content": {"template": "You run code."}});
        for body in [sandbox, prompt] {
            let (status, created) = call(&cluster, "POST", "/v1/resources", Some(body)).await?;
            anyhow::ensure!(status == 201, "{created}");
        }
        let agent = json!({"kind": "agent", "name": environment, "version": "1.0.0", "content": {
            "prompt": format!("resource://prompts/{environment}@1"),
            "sandbox": format!("resource://sandboxes/{environment}@1")}});
        let (status, created) = call(&cluster, "POST", "/v1/resources", Some(agent)).await?;
        anyhow::ensure!(status == 201, "{created}");
        let (mut client, chat) = open_chat(
            &cluster,
            json!({"agent": format!("resource://agents/{environment}@1"), "tools": ["run_command"]}),
        )
        .await?;
        let call = json!({ "command": command }).to_string().replace('\'', "\\'");
        let frames = send_and_finish(
            &mut client,
            &chat.image_id,
            json!(format!("[mock call='run_command:{call}']")),
        )
        .await?;
        let result = frames
            .iter()
            .find(|f| f["type"] == "tool_result")
            .context("the command's result")?;
        assert_eq!(
            result["data"]["result"], "exit code 0\nstdout:\n42\n",
            "{environment}: {result}"
        );
        let request = mock.requests().pop().context("the provider was called")?;
        let tools = request.body["tools"].to_string();
        assert!(tools.contains(said), "{environment}: {tools}");
    }
    Ok(())
}

both_modes!(an_agents_sandbox_resource_sets_its_limits, sandbox_limits);

async fn sandbox_limits(mode: Mode) -> anyhow::Result<()> {
    sandbox_limits_with(mode, Options::default()).await
}

/// The same with commands in an `avm sandbox` child: the limits an agent's
/// sandbox resource sets travel with each command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_sandbox_resource_sets_its_limits_in_a_sandbox_process() -> anyhow::Result<()> {
    let options = Options {
        sandbox_process: true,
        ..Options::default()
    };
    sandbox_limits_with(Mode::PerComponent, options).await
}

async fn sandbox_limits_with(mode: Mode, options: Options) -> anyhow::Result<()> {
    let (_mock, cluster) = start_with(mode, MockApi::OpenAi, options).await?;
    let sandbox = json!({"kind": "sandbox", "name": "offline", "version": "1.0.0",
        "content": {"limits": {"network": false, "timeoutSeconds": 1, "diskMb": 1}}});
    let prompt = json!({"kind": "prompt", "name": "offline", "version": "1.0.0",
        "content": {"template": "You have no network."}});
    for body in [sandbox, prompt] {
        let (status, created) = call(&cluster, "POST", "/v1/resources", Some(body)).await?;
        anyhow::ensure!(status == 201, "{created}");
    }
    let agent = json!({"kind": "agent", "name": "offline", "version": "1.0.0", "content": {
        "prompt": "resource://prompts/offline@1", "sandbox": "resource://sandboxes/offline@1"}});
    let (status, created) = call(&cluster, "POST", "/v1/resources", Some(agent)).await?;
    anyhow::ensure!(status == 201, "{created}");
    let (mut client, chat) = open_chat(
        &cluster,
        json!({"agent": "resource://agents/offline@1", "tools": ["run_command", "fetch_url"]}),
    )
    .await?;
    let script = r#"[mock call='run_command:{"command": "sed 1,2d /proc/net/dev | cut -d: -f1 | tr -d [:blank:]"}' call='fetch_url:{"url": "https://example.com/"}' call='run_command:{"command": "sleep 5"}' call='run_command:{"command": "head -c 2000000 /dev/zero > big"}']"#;
    let frames = send_and_finish(&mut client, &chat.image_id, json!(script)).await?;
    let results: Vec<(&str, bool)> = frames
        .iter()
        .filter(|f| f["type"] == "tool_result")
        .map(|f| {
            (
                f["data"]["result"].as_str().unwrap_or_default(),
                f["data"]["isError"] == true,
            )
        })
        .collect();
    assert_eq!(results.len(), 4, "{:?}", types(&frames));
    assert_eq!(results[0], ("exit code 0\nstdout:\nlo\n", false), "only a loopback");
    assert_eq!(
        results[1],
        ("this agent's sandbox has no network (network: false)", true)
    );
    assert_eq!(
        results[2],
        ("the command did not finish within 1 s and was killed", true)
    );
    assert!(results[3].1, "{}", results[3].0);
    let big = find_file(&cluster.data_dir().join("workspaces"), "big").context("big")?;
    assert!(
        std::fs::metadata(big)?.len() <= 1024 * 1024,
        "the file stopped at the disk quota"
    );
    Ok(())
}

both_modes!(an_images_tools_change_after_creation, changed_tools);

async fn changed_tools(mode: Mode) -> anyhow::Result<()> {
    let (mock, cluster) = start(mode, MockApi::Anthropic).await?;
    let (mut client, chat) = open_chat(&cluster, json!({"name": "plain"})).await?;
    let frames = send_and_finish(&mut client, &chat.image_id, json!("hello")).await?;
    assert_eq!(frames.last().context("frames")?["type"], "conversation_end");
    assert!(
        mock.requests()[0].body.get("tools").is_none(),
        "a tool-free agent is offered none"
    );

    // Over the WebSocket: the running agent restarts with the new tools.
    let updated = client
        .request(
            "image_update",
            json!({"imageId": chat.image_id, "updates": {"tools": ["write_file"]}}),
        )
        .await?;
    assert_eq!(updated["record"]["tools"], json!(["write_file"]), "{updated}");
    let script = r#"[mock call='write_file:{"path": "later.txt", "content": "now"}']"#;
    let frames = send_and_finish(&mut client, &chat.image_id, json!(script)).await?;
    assert_eq!(streamed_text(&frames), "Tool results: wrote 3 bytes to later.txt");

    // Over REST: none again, and unknown names refused.
    let path = format!("/v1/images/{}", chat.image_id);
    let (status, refused) = call(&cluster, "PATCH", &path, Some(json!({"tools": ["format_disk"]}))).await?;
    assert_eq!(
        (status, refused["error"]["code"].clone()),
        (400, json!("UNKNOWN_TOOL")),
        "{refused}"
    );
    let (status, record) = call(&cluster, "PATCH", &path, Some(json!({"tools": []}))).await?;
    assert_eq!(status, 200, "{record}");
    assert!(
        record.get("tools").is_none(),
        "a record without tools shows none: {record}"
    );
    let frames = send_and_finish(&mut client, &chat.image_id, json!("and now?")).await?;
    assert_eq!(frames.last().context("frames")?["type"], "conversation_end");
    let last = mock.requests().last().context("requests")?.body.clone();
    assert!(last.get("tools").is_none(), "no tools after they were removed: {last}");
    Ok(())
}
