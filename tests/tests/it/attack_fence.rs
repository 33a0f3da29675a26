//! The command fence, attacked as an outside tester did it (issue 26, items
//! 1 and 3): a command that tries to undo its fence, and the server's own
//! secrets outside its data directory.

use anyhow::Context;
use avm_tests::cluster::{Cluster, Mode, Options, TEST_API_KEY, TEST_CONFIG_SECRET_KEY, TEST_SERVICE_KEY};
use avm_tests::mock_llm::MockApi;
use serde_json::json;

use crate::both_modes;
use crate::support::send_and_finish;
use crate::tools::{open_chat, start_with};

/// Runs `command` through the model's `run_command` in a new conversation;
/// returns the tool's result and every event of the turn, as text.
async fn run_command(cluster: &Cluster, command: &str) -> anyhow::Result<(String, String)> {
    let (mut client, chat) = open_chat(cluster, json!({"tools": ["run_command"]})).await?;
    let script = format!("[mock call='run_command:{}']", json!({ "command": command }));
    let frames = send_and_finish(&mut client, &chat.image_id, json!(script)).await?;
    let result = frames
        .iter()
        .find(|frame| frame["type"] == "tool_result")
        .and_then(|frame| frame["data"]["result"].as_str())
        .context("the command's result")?
        .to_owned();
    Ok((result, serde_json::to_string(&frames)?))
}

/// Returns the operator's admin key, as the first start wrote it.
fn admin_key(cluster: &Cluster) -> anyhow::Result<String> {
    Ok(std::fs::read_to_string(cluster.data_dir().join("admin.key"))?
        .trim()
        .to_owned())
}

/// Asserts that no secret of the server shows in `events`.
fn assert_no_secret(cluster: &Cluster, events: &str) -> anyhow::Result<()> {
    let admin = admin_key(cluster)?;
    for secret in [admin.as_str(), TEST_API_KEY, TEST_SERVICE_KEY, TEST_CONFIG_SECRET_KEY] {
        assert!(!events.contains(secret), "a secret reached the events: {events}");
    }
    Ok(())
}

/// Tries, from a command, what undid the fence before: the data directory's
/// cover unmounted, the root remounted writable, the control groups'
/// cover unmounted, the first process's environment read.
async fn undo_the_fence(cluster: &Cluster) -> anyhow::Result<()> {
    let outside = tempfile::tempdir()?;
    let (data, planted) = (cluster.data_dir(), outside.path().join("planted"));
    let command = format!(
        "umount -l {data}; cat {data}/admin.key; mount -o remount,bind,rw / && touch {planted} {data}/planted; \
         umount -l /sys/fs/cgroup; echo cgroups=$(ls -A /sys/fs/cgroup 2>/dev/null | wc -l); \
         cat /proc/1/environ; echo; grep CapEff /proc/self/status",
        data = data.display(),
        planted = planted.display(),
    );
    let (result, events) = run_command(cluster, &command).await?;
    assert_no_secret(cluster, &events)?;
    assert!(
        !planted.exists() && !data.join("planted").exists(),
        "the command wrote outside: {result}"
    );
    assert!(
        result.contains("cgroups=0\n"),
        "the control groups are out of sight: {result}"
    );
    assert!(result.contains("CapEff:\t0000000000000000"), "no capability: {result}");
    Ok(())
}

both_modes!(a_command_cannot_undo_its_fence, fence_held);

/// Issue 26 item 1: a command undid its own fence (`umount -l <data dir>`
/// showed the admin key, `mount -o remount,bind,rw /` let it write to the
/// host, `umount -l /sys/fs/cgroup` showed the control groups).
async fn fence_held(mode: Mode) -> anyhow::Result<()> {
    let (_mock, cluster) = start_with(mode, MockApi::OpenAi, Options::default()).await?;
    undo_the_fence(&cluster).await
}

/// Issue 26 item 1, as reproduced with the server running as an
/// unprivileged user (nobody, owning the data directory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_cannot_undo_its_fence_under_an_unprivileged_server() -> anyhow::Result<()> {
    const NOBODY: u32 = 65534;
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("SKIPPED: starting the server as another user takes root");
        return Ok(());
    }
    let options = Options {
        serve_process: true,
        run_as: Some(NOBODY),
        ..Options::default()
    };
    let (_mock, cluster) = start_with(Mode::OneProcess, MockApi::OpenAi, options).await?;
    let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(cluster.data_dir().join("admin.key"))?);
    assert_eq!(owner, NOBODY, "the server runs unprivileged");
    undo_the_fence(&cluster).await
}

/// Issue 26 item 3: with `avm serve --config <file>`, the file (the LLM key
/// in it) was readable by commands, and so was the server's home.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_reads_neither_the_config_file_nor_the_servers_home() -> anyhow::Result<()> {
    let home = tempfile::tempdir()?;
    std::fs::write(home.path().join("notes.txt"), "home-canary-5d1e")?;
    let files = tempfile::tempdir()?;
    let config = files.path().join("avm.toml");
    std::fs::write(&config, format!("[llm]\napi_key = \"{TEST_API_KEY}\"\n"))?;
    let options = Options {
        serve_process: true,
        config_file: Some(config.clone()),
        env: vec![("HOME".to_owned(), home.path().display().to_string())],
        ..Options::default()
    };
    let (_mock, cluster) = start_with(Mode::OneProcess, MockApi::OpenAi, options).await?;
    let command = format!(
        "cat {config}; ls -A {home}; cat {home}/notes.txt; echo home=$HOME",
        config = config.display(),
        home = home.path().display()
    );
    let (result, events) = run_command(&cluster, &command).await?;
    assert!(result.contains("home=/workspace\n"), "{result}");
    assert_no_secret(&cluster, &events)?;
    for seen in ["home-canary-5d1e", "notes.txt\n", "api_key"] {
        assert!(!result.contains(seen), "{seen} was read: {result}");
    }
    Ok(())
}
