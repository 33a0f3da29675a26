//! `mock-llm`: serves the mock LLM (Anthropic Messages and OpenAI Chat
//! Completions, streaming) until Ctrl-C, for manual runs and benchmarks.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use avm_tests::mock_llm::{MockApi, MockBehavior, MockFailure, MockLlm, MockToolCall};
use clap::Parser;

/// Serves a mock LLM speaking the Anthropic and OpenAI streaming APIs.
#[derive(Debug, Parser)]
#[command(name = "mock-llm")]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value_t = IpAddr::V4(Ipv4Addr::LOCALHOST))]
    host: IpAddr,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 9000)]
    port: u16,
    /// Deltas in the default reply (`mock-0 mock-1 …`).
    #[arg(long, default_value_t = 5)]
    tokens: usize,
    /// A fixed reply, streamed a word per delta (overrides --tokens).
    #[arg(long)]
    reply: Option<String>,
    /// Milliseconds between two deltas.
    #[arg(long, default_value_t = 0)]
    interval_ms: u64,
    /// Milliseconds before the first delta.
    #[arg(long, default_value_t = 0)]
    first_token_ms: u64,
    /// Input token count to report (default: words of the request).
    #[arg(long)]
    input_tokens: Option<u64>,
    /// A failure to act out: an HTTP status (e.g. 500), malformed, drop:N or hang.
    #[arg(long)]
    fail: Option<MockFailure>,
    /// A tool call every reply makes until its results are in, as
    /// `name:{"json":"input"}` (repeatable: one reply calls them all).
    #[arg(long = "call", value_name = "NAME:INPUT")]
    calls: Vec<MockToolCall>,
    /// How many replies call the tools before one answers with text.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Print each request's API, model, token limit and system prompt (never its key).
    #[arg(long)]
    log_requests: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let behavior = MockBehavior {
        reply: args.reply,
        tokens: args.tokens,
        first_token_delay: Duration::from_millis(args.first_token_ms),
        token_interval: Duration::from_millis(args.interval_ms),
        input_tokens: args.input_tokens,
        failure: args.fail,
        tool_calls: args.calls,
        tool_rounds: args.rounds,
        offered_tools_only: false,
    };
    let mock = MockLlm::start_on(SocketAddr::new(args.host, args.port), behavior).await?;
    // Nobody reads them back here; kept, they would grow without end.
    mock.set_recording(false);
    println!("mock LLM listening on {}", mock.addr());
    println!(
        "anthropic: LLM_PROVIDER=anthropic LLM_BASE_URL={} LLM_API_KEY=mock",
        mock.anthropic_base_url()
    );
    println!(
        "openai:    LLM_PROVIDER=openai LLM_BASE_URL={} LLM_API_KEY=mock",
        mock.openai_base_url()
    );
    if args.log_requests {
        tokio::select! {
            result = tokio::signal::ctrl_c() => result?,
            () = log_requests(&mock) => {}
        }
    } else {
        tokio::signal::ctrl_c().await?;
    }
    mock.shutdown().await;
    Ok(())
}

/// Prints a line for every request as it arrives.
async fn log_requests(mock: &MockLlm) {
    let mut seen = 0;
    loop {
        let Ok(requests) = mock.wait_for_requests(seen + 1, Duration::from_secs(3600)).await else {
            continue;
        };
        for request in &requests[seen..] {
            let body = &request.body;
            let system = match request.api {
                MockApi::Anthropic => body["system"].clone(),
                MockApi::OpenAi => body["messages"]
                    .as_array()
                    .and_then(|messages| messages.iter().find(|m| m["role"] == "system"))
                    .map(|m| m["content"].clone())
                    .unwrap_or_default(),
            };
            println!(
                "request {}: {:?} model={} max_tokens={} system={system}",
                seen + 1,
                request.api,
                body["model"],
                body["max_tokens"]
            );
            seen += 1;
        }
    }
}
