//! A fake Kubernetes API server at the network edge, for the `kubernetes`
//! sandbox provider: it serves the agent-sandbox `SandboxClaim` API
//! (`extensions.agents.x-k8s.io/v1beta1`, create, get and delete in a
//! namespace) as the API server and the agent-sandbox controller would
//! together, answering a claim with a "pod": a local `avm sandbox` process
//! listening on a loopback address of its own, at the port every pod uses.
//!
//! Warm pools are kept warm: a claim naming one adopts a started pod, which
//! is replaced; a claim naming a pool with none left waits for a cold start
//! (the pod's readiness comes later, as a pod's would). A claim naming an
//! unknown pool is never ready, its `Ready` condition saying why. With
//! `forbid`, every request is refused as RBAC refuses a ServiceAccount
//! without the right Role. Requests without the kubeconfig's token get 401.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::Context;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

const API: &str = "extensions.agents.x-k8s.io/v1beta1";
const TOKEN: &str = "fake-service-account-token";
/// The namespace the kubeconfig's context names.
pub const NAMESPACE: &str = "agentvm";

/// An `avm sandbox` process as an operator's pod runs it: no key, no
/// configuration, claimed by whichever runtime asks first.
#[derive(Debug)]
pub struct SandboxProcess {
    /// Where it listens (`http://ip:port`).
    pub address: String,
    /// Its workspaces.
    pub root: tempfile::TempDir,
    /// Killed when dropped.
    _child: tokio::process::Child,
}

impl SandboxProcess {
    /// Starts one listening on `listen`; returns once it listens.
    pub async fn start(listen: &str) -> anyhow::Result<Self> {
        use tokio::io::AsyncBufReadExt;
        let root = tempfile::tempdir()?;
        let binary = crate::cluster::avm_binary()?;
        let mut child = tokio::process::Command::new(&binary)
            .args(["sandbox", "--listen", listen, "--root"])
            .arg(root.path())
            .arg("--relay")
            .arg(&binary)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child.stdout.take().context("stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let address = tokio::time::timeout(Duration::from_secs(20), async {
            while let Some(line) = lines.next_line().await? {
                if let Some(url) = line.strip_prefix("listening: grpc ") {
                    return Ok(url.to_owned());
                }
            }
            anyhow::bail!("the sandbox stopped before it listened")
        })
        .await??;
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Self {
            address,
            root,
            _child: child,
        })
    }
}

/// What the fake serves besides claims.
#[derive(Clone, Debug, Default)]
pub struct FakeKubeOptions {
    /// Warm pools by name, with their replicas.
    pub warm_pools: Vec<(String, usize)>,
    /// Refuses every request as RBAC would (403).
    pub forbid: bool,
}

/// A claim as the fake holds it.
#[derive(Debug)]
struct Claimed {
    object: Value,
    pod: Option<SandboxProcess>,
}

#[derive(Debug, Default)]
struct Cluster {
    claims: BTreeMap<String, Claimed>,
    warm: BTreeMap<String, Vec<SandboxProcess>>,
    /// Claims served from a warm pool, and cold.
    adopted: usize,
    cold: usize,
    deleted: Vec<String>,
    next_host: u8,
}

#[derive(Clone)]
struct Shared {
    cluster: Arc<Mutex<Cluster>>,
    options: FakeKubeOptions,
    /// The first three bytes of the pods' loopback addresses.
    net: [u8; 3],
    port: u16,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Cluster> {
        self.cluster.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts a pod on the next address.
    async fn start_pod(&self) -> anyhow::Result<SandboxProcess> {
        let host = {
            let mut cluster = self.lock();
            cluster.next_host = cluster.next_host.checked_add(1).context("too many pods")?;
            cluster.next_host
        };
        let [a, b, c] = self.net;
        SandboxProcess::start(&format!("{}:{}", Ipv4Addr::new(a, b, c, host), self.port)).await
    }

    /// Starts a pod into `pool`.
    fn refill(&self, pool: String) {
        let shared = self.clone();
        tokio::spawn(async move {
            match shared.start_pod().await {
                Ok(pod) => shared.lock().warm.entry(pool).or_default().push(pod),
                Err(err) => tracing::warn!(error = %err, "the fake cluster cannot start a warm pod"),
            }
        });
    }
}

/// The fake API server; stops (and its pods with it) when dropped.
pub struct FakeKube {
    shared: Shared,
    dir: tempfile::TempDir,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeKube {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeKube {
    /// Serves the API, with the warm pools' pods started.
    pub async fn start(options: FakeKubeOptions) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let api = listener.local_addr()?;
        // Every pod listens on the same port, each at a loopback address of its own.
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let net = [127, rand_byte(100..=250), rand_byte(0..=255)];
        let shared = Shared {
            cluster: Arc::default(),
            options: options.clone(),
            net,
            port,
        };
        for (pool, replicas) in &options.warm_pools {
            let mut pods = Vec::new();
            for _ in 0..*replicas {
                pods.push(shared.start_pod().await?);
            }
            shared.lock().warm.insert(pool.clone(), pods);
        }
        let claims = "/apis/extensions.agents.x-k8s.io/v1beta1/namespaces/{namespace}/sandboxclaims";
        let router = axum::Router::new()
            .route(claims, axum::routing::post(create))
            .route(&format!("{claims}/{{name}}"), axum::routing::get(get).delete(delete))
            .fallback(|| async { status(404, "NotFound", "the fake API server serves sandboxclaims only") })
            .with_state(shared.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        let dir = tempfile::tempdir()?;
        let kubeconfig = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": format!("http://{api}")}}],
            "users": [{"name": "runtime", "user": {"token": TOKEN}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "runtime", "namespace": NAMESPACE}}],
            "current-context": "fake",
        });
        std::fs::write(dir.path().join("kubeconfig"), serde_json::to_vec_pretty(&kubeconfig)?)?;
        Ok(Self { shared, dir, task })
    }

