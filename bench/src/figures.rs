//! The figures, each measured for every target in the same batch as its
//! baseline.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use avm_tests::mock_llm::{MockBehavior, MockLlm};
use avm_tests::ws_client::WsClient;
use futures::StreamExt;

use crate::client::{self, Api, ms};
use crate::deploy::{Backing, Deployment, Mode};
use crate::{Args, Results, SETTLE, quantile, system};

/// The target name of the figures' baselines.
pub const BASELINE: &str = "baseline";

/// Deltas added per turn to find the cost of one relayed delta.
const EXTRA_DELTAS: usize = 100;
/// Turns of each conversation a CPU measurement runs (see [`spend`]).
const TURNS_PER_CONVERSATION: usize = 10;
/// A 50 tokens/s stream.
const STREAM_INTERVAL: Duration = Duration::from_millis(20);
/// Deltas per stream in the streams-per-core figure (a 1 s stream).
const STREAM_DELTAS: usize = 50;
/// How long after the last request an idle reading starts.
const IDLE_AFTER: Duration = Duration::from_secs(2);
/// Conversations stopped and woken per wake-from-zero measurement.
const WAKES: usize = 10;
/// The history figures' conversations say what a chat says: a user's
/// message of about this many bytes and a reply of about `REPLY_BYTES`, so
/// the window holds as many of them as it would of a real conversation's.
const MESSAGE_BYTES: usize = 400;
const REPLY_BYTES: usize = 1_200;
/// Conversations per tool-call measurement (each makes two calls).
const TOOL_CONVERSATIONS: usize = 5;

/// The goal of a figure (from the issue that set them), shown beside it.
pub fn goal(figure: &str) -> Option<&'static str> {
    // The first goal whose prefix matches applies: the specific ones first.
    let goals: [(&str, &str); 11] = [
        ("ttft_added_p50_ms{first_token=0ms,concurrent=200}", "<= 15 ms"),
        ("ttft_added_p50_ms", "<= 0.3 ms"),
        ("ttft_added_p99_ms", "<= 1 ms at 200"),
        ("control_plane_ratio", ">= 0.5 serve, 0.3 components"),
        ("cpu_per_turn_us", "<= 300 us serve, 600 components"),
        ("cpu_per_delta_us{process=all}", "<= 8 us serve, 15 replicated"),
        ("idle_ws_kib", "<= 3 KiB"),
        ("idle_http_kib", "<= 16 KiB"),
        ("idle_agent_kib", "<= 1 KiB"),
        ("idle_wakeups_per_s", "0"),
        ("db_writes_per_token", "0"),
    ];
    goals
        .iter()
        .find(|(prefix, _)| figure.starts_with(prefix))
        .map(|(_, goal)| *goal)
}

/// A group of figures, as `--figure` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Figure {
    /// Time to first token added over calling the mock directly.
    Ttft,
    /// CPU per turn and per delta (per process), database writes, Redis CPU.
    Cpu,
    /// `GET /v1/containers` against `GET /health` requests/s.
    ControlPlane,
    /// Memory per idle WebSocket.
    IdleSockets,
    /// Memory per idle HTTP/1.1 keep-alive connection, and after they close.
    IdleHttp,
    /// First token of a dropped agent against a hydrated one.
    Wake,
    /// Append and context load at 10 messages and `--history`.
    History,
    /// Memory per idle agent, idle CPU and wakeups.
    IdleAgents,
    /// 50 tokens/s streams held per core.
    Streams,
    /// A `run_command` call's time from its stored call to its result, the
    /// first of a conversation and a later one, with network and without.
    Tools,
}

/// The counts of one run, from the arguments.
pub struct Plan {
    figures: Vec<Figure>,
    repeat: usize,
    concurrency: Vec<usize>,
    first_token_ms: Vec<u64>,
    tokens: usize,
    cpu_turns: usize,
    cpu_concurrency: usize,
    idle_sockets: usize,
    idle_http: usize,
    idle_http_body: usize,
    idle_agents: usize,
    history: usize,
    context_window: u64,
    streams: Vec<usize>,
    rps_seconds: f64,
    tokens_per_month: u64,
}

