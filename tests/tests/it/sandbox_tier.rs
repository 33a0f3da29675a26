//! The sandbox tier's `process` provider: an image's commands run in an
//! `avm sandbox` child holding none of the runtime's secrets, started on the
//! first command, stopped when the agent goes; a chat never starts one; a
//! sandbox killed mid-command costs the command, not the workspace.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use avm_tests::cluster::{Cluster, Mode, Options};
use avm_tests::fake_kube::{FakeKube, FakeKubeOptions, SandboxProcess};
use avm_tests::mock_llm::{MockApi, MockLlm};
use serde_json::{Value, json};

use crate::both_modes;
use crate::support::{call, poll, send_and_finish, streamed_text, types};
use crate::tools::{open_chat, start_with};

/// Returns where the cluster's sandboxes keep their workspaces.
fn sandboxes_root(cluster: &Cluster) -> PathBuf {
    cluster.data_dir().join("workspaces-sandboxes")
}

/// Returns the live `avm sandbox` processes of this cluster (their `/proc` directories).
fn sandboxes(cluster: &Cluster) -> Vec<PathBuf> {
    let root = sandboxes_root(cluster);
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|entry| entry.path())
        .filter(|proc_dir| {
            let Ok(cmdline) = std::fs::read(proc_dir.join("cmdline")) else {
                return false;
            };
            let args: Vec<&[u8]> = cmdline.split(|byte| *byte == 0).collect();
            args.get(1) == Some(&b"sandbox".as_slice())
                && args.windows(2).any(|pair| {
                    pair[0] == b"--root" && Path::new(std::str::from_utf8(pair[1]).unwrap_or("")).starts_with(&root)
                })
                && crate::tools::is_running(proc_dir)
        })
        .collect()
}

/// Publishes an agent with file tools and `run_command`; returns its URI.
async fn sandboxed_agent(cluster: &Cluster) -> anyhow::Result<String> {
    let prompt = json!({"kind": "prompt", "name": "worker", "version": "1.0.0",
        "content": {"template": "You work in your workspace."}});
    let (status, created) = call(cluster, "POST", "/v1/resources", Some(prompt)).await?;
    anyhow::ensure!(status == 201, "prompt: {created}");
    let agent = json!({"kind": "agent", "name": "worker", "version": "1.0.0",
        "content": {"prompt": "resource://prompts/worker@1"}});
    let (status, created) = call(cluster, "POST", "/v1/resources", Some(agent)).await?;
    anyhow::ensure!(status == 201, "agent: {created}");
    Ok("resource://agents/worker@1".to_owned())
}

/// Starts a cluster whose commands run in sandbox processes, and publishes
/// the agent of [`sandboxed_agent`].
async fn process_cluster(mode: Mode, api: MockApi) -> anyhow::Result<(MockLlm, Cluster, String)> {
    let options = Options {
        sandbox_process: true,
        ..Options::default()
    };
    let (mock, cluster) = start_with(mode, api, options).await?;
    let agent = sandboxed_agent(&cluster).await?;
    Ok((mock, cluster, agent))
}

/// Publishes an agent whose sandbox names the python environment, and opens
/// a conversation with it that may run commands.
async fn python_chat(
    cluster: &Cluster,
) -> anyhow::Result<(avm_tests::ws_client::WsClient, crate::support::Conversation)> {
    let resources = [
        json!({"kind": "sandbox", "name": "py", "version": "1.0.0", "content": {"limits": {}, "environment": "python"}}),
        json!({"kind": "prompt", "name": "py", "version": "1.0.0", "content": {"template": "You run code."}}),
        json!({"kind": "agent", "name": "py", "version": "1.0.0", "content": {
            "prompt": "resource://prompts/py@1", "sandbox": "resource://sandboxes/py@1"}}),
    ];
    for resource in resources {
        let (status, body) = call(cluster, "POST", "/v1/resources", Some(resource)).await?;
        anyhow::ensure!(status == 201, "{body}");
    }
    open_chat(
        cluster,
        json!({"agent": "resource://agents/py@1", "tools": ["run_command"]}),
    )
    .await
}