    /// The kubeconfig that reaches it.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// The runtime's settings for it: its kubeconfig and pods' port, the
    /// shell environment's warm pool named `shell_pool`, and a short wait
    /// for readiness.
    pub fn settings(&self, shell_pool: &str) -> avm_sandbox::KubernetesSandboxes {
        let mut settings = avm_sandbox::KubernetesSandboxes {
            kubeconfig: Some(self.kubeconfig()),
            port: self.shared.port,
            ready_timeout_seconds: 5,
            ..avm_sandbox::KubernetesSandboxes::default()
        };
        settings.warm_pools.shell = shell_pool.to_owned();
        settings
    }

    /// The claims that exist, as the API holds them.
    pub fn claims(&self) -> Vec<Value> {
        let cluster = self.shared.lock();
        cluster.claims.values().map(|claimed| claimed.object.clone()).collect()
    }

    /// The workspaces' roots of the claimed pods.
    pub fn claimed_roots(&self) -> Vec<PathBuf> {
        let cluster = self.shared.lock();
        cluster
            .claims
            .values()
            .filter_map(|claimed| Some(claimed.pod.as_ref()?.root.path().to_owned()))
            .collect()
    }

    /// Claims served by a warm pod, and by a cold start.
    pub fn served(&self) -> (usize, usize) {
        let cluster = self.shared.lock();
        (cluster.adopted, cluster.cold)
    }

    /// The names of the claims deleted so far.
    pub fn deleted(&self) -> Vec<String> {
        self.shared.lock().deleted.clone()
    }
}

fn rand_byte(range: std::ops::RangeInclusive<u8>) -> u8 {
    use std::hash::{BuildHasher, RandomState};
    let (low, high) = (*range.start(), *range.end());
    let random = RandomState::new().hash_one(std::time::SystemTime::now());
    low + (random % (u64::from(high - low) + 1)) as u8
}

/// A `Status` answer, as the API server words its failures.
fn status(code: u16, reason: &str, message: &str) -> Response {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    });
    let code = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (code, axum::Json(body)).into_response()
}

/// Refuses a request without the token, or any request when forbidden.
fn refused(shared: &Shared, headers: &HeaderMap, verb: &str, namespace: &str) -> Option<Response> {
    let bearer = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok());
    if bearer != Some(&format!("Bearer {TOKEN}")) {
        return Some(status(401, "Unauthorized", "Unauthorized"));
    }
    shared.options.forbid.then(|| {
        status(
            403,
            "Forbidden",
            &format!(
                "sandboxclaims.extensions.agents.x-k8s.io is forbidden: User \"system:serviceaccount:{namespace}:agentvm-runtime\" \
                 cannot {verb} resource \"sandboxclaims\" in API group \"extensions.agents.x-k8s.io\" in the namespace \
                 \"{namespace}\""
            ),
        )
    })
}