impl From<&Args> for Plan {
    fn from(args: &Args) -> Self {
        Self {
            figures: args.figures.clone(),
            repeat: args.repeat,
            concurrency: args.concurrency.clone(),
            first_token_ms: args.first_token_ms.clone(),
            tokens: args.tokens,
            cpu_turns: args.cpu_turns,
            cpu_concurrency: args.cpu_concurrency,
            idle_sockets: args.idle_sockets,
            idle_http: args.idle_http,
            idle_http_body: args.idle_http_body,
            idle_agents: args.idle_agents,
            history: args.history.max(20),
            context_window: args.context_window,
            streams: args.streams.clone(),
            rps_seconds: args.rps_seconds,
            tokens_per_month: args.tokens_per_month,
        }
    }
}

impl Plan {
    fn wants(&self, figure: Figure) -> bool {
        self.figures.contains(&figure)
    }
}

/// A deployment with its conversations ready.
pub struct Bench {
    pub deployment: Deployment,
    api: Api,
    /// `label/mode`.
    name: String,
    /// Conversations with a hydrated agent.
    images: Vec<String>,
    /// A conversation of 10 messages and one of `history`.
    short: String,
    long: String,
}

fn behavior(tokens: usize, first_token_ms: u64) -> MockBehavior {
    MockBehavior {
        tokens,
        first_token_delay: Duration::from_millis(first_token_ms),
        input_tokens: Some(10),
        ..MockBehavior::default()
    }
}

impl Bench {
    /// Reads the idle figures of a fresh deployment, then makes and warms
    /// its conversations.
    pub async fn prepare(
        deployment: Deployment,
        mock: &MockLlm,
        plan: &Plan,
        results: &mut Results,
    ) -> anyhow::Result<Self> {
        let name = format!("{}/{}", deployment.label, deployment.mode.name());
        let mut api = Api::new(&deployment.url, &deployment.admin_key)?;
        if plan.tokens_per_month > 0 {
            let key = api.tenant_with_quota(plan.tokens_per_month).await?;
            api = Api::new(&deployment.url, &key)?;
        }
        api.container().await?;
        idle(&deployment, &name, 0, results).await?;
        mock.set_behavior(behavior(1, 0));
        let mut images = memory(&deployment, &api, &name, plan, results).await?;
        let most = plan
            .concurrency
            .iter()
            .copied()
            .chain([plan.cpu_concurrency, WAKES])
            .max()
            .unwrap_or(1);
        if images.len() < most {
            let more = api.images(most - images.len()).await?;
            api.turns(&more, 16).await?;
            images.extend(more);
        }
        let conversations = api.images(2).await?;
        let (short, long) = (conversations[0].clone(), conversations[1].clone());
        if plan.wants(Figure::History) {
            if plan.context_window > 0 && !api.set_context_window(plan.context_window).await? {
                eprintln!("{name}: no llm.contextWindows here: its long conversation is sent whole");
            }
            eprintln!("{name}: writing a conversation of {} messages", plan.history);
            grow(&api, mock, &short, 10).await?;
            grow(&api, mock, &long, plan.history).await?;
        }
        Ok(Self {
            deployment,
            api,
            name,
            images,
            short,
            long,
        })
    }

    /// Makes sure `count` conversations with hydrated agents exist.
    async fn hydrated(&mut self, count: usize) -> anyhow::Result<&[String]> {
        if self.images.len() < count {
            let more = self.api.images(count - self.images.len()).await?;
            self.api.turns(&more, 16).await?;
            self.images.extend(more);
        }
        Ok(&self.images[..count])
    }
}

