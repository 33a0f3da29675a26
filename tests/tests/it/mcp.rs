//! Tools from MCP servers: a stdio server an operator published, a
//! streamable HTTP server, the list changing mid-turn, and what is refused
//! (a tenant's own command, an internal address) when it is published.

use anyhow::Context;
use avm_tests::cluster::{Cluster, Mode, Options};
use avm_tests::mock_llm::{MockApi, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{Conversation, call, send_and_finish, streamed_text, types};
use crate::tools::{counting_listener, is_running, open_chat, processes_in, start_with};

/// The mock MCP server's binary, built with the tests.
const MOCK_MCP: &str = env!("CARGO_BIN_EXE_mock-mcp");

/// Returns options under which commands' roots hold the mock server's
/// directory, as an operator exposes the tools they installed.
fn mock_exposed(options: Options) -> Options {
    let dir = std::path::Path::new(MOCK_MCP).parent().map(std::path::Path::to_owned);
    Options {
        expose: dir.into_iter().collect(),
        ..options
    }
}

/// Publishes a tool resource named `name` whose server is `server`; public
/// ones take an operator (the cluster's admin is one).
async fn mcp_tool(cluster: &Cluster, name: &str, server: Value, public: bool) -> anyhow::Result<String> {
    let body = json!({"kind": "tool", "name": name, "version": "1.0.0", "public": public, "content": {
        "name": name, "inputSchema": {"type": "object"}, "mcpServer": server}});
    let (status, created) = call(cluster, "POST", "/v1/resources", Some(body)).await?;
    anyhow::ensure!(status == 201, "tool {name}: {created}");
    Ok(format!("resource://tools/{name}@1"))
}

/// Returns an image's workspace directory, if it has one.
fn workspace_of(cluster: &Cluster, image_id: &str) -> Option<std::path::PathBuf> {
    let tenants = std::fs::read_dir(cluster.data_dir().join("workspaces")).ok()?;
    tenants
        .flatten()
        .map(|tenant| tenant.path().join(image_id))
        .find(|dir| dir.is_dir())
}

/// Starts a cluster that may reach `allow` (an internal address, as the
/// test servers' are), publishes the tool resource `name` for `server`, and
/// opens a conversation with it (and `more` tools).
async fn remote_chat(
    mode: Mode,
    api: MockApi,
    allow: &str,
    name: &str,
    server: Value,
    more: &[&str],
) -> anyhow::Result<(MockLlm, Cluster, WsClient, Conversation)> {
    let options = Options {
        network_allow: vec![allow.to_owned()],
        ..Options::default()
    };
    let (mock, cluster) = start_with(mode, api, options).await?;
    let mut tools = vec![mcp_tool(&cluster, name, server, false).await?];
    tools.extend(more.iter().map(|tool| (*tool).to_owned()));
    let (client, chat) = open_chat(&cluster, json!({"tools": tools})).await?;
    Ok((mock, cluster, client, chat))
}

/// Publishes a tool resource named `name` for `server`, which must be
/// refused (400) with `code`.
async fn refused_tool(cluster: &Cluster, name: &str, server: Value, public: bool, code: &str) -> anyhow::Result<()> {
    let body = json!({"kind": "tool", "name": name, "version": "1.0.0", "public": public, "content": {
        "name": name, "inputSchema": {"type": "object"}, "mcpServer": server}});
    let (status, refused) = call(cluster, "POST", "/v1/resources", Some(body)).await?;
    assert_eq!(
        (status, refused["error"]["code"].clone()),
        (400, json!(code)),
        "{refused}"
    );
    Ok(())
}

/// Returns the results of a turn's tool calls, in order, with their error flags.
fn results(frames: &[Value]) -> Vec<(String, bool)> {
    frames
        .iter()
        .filter(|f| f["type"] == "tool_result")
        .map(|f| {
            (
                f["data"]["result"].as_str().unwrap_or_default().to_owned(),
                f["data"]["isError"] == true,
            )
        })
        .collect()
}

both_modes!(an_operators_stdio_server_serves_tools_in_the_sandbox, stdio);

/// What the mock server's `whereami` says from a fenced workspace: its
/// place, and its variables (its own, the fence's, its network proxy's).
const WHEREAMI: &str =
    "cwd=/workspace env=GREETING,HOME,HTTPS_PROXY,HTTP_PROXY,LANG,PATH,TMPDIR,http_proxy,https_proxy";

/// Has the mock server add a tool mid-turn (`unlock`), calls it (`door`)
/// and a failing one: each answered on the turn's next call, the failure a
/// result. Returns the turn's frames.
async fn unlock_the_door(client: &mut WsClient, image_id: &str) -> anyhow::Result<Vec<Value>> {
    let script = r#"[mock call='mcp__mock__unlock:{}' call='2:mcp__mock__door:{}' call='3:mcp__mock__fail:{}']"#;
    let frames = send_and_finish(client, image_id, json!(script)).await?;
    assert_eq!(
        results(&frames),
        [
            ("unlocked".to_owned(), false),
            ("opened".to_owned(), false),
            ("it failed on purpose".to_owned(), true),
        ],
        "{:?}",
        types(&frames)
    );
    Ok(frames)
}

/// Issue 27: with a sandbox provider, a stdio server runs in the image's
/// sandbox, as commands do, never in the runtime: its standard streams
/// travel over the sandbox's gRPC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_stdio_server_serves_tools_in_a_sandbox_process() -> anyhow::Result<()> {
    let options = Options {
        sandbox_process: true,
        ..Options::default()
    };
    let (_mock, cluster) = start_with(Mode::PerComponent, MockApi::Anthropic, mock_exposed(options)).await?;
    let server = json!({"command": MOCK_MCP, "env": {"GREETING": "hi"}});
    let tool = mcp_tool(&cluster, "mock", server, true).await?;
    let (mut client, chat) = open_chat(&cluster, json!({"tools": [tool]})).await?;
    let script = r#"[mock call='mcp__mock__echo:{"text": "hello"}' call='mcp__mock__whereami:{}']"#;
    let frames = send_and_finish(&mut client, &chat.image_id, json!(script)).await?;
    assert_eq!(
        results(&frames),
        [("echo: hello".to_owned(), false), (WHEREAMI.to_owned(), false),],
        "{:?}",
        types(&frames)
    );
    // It is a child of the sandbox, not of the runtime.
    let sandbox_root = cluster.data_dir().join("workspaces-sandboxes");
    let workspace = std::fs::read_dir(&sandbox_root)?
        .flatten()
        .map(|sandbox| sandbox.path().join(&chat.image_id))
        .find(|dir| dir.is_dir())
        .context("the sandbox's copy of the workspace")?;
    let program = std::path::Path::new(MOCK_MCP)
        .file_name()
        .and_then(|name| name.to_str())
        .context("the server's name")?;
    let served = crate::tools::processes_in(&workspace, program);
    assert_eq!(served.len(), 1, "the server runs in the sandbox's workspace");

    // A tool it adds mid-turn is offered on the next call, and failures are results.
    unlock_the_door(&mut client, &chat.image_id).await?;

    // The agent goes: the server goes with its sandbox.
    let (status, stopped) = call(&cluster, "POST", &format!("/v1/images/{}/stop", chat.image_id), None).await?;
    assert_eq!(status, 200, "{stopped}");
    let proc_dir = served[0].clone();
    crate::support::poll(std::time::Duration::from_secs(20), "the server stops", || async {
        Ok((!crate::tools::is_running(&proc_dir)).then_some(()))
    })
    .await?;
    Ok(())
}