fn ready(object: &mut Value, pod_name: &str, pod: &SandboxProcess) {
    let ip = pod
        .address
        .trim_start_matches("http://")
        .rsplit_once(':')
        .map(|(ip, _)| ip.to_owned())
        .unwrap_or_default();
    object["status"] = json!({
        "conditions": [{"type": "Ready", "status": "True", "reason": "SandboxReady", "message": "",
            "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        "sandbox": {"name": pod_name, "podIPs": [ip]},
    });
}

async fn create(
    State(shared): State<Shared>,
    UrlPath(namespace): UrlPath<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if let Some(refusal) = refused(&shared, &headers, "create", &namespace) {
        return refusal;
    }
    let Ok(mut object) = serde_json::from_slice::<Value>(&body) else {
        return status(400, "BadRequest", "the body is not JSON");
    };
    if object["apiVersion"] != API || object["kind"] != "SandboxClaim" {
        return status(
            400,
            "BadRequest",
            "not a SandboxClaim of extensions.agents.x-k8s.io/v1beta1",
        );
    }
    let Some(pool) = object["spec"]["warmPoolRef"]["name"].as_str().map(str::to_owned) else {
        return status(
            422,
            "Invalid",
            "SandboxClaim.extensions.agents.x-k8s.io is invalid: spec.warmPoolRef.name: Required value",
        );
    };
    let suffix: String = (0..5)
        .map(|_| char::from(b"bcdfghjklmnpqrstvwxz2456789"[usize::from(rand_byte(0..=26))]))
        .collect();
    let name = match (
        object["metadata"]["name"].as_str(),
        object["metadata"]["generateName"].as_str(),
    ) {
        (Some(name), _) => name.to_owned(),
        (None, Some(prefix)) => format!("{prefix}{suffix}"),
        (None, None) => return status(422, "Invalid", "metadata.name: Required value"),
    };
    object["metadata"]["name"] = json!(name);
    object["metadata"]["namespace"] = json!(namespace);
    object["metadata"]["uid"] = json!(format!("uid-{name}"));
    object["metadata"]["resourceVersion"] = json!("1");
    let known = shared.options.warm_pools.iter().any(|(known, _)| *known == pool);
    if !known {
        object["status"] = json!({"conditions": [{"type": "Ready", "status": "False", "reason": "WarmPoolNotFound",
            "message": format!("SandboxWarmPool {pool:?} not found"), "lastTransitionTime": "2026-01-01T00:00:00Z"}]});
        shared.lock().claims.insert(
            name,
            Claimed {
                object: object.clone(),
                pod: None,
            },
        );
        return (StatusCode::CREATED, axum::Json(object)).into_response();
    }
    let warm = {
        let mut cluster = shared.lock();
        cluster.warm.get_mut(&pool).and_then(Vec::pop)
    };
    let answer = object.clone();
    match warm {
        Some(pod) => {
            // Adopted: ready at once; the pool is refilled.
            ready(&mut object, &format!("{pool}-{suffix}"), &pod);
            let mut cluster = shared.lock();
            cluster.adopted += 1;
            cluster.claims.insert(name, Claimed { object, pod: Some(pod) });
            drop(cluster);
            shared.refill(pool);
        }
        None => {
            shared.lock().claims.insert(name.clone(), Claimed { object, pod: None });
            let shared = shared.clone();
            tokio::spawn(async move {
                let Ok(pod) = shared.start_pod().await else { return };
                let mut cluster = shared.lock();
                cluster.cold += 1;
                // A claim deleted while its pod started takes the pod with it.
                if let Some(claimed) = cluster.claims.get_mut(&name) {
                    ready(&mut claimed.object, &format!("{pool}-{suffix}"), &pod);
                    claimed.pod = Some(pod);
                }
            });
        }
    }
    (StatusCode::CREATED, axum::Json(answer)).into_response()
}

async fn get(
    State(shared): State<Shared>,
    UrlPath((namespace, name)): UrlPath<(String, String)>,
    headers: HeaderMap,
) -> Response {
    if let Some(refusal) = refused(&shared, &headers, "get", &namespace) {
        return refusal;
    }
    let cluster = shared.lock();
    match cluster.claims.get(&name) {
        Some(claimed) if claimed.object["metadata"]["namespace"] == namespace => {
            axum::Json(claimed.object.clone()).into_response()
        }
        _ => status(
            404,
            "NotFound",
            &format!("sandboxclaims.extensions.agents.x-k8s.io \"{name}\" not found"),
        ),
    }
}

async fn delete(
    State(shared): State<Shared>,
    UrlPath((namespace, name)): UrlPath<(String, String)>,
    headers: HeaderMap,
) -> Response {
    if let Some(refusal) = refused(&shared, &headers, "delete", &namespace) {
        return refusal;
    }
    let removed = {
        let mut cluster = shared.lock();
        let removed = cluster.claims.remove(&name);
        if removed.is_some() {
            cluster.deleted.push(name.clone());
        }
        removed
    };
    match removed {
        // Its pod goes with it (killed, its files removed).
        Some(claimed) => {
            drop(claimed.pod);
            axum::Json(
                json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": name, "group": "extensions.agents.x-k8s.io", "kind": "sandboxclaims"}}),
            )
            .into_response()
        }
        None => status(
            404,
            "NotFound",
            &format!("sandboxclaims.extensions.agents.x-k8s.io \"{name}\" not found"),
        ),
    }
}