/// Runs turns in `image` until it holds `messages` messages (two per turn)
/// of a chat's sizes.
async fn grow(api: &Api, mock: &MockLlm, image: &str, messages: usize) -> anyhow::Result<()> {
    mock.set_behavior(MockBehavior {
        reply: Some(prose(REPLY_BYTES, 100)),
        ..behavior(1, 0)
    });
    let message = prose(MESSAGE_BYTES, 6);
    for _ in 0..messages.div_ceil(2) {
        api.turn_saying(image, &message).await?;
    }
    mock.set_behavior(behavior(1, 0));
    Ok(())
}

/// Text of about `bytes` bytes in words of `word` bytes, each with its
/// trailing space (the mock streams a word per delta).
fn prose(bytes: usize, word: usize) -> String {
    let word = format!("{} ", "x".repeat(word.saturating_sub(1).max(1)));
    word.repeat(bytes.div_ceil(word.len()))
}

/// One round of every figure, every target in turn.
pub async fn round(
    benches: &mut [Bench],
    mock: &MockLlm,
    plan: &Plan,
    backing: &Backing,
    results: &mut Results,
) -> anyhow::Result<()> {
    let direct_client = client::client()?;
    let mock_url = mock.anthropic_base_url();
    let first_tokens: &[u64] = if plan.wants(Figure::Ttft) {
        &plan.first_token_ms
    } else {
        &[]
    };
    for &first_token in first_tokens {
        mock.set_behavior(behavior(plan.tokens, first_token));
        for &level in &plan.concurrency {
            let labels = format!("{{first_token={first_token}ms,concurrent={level}}}");
            for bench in benches.iter_mut() {
                let direct = firsts(
                    futures::future::join_all((0..level).map(|_| client::direct(&direct_client, &mock_url))).await,
                )?;
                let images = bench.hydrated(level).await?.to_vec();
                let through =
                    firsts(futures::future::join_all(images.iter().map(|image| bench.api.turn(image))).await)?;
                for (name, q) in [("p50", 0.5), ("p99", 0.99)] {
                    results.add(
                        format!("ttft_added_{name}_ms{labels}"),
                        &bench.name,
                        quantile(&through, q) - quantile(&direct, q),
                    );
                }
                results.add(format!("ttft_direct_p50_ms{labels}"), BASELINE, quantile(&direct, 0.5));
            }
        }
    }
    // Figure by figure, each target in turn.
    for &figure in &plan.figures {
        for bench in benches.iter_mut() {
            mock.set_behavior(behavior(1, 0));
            match figure {
                Figure::Ttft => {}
                Figure::Cpu => {
                    cpu(bench, mock, plan, backing, results).await?;
                    bare_consumer(&direct_client, mock, plan, results).await?;
                }
                Figure::ControlPlane => control_plane(bench, plan, results).await?,
                // Measured on the fresh deployment (`memory`).
                Figure::IdleSockets | Figure::IdleHttp => {}
                Figure::Wake => wake_from_zero(bench, results).await?,
                Figure::History => history(bench, mock, plan, results).await?,
                Figure::IdleAgents => idle(&bench.deployment, &bench.name, bench.images.len() + 2, results).await?,
                Figure::Streams => streams_per_core(bench, mock, plan, results).await?,
                Figure::Tools => tool_calls(bench, results).await?,
            }
        }
    }
    Ok(())
}

fn firsts(turns: Vec<anyhow::Result<client::Streamed>>) -> anyhow::Result<Vec<f64>> {
    turns.into_iter().map(|turn| turn.map(|turn| ms(turn.first))).collect()
}

/// What `turns` turns of `tokens` deltas cost: CPU seconds per process role,
/// Redis's CPU seconds and the database's write transactions.
struct Spent {
    cpu: Vec<(String, f64)>,
    redis: Option<f64>,
    writes: Option<f64>,
}

