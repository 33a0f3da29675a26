//! `avm-bench`: what AgentVM costs, measured side by side with its baselines
//! in one run.
//!
//! Every `avm` binary named with `--avm label=path` runs in each `--mode`
//! (`avm serve`, one process per component, and with two runtime replicas
//! sharing Redis) against one mock LLM (the project's, speaking the
//! Anthropic streaming API). Targets are measured batch by batch in turn, so
//! the machine's mood treats them alike, and each figure's baseline is
//! measured in the same batches: the mock called directly (time to first
//! token, CPU per delta), a hello-world route on the same gateway
//! (control-plane requests/s), an idle process (wakeups).
//!
//! Every figure is repeated `--repeat` times and reported as min / median /
//! max, printed as a table and, with `--json`, written as a JSON document.
//! The figures are listed in `--help` and the README's Performance section.

mod client;
mod deploy;
mod figures;
mod system;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, ensure};
use avm_tests::mock_llm::{MockBehavior, MockLlm};
use clap::Parser;
use serde_json::{Value, json};

use crate::deploy::{Backing, Deployment, Mode};

/// Benchmarks AgentVM against a mock LLM: time to first token, CPU per
/// relayed delta (per process), control-plane requests/s, memory per idle
/// WebSocket and per idle agent, idle wakeups, wake-from-zero, history
/// scaling, database writes per token, streams held per core and the time
/// of a tool call.
#[derive(Debug, Parser)]
#[command(name = "avm-bench")]
struct Args {
    /// An `avm` binary to measure, as `label=path` (repeatable; default: the
    /// `avm` next to this binary, labelled `current`).
    #[arg(long = "avm", value_name = "LABEL=PATH")]
    targets: Vec<String>,
    /// How the product runs: `serve`, `components`, `replicated` (the last
    /// needs --redis-url).
    #[arg(long = "mode", value_delimiter = ',', default_value = "serve,components")]
    modes: Vec<Mode>,
    /// Postgres for the per-component modes (fresh schemas, dropped after);
    /// gives the database writes per token. Without it they use SQLite files.
    #[arg(long, env = "AVM_BENCH_DATABASE_URL")]
    database_url: Option<String>,
    /// Redis for the replicated mode (a fresh key prefix).
    #[arg(long, env = "AVM_BENCH_REDIS_URL")]
    redis_url: Option<String>,
    /// An environment variable for every `avm` process, as `KEY=VALUE`
    /// (repeatable), e.g. to compare settings.
    #[arg(long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// How many times each figure is measured.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Concurrent new turns at which time to first token is measured.
    #[arg(long, value_delimiter = ',', default_value = "1,10,50,100,200")]
    concurrency: Vec<usize>,
    /// The mock's delays before the first token, in ms (each measured).
    #[arg(long, value_delimiter = ',', default_value = "20,0")]
    first_token_ms: Vec<u64>,
    /// Text deltas per reply (time to first token, CPU per turn).
    #[arg(long, default_value_t = 20)]
    tokens: usize,
    /// Turns per CPU measurement.
    #[arg(long, default_value_t = 400)]
    cpu_turns: usize,
    /// Turns in flight at once during the CPU measurement.
    #[arg(long, default_value_t = 8)]
    cpu_concurrency: usize,
    /// Idle WebSockets opened to measure memory per socket.
    #[arg(long, default_value_t = 1000)]
    idle_sockets: usize,
    /// Idle HTTP/1.1 keep-alive connections opened to measure memory per connection.
    #[arg(long, default_value_t = 1000)]
    idle_http: usize,
    /// The body (bytes) each idle keep-alive connection sends before it idles:
    /// 0 is `GET /health`, more a `POST /v1/containers` read whole and refused.
    #[arg(long, default_value_t = 0)]
    idle_http_body: usize,
    /// Idle agents hydrated to measure memory per agent and idle wakeups.
    #[arg(long, default_value_t = 500)]
    idle_agents: usize,
    /// Messages of the long conversation of the history figures.
    #[arg(long, default_value_t = 10_000)]
    history: usize,
    /// The context window, in tokens, the history figures' model is given
    /// (`llm.contextWindows`), so the long conversation is compacted to it;
    /// 0 leaves the built-in window (200,000 tokens for the mock's model).
    #[arg(long, default_value_t = 16_000)]
    context_window: u64,
    /// Concurrent 50 tokens/s streams tried, in order, until inter-token
    /// gaps exceed 10x (the run says so when every level held).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "25,50,100,200,400,800,1200,1600,2400,3200"
    )]
    streams: Vec<usize>,
    /// Which figures to measure (default: all).
    #[arg(
        long = "figure",
        value_delimiter = ',',
        default_value = "ttft,cpu,control-plane,idle-sockets,idle-http,wake,history,idle-agents,streams,tools"
    )]
    figures: Vec<figures::Figure>,
    /// Seconds of each control-plane requests/s measurement.
    #[arg(long, default_value_t = 2.0)]
    rps_seconds: f64,
    /// Runs the turns as a tenant with this monthly token quota (0: as the
    /// operator, unlimited), so each LLM call reserves its tokens against it.
    #[arg(long, default_value_t = 0)]
    tokens_per_month: u64,
    /// Writes the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Where a target's tenants' commands run, as `label=local|process|pool`
    /// (repeatable; default `local`): the sandbox tier's `[runtime.sandbox]
    /// provider`, a pool being `avm sandbox` processes the bench starts.
    #[arg(long = "sandbox", value_name = "LABEL=PROVIDER")]
    sandboxes: Vec<String>,
    /// A short run: one repetition, small counts (a smoke test, not figures).
    #[arg(long)]
    quick: bool,
}

