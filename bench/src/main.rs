//! `avm-bench`: what a turn costs through `avm serve`, measured side by side
//! with its baseline in one run.
//!
//! Every `avm` binary named with `--avm label=path` runs as its own `avm
//! serve --dev` against one mock LLM (the project's, speaking the Anthropic
//! streaming API); their measurements are interleaved batch by batch, so
//! the machine's mood treats them alike. The baseline of time to first
//! token is the same mock called directly, in the same batches.
//!
//! Figures:
//! - `ttft_added_p50_ms` / `ttft_added_p99_ms`: time to the first text delta
//!   through the gateway (REST + SSE) minus the same percentile calling the
//!   mock directly, at each concurrency of new turns;
//! - `cpu_per_turn_us`: CPU time (user + system) the `avm serve` process
//!   spends per complete turn of `--tokens` deltas.
//!
//! Each figure is repeated `--repeat` times and reported as min / median / max,
//! as a table and, with `--json`, as a JSON document.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use avm_tests::mock_llm::{MockBehavior, MockLlm};
use clap::Parser;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Benchmarks turns through `avm serve` against a mock LLM.
#[derive(Debug, Parser)]
#[command(name = "avm-bench")]
struct Args {
    /// An `avm` binary to measure, as `label=path` (repeatable; default: the
    /// `avm` next to this binary, labelled `current`).
    #[arg(long = "avm", value_name = "LABEL=PATH")]
    targets: Vec<String>,
    /// How many times each figure is measured.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// Concurrent new turns at which time to first token is measured.
    #[arg(long, value_delimiter = ',', default_value = "1,10,50,100,200")]
    concurrency: Vec<usize>,
    /// The mock's delays before the first token, in ms (each measured).
    #[arg(long, value_delimiter = ',', default_value = "20,0")]
    first_token_ms: Vec<u64>,
    /// Text deltas per reply.
    #[arg(long, default_value_t = 20)]
    tokens: usize,
    /// Turns per CPU measurement.
    #[arg(long, default_value_t = 400)]
    cpu_turns: usize,
    /// Turns in flight at once during the CPU measurement.
    #[arg(long, default_value_t = 8)]
    cpu_concurrency: usize,
    /// Writes the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// A short run: one repetition, small counts (a smoke test, not figures).
    #[arg(long)]
    quick: bool,
}

/// One running `avm serve`.
struct Target {
    label: String,
    child: Child,
    pid: u32,
    url: String,
    /// Conversations with a live agent, one per concurrent turn.
    images: Vec<String>,
    _data: tempfile::TempDir,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = Args::parse();
    if args.quick {
        args.repeat = 1;
        args.concurrency = vec![1, 10];
        args.cpu_turns = 40;
        args.first_token_ms.truncate(1);
    }
    ensure!(args.repeat > 0, "--repeat must be at least 1");
    let targets = parse_targets(&args.targets)?;
    let mock = MockLlm::start(behavior(&args, 0)).await?;
    let client = reqwest::Client::builder().tcp_nodelay(true).build()?;
    let most = args
        .concurrency
        .iter()
        .copied()
        .max()
        .unwrap_or(1)
        .max(args.cpu_concurrency);
    let mut running = Vec::new();
    for (label, binary) in targets {
        let target = start(&label, &binary, &mock.anthropic_base_url()).await?;
        running.push(prepare(&client, target, most).await?);
    }
    let clock_ticks = clock_ticks_per_second().await?;
    let mut results: BTreeMap<String, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
    for round in 0..args.repeat {
        eprintln!("round {} of {}", round + 1, args.repeat);
        for &first_token in &args.first_token_ms {
            mock.set_behavior(behavior(&args, first_token));
            for &level in &args.concurrency {
                for target in &running {
                    let direct = ttft_direct(&client, &mock.anthropic_base_url(), level).await?;
                    let through = ttft_gateway(&client, target, level).await?;
                    let figures = results.entry(target.label.clone()).or_default();
                    for (name, percentile) in [("p50", 0.5), ("p99", 0.99)] {
                        let added = quantile(&through, percentile) - quantile(&direct, percentile);
                        figures
                            .entry(format!(
                                "ttft_added_{name}_ms{{first_token={first_token}ms,concurrent={level}}}"
                            ))
                            .or_default()
                            .push(added);
                    }
                    figures
                        .entry(format!(
                            "ttft_direct_p50_ms{{first_token={first_token}ms,concurrent={level}}}"
                        ))
                        .or_default()
                        .push(quantile(&direct, 0.5));
                }
            }
        }
        mock.set_behavior(behavior(&args, 0));
        for target in &running {
            let per_turn = cpu_per_turn(&client, target, &args, clock_ticks).await?;
            results
                .entry(target.label.clone())
                .or_default()
                .entry(format!("cpu_per_turn_us{{tokens={}}}", args.tokens))
                .or_default()
                .push(per_turn);
        }
    }
    print_table(&results);
    if let Some(path) = &args.json {
        let document = json!({
            "machine": machine(),
            "repeat": args.repeat,
            "tokens": args.tokens,
            "results": summarize(&results),
        });
        std::fs::write(path, serde_json::to_string_pretty(&document)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    for target in running {
        stop(target).await?;
    }
    mock.shutdown().await;
    Ok(())
}

fn behavior(args: &Args, first_token_ms: u64) -> MockBehavior {
    MockBehavior {
        tokens: args.tokens,
        first_token_delay: Duration::from_millis(first_token_ms),
        input_tokens: Some(10),
        ..MockBehavior::default()
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
            let path = PathBuf::from(path);
            ensure!(path.exists(), "no avm binary at {}", path.display());
            Ok((label.to_owned(), path))
        })
        .collect()
}

/// Starts `avm serve --dev` on free ports with the mock as its LLM.
async fn start(label: &str, binary: &PathBuf, mock_url: &str) -> anyhow::Result<Target> {
    let data = tempfile::tempdir()?;
    // As `avm` makes its own: readable only by the user (it holds keys).
    std::fs::set_permissions(data.path(), std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    let mut command = Command::new(binary);
    for (key, _) in std::env::vars() {
        if key.starts_with("AVM_") || key.starts_with("LLM_") {
            command.env_remove(key);
        }
    }
    command
        .args(["serve", "--dev", "--port", "0", "--grpc-port", "0", "--data-dir"])
        .arg(data.path())
        .env("LLM_PROVIDER", "anthropic")
        .env("LLM_BASE_URL", mock_url)
        .env("LLM_API_KEY", "bench")
        .env("AVM_LOG_LEVEL", "warn")
        .env("AVM_AUTH_DEFAULT_REQUESTS_PER_MINUTE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot run {}", binary.display()))?;
    let pid = child.id().context("avm exited at once")?;
    let mut lines = BufReader::new(child.stdout.take().context("no stdout")?).lines();
    let url = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await? {
            if let Some(url) = line.strip_prefix("listening: gateway ") {
                return Ok::<_, anyhow::Error>(url.to_owned());
            }
        }
        bail!("avm serve ({label}) exited before listening")
    })
    .await
    .with_context(|| format!("avm serve ({label}) did not start"))??;
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    eprintln!("{label}: avm serve at {url}");
    Ok(Target {
        label: label.to_owned(),
        child,
        pid,
        url,
        images: Vec::new(),
        _data: data,
    })
}