async fn spend(bench: &Bench, mock: &MockLlm, plan: &Plan, backing: &Backing, tokens: usize) -> anyhow::Result<Spent> {
    mock.set_behavior(behavior(tokens, 0));
    let deployment = &bench.deployment;
    let roles = deployment.roles();
    let redis_pid = match (&backing.redis_url, deployment.mode) {
        (Some(url), Mode::Replicated) => Some(redis_pid(url).await?),
        _ => None,
    };
    let cpu_of = |roles: &[String]| -> anyhow::Result<Vec<f64>> {
        roles
            .iter()
            .map(|role| system::cpu_seconds_of(&deployment.pids(Some(role))))
            .collect()
    };
    // Every measurement runs in conversations of its own, each of at most
    // `TURNS_PER_CONVERSATION` turns, their agents started beforehand: a
    // turn sends its whole history to the model, so turns in ever longer
    // conversations (the same few, round after round) measured the bench's
    // history rather than a turn (`history_*` measure that). Each lane
    // takes its conversations in turn.
    let lanes = plan.cpu_concurrency.max(1);
    let per_lane = plan.cpu_turns.div_ceil(lanes);
    let images = bench
        .api
        .images(lanes * per_lane.div_ceil(TURNS_PER_CONVERSATION))
        .await?;
    bench.api.turns(&images, lanes).await?;
    let redis_before = redis_pid.map(system::cpu_seconds).transpose()?;
    let writes_before = transactions(deployment).await?;
    let before = cpu_of(&roles)?;
    let runs = images.chunks(images.len() / lanes).map(|mine| async move {
        for turn in 0..per_lane {
            bench.api.turn(&mine[turn % mine.len()]).await?;
        }
        Ok::<_, anyhow::Error>(())
    });
    for run in futures::future::join_all(runs).await {
        run?;
    }
    let after = cpu_of(&roles)?;
    let writes_after = transactions(deployment).await?;
    let redis_after = redis_pid.map(system::cpu_seconds).transpose()?;
    let turns = (per_lane * lanes) as f64;
    Ok(Spent {
        cpu: roles
            .into_iter()
            .zip(before.iter().zip(&after))
            .map(|(role, (before, after))| (role, (after - before) / turns))
            .collect(),
        redis: redis_before
            .zip(redis_after)
            .map(|(before, after)| (after - before) / turns),
        // The second txid_current takes an id of its own.
        writes: writes_before
            .zip(writes_after)
            .map(|(before, after)| (after - before - 1) as f64 / turns),
    })
}

/// CPU per turn and per relayed delta (all processes and each role), the
/// database's writes and Redis's CPU, from turns of `tokens` and of
/// `tokens + 100` deltas.
async fn cpu(
    bench: &Bench,
    mock: &MockLlm,
    plan: &Plan,
    backing: &Backing,
    results: &mut Results,
) -> anyhow::Result<()> {
    let few = spend(bench, mock, plan, backing, plan.tokens).await?;
    let many = spend(bench, mock, plan, backing, plan.tokens + EXTRA_DELTAS).await?;
    let total = |spent: &Spent| spent.cpu.iter().map(|(_, cpu)| cpu).sum::<f64>();
    results.add(
        format!("cpu_per_turn_us{{tokens={}}}", plan.tokens),
        &bench.name,
        total(&few) * 1e6,
    );
    results.add(
        "cpu_per_delta_us{process=all}",
        &bench.name,
        (total(&many) - total(&few)) * 1e6 / EXTRA_DELTAS as f64,
    );
    if bench.deployment.mode != Mode::Serve {
        for ((role, few), (_, many)) in few.cpu.iter().zip(&many.cpu) {
            results.add(
                format!("cpu_per_delta_us{{process={role}}}"),
                &bench.name,
                (many - few) * 1e6 / EXTRA_DELTAS as f64,
            );
        }
    }
    if let (Some(few), Some(many)) = (few.redis, many.redis) {
        results.add(
            "cpu_per_delta_us{process=redis}",
            &bench.name,
            (many - few) * 1e6 / EXTRA_DELTAS as f64,
        );
    }
    if let (Some(few_writes), Some(many_writes)) = (few.writes, many.writes) {
        results.add("db_writes_per_turn", &bench.name, few_writes);
        results.add(
            "db_writes_per_token",
            &bench.name,
            (many_writes - few_writes) / EXTRA_DELTAS as f64,
        );
    }
    Ok(())
}