async fn stdio(mode: Mode) -> anyhow::Result<()> {
    let (mock, cluster) = start_with(mode, MockApi::Anthropic, mock_exposed(Options::default())).await?;
    let server = json!({"command": MOCK_MCP, "env": {"GREETING": "hi"}});
    let tool = mcp_tool(&cluster, "mock", server, true).await?;
    let (mut client, chat) = open_chat(&cluster, json!({"tools": [tool]})).await?;

    // Two calls in one reply: the server answers both, from the workspace.
    let script = r#"[mock call='mcp__mock__echo:{"text": "hello"}' call='mcp__mock__whereami:{}']"#;
    let frames = send_and_finish(&mut client, &chat.image_id, json!(script)).await?;
    let answered = results(&frames);
    assert_eq!(answered.len(), 2, "{:?}", types(&frames));
    assert_eq!(answered[0], ("echo: hello".to_owned(), false));
    let (whereami, failed) = &answered[1];
    assert!(!failed, "{whereami}");
    assert!(workspace_of(&cluster, &chat.image_id).is_some(), "the workspace");
    assert_eq!(
        whereami, WHEREAMI,
        "the server runs in the workspace with a clean environment, its own variables and its network proxy"
    );
    let requests = mock.requests();
    let offered: Vec<&str> = requests[0].body["tools"]
        .as_array()
        .context("tools offered")?
        .iter()
        .filter_map(|tool| tool["name"].as_str())
        .collect();
    assert_eq!(
        offered,
        [
            "mcp__mock__echo",
            "mcp__mock__whereami",
            "mcp__mock__fail",
            "mcp__mock__slow",
            "mcp__mock__unlock"
        ]
    );

    // A tool the server adds mid-turn is offered on the next call of the turn.
    let frames = unlock_the_door(&mut client, &chat.image_id).await?;
    assert_eq!(frames.last().context("frames")?["type"], "conversation_end");
    let last = mock.requests().last().context("requests")?.body["tools"].clone();
    assert!(
        last.as_array()
            .is_some_and(|tools| tools.iter().any(|tool| tool["name"] == "mcp__mock__door")),
        "{last}"
    );
    Ok(())
}