/// Every measured value: figure → target (`label/mode`, or `baseline`) → runs.
#[derive(Default)]
pub struct Results(BTreeMap<String, BTreeMap<String, Vec<f64>>>);

impl Results {
    pub fn add(&mut self, figure: impl Into<String>, target: &str, value: f64) {
        self.0
            .entry(figure.into())
            .or_default()
            .entry(target.to_owned())
            .or_default()
            .push(value);
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if args.quick {
        args.repeat = 1;
        args.concurrency = vec![1, 10];
        args.cpu_turns = 40;
        args.first_token_ms.truncate(1);
        args.idle_sockets = 50;
        args.idle_http = 50;
        args.idle_agents = 20;
        args.history = 100;
        args.streams = vec![10];
        args.rps_seconds = 0.3;
    }
    ensure!(args.repeat > 0, "--repeat must be at least 1");
    raise_open_files_limit();
    let targets = parse_targets(&args.targets)?;
    let backing = Backing {
        database_url: args.database_url.clone(),
        redis_url: args.redis_url.clone(),
        env: args
            .env
            .iter()
            .map(|pair| {
                pair.split_once('=')
                    .map(|(key, value)| (key.to_owned(), value.to_owned()))
                    .with_context(|| format!("--env takes KEY=VALUE, not {pair:?}"))
            })
            .collect::<anyhow::Result<_>>()?,
        sandbox: None,
    };
    let mock = MockLlm::start(MockBehavior::default()).await?;
    mock.set_recording(false);
    let mock_url = mock.anthropic_base_url();
    let plan = figures::Plan::from(&args);
    let mut results = Results::default();
    for &mode in &args.modes {
        if mode == Mode::Replicated && backing.redis_url.is_none() {
            eprintln!("skipping the replicated mode: it needs --redis-url (or AVM_BENCH_REDIS_URL)");
            continue;
        }
        let mut benches = Vec::new();
        for (label, binary) in &targets {
            let backing = Backing {
                sandbox: sandbox_of(&args.sandboxes, label)?,
                ..backing.clone()
            };
            let deployment = Deployment::start(label, binary, mode, &mock_url, &backing).await?;
            benches.push(figures::Bench::prepare(deployment, &mock, &plan, &mut results).await?);
        }
        for round in 0..args.repeat {
            eprintln!("{}: round {} of {}", mode.name(), round + 1, args.repeat);
            figures::round(&mut benches, &mock, &plan, &backing, &mut results).await?;
        }
        for bench in benches {
            bench.deployment.stop().await?;
        }
    }
    mock.shutdown().await;
    print_table(&results);
    if let Some(path) = &args.json {
        let document = json!({
            "machine": system::machine(),
            "repeat": args.repeat,
            "quick": args.quick,
            "results": summarize(&results),
        });
        std::fs::write(path, serde_json::to_string_pretty(&document)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// Idle WebSockets and hundreds of streams need more descriptors than the
/// usual soft limit of 1024; the children inherit the raised limit.
fn raise_open_files_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
        && let Err(err) = setrlimit(Resource::RLIMIT_NOFILE, hard.min(1 << 20), hard)
    {
        eprintln!("cannot raise the open files limit from {soft}: {err}");
    }
}

/// Reads `label=path` pairs; none means the `avm` beside this binary.
fn parse_targets(specs: &[String]) -> anyhow::Result<Vec<(String, PathBuf)>> {
    if specs.is_empty() {
        let exe = std::env::current_exe()?;
        let beside = exe.with_file_name("avm");
        ensure!(
            beside.exists(),
            "no avm binary at {}; build it (cargo build --release -p avm) or pass --avm label=path",
            beside.display()
        );
        return Ok(vec![("current".to_owned(), beside)]);
    }
    specs
        .iter()
        .map(|spec| {
            let (label, path) = spec
                .split_once('=')
                .with_context(|| format!("--avm takes label=path, not {spec:?}"))?;
            ensure!(
                !label.is_empty() && !label.contains('/'),
                "a label is a word without '/', not {label:?}"
            );
            let path = PathBuf::from(path);
            ensure!(path.exists(), "no avm binary at {}", path.display());
            Ok((label.to_owned(), path))
        })
        .collect()
}

/// Returns the sandbox provider `--sandbox` names for `label` (`None`: local).
fn sandbox_of(specs: &[String], label: &str) -> anyhow::Result<Option<String>> {
    for spec in specs {
        let (named, provider) = spec
            .split_once('=')
            .with_context(|| format!("--sandbox takes label=provider, not {spec:?}"))?;
        ensure!(
            matches!(provider, "local" | "process" | "pool"),
            "--sandbox: the providers are local, process and pool, not {provider:?}"
        );
        if named == label && provider != "local" {
            return Ok(Some(provider.to_owned()));
        }
    }
    Ok(None)
}

/// Returns the `q` quantile (nearest rank) of `values`.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn summarize(results: &Results) -> Value {
    let mut out = serde_json::Map::new();
    for (figure, targets) in &results.0 {
        let mut by_target = serde_json::Map::new();
        for (target, values) in targets {
            by_target.insert(
                target.clone(),
                json!({"min": quantile(values, 0.0), "median": quantile(values, 0.5), "max": quantile(values, 1.0), "runs": values}),
            );
        }
        let mut entry = json!({"targets": by_target});
        if let Some(goal) = figures::goal(figure) {
            entry["goal"] = json!(goal);
        }
        out.insert(figure.clone(), entry);
    }
    Value::Object(out)
}

fn print_table(results: &Results) {
    let width = results.0.keys().map(String::len).max().unwrap_or(6).max(6);
    let target_width = results
        .0
        .values()
        .flat_map(BTreeMap::keys)
        .map(String::len)
        .max()
        .unwrap_or(6)
        .max(6);
    println!(
        "{:<width$}  {:<target_width$} {:>10} {:>10} {:>10}  goal",
        "figure", "target", "min", "median", "max"
    );
    let mut last_group = BTreeSet::new();
    for (figure, targets) in &results.0 {
        let group = figure.split('{').next().unwrap_or(figure).to_owned();
        if !last_group.contains(&group) {
            last_group.clear();
            last_group.insert(group);
            println!();
        }
        for (target, values) in targets {
            println!(
                "{figure:<width$}  {target:<target_width$} {:>10.3} {:>10.3} {:>10.3}  {}",
                quantile(values, 0.0),
                quantile(values, 0.5),
                quantile(values, 1.0),
                if target == figures::BASELINE {
                    ""
                } else {
                    figures::goal(figure).unwrap_or("")
                }
            );
        }
    }
}

/// How long the processes are left alone before an idle reading.
pub const SETTLE: Duration = Duration::from_millis(500);