/// Waits until the target is ready, then makes `count` conversations and
/// runs a first turn in each, so every measured turn finds its agent hydrated.
async fn prepare(client: &reqwest::Client, mut target: Target, count: usize) -> anyhow::Result<Target> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !client
        .get(format!("{}/ready", target.url))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        ensure!(Instant::now() < deadline, "{} never became ready", target.label);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let created = client
        .post(format!("{}/v1/containers", target.url))
        .json(&json!({"containerId": "bench"}))
        .send()
        .await?;
    ensure!(
        created.status().is_success(),
        "cannot create the container: {}",
        created.status()
    );
    for _ in 0..count {
        let image: Value = client
            .post(format!("{}/v1/containers/bench/images", target.url))
            .json(&json!({"name": "bench"}))
            .send()
            .await?
            .json()
            .await?;
        let id = image["imageId"].as_str().context("no imageId")?.to_owned();
        target.images.push(id);
    }
    let warm = futures::stream::iter(target.images.clone())
        .map(|image| {
            let client = client.clone();
            let url = target.url.clone();
            async move { turn(&client, &url, &image).await }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    for result in warm {
        result?;
    }
    Ok(target)
}

/// Runs one turn over REST and returns its time to the first text delta.
///
/// A server that still holds the image's previous turn for a moment after
/// its `conversation_end` (409 `AGENT_BUSY`; builds before aa2dfb0) is asked
/// again, as a client would, and the wait counts in the figure.
async fn turn(client: &reqwest::Client, url: &str, image: &str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut attempts = 0;
    let response = loop {
        let response = client
            .post(format!("{url}/v1/images/{image}/messages"))
            .json(&json!({"content": "hello"}))
            .send()
            .await?;
        attempts += 1;
        if response.status() == reqwest::StatusCode::CONFLICT && attempts < 100 {
            tokio::task::yield_now().await;
            continue;
        }
        break response;
    };
    if attempts > 1 {
        eprintln!("{url}: the image was busy after its turn ended; sent {attempts} times");
    }
    let status = response.status();
    ensure!(
        status.is_success(),
        "{url}: message refused: {status} {}",
        response.text().await.unwrap_or_default()
    );
    first_marker_then_end(response, started, b"event: text_delta", b"event: conversation_end").await
}

/// Reads a streamed response; returns when `marker` first showed, after reading to `end` (or the end).
async fn first_marker_then_end(
    response: reqwest::Response,
    started: Instant,
    marker: &[u8],
    end: &[u8],
) -> anyhow::Result<Duration> {
    let mut stream = response.bytes_stream();
    let mut seen = Vec::new();
    let mut first = None;
    while let Some(chunk) = stream.next().await {
        seen.extend_from_slice(&chunk?);
        if first.is_none() && contains(&seen, marker) {
            first = Some(started.elapsed());
        }
        if contains(&seen, end) {
            break;
        }
    }
    first.with_context(|| {
        format!(
            "no {} in {}",
            String::from_utf8_lossy(marker),
            String::from_utf8_lossy(&seen)
        )
    })
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|window| window == needle)
}