/// Returns the text of a turn's first tool result and whether it is an error.
fn tool_result(frames: &[Value]) -> anyhow::Result<(String, bool)> {
    let result = frames
        .iter()
        .find(|frame| frame["type"] == "tool_result")
        .context("a tool result")?;
    Ok((
        result["data"]["result"].as_str().context("result text")?.to_owned(),
        result["data"]["isError"] == true,
    ))
}

fn run(command: &str) -> Value {
    let input = json!({ "command": command })
        .to_string()
        .replace('\\', "\\\\")
        .replace('\'', "\\'");
    json!(format!("[mock call='run_command:{input}']"))
}

both_modes!(commands_run_in_a_sandbox_process_that_holds_no_secret, process_provider);

async fn process_provider(mode: Mode) -> anyhow::Result<()> {
    let (_mock, cluster, agent) = process_cluster(mode, MockApi::OpenAi).await?;

    // A chat without tools starts no sandbox.
    let (mut chat_client, chat) = open_chat(&cluster, json!({"agent": agent})).await?;
    send_and_finish(&mut chat_client, &chat.image_id, json!("hello")).await?;
    assert!(sandboxes(&cluster).is_empty(), "a chat started a sandbox");

    let tools = json!(["write_file", "read_file", "run_command"]);
    let (mut client, work) = open_chat(&cluster, json!({"agent": agent, "tools": tools})).await?;
    // What a file tool wrote reaches the command; what the command made comes back.
    let script = r#"[mock call='write_file:{"path": "in.txt", "content": "forty two"}' call='2:run_command:{"command": "tr a-z A-Z < in.txt > out.txt && cat out.txt"}' call='3:read_file:{"path": "out.txt"}']"#;
    let frames = send_and_finish(&mut client, &work.image_id, json!(script)).await?;
    assert_eq!(
        streamed_text(&frames),
        "Tool results: FORTY TWO",
        "{:?}",
        types(&frames)
    );
    let started = sandboxes(&cluster);
    assert_eq!(started.len(), 1, "one sandbox for the image");
    // Clients see what the command made.
    let over_ws = client
        .request("workspace_read", json!({"imageId": work.image_id, "path": "out.txt"}))
        .await?;
    assert_eq!(over_ws["content"], "FORTY TWO", "{over_ws}");

    // The sandbox's own environment holds no key, no URL, no secret of the runtime's.
    let environ = std::fs::read(started[0].join("environ"))?;
    let environ = String::from_utf8_lossy(&environ);
    for secret in [
        "AVM_AUTH",
        "AVM_DATABASE",
        "AVM_REDIS",
        "LLM_",
        avm_tests::cluster::TEST_API_KEY,
        avm_tests::cluster::TEST_SERVICE_KEY,
    ] {
        assert!(!environ.contains(secret), "the sandbox holds {secret}: {environ}");
    }
    let admin_key = std::fs::read_to_string(cluster.data_dir().join("admin.key"))?;
    assert!(!environ.contains(admin_key.trim()));
    // Nor do its commands see any of it, or the data directory.
    let peek = format!(
        "env; cat {data}/admin.key; cat /proc/*/environ 2>/dev/null | grep -ac LLM_",
        data = cluster.data_dir().display()
    );
    let frames = send_and_finish(&mut client, &work.image_id, run(&peek)).await?;
    let (seen, _) = tool_result(&frames)?;
    assert!(!seen.contains(admin_key.trim()), "{seen}");
    assert!(
        !seen.contains("AVM_") && !seen.contains(avm_tests::cluster::TEST_SERVICE_KEY),
        "{seen}"
    );
    assert!(seen.contains("No such file"), "{seen}");
    assert_eq!(
        sandboxes(&cluster),
        started,
        "the same sandbox serves the image's commands"
    );

    // The agent goes: its sandbox stops, and its copy of the workspace goes with it.
    let (status, stopped) = call(&cluster, "POST", &format!("/v1/images/{}/stop", work.image_id), None).await?;
    assert_eq!(status, 200, "{stopped}");
    poll(
        Duration::from_secs(20),
        "the sandbox and its files go with its agent",
        || async {
            let left = std::fs::read_dir(sandboxes_root(&cluster))?.flatten().count();
            Ok((sandboxes(&cluster).is_empty() && left == 0).then_some(()))
        },
    )
    .await?;
    Ok(())
}

