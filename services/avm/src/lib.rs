//! The AgentVM binary's library: `avm serve` composes every component in one
//! process; `avm <component>` runs one, with peers reached over gRPC; `avm
//! tenants|users|keys|whoami` manage a running server through its REST API.
//!
//! ```text
//! command.rs  the command line and the configuration it loads
//! roles.rs    each role built as an App; serve's in-process composition
//! storage.rs  the data dir, each service's store, opening the services
//! config.rs   the whole configuration document
//! cli.rs      the client commands
//! health.rs   `avm health`, the container health check
//! telemetry.rs the subscriber, and the OTLP exporter when configured
//! ```

use std::process::ExitCode;

use clap::Parser;

mod cli;
mod command;
pub mod config;
mod health;
mod roles;
mod sandbox;
mod storage;
mod telemetry;

pub use command::Cli;
pub use config::AvmConfig;
pub use roles::{Role, ServeListeners, serve};
pub use storage::{ADMIN_KEY_FILE, CONFIG_KEY_FILE};

use command::Command;

/// Parses the command line, runs, and maps failure to a non-zero exit.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::SandboxRelay { socket } = &cli.command {
        return sandbox_relay(socket);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Loads configuration and runs the chosen command until a shutdown signal.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    // A health check asks another process: it needs none of this one's
    // configuration, and must not fail because of it.
    if let Command::Health(args) = &cli.command {
        println!("{}", health::check(args).await?);
        return Ok(());
    }
    // A sandbox reads no configuration: what it needs is on its command line.
    if let Command::Sandbox(args) = cli.command {
        return sandbox::run(args).await;
    }
    let config = command::load_config(&cli)?;
    if cli.print_config {
        print!("{}", avm_common::config::render(&config)?);
        return Ok(());
    }
    let Some(role) = cli.command.role() else {
        return match cli.command {
            Command::Tenants(command) => cli::tenants(command, &config).await,
            Command::Users(command) => cli::users(command, &config).await,
            Command::Keys(command) => cli::keys(command, &config).await,
            Command::Whoami(client) => cli::whoami(&client, &config).await,
            Command::Openapi => {
                println!("{}", avm_gateway::router::openapi().to_pretty_json()?);
                Ok(())
            }
            _ => Ok(()),
        };
    };
    let telemetry = telemetry::init(&config.log, role.name());
    let shutdown = avm_common::shutdown::on_signal();
    let result = role.run(config, shutdown).await;
    // Spans still buffered go out now; the exporter blocks on the runtime.
    let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
    result
}

/// `avm sandbox-relay`: a fenced command's way out to its network proxy,
/// on a single thread (it runs beside every command with network).
fn sandbox_relay(socket: &std::path::Path) -> ExitCode {
    let relayed = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|runtime| Ok(runtime.block_on(avm_sandbox::egress::relay(socket))?));
    match relayed {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: sandbox-relay: {err:#}");
            ExitCode::FAILURE
        }
    }
}