both_modes!(a_stdio_server_stops_with_its_agent, stops_when_idle);

async fn stops_when_idle(mode: Mode) -> anyhow::Result<()> {
    let options = Options {
        agent_idle_timeout: Some(std::time::Duration::from_millis(300)),
        ..mock_exposed(Options::default())
    };
    let (_mock, cluster) = start_with(mode, MockApi::OpenAi, options).await?;
    let tool = mcp_tool(&cluster, "mock", json!({"command": MOCK_MCP}), true).await?;
    let (mut client, chat) = open_chat(&cluster, json!({"tools": [tool]})).await?;
    let script = json!("[mock call='mcp__mock__echo:{\"text\": \"hi\"}']");
    let frames = send_and_finish(&mut client, &chat.image_id, script.clone()).await?;
    assert_eq!(results(&frames), [("echo: hi".to_owned(), false)]);
    let workspace = workspace_of(&cluster, &chat.image_id).context("the workspace")?;
    let first = processes_in(&workspace, MOCK_MCP);
    assert_eq!(first.len(), 1, "the server runs while its agent does");
    // The agent goes idle and is dropped: its server goes with it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    while is_running(&first[0]) {
        anyhow::ensure!(std::time::Instant::now() < deadline, "the server outlived its agent");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // The next message starts the agent, and a new server, again.
    let frames = send_and_finish(&mut client, &chat.image_id, script).await?;
    assert_eq!(results(&frames), [("echo: hi".to_owned(), false)]);
    let second = processes_in(&workspace, MOCK_MCP);
    assert_eq!(second.len(), 1);
    assert_ne!(first, second);
    Ok(())
}

both_modes!(a_tenants_own_command_is_refused_and_nothing_runs, refused_command);

async fn refused_command(mode: Mode) -> anyhow::Result<()> {
    let (_mock, cluster) = start_with(mode, MockApi::OpenAi, Options::default()).await?;
    let marker = cluster.data_dir().join("spawned");
    let server = json!({"command": "/bin/sh", "args": ["-c", format!("touch {}", marker.display())]});
    // Refused when it is published (issue 26 item 18), by the rule the runtime applies at use.
    refused_tool(&cluster, "mine", server, false, "MCP_COMMAND_NOT_APPROVED").await?;
    assert!(!marker.exists(), "the command ran");
    Ok(())
}

both_modes!(a_streamable_http_server_serves_tools, http);

async fn http(mode: Mode) -> anyhow::Result<()> {
    let (addr, _server) = avm_tests::mock_mcp::serve_http().await?;
    let server = json!({"type": "http", "url": format!("http://{addr}/mcp")});
    let (_mock, _cluster, mut client, chat) =
        remote_chat(mode, MockApi::OpenAi, &addr.ip().to_string(), "remote", server, &[]).await?;
    let script = r#"[mock call='mcp__remote__echo:{"text": "over http"}']"#;
    let frames = send_and_finish(&mut client, &chat.image_id, json!(script)).await?;
    assert_eq!(results(&frames), [("echo: over http".to_owned(), false)]);
    assert_eq!(streamed_text(&frames), "Tool results: echo: over http");
    Ok(())
}

both_modes!(a_legacy_sse_server_serves_tools, sse);

async fn sse(mode: Mode) -> anyhow::Result<()> {
    let (addr, _server) = avm_tests::mock_mcp::serve_sse().await?;
    let server = json!({"type": "sse", "url": format!("http://{addr}/sse")});
    let (_mock, _cluster, mut client, chat) =
        remote_chat(mode, MockApi::Anthropic, &addr.ip().to_string(), "legacy", server, &[]).await?;
    let script = r#"[mock call='mcp__legacy__echo:{"text": "over sse"}' call='mcp__legacy__fail:{}']"#;
    let frames = send_and_finish(&mut client, &chat.image_id, json!(script)).await?;
    assert_eq!(
        results(&frames),
        [
            ("echo: over sse".to_owned(), false),
            ("it failed on purpose".to_owned(), true)
        ],
        "{:?}",
        types(&frames)
    );
    Ok(())
}

both_modes!(an_unreachable_server_is_left_out_and_not_retried_at_once, unreachable);

