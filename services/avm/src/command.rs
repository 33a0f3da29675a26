//! The command line: what to run, and the configuration it runs with (flags
//! are its top layer).

use std::path::PathBuf;

use avm_common::config::Sources;
use clap::{Parser, Subcommand};
use serde_json::{Map, Value, json};

use crate::AvmConfig;
use crate::cli;

/// AgentVM: hosts AI agents for many tenants.
#[derive(Debug, Parser)]
#[command(name = "avm", version, about)]
pub struct Cli {
    /// TOML configuration file (also `AVM_CONFIG`).
    #[arg(long, global = true)]
    pub config: Option<PathBuf>,
    /// Print the effective configuration (secrets redacted) and exit.
    #[arg(long, global = true)]
    pub print_config: bool,
    /// Log filter, e.g. `info` or `avm_runtime=debug` (also `AVM_LOG_LEVEL`).
    #[arg(long, global = true)]
    pub log_level: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

/// What `avm` is asked to do.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run every component in one process: gateway, gRPC services, SQLite storage.
    Serve {
        /// Address to bind (loopback unless authentication is configured).
        #[arg(long)]
        host: Option<String>,
        /// Gateway (HTTP + WebSocket) port.
        #[arg(long)]
        port: Option<u16>,
        /// gRPC port of all services.
        #[arg(long)]
        grpc_port: Option<u16>,
        /// Directory of the SQLite files.
        #[arg(long)]
        data_dir: Option<String>,
        /// Let requests without credentials act as the admin of a local `dev`
        /// tenant (loopback only; never in production).
        #[arg(long)]
        dev: bool,
    },
    /// Run the gateway alone (needs AVM_AUTH_ADDR, AVM_SESSION_ADDR, AVM_RUNTIME_ADDR, AVM_RESOURCE_ADDR,
    /// AVM_CONFIG_ADDR, AVM_OBSERVABILITY_ADDR, AVM_AUTH_SERVICE_KEY).
    Gateway(ComponentArgs),
    /// Run the auth service alone (storage from AVM_DATABASE_URL; needs AVM_AUTH_SERVICE_KEY).
    Auth(ComponentArgs),
    /// Run the session service alone (storage from AVM_DATABASE_URL; needs AVM_AUTH_ADDR, AVM_RESOURCE_ADDR,
    /// AVM_AUTH_SERVICE_KEY).
    Session(ComponentArgs),
    /// Run the runtime alone (needs AVM_AUTH_ADDR, AVM_SESSION_ADDR, AVM_RESOURCE_ADDR, AVM_CONFIG_ADDR,
    /// AVM_OBSERVABILITY_ADDR, AVM_AUTH_SERVICE_KEY).
    Runtime(ComponentArgs),
    /// Run the resource service alone (storage from AVM_DATABASE_URL; needs AVM_AUTH_ADDR, AVM_AUTH_SERVICE_KEY).
    Resource(ComponentArgs),
    /// Run the config service alone (storage from AVM_DATABASE_URL; needs AVM_AUTH_ADDR, AVM_AUTH_SERVICE_KEY,
    /// AVM_CONFIG_SECRET_KEY; its LLM_* variables are the deployment's LLM settings).
    Config(ComponentArgs),
    /// Run the observability service alone: the usage ledger, budgets and tenants' logs (storage from
    /// AVM_DATABASE_URL; needs AVM_AUTH_ADDR, AVM_AUTH_SERVICE_KEY).
    Observability(ComponentArgs),
    /// Manage tenants of a running server (operators).
    Tenants(cli::Tenants),
    /// Manage the users of a tenant (its admins).
    Users(cli::Users),
    /// Manage API keys.
    Keys(cli::Keys),
    /// Show who the credential in use is.
    Whoami(cli::ClientArgs),
    /// Print the OpenAPI 3.1 document of the REST API (as `GET /v1/openapi.json` serves it).
    Openapi,
    /// Check a running process's health: exit 0 when healthy, else 1 with the reason
    /// (for container health checks; default: gRPC health of 127.0.0.1:7000).
    Health(crate::health::HealthArgs),
    /// Run a sandbox: hold images' workspaces and run their commands for a
    /// runtime (`[runtime.sandbox] provider = "process"` starts one per image
    /// itself). It reads no configuration file and holds no platform secret:
    /// only the runtime's public token key.
    Sandbox(crate::sandbox::SandboxArgs),
    /// Inside a fenced command's namespaces: relay the command's connections
    /// to its network proxy (started by the runtime, never by hand).
    #[command(hide = true)]
    SandboxRelay {
        /// The proxy's socket, as the command sees it.
        #[arg(default_value = "/run/avm/egress.sock")]
        socket: std::path::PathBuf,
    },
}

/// The flags of one component's process.
#[derive(Debug, clap::Args)]
pub struct ComponentArgs {
    /// Address to listen on, e.g. 127.0.0.1:7000.
    #[arg(long)]
    listen: Option<String>,
}

impl Command {
    /// Returns the role a command runs, or `None` for a client command.
    pub fn role(&self) -> Option<crate::roles::Role> {
        use crate::roles::Role;
        Some(match self {
            Command::Serve { .. } => Role::Serve,
            Command::Gateway(_) => Role::Gateway,
            Command::Auth(_) => Role::Auth,
            Command::Session(_) => Role::Session,
            Command::Runtime(_) => Role::Runtime,
            Command::Resource(_) => Role::Resource,
            Command::Config(_) => Role::Config,
            Command::Observability(_) => Role::Observability,
            Command::Tenants(_)
            | Command::Users(_)
            | Command::Keys(_)
            | Command::Whoami(_)
            | Command::Openapi
            | Command::Health(_)
            | Command::Sandbox(_)
            | Command::SandboxRelay { .. } => {
                return None;
            }
        })
    }
}

/// Loads the configuration: defaults, the file, the environment, then these flags.
pub fn load_config(cli: &Cli) -> anyhow::Result<AvmConfig> {
    let mut server = Map::new();
    let mut flags = Map::new();
    match &cli.command {
        Command::Serve {
            host,
            port,
            grpc_port,
            data_dir,
            dev,
        } => {
            insert(&mut server, "host", host.clone().map(Value::from));
            insert(&mut server, "port", port.map(Value::from));
            insert(&mut server, "grpc_port", grpc_port.map(Value::from));
            insert(&mut server, "data_dir", data_dir.clone().map(Value::from));
            if *dev {
                flags.insert("auth".to_owned(), json!({"dev": true}));
            }
        }
        Command::Gateway(args)
        | Command::Auth(args)
        | Command::Session(args)
        | Command::Runtime(args)
        | Command::Resource(args)
        | Command::Config(args)
        | Command::Observability(args) => {
            insert(&mut server, "listen", args.listen.clone().map(Value::from));
        }
        Command::Tenants(_)
        | Command::Users(_)
        | Command::Keys(_)
        | Command::Whoami(_)
        | Command::Openapi
        | Command::Health(_)
        | Command::Sandbox(_)
        | Command::SandboxRelay { .. } => {}
    }
    if !server.is_empty() {
        flags.insert("server".to_owned(), Value::Object(server));
    }
    if let Some(level) = &cli.log_level {
        flags.insert("log".to_owned(), json!({"level": level}));
    }
    let sources = Sources {
        file: cli.config.clone(),
        flags,
    };
    Ok(avm_common::config::load(&sources)?)
}

fn insert(map: &mut Map<String, Value>, key: &str, value: Option<Value>) {
    if let Some(value) = value {
        map.insert(key.to_owned(), value);
    }
}