/// Times `level` concurrent turns through the gateway, one per conversation.
async fn ttft_gateway(client: &reqwest::Client, target: &Target, level: usize) -> anyhow::Result<Vec<f64>> {
    let turns = target.images[..level]
        .iter()
        .map(|image| turn(client, &target.url, image));
    millis(futures::future::join_all(turns).await)
}

/// Times `level` concurrent streaming calls straight to the mock.
async fn ttft_direct(client: &reqwest::Client, mock_url: &str, level: usize) -> anyhow::Result<Vec<f64>> {
    let calls = (0..level).map(|_| async {
        let started = Instant::now();
        let response = client
            .post(format!("{mock_url}/v1/messages"))
            .header("x-api-key", "bench")
            .header("anthropic-version", "2023-06-01")
            .json(&json!({
                "model": "claude-sonnet-4-20250514",
                "max_tokens": 1024,
                "stream": true,
                "messages": [{"role": "user", "content": "hello"}],
            }))
            .send()
            .await?;
        ensure!(
            response.status().is_success(),
            "the mock refused: {}",
            response.status()
        );
        first_marker_then_end(response, started, b"content_block_delta", b"message_stop").await
    });
    millis(futures::future::join_all(calls).await)
}

fn millis(results: Vec<anyhow::Result<Duration>>) -> anyhow::Result<Vec<f64>> {
    results
        .into_iter()
        .map(|result| result.map(|elapsed| elapsed.as_secs_f64() * 1000.0))
        .collect()
}

/// Returns the CPU time `avm serve` spent per turn over `--cpu-turns` turns.
async fn cpu_per_turn(client: &reqwest::Client, target: &Target, args: &Args, ticks: f64) -> anyhow::Result<f64> {
    let images = &target.images[..args.cpu_concurrency.min(target.images.len())];
    let before = cpu_ticks(target.pid)?;
    let per_image = args.cpu_turns.div_ceil(images.len());
    let lanes = images.iter().map(|image| async move {
        for _ in 0..per_image {
            turn(client, &target.url, image).await?;
        }
        Ok::<_, anyhow::Error>(())
    });
    for lane in futures::future::join_all(lanes).await {
        lane?;
    }
    let spent = (cpu_ticks(target.pid)? - before) as f64 / ticks;
    Ok(spent * 1e6 / (per_image * images.len()) as f64)
}

/// Returns a process's user + system CPU time in clock ticks.
fn cpu_ticks(pid: u32) -> anyhow::Result<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at its closing parenthesis.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .context("unreadable /proc stat")?
        .1
        .split_whitespace()
        .collect();
    let field =
        |index: usize| -> anyhow::Result<u64> { Ok(fields.get(index).context("short /proc stat")?.parse::<u64>()?) };
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 here.
    Ok(field(11)? + field(12)?)
}

async fn clock_ticks_per_second() -> anyhow::Result<f64> {
    let output = Command::new("getconf").arg("CLK_TCK").output().await?;
    Ok(String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse::<f64>()
        .unwrap_or(100.0))
}

/// Returns the `q` quantile (nearest rank) of `values`.
fn quantile(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn summarize(results: &BTreeMap<String, BTreeMap<String, Vec<f64>>>) -> Value {
    let mut out = serde_json::Map::new();
    for (label, figures) in results {
        let mut by_figure = serde_json::Map::new();
        for (figure, values) in figures {
            by_figure.insert(
                figure.clone(),
                json!({"min": quantile(values, 0.0), "median": quantile(values, 0.5), "max": quantile(values, 1.0), "runs": values}),
            );
        }
        out.insert(label.clone(), Value::Object(by_figure));
    }
    Value::Object(out)
}

fn print_table(results: &BTreeMap<String, BTreeMap<String, Vec<f64>>>) {
    println!(
        "{:<62} {:<10} {:>10} {:>10} {:>10}",
        "figure", "target", "min", "median", "max"
    );
    let figures: std::collections::BTreeSet<&String> = results.values().flat_map(BTreeMap::keys).collect();
    for figure in figures {
        for (label, by_figure) in results {
            if let Some(values) = by_figure.get(figure) {
                println!(
                    "{figure:<62} {label:<10} {:>10.3} {:>10.3} {:>10.3}",
                    quantile(values, 0.0),
                    quantile(values, 0.5),
                    quantile(values, 1.0)
                );
            }
        }
    }
}

fn machine() -> Value {
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split_once(':'))
                .map(|(_, name)| name.trim().to_owned())
        })
        .unwrap_or_default();
    json!({"cpus": cpus, "cpu": model})
}

async fn stop(mut target: Target) -> anyhow::Result<()> {
    Command::new("kill")
        .args(["-TERM", &target.pid.to_string()])
        .status()
        .await?;
    tokio::time::timeout(Duration::from_secs(20), target.child.wait())
        .await
        .with_context(|| format!("{} did not stop", target.label))??;
    Ok(())
}