both_modes!(
    a_sandbox_killed_mid_command_costs_the_command_not_the_workspace,
    killed_sandbox
);

async fn killed_sandbox(mode: Mode) -> anyhow::Result<()> {
    let (_mock, cluster, agent) = process_cluster(mode, MockApi::Anthropic).await?;
    let (mut client, chat) = open_chat(&cluster, json!({"agent": agent, "tools": ["run_command"]})).await?;
    let frames = send_and_finish(&mut client, &chat.image_id, run("echo kept > kept.txt")).await?;
    assert_eq!(tool_result(&frames)?, ("exit code 0".to_owned(), false));

    client
        .send_request(
            "message_send",
            json!({"imageId": chat.image_id, "content": run("echo lost > lost.txt; sleep 60")}),
        )
        .await?;
    // The command runs once its file is in the sandbox's copy; then the sandbox dies.
    poll(Duration::from_secs(20), "the command starts", || async {
        let found = std::fs::read_dir(sandboxes_root(&cluster))?
            .flatten()
            .any(|sandbox| sandbox.path().join(&chat.image_id).join("lost.txt").exists());
        Ok(found.then_some(()))
    })
    .await?;
    let killed = sandboxes(&cluster);
    assert_eq!(killed.len(), 1);
    let pid: i32 = killed[0]
        .file_name()
        .and_then(|name| name.to_str())
        .and_then(|name| name.parse().ok())
        .context("the sandbox's pid")?;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL)?;
    let frames = client.frames_until("conversation_end").await?;
    let (text, is_error) = tool_result(&frames)?;
    assert!(is_error, "{text}");
    assert!(text.contains("sandbox stopped"), "{text}");

    // The workspace is as the last command left it; the next command gets a new sandbox.
    let frames = send_and_finish(&mut client, &chat.image_id, run("ls; cat kept.txt")).await?;
    assert_eq!(
        tool_result(&frames)?,
        ("exit code 0\nstdout:\nkept.txt\nkept\n".to_owned(), false)
    );
    let now = sandboxes(&cluster);
    assert_eq!(now.len(), 1);
    assert_ne!(now, killed, "a new sandbox");
    Ok(())
}

/// A pool's sandbox, started as an operator's Deployment would.
pub(crate) async fn pool_sandbox() -> anyhow::Result<SandboxProcess> {
    SandboxProcess::start("127.0.0.1:0").await
}

both_modes!(
    a_pools_sandboxes_serve_one_image_each_and_are_released_with_it,
    pool_provider
);

