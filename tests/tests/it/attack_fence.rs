//! The command fence, attacked as an outside tester did it (issue 26, items
//! 1 to 3): a command that tries to undo its fence, a client racing a
//! command that swaps a directory for a link, and the server's own secrets
//! outside its data directory.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Context;
use avm_tests::cluster::{Cluster, Mode, Options, TEST_API_KEY, TEST_CONFIG_SECRET_KEY, TEST_SERVICE_KEY};
use avm_tests::mock_llm::MockApi;
use futures::future::join_all;
use serde_json::json;

use crate::both_modes;
use crate::support::{conversation, send_and_finish};
use crate::tools::{open_chat, start_with};

/// Runs `command` through the model's `run_command` in a new conversation;
/// returns the tool's result and every event of the turn, as text.
async fn run_command(cluster: &Cluster, command: &str) -> anyhow::Result<(String, String)> {
    let (mut client, chat) = open_chat(cluster, json!({"tools": ["run_command"]})).await?;
    // The mock's directive unescapes `\` and ends a value at an unescaped `'`.
    let call = json!({ "command": command })
        .to_string()
        .replace('\\', "\\\\")
        .replace('\'', "\\'");
    let script = format!("[mock call='run_command:{call}']");
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

/// Asserts that no secret of the server shows in `events` (saying which,
/// never the events: they would print it).
fn assert_no_secret(cluster: &Cluster, events: &str) -> anyhow::Result<()> {
    let admin = admin_key(cluster)?;
    let secrets = [
        ("the admin key", admin.as_str()),
        ("the LLM key", TEST_API_KEY),
        ("the service key", TEST_SERVICE_KEY),
        ("the config secret key", TEST_CONFIG_SECRET_KEY),
    ];
    for (name, secret) in secrets {
        assert!(!events.contains(secret), "{name} reached the turn's events");
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

/// Issue 27: the fence is every provider's: a command in an `avm sandbox`
/// child, or in a pool's sandbox, undoes it no more than in the runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_in_a_sandbox_process_or_a_pools_cannot_undo_its_fence() -> anyhow::Result<()> {
    let options = Options {
        sandbox_process: true,
        ..Options::default()
    };
    let (_mock, cluster) = start_with(Mode::OneProcess, MockApi::OpenAi, options).await?;
    undo_the_fence(&cluster).await?;
    let pool = crate::sandbox_tier::pool_sandbox().await?;
    let options = Options {
        sandbox_pool: vec![pool.address.clone()],
        ..Options::default()
    };
    let (_mock, cluster) = start_with(Mode::PerComponent, MockApi::OpenAi, options).await?;
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
    assert_no_secret(&cluster, &events)?;
    for seen in ["home-canary-5d1e", "notes.txt\n", "api_key"] {
        assert!(!result.contains(seen), "{seen} was read: {result}");
    }
    assert!(result.contains("home=/workspace\n"), "{result}");
    Ok(())
}

both_modes!(a_swap_to_a_link_never_leads_a_client_outside_the_workspace, race);

/// Issue 26 item 2: a command swapped a directory and a link to the data
/// directory (`renameat2(RENAME_EXCHANGE)`) while a client looped `GET
/// …/files/d/admin.key` and `PUT …/files/w/x`: the GET returned the admin
/// key and the PUT wrote into the data directory.
async fn race(mode: Mode) -> anyhow::Result<()> {
    const ROUNDS: usize = 4;
    const AT_ONCE: usize = 8;
    let cluster = Cluster::start(mode, Options::default()).await?;
    let mut client = avm_tests::ws_client::WsClient::connect(&cluster.ws_url()).await?;
    let chat = conversation(&mut client, "default", json!({"name": "racer"})).await?;
    let http = cluster.http()?;
    let file_url = |path: &str| cluster.url(&format!("/v1/images/{}/workspace/files/{path}", chat.image_id));
    for (path, content) in [("d/admin.key", "decoy"), ("w/kept", "")] {
        let put = http.put(file_url(path)).body(content).send().await?;
        anyhow::ensure!(put.status().is_success(), "{path}: {}", put.status());
    }
    let workspace = workspace_of(&cluster, &chat.image_id).context("the workspace")?;
    let data = cluster.data_dir().to_owned();
    // As the command did: beside each directory, a link to the data directory.
    std::os::unix::fs::symlink(&data, workspace.join("s"))?;
    std::os::unix::fs::symlink(&data, workspace.join("t"))?;
    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let (workspace, stop) = (workspace.clone(), Arc::clone(&stop));
        std::thread::spawn(move || -> anyhow::Result<u64> {
            use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
            let mut swaps = 0_u64;
            while !stop.load(Ordering::Relaxed) {
                for (a, b) in [("d", "s"), ("w", "t")] {
                    renameat2(
                        AT_FDCWD,
                        &workspace.join(a),
                        AT_FDCWD,
                        &workspace.join(b),
                        RenameFlags::RENAME_EXCHANGE,
                    )?;
                }
                swaps += 1;
            }
            Ok(swaps)
        })
    };
    let admin = admin_key(&cluster)?;
    let (mut served, mut refused) = (0, 0);
    let raced = async {
        // Rounds of requests at once: as many tries as one by one, in less time.
        for round in 0..ROUNDS {
            let reads = (0..AT_ONCE).map(|_| async {
                let got = http.get(file_url("d/admin.key")).send().await?;
                Ok::<_, anyhow::Error>((got.status().as_u16(), got.text().await?))
            });
            let writes = (0..AT_ONCE).map(|_| http.put(file_url("w/x")).body("planted").send());
            let (reads, writes) = tokio::join!(join_all(reads), join_all(writes));
            for read in reads {
                let (status, body) = read?;
                anyhow::ensure!(!body.contains(&admin), "round {round}: the admin key was served");
                match status {
                    200 => {
                        anyhow::ensure!(body == "decoy", "round {round}: {body}");
                        served += 1;
                    }
                    _ => refused += 1,
                }
            }
            for write in writes {
                write?;
            }
            anyhow::ensure!(
                !data.join("x").exists(),
                "round {round}: a PUT wrote into the data directory"
            );
        }
        Ok(())
    }
    .await;
    stop.store(true, Ordering::Relaxed);
    let swaps = swapper.join().map_err(|_| anyhow::anyhow!("the swapper panicked"))??;
    raced?;
    eprintln!("{served} reads served, {refused} refused, over {swaps} swaps");
    assert!(served > 0, "the route still serves the directory's file");
    assert!(!data.join("x").exists());
    Ok(())
}

/// Returns an image's workspace directory, if it has one.
fn workspace_of(cluster: &Cluster, image_id: &str) -> Option<std::path::PathBuf> {
    let tenants = std::fs::read_dir(cluster.data_dir().join("workspaces")).ok()?;
    tenants
        .flatten()
        .map(|tenant| tenant.path().join(image_id))
        .find(|dir| Path::is_dir(dir))
}

both_modes!(
    a_command_reaches_the_network_only_through_the_guarded_proxy,
    network_guarded
);

/// Issue 27 item 7: a command with the default `network: true` reached
/// every loopback service (the gateway, the gRPC ports, Redis, Postgres)
/// and 169.254.169.254, which `fetch_url` refuses. Now its network is a
/// namespace of its own whose one way out is the proxy: an address the
/// operator allowed answers through it, plain and tunnelled; internal
/// addresses get the proxy's 403; a direct connection reaches nothing.
async fn network_guarded(mode: Mode) -> anyhow::Result<()> {
    network_guarded_with(mode, Options::default()).await
}

/// The same from an `avm sandbox` child: the runtime's allow-list travels
/// with each command to the sandbox's proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_in_a_sandbox_process_reaches_the_network_only_through_the_guarded_proxy() -> anyhow::Result<()> {
    let options = Options {
        sandbox_process: true,
        ..Options::default()
    };
    network_guarded_with(Mode::OneProcess, options).await
}

