//! What a sandbox's commands run under: the operator's limits
//! (`[runtime.sandbox]`), what an agent's sandbox resource asks for, and the
//! environment (interpreters) it is given.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The limits a command runs under (`[runtime.sandbox]`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SandboxLimits {
    /// Wall time, after which the command's process group is killed.
    pub timeout_seconds: u64,
    /// CPU time of each process.
    pub cpu_seconds: u64,
    /// Address space of each process, in MiB.
    pub memory_mb: u64,
    /// Processes of a command together (its cgroup), or of the server's user (rlimit, not for root).
    pub processes: u64,
    /// Largest file a command may write, in MiB.
    pub file_mb: u64,
    /// Bytes of stdout and of stderr kept, each; the rest is cut with a marker.
    pub output_bytes: usize,
    /// The workspace's disk quota, in MiB: the files of an image's workspace together.
    pub disk_mb: u64,
    /// Whether commands and `fetch_url` reach the network; without, commands
    /// run in a network namespace of their own (nothing but a down loopback).
    pub network: bool,
    /// Whether commands (and stdio MCP servers) run behind the fence of
    /// `tools/isolation.rs`: user, mount and PID namespaces of their own and
    /// a fresh root holding only the system directories, the workspace and
    /// `expose`, without any capability; where the server cannot make it,
    /// commands are refused.
    pub isolate: bool,
    /// More host paths (absolute) a command's root holds, read-only, at the
    /// same place: tools an operator installed outside `/usr`, say.
    pub expose: Vec<std::path::PathBuf>,
    /// The `avm` executable whose `sandbox-relay` is a fenced command's way
    /// out to the network proxy, and whose `sandbox` is the `process`
    /// provider's sandbox (default: the running executable).
    pub relay: Option<std::path::PathBuf>,
    /// Where commands (and stdio MCP servers) run: `local`, in the
    /// runtime's own process behind the fence; `process`, in an `avm
    /// sandbox` child per image, started on its first command and stopped
    /// when its agent goes, holding none of the runtime's secrets; `pool`,
    /// in one of the `avm sandbox` processes of `pool`, claimed for one image
    /// at a time; `kubernetes`, in a sandbox pod per image, claimed through
    /// the agent-sandbox API (`kubernetes`).
    pub provider: Provider,
    /// The `pool` provider's sandboxes: `http://host:port` addresses, each
    /// name standing for every address it resolves to (a headless Service).
    pub pool: Vec<String>,
    /// Pools of their own for the `python` and `node` environments (same
    /// form as `pool`): an image naming one of them claims from its pool,
    /// other images from `pool`.
    pub pools: EnvironmentPools,
    /// The `kubernetes` provider's claims (`[runtime.sandbox.kubernetes]`).
    pub kubernetes: KubernetesSandboxes,
    /// Removed: a command's root holds nothing of the host's but what it is
    /// given, so there is nothing to hide. An empty list is accepted (older
    /// example files have one); any path is refused with what replaced it.
    #[serde(skip_serializing)]
    pub hide: Removed,
}

/// Where commands run (`[runtime.sandbox] provider`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Provider {
    #[default]
    Local,
    Process,
    Pool,
    Kubernetes,
}

/// Where the `kubernetes` provider claims sandbox pods: a `SandboxClaim`
/// (agent-sandbox, `extensions.agents.x-k8s.io/v1beta1`) naming the
/// `SandboxWarmPool` of the image's environment, per image.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubernetesSandboxes {
    /// The namespace claims are made in (default: the runtime pod's own, or
    /// the kubeconfig's).
    pub namespace: Option<String>,
    /// The kubeconfig file to reach the API server with (default: the pod's
    /// service account, else `KUBECONFIG` or `~/.kube/config`).
    pub kubeconfig: Option<std::path::PathBuf>,
    /// The warm pool a claim names, per environment.
    pub warm_pools: WarmPools,
    /// The port `avm sandbox` listens on in a sandbox pod.
    pub port: u16,
    /// How long a claim may take to have a ready pod.
    pub ready_timeout_seconds: u64,
    /// How long a claim lives: the controller deletes it (and its pod) then,
    /// whatever becomes of the runtime; the runtime claims a new one before.
    pub lifetime_seconds: u64,
}