async fn unreachable(mode: Mode) -> anyhow::Result<()> {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let server = json!({"type": "http", "url": format!("http://127.0.0.1:{port}/mcp")});
    let (_mock, _cluster, mut client, chat) =
        remote_chat(mode, MockApi::Anthropic, "127.0.0.1", "gone", server, &["list_files"]).await?;
    let frames = send_and_finish(&mut client, &chat.image_id, json!("hello")).await?;
    let state = frames
        .iter()
        .find(|f| f["type"] == "mcp_server_state")
        .context("mcp_server_state")?;
    assert_eq!(state["data"]["state"], "failed", "{state}");
    assert_eq!(frames.last().context("frames")?["type"], "conversation_end");
    // The next turn does not wait for it again.
    let frames = send_and_finish(&mut client, &chat.image_id, json!("again")).await?;
    assert!(
        frames.iter().all(|f| f["type"] != "mcp_server_state"),
        "{:?}",
        types(&frames)
    );
    assert_eq!(frames.last().context("frames")?["type"], "conversation_end");
    Ok(())
}

both_modes!(an_internal_server_address_is_refused, internal_url);

async fn internal_url(mode: Mode) -> anyhow::Result<()> {
    let (addr, _server) = avm_tests::mock_mcp::serve_http().await?;
    let (_mock, cluster) = start_with(mode, MockApi::Anthropic, Options::default()).await?;
    // Addresses are refused when they are published, even by an operator.
    let (port, accepted) = counting_listener().await?;
    for (name, url) in [
        ("loopback", format!("http://{addr}/mcp")),
        ("metadata", "http://169.254.169.254/mcp".to_owned()),
        ("private", "http://10.1.2.3/mcp".to_owned()),
        ("named", format!("http://localhost:{port}/mcp")),
    ] {
        refused_tool(
            &cluster,
            name,
            json!({"type": "http", "url": url}),
            true,
            "MCP_SERVER_REFUSED",
        )
        .await?;
    }
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "no connection was made"
    );
    Ok(())
}

both_modes!(a_refused_credential_shows_needs_auth_until_one_is_stored, credentials);

async fn credentials(mode: Mode) -> anyhow::Result<()> {
    let token = "tok-mcp-canary-81f2";
    let (addr, _server) = avm_tests::mock_mcp::serve_http_with(Some(token.to_owned())).await?;
    let server = json!({"type": "http", "url": format!("http://{addr}/mcp")});
    let (_mock, cluster, mut client, chat) =
        remote_chat(mode, MockApi::OpenAi, &addr.ip().to_string(), "secure", server, &[]).await?;
    let script = r#"[mock call='mcp__secure__echo:{"text": "let me in"}']"#;

    // Without a credential: the turn goes on, the server is shown needing one.
    let frames = send_and_finish(&mut client, &chat.image_id, json!(script)).await?;
    let state = frames
        .iter()
        .find(|f| f["type"] == "mcp_server_state")
        .context("mcp_server_state")?;
    assert_eq!(
        (&state["data"]["server"], &state["data"]["state"]),
        (&json!("secure"), &json!("needs_auth")),
        "{state}"
    );
    assert_eq!(results(&frames).len(), 1);
    assert!(results(&frames)[0].1, "the call was not served");
    assert_eq!(frames.last().context("frames")?["type"], "conversation_end");

    // The user stores a token: write-only, listed by header name.
    let (status, stored) = call(
        &cluster,
        "PUT",
        "/v1/credentials/secure",
        Some(json!({"bearerToken": token})),
    )
    .await?;
    assert_eq!(status, 200, "{stored}");
    assert_eq!(
        stored,
        json!({"server": "secure", "scope": "user", "headerNames": ["Authorization"], "origin": format!("http://{addr}")})
    );
    let (status, listed) = call(&cluster, "GET", "/v1/credentials", None).await?;
    assert_eq!(status, 200);
    assert_eq!(listed["credentials"][0]["server"], "secure", "{listed}");
    assert!(!listed.to_string().contains(token), "a credential is never shown");
    let listed_ws = client.request("credential_list", json!({})).await?;
    assert_eq!(listed_ws["credentials"], listed["credentials"]);

    // The next turn reaches the server with it.
    let frames = send_and_finish(&mut client, &chat.image_id, json!(script)).await?;
    assert!(
        frames.iter().all(|f| f["type"] != "mcp_server_state"),
        "{:?}",
        types(&frames)
    );
    assert_eq!(results(&frames), [("echo: let me in".to_owned(), false)]);

    // Removed, it is gone; a missing one is NOT_FOUND.
    let (status, _) = call(&cluster, "DELETE", "/v1/credentials/secure", None).await?;
    assert_eq!(status, 200);
    let (status, missing) = call(&cluster, "DELETE", "/v1/credentials/secure", None).await?;
    assert_eq!(
        (status, missing["error"]["code"].clone()),
        (404, json!("CREDENTIAL_NOT_FOUND")),
        "{missing}"
    );
    Ok(())
}
