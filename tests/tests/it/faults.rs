//! The fault suite: spawned `avm` processes, on loopback, killed and
//! restarted under load. A crashed `avm serve` keeps every acknowledged user
//! message and records each turn it cut (`TURN_LOST`); a killed component of
//! the per-component mode gives clients typed errors, not hangs, and serves
//! again once restarted on its address; so do a private Postgres and a
//! private Redis stopped and started again (never the machine's shared
//! ones); SIGTERM drains `avm serve`.
//!
//! Each test is bounded; waits poll with deadlines. The only timing goals
//! are the issue's: a typed error within 2 s of a fault, requests served
//! again within 5 s of the restart. (Postgres down: within the pool's
//! acquire timeout, 5 s, for calls that need a new connection.)

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use avm_tests::cluster::{Cluster, Llm, Mode, Options};
use avm_tests::mock_llm::{MockApi, MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use serde_json::{Value, json};

use crate::support::{Conversation, call, conversation, streamed_text};

/// Within how long of a fault a client must get a typed error.
const TYPED_ERROR_WITHIN: Duration = Duration::from_secs(2);
/// Within how long of a restart requests must succeed again.
const RECOVERED_WITHIN: Duration = Duration::from_secs(5);
/// Within how long of Postgres going down a call that needs a new
/// connection fails: sqlx retries a refused connection for the pool's whole
/// acquire timeout (a shorter one would fail calls that wait for a busy pool).
const POSTGRES_TYPED_ERROR_WITHIN: Duration = avm_store::db::ACQUIRE_TIMEOUT.saturating_add(Duration::from_secs(1));
/// How long one probe waits for its answer.
const PROBE_WAIT: Duration = POSTGRES_TYPED_ERROR_WITHIN;
/// How long a test waits for what must happen eventually (no timing goal).
const PATIENCE: Duration = Duration::from_secs(20);

/// A reply that streams for a few seconds: turns are in flight at the fault.
fn slow() -> MockBehavior {
    MockBehavior {
        tokens: 200,
        token_interval: Duration::from_millis(20),
        ..MockBehavior::default()
    }
}

/// Polls `check` until it gives a value or `limit` passes; returns the value
/// and when it came.
async fn poll<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> anyhow::Result<(T, Duration)>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(value) = check().await {
            return Ok((value, started.elapsed()));
        }
        if started.elapsed() > limit {
            bail!("{what}: not within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What one REST call gave: a success, a typed error (a JSON error code), or
/// neither (no connection, a body without a code).
#[derive(Debug)]
enum Probe {
    Ok,
    Typed(u16, String),
    Untyped(String),
}

/// Calls `GET path` with a bounded wait and classifies the answer.
async fn probe(http: &reqwest::Client, url: &str) -> Probe {
    let answer = tokio::time::timeout(PROBE_WAIT, http.get(url).send()).await;
    let response = match answer {
        Err(_) => return Probe::Untyped(format!("no answer within {PROBE_WAIT:?}")),
        Ok(Err(err)) => return Probe::Untyped(format!("{err}")),
        Ok(Ok(response)) => response,
    };
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap_or_default();
    if status < 300 {
        return Probe::Ok;
    }
    match body["error"]["code"].as_str() {
        Some(code) => Probe::Typed(status, code.to_owned()),
        None => Probe::Untyped(format!("{status} {body}")),
    }
}

/// Polls `url` until it answers with a typed error (or, with `unreachable`,
/// cannot be reached at all); returns what it answered and when.
async fn typed_error(
    http: &reqwest::Client,
    url: &str,
    unreachable: bool,
    within: Duration,
) -> anyhow::Result<(String, Duration)> {
    let started = Instant::now();
    loop {
        let answer = probe(http, url).await;
        match answer {
            Probe::Typed(status, code) => {
                let after = started.elapsed();
                ensure!(after <= within, "{url}: answered {status} {code} only after {after:?}");
                return Ok((format!("{status} {code}"), after));
            }
            Probe::Untyped(why) if unreachable => return Ok((format!("unreachable: {why}"), started.elapsed())),
            other if started.elapsed() > within => {
                bail!("{url}: no typed error within {within:?}; last answer {other:?}")
            }
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Returns a turn's frames up to its end, or up to the error that ended the
/// subscription (`system_error`).
async fn turn_or_error(client: &mut WsClient) -> anyhow::Result<Vec<Value>> {
    let mut frames = Vec::new();
    loop {
        let frame = client.next_frame().await?;
        let end = matches!(
            frame["type"].as_str(),
            Some("conversation_end" | "error_occurred" | "system_error")
        );
        frames.push(frame);
        if end {
            return Ok(frames);
        }
    }
}

/// A conversation with the user messages the server acknowledged.
struct Chat {
    client: WsClient,
    chat: Conversation,
    acknowledged: Vec<String>,
}

impl Chat {
    async fn open(ws_url: &str, name: &str) -> anyhow::Result<Self> {
        let mut client = WsClient::connect(ws_url).await?;
        let chat = conversation(&mut client, name, json!({})).await?;
        Ok(Self {
            client,
            chat,
            acknowledged: Vec::new(),
        })
    }

    /// Sends `text` and waits for its acknowledgement; `Ok(false)` when the
    /// server refused it with a typed error.
    async fn send(&mut self, text: &str) -> anyhow::Result<bool> {
        let answer = self
            .client
            .request("message_send", json!({"imageId": self.chat.image_id, "content": text}))
            .await?;
        if answer.get("error").is_some() {
            ensure!(answer["code"].is_string(), "an untyped refusal: {answer}");
            return Ok(false);
        }
        self.acknowledged.push(text.to_owned());
        Ok(true)
    }

    /// Starts a turn and waits until it streams.
    async fn start_streaming(&mut self, text: &str) -> anyhow::Result<()> {
        ensure!(self.send(text).await?, "the message was refused");
        self.client.frames_until("text_delta").await?;
        Ok(())
    }

    /// Sends `text` and returns the turn's frames; the turn must complete.
    ///
    /// What comes before the answer to the send (a replay of earlier turns'
    /// events, the record of a lost turn) is returned but ends nothing.
    async fn talk(&mut self, text: &str) -> anyhow::Result<Vec<Value>> {
        let request_id = self
            .client
            .send_request("message_send", json!({"imageId": self.chat.image_id, "content": text}))
            .await?;
        let mut frames = Vec::new();
        let mut answered = false;
        loop {
            let frame = self.client.next_frame().await?;
            if frame["category"] == "response" && frame["data"]["requestId"] == request_id.as_str() {
                ensure!(frame["data"].get("error").is_none(), "the message was refused: {frame}");
                answered = true;
            }
            let end = answered && matches!(frame["type"].as_str(), Some("conversation_end" | "error_occurred"));
            frames.push(frame);
            if end {
                break;
            }
        }
        self.acknowledged.push(text.to_owned());
        let end = frames.last().cloned().unwrap_or_default();
        ensure!(
            end["type"] == "conversation_end" && end["data"]["reason"] == "completed",
            "the turn did not complete: {end}"
        );
        ensure!(!streamed_text(&frames).is_empty(), "no reply streamed");
        Ok(frames)
    }

    /// Connects again (after the gateway went away) and subscribes.
    async fn reconnect(&mut self, ws_url: &str) -> anyhow::Result<()> {
        self.client = WsClient::connect(ws_url).await?;
        self.client.subscribe(&self.chat.session_id, None).await
    }

    /// Returns the stored history.
    async fn history(&mut self) -> anyhow::Result<Vec<Value>> {
        let history = self
            .client
            .request("image_messages", json!({"imageId": self.chat.image_id}))
            .await?;
        history["messages"]
            .as_array()
            .cloned()
            .with_context(|| format!("no history: {history}"))
    }

    /// Checks that every acknowledged user message is stored, in order.
    async fn assert_kept(&mut self) -> anyhow::Result<Vec<Value>> {
        let history = self.history().await?;
        let users: Vec<&str> = history
            .iter()
            .filter(|m| m["role"] == "user")
            .filter_map(|m| m["content"].as_str())
            .collect();
        ensure!(
            users == self.acknowledged,
            "acknowledged {:?}, stored {users:?}",
            self.acknowledged
        );
        Ok(history)
    }
}

/// Returns the stored message after the user message `text`.
fn after_user<'a>(history: &'a [Value], text: &str) -> Option<&'a Value> {
    let at = history
        .iter()
        .position(|m| m["role"] == "user" && m["content"] == text)?;
    history.get(at + 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_keeps_what_it_acknowledged_and_records_the_cut_turns() -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let options = Options {
        serve_process: true,
        ..Options::with_llm(Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        })
    };
    let mut cluster = Cluster::start(Mode::OneProcess, options).await?;
    let mut chats = Vec::new();
    for index in 0..4 {
        let mut chat = Chat::open(&cluster.ws_url(), &format!("crash-{index}")).await?;
        chat.talk(&format!("before {index}")).await?;
        chats.push(chat);
    }
    mock.set_behavior(slow());
    for (index, chat) in chats.iter_mut().enumerate() {
        chat.start_streaming(&format!("cut {index}")).await?;
    }
    cluster.kill().await?;
    mock.set_behavior(MockBehavior::default());
    let restarting = Instant::now();
    let cluster = cluster.restart().await?;
    println!("avm serve: killed, restarted and ready in {:?}", restarting.elapsed());

    for (index, chat) in chats.iter_mut().enumerate() {
        chat.reconnect(&cluster.ws_url()).await?;
        let cut = format!("cut {index}");
        // The cut turn was recorded at start-up, before this message (a
        // client resuming with its cursor gets the record as any error
        // message: `attack_ledger`, item 10).
        chat.talk(&format!("after {index}")).await?;
        let history = chat.assert_kept().await?;
        let recorded = after_user(&history, &cut).context("the cut message is kept")?;
        assert_eq!(
            (&recorded["role"], &recorded["errorCode"]),
            (&json!("error"), &json!("TURN_LOST")),
            "the cut turn is recorded right after its message: {history:?}"
        );
        let lost = history.iter().filter(|m| m["errorCode"] == "TURN_LOST").count();
        assert_eq!(lost, 1, "one record per cut turn: {history:?}");
    }
    // REST history shows it as well.
    let image_id = chats[0].chat.image_id.clone();
    let (status, rest) = call(&cluster, "GET", &format!("/v1/images/{image_id}/messages"), None).await?;
    assert_eq!(status, 200, "{rest}");
    assert!(rest.to_string().contains("TURN_LOST"), "{rest}");

    // The requests after a lost turn are well-formed: roles alternate, the
    // cut message and the next one go as one user message.
    let requests = mock.requests();
    for index in 0..chats.len() {
        let next = format!("after {index}");
        let request = requests
            .iter()
            .rev()
            .find(|r| r.api == MockApi::Anthropic && r.body.to_string().contains(&next))
            .context("the provider got the next message")?;
        let messages = request.body["messages"].as_array().context("messages")?;
        let roles: Vec<&str> = messages.iter().filter_map(|m| m["role"].as_str()).collect();
        assert_eq!(roles, ["user", "assistant", "user"], "{}", request.body);
        let last = messages[2].to_string();
        assert!(last.contains(&format!("cut {index}")) && last.contains(&next), "{last}");
        assert!(!request.body.to_string().contains("TURN_LOST"), "errors are not sent");
    }
    Ok(())
}

/// For each component of the per-component mode: a REST call that needs it.
fn probe_path(component: &str) -> &'static str {
    match component {
        "auth" => "/v1/auth/keys",
        "session" => "/v1/containers",
        "resource" => "/v1/resources",
        "config" => "/v1/config",
        "observability" => "/v1/usage",
        "runtime" => "/v1/agents",
        _ => "/health",
    }
}

macro_rules! kill_each {
    ($($component:ident),*) => {
        mod a_killed_component_fails_typed_and_recovers {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $component() -> anyhow::Result<()> {
                    super::kill_component(stringify!($component)).await
                }
            )*
        }
    };
}

kill_each!(auth, session, resource, config, observability, runtime, gateway);

async fn kill_component(component: &str) -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let mut cluster = Cluster::start(
        Mode::PerComponent,
        Options::with_llm(Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        }),
    )
    .await?;
    let http = cluster.http()?;
    let probe_url = cluster.url(probe_path(component));
    ensure!(
        matches!(probe(&http, &probe_url).await, Probe::Ok),
        "the probe works before the fault"
    );
    let mut chats = Vec::new();
    for index in 0..3 {
        let mut chat = Chat::open(&cluster.ws_url(), &format!("{component}-{index}")).await?;
        chat.talk(&format!("before {index}")).await?;
        chats.push(chat);
    }
    mock.set_behavior(MockBehavior { tokens: 60, ..slow() });
    for (index, chat) in chats.iter_mut().enumerate() {
        chat.start_streaming(&format!("during {index}")).await?;
    }

    cluster.kill_component(component).await?;
    let killed = Instant::now();
    // Calls that need the component fail with a typed error, at once.
    let (seen, after) = typed_error(&http, &probe_url, component == "gateway", TYPED_ERROR_WITHIN).await?;
    println!("{component}: killed; {probe_url} answered {seen} after {after:?}");
    // The turns in flight end, with a typed error or their reply; none hangs.
    let mut cut = Vec::new();
    let mut last_typed = Duration::ZERO;
    for (index, chat) in chats.iter_mut().enumerate() {
        let ended = tokio::time::timeout(PATIENCE, turn_or_error(&mut chat.client)).await;
        match ended {
            Err(_) => bail!("{component}: a turn in flight hangs"),
            // The gateway's sockets close: the only word a dead gateway has.
            Ok(Err(err)) if component == "gateway" => {
                println!(
                    "{component}: socket {index} ended after {:?}: {err:#}",
                    killed.elapsed()
                );
            }
            Ok(Err(err)) => bail!("{component}: the turn's stream broke: {err:#}"),
            Ok(Ok(frames)) => {
                let end = frames.last().cloned().unwrap_or_default();
                if end["type"] != "conversation_end" {
                    ensure!(end["data"]["code"].is_string(), "untyped: {end}");
                    last_typed = killed.elapsed();
                    println!(
                        "{component}: turn {index} ended with {} after {last_typed:?}",
                        end["data"]["code"]
                    );
                    cut.push(index);
                }
            }
        }
    }
    if component == "runtime" {
        ensure!(cut.len() == chats.len(), "every turn of the killed runtime ended typed");
        ensure!(
            last_typed < TYPED_ERROR_WITHIN,
            "the turns of the killed runtime ended {last_typed:?} after the kill"
        );
    }

    mock.set_behavior(MockBehavior::default());
    let restarting = Instant::now();
    cluster.restart_component(component).await?;
    let started = restarting.elapsed();
    let (_, recovered) = poll(RECOVERED_WITHIN, "served again", || async {
        matches!(probe(&http, &probe_url).await, Probe::Ok).then_some(())
    })
    .await?;
    println!("{component}: restarted in {started:?}; served again {recovered:?} after");

    if component == "gateway" {
        // The turns went on without the gateway: their replies are stored.
        poll(PATIENCE, "the turns end", || async {
            let (_, listed) = call(&cluster, "GET", "/v1/agents", None).await.ok()?;
            let agents = listed["agents"].as_array()?;
            agents.iter().all(|agent| agent["state"] == "idle").then_some(())
        })
        .await?;
    }
    for (index, chat) in chats.iter_mut().enumerate() {
        if component == "gateway" {
            chat.reconnect(&cluster.ws_url()).await?;
            let history = chat.history().await?;
            let reply = after_user(&history, &format!("during {index}")).context("the message is kept")?;
            ensure!(reply["role"] == "assistant", "the reply is stored: {history:?}");
        } else if cut.contains(&index) {
            // The subscription ended with its error: subscribe again.
            chat.client.subscribe(&chat.chat.session_id, None).await?;
        }
        // The next message streams a reply (within the recovery bound).
        let next = Instant::now();
        chat.talk(&format!("after {index}")).await?;
        println!("{component}: conversation {index} answered {:?} after", next.elapsed());
        let history = chat.assert_kept().await?;
        if cut.contains(&index) {
            let recorded = after_user(&history, &format!("during {index}")).context("the cut message is kept")?;
            ensure!(recorded["role"] == "error", "the cut turn is recorded: {history:?}");
        }
    }
    Ok(())
}