async fn network_guarded_with(mode: Mode, options: Options) -> anyhow::Result<()> {
    // "Public": an address the operator allowed, as a package index would be.
    let public = tokio::net::TcpListener::bind("127.0.0.2:0").await?;
    let public_port = public.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = public.accept().await {
            tokio::spawn(async move {
                use tokio::io::{AsyncReadExt, AsyncWriteExt};
                let mut head = Vec::new();
                let mut chunk = [0_u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(read) => head.extend_from_slice(&chunk[..read]),
                    }
                }
                let body = "public-canary";
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    let options = Options {
        network_allow: vec!["127.0.0.2".to_owned()],
        ..options
    };
    let (_mock, cluster) = start_with(mode, MockApi::OpenAi, options).await?;
    let gateway = cluster.gateway_url.trim_start_matches("http://").to_owned();
    let code = "-s -m 5 -o /dev/null -w '%{http_code}'";
    let command = format!(
        "echo proxy=$HTTP_PROXY; \
         echo public=$(curl -s -m 5 http://127.0.0.2:{public_port}/); \
         echo tunnelled=$(curl -s -m 5 -p http://127.0.0.2:{public_port}/); \
         echo gateway=$(curl {code} http://{gateway}/health); \
         echo localhost=$(curl {code} http://localhost:{gateway_port}/health); \
         echo metadata=$(curl {code} http://169.254.169.254/latest/meta-data/); \
         echo redis=$(curl -s -m 5 -o /dev/null -w %{{http_connect}} -p http://127.0.0.1:6379/); \
         curl -s -m 3 --noproxy '*' http://{gateway}/health; echo direct_gateway=$?; \
         curl -s -m 3 --noproxy '*' http://127.0.0.1:5432/; echo direct_postgres=$?; \
         curl -s -m 3 --noproxy '*' http://127.0.0.2:{public_port}/; echo direct_public=$?",
        gateway_port = gateway.rsplit(':').next().unwrap_or_default(),
    );
    let (result, events) = run_command(&cluster, &command).await?;
    assert_no_secret(&cluster, &events)?;
    for line in [
        "proxy=http://127.0.0.1:3128\n",
        "public=public-canary\n",
        "tunnelled=public-canary\n",
        "gateway=403\n",
        "localhost=403\n",
        "metadata=403\n",
        "redis=403\n",
    ] {
        assert!(result.contains(line), "{line:?} in {result}");
    }
    // 7: nothing to connect to; the namespace holds only its loopback.
    for direct in ["direct_gateway", "direct_postgres", "direct_public"] {
        assert!(result.contains(&format!("{direct}=7\n")), "{direct}: {result}");
    }
    Ok(())
}