/// The baseline of CPU per delta: this process streaming from the mock
/// directly (the mock and its consumer), the same turns as `cpu`.
async fn bare_consumer(
    client: &reqwest::Client,
    mock: &MockLlm,
    plan: &Plan,
    results: &mut Results,
) -> anyhow::Result<()> {
    let url = mock.anthropic_base_url();
    let mut spent = Vec::new();
    for tokens in [plan.tokens, plan.tokens + EXTRA_DELTAS] {
        mock.set_behavior(behavior(tokens, 0));
        let before = system::own_cpu_seconds();
        let lanes = plan.cpu_concurrency.max(1);
        let per_lane = plan.cpu_turns.div_ceil(lanes);
        let runs = (0..lanes).map(|_| async {
            for _ in 0..per_lane {
                client::direct(client, &url).await?;
            }
            Ok::<_, anyhow::Error>(())
        });
        for run in futures::future::join_all(runs).await {
            run?;
        }
        spent.push((system::own_cpu_seconds() - before) / (per_lane * lanes) as f64);
    }
    results.add(
        "cpu_per_delta_us{process=all}",
        BASELINE,
        (spent[1] - spent[0]) * 1e6 / EXTRA_DELTAS as f64,
    );
    Ok(())
}

/// Write transactions so far in the deployment's Postgres (none on SQLite).
async fn transactions(deployment: &Deployment) -> anyhow::Result<Option<i64>> {
    let Some((url, _)) = &deployment.database else {
        return Ok(None);
    };
    let mut connection = <sqlx::PgConnection as sqlx::Connection>::connect(url).await?;
    let (id,): (i64,) = sqlx::query_as("SELECT txid_current()")
        .fetch_one(&mut connection)
        .await?;
    Ok(Some(id))
}

/// The pid of the Redis server (on this machine).
async fn redis_pid(url: &str) -> anyhow::Result<u32> {
    let client = redis::Client::open(url)?;
    let mut connection = client.get_multiplexed_async_connection().await?;
    let info: String = redis::cmd("INFO").arg("server").query_async(&mut connection).await?;
    info.lines()
        .find_map(|line| line.strip_prefix("process_id:"))
        .context("Redis did not say its process id")?
        .trim()
        .parse()
        .context("malformed Redis process id")
}

/// Requests/s of `GET /v1/containers` against `GET /health` on the same gateway.
async fn control_plane(bench: &Bench, plan: &Plan, results: &mut Results) -> anyhow::Result<()> {
    let seconds = Duration::from_secs_f64(plan.rps_seconds);
    let listed = rate(&bench.api, "/v1/containers", seconds).await?;
    let health = rate(&bench.api, "/health", seconds).await?;
    results.add("control_plane_rps{route=/v1/containers}", &bench.name, listed);
    results.add("control_plane_rps{route=/health}", BASELINE, health);
    results.add("control_plane_ratio", &bench.name, listed / health);
    Ok(())
}