/// The `pool` provider's pools of the environments that have their own.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnvironmentPools {
    pub python: Vec<String>,
    pub node: Vec<String>,
}

impl SandboxLimits {
    /// Returns the `pool` provider's addresses for `environment`: its own
    /// pool where it has one, else `pool`.
    pub fn pool_of(&self, environment: SandboxEnvironment) -> &[String] {
        let own = match environment {
            SandboxEnvironment::Shell => &self.pool,
            SandboxEnvironment::Python => &self.pools.python,
            SandboxEnvironment::Node => &self.pools.node,
        };
        if own.is_empty() { &self.pool } else { own }
    }
}

/// The `SandboxWarmPool` of each environment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WarmPools {
    pub shell: String,
    pub python: String,
    pub node: String,
}

impl Default for WarmPools {
    fn default() -> Self {
        Self {
            shell: "avm-sandbox-shell".to_owned(),
            python: "avm-sandbox-python".to_owned(),
            node: "avm-sandbox-node".to_owned(),
        }
    }
}

impl WarmPools {
    /// Returns the warm pool of `environment`.
    pub fn of(&self, environment: SandboxEnvironment) -> &str {
        match environment {
            SandboxEnvironment::Shell => &self.shell,
            SandboxEnvironment::Python => &self.python,
            SandboxEnvironment::Node => &self.node,
        }
    }
}

impl Default for KubernetesSandboxes {
    fn default() -> Self {
        Self {
            namespace: None,
            kubeconfig: None,
            warm_pools: WarmPools::default(),
            port: 7010,
            ready_timeout_seconds: 60,
            lifetime_seconds: 3600,
        }
    }
}

/// A removed setting: absent or empty, it reads as nothing; with anything
/// in it, the configuration is refused with what replaced the setting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Removed;

/// Why `[runtime.sandbox] hide` is refused.
pub const HIDE_REMOVED: &str = "[runtime.sandbox] hide was removed: a command's root now holds only the system \
    directories, the workspace and what [runtime.sandbox] expose lists, so nothing needs hiding; remove hide";

impl<'de> Deserialize<'de> for Removed {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let paths = Vec::<std::path::PathBuf>::deserialize(deserializer)?;
        if paths.is_empty() {
            Ok(Removed)
        } else {
            Err(serde::de::Error::custom(HIDE_REMOVED))
        }
    }
}

impl Default for SandboxLimits {
    fn default() -> Self {
        Self {
            timeout_seconds: 60,
            cpu_seconds: 60,
            memory_mb: 1024,
            processes: 256,
            file_mb: 100,
            output_bytes: 32 * 1024,
            disk_mb: 1024,
            network: true,
            isolate: true,
            expose: Vec::new(),
            relay: None,
            provider: Provider::Local,
            pool: Vec::new(),
            pools: EnvironmentPools::default(),
            kubernetes: KubernetesSandboxes::default(),
            hide: Removed,
        }
    }
}

/// What a sandbox's commands are given besides a shell (`"environment"`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SandboxEnvironment {
    #[default]
    Shell,
    Python,
    Node,
}

/// Where a command's `PATH` looks, in order (inside the fence and out).
pub const COMMAND_PATH: [&str; 3] = ["/usr/local/bin", "/usr/bin", "/bin"];