// Private Postgres and Redis, stopped and started again on their ports.

/// Returns whether the fault tests of an external service can run, saying
/// loudly when not; with `AVM_TEST_REQUIRE_EXTERNAL=1` a missing one fails.
fn available(what: &str, found: bool) -> anyhow::Result<bool> {
    if found {
        return Ok(true);
    }
    if std::env::var("AVM_TEST_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1") {
        bail!("{what} is not installed but AVM_TEST_REQUIRE_EXTERNAL=1");
    }
    eprintln!("SKIPPED: {what} is not installed; its fault test did not run");
    Ok(false)
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn running_as_root() -> bool {
    std::process::Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

/// A Postgres of this test alone, in a temporary directory: `initdb` and
/// `pg_ctl` as the `postgres` user when the tests run as root (Postgres
/// refuses root).
struct PrivatePostgres {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
}

impl PrivatePostgres {
    /// Returns the newest `/usr/lib/postgresql/<version>/bin` with `initdb`.
    fn binaries() -> Option<PathBuf> {
        let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .filter_map(Result::ok)
            .filter_map(|entry| {
                let version = entry.file_name().to_str()?.parse().ok()?;
                let bin = entry.path().join("bin");
                bin.join("initdb").exists().then_some((version, bin))
            })
            .collect();
        found.sort();
        let bin = found.pop()?.1;
        // As root, `runuser` drops to `postgres`.
        (!running_as_root() || Path::new("/usr/sbin/runuser").exists() || Path::new("/sbin/runuser").exists())
            .then_some(bin)
    }

    fn command(&self, tool: &str) -> std::process::Command {
        let path = self.bin.join(tool);
        let mut command = if running_as_root() {
            let mut command = std::process::Command::new("runuser");
            command.args(["-u", "postgres", "--"]).arg(path);
            command
        } else {
            std::process::Command::new(path)
        };
        command
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        command
    }

    async fn start(bin: PathBuf) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        if running_as_root() {
            let status = std::process::Command::new("chown")
                .args(["-R", "postgres:"])
                .arg(dir.path())
                .status()?;
            ensure!(
                status.success(),
                "cannot give the postgres user {}",
                dir.path().display()
            );
        }
        let postgres = Self {
            bin,
            port: free_port()?,
            dir,
        };
        let data = postgres.data();
        let status = postgres
            .command("initdb")
            .args(["-A", "trust", "-U", "postgres", "-D"])
            .arg(&data)
            .status()?;
        ensure!(status.success(), "initdb failed");
        postgres.up().await?;
        Ok(postgres)
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Starts the server on its port and waits until it accepts connections.
    async fn up(&self) -> anyhow::Result<()> {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.path().display()
        );
        let mut command = self.command("pg_ctl");
        command
            .args(["-w", "-t", "20", "-l"])
            .arg(self.dir.path().join("log"))
            .args(["-o", &options, "-D"]);
        command.arg(self.data()).arg("start");
        let status = tokio::task::spawn_blocking(move || command.status()).await??;
        ensure!(status.success(), "pg_ctl start failed");
        Ok(())
    }

    /// Stops the server (`fast`: connections are cut, as in a restart).
    async fn down(&self) -> anyhow::Result<()> {
        let mut command = self.command("pg_ctl");
        command.args(["-w", "-m", "fast", "-D"]).arg(self.data()).arg("stop");
        let status = tokio::task::spawn_blocking(move || command.status()).await??;
        ensure!(status.success(), "pg_ctl stop failed");
        Ok(())
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = self
            .command("pg_ctl")
            .args(["-w", "-m", "immediate", "-D"])
            .arg(self.data())
            .arg("stop")
            .status();
    }
}

/// A Redis of this test alone, without persistence.
struct PrivateRedis {
    port: u16,
    child: Option<tokio::process::Child>,
}

impl PrivateRedis {
    fn binary() -> bool {
        std::process::Command::new("redis-server")
            .arg("--version")
            .stdout(std::process::Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
    }

    async fn start() -> anyhow::Result<Self> {
        let mut redis = Self {
            port: free_port()?,
            child: None,
        };
        redis.up().await?;
        Ok(redis)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    async fn up(&mut self) -> anyhow::Result<()> {
        let child = tokio::process::Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        self.child = Some(child);
        let address = format!("127.0.0.1:{}", self.port);
        poll(PATIENCE, "redis listening", || async {
            tokio::net::TcpStream::connect(&address).await.ok().map(drop)
        })
        .await?;
        Ok(())
    }

    async fn down(&mut self) -> anyhow::Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill().await?;
        }
        Ok(())
    }
}

/// Runs turns and probes against `cluster` while `fault` stops a backing
/// service and `repair` starts it again; checks the typed errors, the
/// recovery and that nothing acknowledged was lost.
async fn restart_under_load<Stop, Start>(
    what: &str,
    cluster: &Cluster,
    mock: &MockLlm,
    probe_path: &str,
    typed_within: Duration,
    fault: Stop,
    repair: Start,
) -> anyhow::Result<()>
where
    Stop: AsyncFnOnce() -> anyhow::Result<()>,
    Start: AsyncFnOnce() -> anyhow::Result<()>,
{
    let http = cluster.http()?;
    let probe_url = cluster.url(probe_path);
    let mut chats = Vec::new();
    for index in 0..3 {
        let mut chat = Chat::open(&cluster.ws_url(), &format!("{what}-{index}")).await?;
        chat.talk(&format!("before {index}")).await?;
        chats.push(chat);
    }
    mock.set_behavior(MockBehavior { tokens: 60, ..slow() });
    for (index, chat) in chats.iter_mut().enumerate() {
        chat.start_streaming(&format!("during {index}")).await?;
    }

    fault().await?;
    let stopped = Instant::now();
    let (seen, after) = typed_error(&http, &probe_url, false, typed_within).await?;
    println!("{what}: stopped; {probe_url} answered {seen} after {after:?}");
    let mut unsubscribed = Vec::new();
    for (index, chat) in chats.iter_mut().enumerate() {
        match tokio::time::timeout(PATIENCE, turn_or_error(&mut chat.client)).await {
            Err(_) => bail!("{what}: a turn in flight hangs"),
            Ok(frames) => {
                let end = frames?.last().cloned().unwrap_or_default();
                ensure!(
                    end["type"] == "conversation_end" || end["data"]["code"].is_string(),
                    "{what}: untyped end {end}"
                );
                println!(
                    "{what}: a turn in flight ended with {} {} after {:?}",
                    end["type"],
                    end["data"],
                    stopped.elapsed()
                );
                if end["type"] == "system_error" {
                    unsubscribed.push(index);
                }
            }
        }
    }
    // While it is down, a new message is acknowledged or refused typed.
    let sent = Instant::now();
    match tokio::time::timeout(typed_within, chats[0].send("while down")).await {
        Err(_) => bail!("{what}: a message sent while it is down hangs"),
        Ok(accepted) => {
            let accepted = accepted?;
            println!(
                "{what}: a message while it was down was {} after {:?}",
                if accepted { "accepted" } else { "refused typed" },
                sent.elapsed()
            );
            if accepted && !unsubscribed.contains(&0) {
                tokio::time::timeout(PATIENCE, turn_or_error(&mut chats[0].client))
                    .await
                    .context("the accepted turn hangs")??;
            }
        }
    }

    mock.set_behavior(MockBehavior::default());
    let restarting = Instant::now();
    repair().await?;
    let started = restarting.elapsed();
    let (_, recovered) = poll(RECOVERED_WITHIN, "served again", || async {
        matches!(probe(&http, &probe_url).await, Probe::Ok).then_some(())
    })
    .await?;
    println!(
        "{what}: restarted in {started:?}; served again {recovered:?} after; down {:?}",
        stopped.elapsed()
    );
    for (index, chat) in chats.iter_mut().enumerate() {
        let next = Instant::now();
        if unsubscribed.contains(&index) {
            chat.client.subscribe(&chat.chat.session_id, None).await?;
        }
        chat.talk(&format!("after {index}")).await?;
        println!("{what}: conversation {index} answered {:?} after", next.elapsed());
        chat.assert_kept().await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarted_under_load() -> anyhow::Result<()> {
    let bin = PrivatePostgres::binaries();
    if !available("postgres (initdb, pg_ctl; runuser as root)", bin.is_some())? {
        return Ok(());
    }
    let postgres = PrivatePostgres::start(bin.context("postgres binaries")?).await?;
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let options = Options {
        database_url: Some(postgres.url()),
        ..Options::with_llm(Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        })
    };
    let cluster = Cluster::start(Mode::PerComponent, options).await?;
    restart_under_load(
        "postgres",
        &cluster,
        &mock,
        "/v1/containers",
        POSTGRES_TYPED_ERROR_WITHIN,
        async || postgres.down().await,
        async || postgres.up().await,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_under_load() -> anyhow::Result<()> {
    if !available("redis-server", PrivateRedis::binary())? {
        return Ok(());
    }
    let redis = tokio::sync::Mutex::new(PrivateRedis::start().await?);
    let url = redis.lock().await.url();
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let options = Options {
        redis: Some((url, "avmfault:".into())),
        ..Options::with_llm(Llm::Anthropic {
            base_url: mock.anthropic_base_url(),
        })
    };
    let cluster = Cluster::start(Mode::PerComponent, options).await?;
    restart_under_load(
        "redis",
        &cluster,
        &mock,
        "/v1/agents",
        TYPED_ERROR_WITHIN,
        async || redis.lock().await.down().await,
        async || redis.lock().await.up().await,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_loaded_server() -> anyhow::Result<()> {
    let mock = MockLlm::start(MockBehavior::default()).await?;
    let data = tempfile::tempdir()?;
    let base_url = mock.anthropic_base_url();
    let grace = Duration::from_secs(8);
    let env = [
        ("LLM_PROVIDER", "anthropic"),
        ("LLM_BASE_URL", base_url.as_str()),
        ("LLM_API_KEY", avm_tests::cluster::TEST_API_KEY),
        ("AVM_GRPC_DRAIN_TIMEOUT", "8s"),
    ];
    let (mut child, _, gateway) = crate::support::serve(data.path(), &[], &env).await?;
    let key = std::fs::read_to_string(data.path().join(avm::ADMIN_KEY_FILE))?;
    let ws_url = format!("{}/ws?token={}", gateway.replacen("http://", "ws://", 1), key.trim());
    let http = reqwest::Client::new();
    let ready = format!("{gateway}/ready");
    let mut chats = Vec::new();
    for index in 0..4 {
        chats.push(Chat::open(&ws_url, &format!("drain-{index}")).await?);
    }
    // Turns of about two seconds, well within the grace period.
    mock.set_behavior(MockBehavior { tokens: 100, ..slow() });
    for (index, chat) in chats.iter_mut().enumerate() {
        chat.start_streaming(&format!("finish me {index}")).await?;
    }
    let pid = child.id().context("no pid")?;
    let status = tokio::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .await?;
    ensure!(status.success(), "kill -TERM failed");
    let signalled = Instant::now();
    let (_, flipped) = poll(TYPED_ERROR_WITHIN, "/ready says not ready", || async {
        let response = http.get(&ready).send().await.ok()?;
        (response.status() == 503).then_some(())
    })
    .await?;
    println!("drain: /ready answered 503 {flipped:?} after SIGTERM");
    // A new turn is refused, typed; the running ones finish.
    let mut other = WsClient::connect(&ws_url).await?;
    let refused = other
        .request(
            "message_send",
            json!({"imageId": chats[0].chat.image_id, "content": "too late"}),
        )
        .await?;
    assert!(refused["code"].is_string(), "refused with a code: {refused}");
    let mut finished = 0;
    for chat in &mut chats {
        let frames = chat.client.turn().await?;
        let end = frames.last().cloned().unwrap_or_default();
        assert_eq!(
            (&end["type"], &end["data"]["reason"]),
            (&json!("conversation_end"), &json!("completed")),
            "the turn in flight completes: {end}"
        );
        finished += 1;
    }
    println!(
        "drain: {finished} turns completed {:?} after SIGTERM",
        signalled.elapsed()
    );
    let exit = tokio::time::timeout(grace + Duration::from_secs(2), child.wait())
        .await
        .context("avm serve did not exit within the grace period")??;
    let took = signalled.elapsed();
    assert!(exit.success(), "avm serve exited with {exit}");
    println!("drain: exited 0 {took:?} after SIGTERM (grace {grace:?})");
    // Every reply is stored: the next start has them all.
    let images: Vec<String> = chats.drain(..).map(|chat| chat.chat.image_id).collect();
    let (child, _, gateway) = crate::support::serve(data.path(), &[], &env).await?;
    let ws_url = format!("{}/ws?token={}", gateway.replacen("http://", "ws://", 1), key.trim());
    let mut client = WsClient::connect(&ws_url).await?;
    for image_id in images {
        let history = client.request("image_messages", json!({"imageId": image_id})).await?;
        let roles: Vec<&str> = history["messages"]
            .as_array()
            .map(|m| m.iter().filter_map(|m| m["role"].as_str()).collect())
            .unwrap_or_default();
        assert_eq!(roles, ["user", "assistant"], "{history}");
    }
    crate::support::stop(child).await
}