async fn pool_provider(mode: Mode) -> anyhow::Result<()> {
    let pool = [pool_sandbox().await?, pool_sandbox().await?];
    let options = Options {
        sandbox_pool: pool.iter().map(|sandbox| sandbox.address.clone()).collect(),
        ..Options::default()
    };
    let (_mock, cluster) = start_with(mode, MockApi::OpenAi, options).await?;
    let agent = sandboxed_agent(&cluster).await?;
    let config = json!({"agent": agent, "tools": ["run_command"]});
    let holding = |image: &str| {
        pool.iter()
            .filter(|sandbox| sandbox.root.path().join(image).exists())
            .count()
    };

    let (mut first, one) = open_chat(&cluster, config.clone()).await?;
    let (mut second, two) = open_chat(&cluster, config.clone()).await?;
    let (mut third, three) = open_chat(&cluster, config.clone()).await?;
    for (client, chat) in [(&mut first, &one), (&mut second, &two)] {
        let frames = send_and_finish(client, &chat.image_id, run("echo mine > mine.txt; cat mine.txt")).await?;
        assert_eq!(
            tool_result(&frames)?,
            ("exit code 0\nstdout:\nmine\n".to_owned(), false)
        );
        assert_eq!(holding(&chat.image_id), 1, "one sandbox holds the image");
    }
    // Both are claimed: a third image waits for one, told why.
    let frames = send_and_finish(&mut third, &three.image_id, run("true")).await?;
    let (text, is_error) = tool_result(&frames)?;
    assert!(is_error && text.contains("no sandbox of the pool is free"), "{text}");
    // Operators see it: the runtime counts claims and an exhausted pool.
    let metrics = reqwest::get(format!("{}/metrics", cluster.runtime_grpc))
        .await?
        .text()
        .await?;
    for outcome in ["claimed", "exhausted"] {
        let counted = metrics.lines().any(|line| {
            line.starts_with("avm_runtime_sandboxes_total{")
                && line.contains(r#"provider="pool""#)
                && line.contains(&format!(r#"outcome="{outcome}""#))
        });
        assert!(counted, "no {outcome} count in the runtime's metrics");
    }

    // The first agent goes: its sandbox is released, emptied, and serves the third.
    let (status, stopped) = call(&cluster, "POST", &format!("/v1/images/{}/stop", one.image_id), None).await?;
    assert_eq!(status, 200, "{stopped}");
    poll(Duration::from_secs(20), "the sandbox is released", || async {
        Ok((holding(&one.image_id) == 0).then_some(()))
    })
    .await?;
    let frames = send_and_finish(&mut third, &three.image_id, run("ls; echo ok")).await?;
    assert_eq!(
        tool_result(&frames)?,
        ("exit code 0\nstdout:\nok\n".to_owned(), false),
        "nothing of the first image is left"
    );
    assert_eq!(holding(&three.image_id), 1);
    assert_eq!(holding(&two.image_id), 1);
    Ok(())
}

both_modes!(an_environments_pool_serves_the_agents_naming_it, environment_pools);

/// With a pool of its own for `python` (`[runtime.sandbox] pools`), an
/// agent whose sandbox names python claims from that pool, any other from
/// `pool`; a sandbox checks its own interpreters when claimed.
async fn environment_pools(mode: Mode) -> anyhow::Result<()> {
    let (shells, pythons) = (pool_sandbox().await?, pool_sandbox().await?);
    let options = Options {
        sandbox_pool: vec![shells.address.clone()],
        sandbox_pools: avm_sandbox::EnvironmentPools {
            python: vec![pythons.address.clone()],
            node: Vec::new(),
        },
        ..Options::default()
    };
    let (_mock, cluster) = start_with(mode, MockApi::OpenAi, options).await?;
    let shell_agent = sandboxed_agent(&cluster).await?;
    let (mut py, py_chat) = python_chat(&cluster).await?;
    let frames = send_and_finish(&mut py, &py_chat.image_id, run("python3 -c 'print(6 * 7)'")).await?;
    assert_eq!(tool_result(&frames)?, ("exit code 0\nstdout:\n42\n".to_owned(), false));
    let (mut sh, sh_chat) = open_chat(&cluster, json!({"agent": shell_agent, "tools": ["run_command"]})).await?;
    let frames = send_and_finish(&mut sh, &sh_chat.image_id, run("echo shell")).await?;
    assert_eq!(
        tool_result(&frames)?,
        ("exit code 0\nstdout:\nshell\n".to_owned(), false)
    );
    let holds = |sandbox: &SandboxProcess, image: &str| sandbox.root.path().join(image).exists();
    assert!(holds(&pythons, &py_chat.image_id) && !holds(&shells, &py_chat.image_id));
    assert!(holds(&shells, &sh_chat.image_id) && !holds(&pythons, &sh_chat.image_id));
    Ok(())
}

both_modes!(an_interrupt_kills_a_command_in_its_sandbox, interrupted);

/// An interrupted turn cancels its command's call: the sandbox kills the
/// command, and the next command runs in the same sandbox, the workspace
/// alike on both sides.
async fn interrupted(mode: Mode) -> anyhow::Result<()> {
    let (_mock, cluster, agent) = process_cluster(mode, MockApi::Anthropic).await?;
    let (mut client, chat) = open_chat(&cluster, json!({"agent": agent, "tools": ["run_command"]})).await?;
    client
        .send_request(
            "message_send",
            json!({"imageId": chat.image_id, "content": run("sleep 30 & echo $! > sleeper.pid; wait")}),
        )
        .await?;
    let pid_file = crate::tools::find_file_eventually(&sandboxes_root(&cluster), "sleeper.pid").await?;
    crate::tools::wait_for_content(&pid_file).await?;
    let workspace = pid_file.parent().context("the sandbox's workspace")?.to_owned();
    let sleeper = poll(Duration::from_secs(10), "the command runs", || async {
        Ok(crate::tools::processes_in(&workspace, "sleep").pop())
    })
    .await?;
    let started = sandboxes(&cluster);

    let answer = client
        .request("agent_interrupt", json!({"imageId": chat.image_id}))
        .await?;
    assert_eq!(answer["interrupted"], true, "{answer}");
    let frames = client.frames_until("conversation_end").await?;
    assert_eq!(frames.last().context("frames")?["data"]["reason"], "interrupted");
    poll(Duration::from_secs(10), "the command is killed", || async {
        Ok((!crate::tools::is_running(&sleeper)).then_some(()))
    })
    .await?;

    let frames = send_and_finish(&mut client, &chat.image_id, run("echo after > after.txt; ls")).await?;
    let (text, is_error) = tool_result(&frames)?;
    assert!(
        !is_error && text.contains("after.txt") && text.contains("sleeper.pid"),
        "{text}"
    );
    assert_eq!(sandboxes(&cluster), started, "the same sandbox");
    Ok(())
}

/// Starts a cluster whose commands run in pods claimed from `kube`, the
/// shell environment's warm pool being `shell_pool`, its agents stopping
/// after `idle` without a turn.
async fn kubernetes_cluster(
    mode: Mode,
    kube: &FakeKube,
    shell_pool: &str,
    idle: Option<Duration>,
) -> anyhow::Result<(MockLlm, Cluster, String)> {
    let options = Options {
        sandbox_kubernetes: Some(kube.settings(shell_pool)),
        agent_idle_timeout: idle,
        ..Options::default()
    };
    let (mock, cluster) = start_with(mode, MockApi::OpenAi, options).await?;
    let agent = sandboxed_agent(&cluster).await?;
    Ok((mock, cluster, agent))
}

both_modes!(
    a_pod_is_claimed_per_image_from_its_environments_warm_pool_and_deleted_with_its_agent,
    kubernetes_provider
);

async fn kubernetes_provider(mode: Mode) -> anyhow::Result<()> {
    let kube = FakeKube::start(FakeKubeOptions {
        warm_pools: vec![("shells".to_owned(), 1)],
        forbid: false,
    })
    .await?;
    let (_mock, cluster, agent) = kubernetes_cluster(mode, &kube, "shells", None).await?;

    // A chat without tools claims nothing.
    let (mut chat_client, chat) = open_chat(&cluster, json!({"agent": agent})).await?;
    send_and_finish(&mut chat_client, &chat.image_id, json!("hello")).await?;
    assert!(kube.claims().is_empty(), "a chat claimed a sandbox");

    // The first command claims a pod of the warm pool; files travel both ways.
    let config = json!({"agent": agent, "tools": ["write_file", "read_file", "run_command"]});
    let (mut first, one) = open_chat(&cluster, config.clone()).await?;
    let script = r#"[mock call='write_file:{"path": "in.txt", "content": "forty two"}' call='2:run_command:{"command": "tr a-z A-Z < in.txt > out.txt && cat out.txt"}' call='3:read_file:{"path": "out.txt"}']"#;
    let frames = send_and_finish(&mut first, &one.image_id, json!(script)).await?;
    assert_eq!(
        streamed_text(&frames),
        "Tool results: FORTY TWO",
        "{:?}",
        types(&frames)
    );
    let claims = kube.claims();
    assert_eq!(claims.len(), 1, "one claim for the image: {claims:?}");
    let claim = &claims[0];
    assert_eq!(claim["metadata"]["namespace"], avm_tests::fake_kube::NAMESPACE);
    assert_eq!(claim["spec"]["warmPoolRef"]["name"], "shells");
    let labels = &claim["metadata"]["labels"];
    assert_eq!(labels["app.kubernetes.io/managed-by"], "agentvm");
    assert_eq!(labels["agentvm.io/environment"], "shell");
    assert_eq!(labels["agentvm.io/image"], one.image_id.as_str());
    // Whatever becomes of the runtime, the controller deletes the claim in time.
    assert_eq!(claim["spec"]["lifecycle"]["shutdownPolicy"], "Delete");
    let shutdown = claim["spec"]["lifecycle"]["shutdownTime"]
        .as_str()
        .context("shutdownTime")?;
    let shutdown = humantime::parse_rfc3339(shutdown)?;
    let left = shutdown.duration_since(std::time::SystemTime::now())?;
    assert!(
        left > Duration::from_secs(3000) && left <= Duration::from_secs(3600),
        "{left:?}"
    );
    assert_eq!(kube.served(), (1, 0), "the warm pod served the first command");
    let first_claim = claim["metadata"]["name"].as_str().context("name")?.to_owned();

    // The same pod serves the image's next command.
    let frames = send_and_finish(&mut first, &one.image_id, run("cat out.txt")).await?;
    assert_eq!(
        tool_result(&frames)?,
        ("exit code 0\nstdout:\nFORTY TWO".to_owned(), false)
    );
    assert_eq!(kube.claims().len(), 1);

    // Another image gets a pod of its own, holding nothing of the first's.
    let (mut second, two) = open_chat(&cluster, config).await?;
    let frames = send_and_finish(&mut second, &two.image_id, run("ls; echo mine > mine.txt")).await?;
    assert_eq!(tool_result(&frames)?, ("exit code 0".to_owned(), false));
    assert_eq!(kube.claims().len(), 2);
    let (warm, cold) = kube.served();
    assert_eq!(warm + cold, 2, "each claim got a pod");
    let holding = |image: &str| {
        kube.claimed_roots()
            .iter()
            .filter(|root| root.join(image).exists())
            .count()
    };
    assert_eq!((holding(&one.image_id), holding(&two.image_id)), (1, 1));

    // Operators see the claims counted.
    let metrics = reqwest::get(format!("{}/metrics", cluster.runtime_grpc))
        .await?
        .text()
        .await?;
    assert!(
        metrics
            .lines()
            .any(|line| line.starts_with("avm_runtime_sandboxes_total{")
                && line.contains(r#"provider="kubernetes""#)
                && line.contains(r#"outcome="claimed""#)),
        "no kubernetes claim in the runtime's metrics"
    );

    // The first agent goes: its claim is deleted, and its pod with it.
    let (status, stopped) = call(&cluster, "POST", &format!("/v1/images/{}/stop", one.image_id), None).await?;
    assert_eq!(status, 200, "{stopped}");
    poll(Duration::from_secs(20), "the claim goes with its agent", || async {
        Ok(kube.deleted().contains(&first_claim).then_some(()))
    })
    .await?;
    assert_eq!(kube.claims().len(), 1);
    assert_eq!(holding(&one.image_id), 0);
    assert_eq!(holding(&two.image_id), 1);
    Ok(())
}

both_modes!(
    kubernetes_refusals_and_a_missing_warm_pool_reach_the_model_clearly_and_an_idle_agents_claim_goes,
    kubernetes_refusals
);

/// RBAC refusing the runtime's ServiceAccount, and a claim no pod answers
/// (an environment without its warm pool), are tool errors that say what
/// an operator does; nothing is left claimed, and an agent that idles out
/// leaves no claim either.
async fn kubernetes_refusals(mode: Mode) -> anyhow::Result<()> {
    let forbidden = FakeKube::start(FakeKubeOptions {
        warm_pools: vec![("shells".to_owned(), 0)],
        forbid: true,
    })
    .await?;
    let (_mock, cluster, agent) = kubernetes_cluster(mode, &forbidden, "shells", None).await?;
    let (mut client, chat) = open_chat(&cluster, json!({"agent": agent, "tools": ["run_command"]})).await?;
    let frames = send_and_finish(&mut client, &chat.image_id, run("true")).await?;
    let (text, is_error) = tool_result(&frames)?;
    assert!(is_error, "{text}");
    for said in [
        "403 Forbidden",
        "cannot create resource \"sandboxclaims\"",
        "needs create, get and delete",
    ] {
        assert!(text.contains(said), "{said:?} missing from {text}");
    }
    let metrics = reqwest::get(format!("{}/metrics", cluster.runtime_grpc))
        .await?
        .text()
        .await?;
    assert!(
        metrics
            .lines()
            .any(|line| line.starts_with("avm_runtime_sandboxes_total{")
                && line.contains(r#"provider="kubernetes""#)
                && line.contains(r#"outcome="refused""#)),
        "no refused claim in the runtime's metrics"
    );
    drop(cluster);

    // A python agent where the cluster has no python warm pool: the claim
    // is never ready; the model reads the controller's reason, and the
    // claim is deleted.
    let kube = FakeKube::start(FakeKubeOptions {
        warm_pools: vec![("shells".to_owned(), 0)],
        forbid: false,
    })
    .await?;
    let idle = Duration::from_secs(3);
    let (_mock, cluster, shell_agent) = kubernetes_cluster(mode, &kube, "shells", Some(idle)).await?;
    let (mut client, chat) = python_chat(&cluster).await?;
    let frames = send_and_finish(&mut client, &chat.image_id, run("python3 -V")).await?;
    let (text, is_error) = tool_result(&frames)?;
    assert!(is_error, "{text}");
    for said in ["warm pool avm-sandbox-python", "WarmPoolNotFound", "not found"] {
        assert!(text.contains(said), "{said:?} missing from {text}");
    }
    poll(Duration::from_secs(20), "the unready claim is deleted", || async {
        Ok((kube.claims().is_empty() && kube.deleted().len() == 1).then_some(()))
    })
    .await?;

    // A shell agent of the same cluster, its pool empty: a cold start serves
    // it; once the agent idles out, its claim is deleted.
    let (mut client, chat) = open_chat(&cluster, json!({"agent": shell_agent, "tools": ["run_command"]})).await?;
    let frames = send_and_finish(&mut client, &chat.image_id, run("echo cold")).await?;
    assert_eq!(
        tool_result(&frames)?,
        ("exit code 0\nstdout:\ncold\n".to_owned(), false)
    );
    assert_eq!(kube.served(), (0, 1));
    assert_eq!(kube.claims().len(), 1);
    poll(Duration::from_secs(30), "the idle agent's claim is deleted", || async {
        Ok((kube.claims().is_empty() && kube.deleted().len() == 2).then_some(()))
    })
    .await?;
    Ok(())
}