impl SandboxEnvironment {
    /// Returns the environment a sandbox resource names.
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "shell" => Some(Self::Shell),
            "python" => Some(Self::Python),
            "node" => Some(Self::Node),
            _ => None,
        }
    }

    /// Returns the name a sandbox resource gives it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Shell => "shell",
            Self::Python => "python",
            Self::Node => "node",
        }
    }

    /// Returns the interpreter it promises, as a command's `PATH` finds it.
    pub fn interpreter(self) -> Option<&'static str> {
        match self {
            Self::Shell => None,
            Self::Python => Some("python3"),
            Self::Node => Some("node"),
        }
    }

    /// Refuses the environment where the server has not its interpreter in
    /// any of `dirs` (the command's `PATH`, from the host's system directories).
    pub fn check(self, dirs: &[&str]) -> Result<(), String> {
        use std::os::unix::fs::PermissionsExt;
        let Some(interpreter) = self.interpreter() else {
            return Ok(());
        };
        let found = dirs.iter().any(|dir| {
            std::fs::metadata(std::path::Path::new(dir).join(interpreter))
                .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
        });
        if found {
            return Ok(());
        }
        Err(format!(
            "this agent's sandbox asks for the {} environment, and this server has no {interpreter} in {}: \
             an operator installs it there, or the sandbox resource names another environment",
            self.name(),
            dirs.join(", ")
        ))
    }
}

/// A variable a sandbox resource's `env` sets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnvValue {
    /// The value as the resource holds it.
    Plain(String),
    /// The value of one of the tenant's secrets, by name (resolved when a
    /// command first needs it; redacted from what tools return).
    Secret(String),
}

/// What an agent's `resource://sandboxes/…` asks for (its `limits`, its `env`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SandboxRequest {
    /// What its commands are given besides a shell.
    pub environment: SandboxEnvironment,
    /// The variables its commands see, by name.
    pub env: Vec<(String, EnvValue)>,
    /// CPU time per process, in milliseconds (rlimits count whole seconds).
    pub cpu_millis: Option<u64>,
    pub memory_mb: Option<u64>,
    pub disk_mb: Option<u64>,
    pub timeout_seconds: Option<u64>,
    pub network: Option<bool>,
}

impl SandboxRequest {
    /// Reads a sandbox resource's content (`{"limits": {…}}`).
    pub fn from_content(content: &Value) -> Self {
        let limits = &content["limits"];
        Self {
            cpu_millis: limits["cpuMillis"].as_u64(),
            memory_mb: limits["memoryMb"].as_u64(),
            disk_mb: limits["diskMb"].as_u64(),
            timeout_seconds: limits["timeoutSeconds"].as_u64(),
            network: limits["network"].as_bool(),
            environment: content["environment"]
                .as_str()
                .and_then(SandboxEnvironment::named)
                .unwrap_or_default(),
            env: content["env"]
                .as_object()
                .map(|env| {
                    env.iter()
                        .filter_map(|(name, value)| {
                            let value = match value {
                                Value::String(plain) => EnvValue::Plain(plain.clone()),
                                other => EnvValue::Secret(other["secret"].as_str()?.to_owned()),
                            };
                            Some((name.clone(), value))
                        })
                        .collect()
                })
                .unwrap_or_default(),
        }
    }
}

impl SandboxLimits {
    /// Returns the executable that relays a fenced command's network.
    pub fn relay_binary(&self) -> std::path::PathBuf {
        self.relay
            .clone()
            .or_else(|| std::env::current_exe().ok())
            .unwrap_or_else(|| std::path::PathBuf::from("avm"))
    }

    /// Returns these limits narrowed by what a sandbox resource asks: it may
    /// lower each limit, never raise one above the server's.
    pub fn narrowed(&self, request: &SandboxRequest) -> Self {
        let lower = |limit: u64, asked: Option<u64>| asked.map_or(limit, |asked| asked.clamp(1, limit));
        Self {
            timeout_seconds: lower(self.timeout_seconds, request.timeout_seconds),
            cpu_seconds: lower(self.cpu_seconds, request.cpu_millis.map(|ms| ms.div_ceil(1000))),
            memory_mb: lower(self.memory_mb, request.memory_mb),
            disk_mb: lower(self.disk_mb, request.disk_mb),
            network: self.network && request.network.unwrap_or(true),
            ..self.clone()
        }
    }
}