/// Requests/s of `GET path` with 32 requests in flight for `duration`.
async fn rate(api: &Api, path: &str, duration: Duration) -> anyhow::Result<f64> {
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let workers = (0..32).map(|_| {
        let done = Arc::clone(&done);
        async move {
            while started.elapsed() < duration {
                api.get(path).send().await?.error_for_status()?.bytes().await?;
                done.fetch_add(1, Ordering::Relaxed);
            }
            Ok::<_, anyhow::Error>(())
        }
    });
    for worker in futures::future::join_all(workers).await {
        worker?;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

/// Resident memory per idle agent (in the processes that hold agents) and
/// per idle, authenticated WebSocket (at the edge), on a fresh deployment:
/// memory freed earlier, which the allocator hands out again, would hide
/// what new ones cost. Each of the `--repeat` batches comes on top of the
/// last, nothing freed in between; agents first, as sockets are closed
/// after, and keep-alive connections last, all closed at the end to see what
/// of their memory is given back.
/// Returns the agents' conversations.
async fn memory(
    deployment: &Deployment,
    api: &Api,
    name: &str,
    plan: &Plan,
    results: &mut Results,
) -> anyhow::Result<Vec<String>> {
    let resident = |pids: &[u32]| -> anyhow::Result<f64> { pids.iter().map(|&pid| system::rss_kib(pid)).sum() };
    let mut images = Vec::new();
    if plan.wants(Figure::IdleAgents) {
        let pids = deployment.agent_pids();
        for _ in 0..plan.repeat {
            tokio::time::sleep(SETTLE).await;
            let before = resident(&pids)?;
            let more = api.images(plan.idle_agents).await?;
            api.turns(&more, 16).await?;
            images.extend(more);
            tokio::time::sleep(SETTLE).await;
            results.add(
                format!("idle_agent_kib{{agents={}}}", plan.idle_agents),
                name,
                (resident(&pids)? - before) / plan.idle_agents as f64,
            );
        }
    }
    if plan.wants(Figure::IdleSockets) {
        let pid = [deployment.edge_pid()];
        let url = api.ws_url();
        let mut held = Vec::new();
        for _ in 0..plan.repeat {
            tokio::time::sleep(SETTLE).await;
            let before = resident(&pid)?;
            let sockets = futures::stream::iter(0..plan.idle_sockets)
                .map(|_| WsClient::connect(&url))
                .buffer_unordered(32)
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .collect::<anyhow::Result<Vec<_>>>()?;
            held.extend(sockets);
            tokio::time::sleep(SETTLE).await;
            results.add(
                format!("idle_ws_kib{{sockets={}}}", plan.idle_sockets),
                name,
                (resident(&pid)? - before) / plan.idle_sockets as f64,
            );
        }
    }
    if plan.wants(Figure::IdleHttp) {
        let pid = [deployment.edge_pid()];
        let labels = format!("{{connections={},body={}}}", plan.idle_http, plan.idle_http_body);
        let first = resident(&pid)?;
        let mut held = Vec::new();
        for _ in 0..plan.repeat {
            tokio::time::sleep(SETTLE).await;
            let before = resident(&pid)?;
            let connections = futures::stream::iter(0..plan.idle_http)
                .map(|_| api.keep_alive(plan.idle_http_body))
                .buffer_unordered(32)
                .collect::<Vec<_>>()
                .await
                .into_iter()
                .collect::<anyhow::Result<Vec<_>>>()?;
            held.extend(connections);
            tokio::time::sleep(SETTLE).await;
            results.add(
                format!("idle_http_kib{labels}"),
                name,
                (resident(&pid)? - before) / plan.idle_http as f64,
            );
        }
        drop(held);
        // The allocator returns freed pages on a schedule (about a second).
        tokio::time::sleep(IDLE_AFTER).await;
        results.add(format!("idle_http_closed_kib{labels}"), name, resident(&pid)? - first);
    }
    Ok(images)
}

/// CPU and wakeups per second of every process while nothing is asked of them.
async fn idle(deployment: &Deployment, name: &str, agents: usize, results: &mut Results) -> anyhow::Result<()> {
    let pids = deployment.pids(None);
    let window = Duration::from_secs(2);
    // Past the batching delays (usage 0.2 s, tenant logs 1 s) of what came before.
    tokio::time::sleep(IDLE_AFTER).await;
    let cpu = system::cpu_seconds_of(&pids)?;
    let switches: u64 = pids
        .iter()
        .map(|&pid| system::context_switches(pid))
        .sum::<anyhow::Result<u64>>()?;
    tokio::time::sleep(window).await;
    let cpu = system::cpu_seconds_of(&pids)? - cpu;
    let switches = pids
        .iter()
        .map(|&pid| system::context_switches(pid))
        .sum::<anyhow::Result<u64>>()?
        - switches;
    let seconds = window.as_secs_f64();
    results.add(
        format!("idle_cpu_ms_per_s{{agents={agents}}}"),
        name,
        cpu * 1000.0 / seconds,
    );
    results.add(
        format!("idle_wakeups_per_s{{agents={agents}}}"),
        name,
        switches as f64 / seconds,
    );
    Ok(())
}

/// Time to first token of a conversation whose agent was dropped, against
/// the same conversation's next turn with its agent hydrated.
async fn wake_from_zero(bench: &mut Bench, results: &mut Results) -> anyhow::Result<()> {
    let images = bench.hydrated(WAKES).await?.to_vec();
    let (mut woken, mut hydrated) = (Vec::new(), Vec::new());
    for image in &images {
        bench.api.stop(image).await?;
        woken.push(ms(bench.api.turn(image).await?.first));
        hydrated.push(ms(bench.api.turn(image).await?.first));
    }
    results.add(
        "wake_from_zero_ttft_ms{first_token=0ms}",
        &bench.name,
        quantile(&woken, 0.5),
    );
    results.add(
        "hydrated_ttft_ms{first_token=0ms}",
        &bench.name,
        quantile(&hydrated, 0.5),
    );
    Ok(())
}

/// Appending a message (time to first token, agent hydrated) and loading
/// the context (agent dropped first) in a short and a long conversation,
/// with the messages and bytes the model was sent.
async fn history(bench: &Bench, mock: &MockLlm, plan: &Plan, results: &mut Results) -> anyhow::Result<()> {
    mock.set_behavior(behavior(1, 0));
    for (image, messages) in [(&bench.short, 10), (&bench.long, plan.history)] {
        let append = bench.api.turn(image).await?.first;
        bench.api.stop(image).await?;
        let load = bench.api.turn(image).await?.first;
        let sent = mock.stats();
        results.add(
            format!("history_sent_messages{{messages={messages}}}"),
            &bench.name,
            sent.last_messages as f64,
        );
        results.add(
            format!("history_sent_kb{{messages={messages}}}"),
            &bench.name,
            sent.last_body_bytes as f64 / 1024.0,
        );
        results.add(
            format!("history_append_ms{{messages={messages}}}"),
            &bench.name,
            ms(append),
        );
        results.add(format!("history_load_ms{{messages={messages}}}"), &bench.name, ms(load));
    }
    Ok(())
}

/// The most 50 tokens/s streams seen streaming at once in a level (of those
/// tried) whose p99 gap between deltas stays within 10x the interval, per
/// CPU core of the machine.
async fn streams_per_core(bench: &mut Bench, mock: &MockLlm, plan: &Plan, results: &mut Results) -> anyhow::Result<()> {
    mock.set_behavior(MockBehavior {
        token_interval: STREAM_INTERVAL,
        ..behavior(STREAM_DELTAS, 0)
    });
    // What counts is how many streamed at once: turns asked for together
    // start over a while (a turn's start costs CPU), and a stream lasts a
    // second, so at high levels the first may end before the last starts.
    let mut held = 0;
    let mut last_level = 0;
    let mut started_all = true;
    for &level in &plan.streams {
        let images = bench.hydrated(level).await?.to_vec();
        let turns = futures::future::join_all(images.iter().map(|image| bench.api.turn(image))).await;
        let mut gaps = Vec::new();
        let mut spans = Vec::new();
        for turn in turns {
            let turn = turn?;
            spans.push((turn.sent + turn.first, turn.sent + turn.last));
            gaps.extend(turn.gaps.into_iter().map(ms));
        }
        let p99 = quantile(&gaps, 0.99);
        let at_once = most_at_once(&spans);
        eprintln!(
            "{}: {level} streams at 50 tokens/s asked, at most {at_once} streaming at once: p99 gap {p99:.1} ms",
            bench.name
        );
        if p99 > ms(STREAM_INTERVAL) * 10.0 {
            break;
        }
        held = held.max(at_once);
        last_level = level;
        started_all = at_once == level;
    }
    if plan.streams.last() == Some(&last_level) {
        let why = if started_all {
            "the edge lies beyond (--streams)"
        } else {
            "the last level never had all its streams at once: turns start no faster"
        };
        eprintln!(
            "{}: every level held its gaps, at most {held} streams at once: {why}",
            bench.name
        );
    }
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    results.add("streams_per_core{50 tokens/s}", &bench.name, held as f64 / cores as f64);
    Ok(())
}

/// Returns the most of `spans` (first to last delta of each stream) that
/// overlap at one instant.
fn most_at_once(spans: &[(std::time::Instant, std::time::Instant)]) -> usize {
    let mut edges: Vec<(std::time::Instant, bool)> = spans
        .iter()
        .flat_map(|&(start, end)| [(start, true), (end, false)])
        .collect();
    // At one instant an end is counted before a start: touching spans do not overlap.
    edges.sort_by_key(|&(at, starts)| (at, starts));
    let (mut now, mut most) = (0_usize, 0_usize);
    for (_, starts) in edges {
        if starts {
            now += 1;
            most = most.max(now);
        } else {
            now = now.saturating_sub(1);
        }
    }
    most
}

/// What a `run_command` call of `true` costs in a fresh conversation (its
/// workspace made, the command's fence and, with network, its proxy and
/// relay) and in one that already ran one: from the stored call
/// (`tool_call_message`) to its `tool_result`, medians over
/// [`TOOL_CONVERSATIONS`] conversations.
async fn tool_calls(bench: &mut Bench, results: &mut Results) -> anyhow::Result<()> {
    for network in [true, false] {
        let images = bench.api.tool_images(TOOL_CONVERSATIONS, network).await?;
        let (mut first, mut later) = (Vec::new(), Vec::new());
        for image in &images {
            first.push(ms(bench.api.tool_turn(image).await?));
            later.push(ms(bench.api.tool_turn(image).await?));
        }
        let labels = format!("{{command=true,network={network}}}");
        results.add(
            format!("tool_first_call_ms{labels}"),
            &bench.name,
            quantile(&first, 0.5),
        );
        results.add(
            format!("tool_later_call_ms{labels}"),
            &bench.name,
            quantile(&later, 0.5),
        );
        // What a sandbox holding an image costs while its agent is idle.
        let held = sandboxes_rss_kib(bench.deployment.data_dir());
        if network && !held.is_empty() {
            let mean = held.iter().sum::<u64>() as f64 / held.len() as f64;
            results.add("sandbox_idle_rss_mb", &bench.name, mean / 1024.0);
        }
        // The agents go, and their sandboxes with them (a pool's are released).
        for image in &images {
            bench.api.stop(image).await?;
        }
    }
    Ok(())
}

/// Returns the resident memory of every `avm sandbox` process whose
/// workspaces are under `data` (a deployment's own), in KiB.
fn sandboxes_rss_kib(data: &std::path::Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let data = data.display().to_string();
    entries
        .flatten()
        .filter_map(|entry| {
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let args: Vec<String> = cmdline
                .split(|byte| *byte == 0)
                .map(|arg| String::from_utf8_lossy(arg).into_owned())
                .collect();
            let ours = args.get(1).is_some_and(|arg| arg == "sandbox")
                && args
                    .windows(2)
                    .any(|pair| pair[0] == "--root" && pair[1].starts_with(&data));
            if !ours {
                return None;
            }
            let status = std::fs::read_to_string(entry.path().join("status")).ok()?;
            let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    #[test]
    fn streams_at_once_are_those_whose_spans_overlap() {
        let t = Instant::now();
        let at = |ms: u64| t + Duration::from_millis(ms);
        // Two overlap, the third starts as the second ends, the fourth later.
        let spans = [(at(0), at(10)), (at(5), at(20)), (at(20), at(30)), (at(40), at(50))];
        assert_eq!(super::most_at_once(&spans), 2);
        assert_eq!(super::most_at_once(&[]), 0);
        let together = vec![(at(0), at(100)); 7];
        assert_eq!(super::most_at_once(&together), 7);
    }
}
