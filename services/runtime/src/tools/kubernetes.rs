//! The `kubernetes` provider's claims: a sandbox pod per image, got through
//! the agent-sandbox API (`SandboxClaim`, `extensions.agents.x-k8s.io/v1beta1`,
//! as of agent-sandbox v0.5.6).
//!
//! A claim names the `SandboxWarmPool` of the image's environment; the
//! controller hands it a pre-warmed pod of the pool's `SandboxTemplate` (or
//! starts one) and mirrors the pod's addresses into the claim's status. The
//! runtime then claims the pod's `avm sandbox` over gRPC, as a pool's. The
//! claim is deleted when its agent goes, and carries a shutdown time so the
//! controller deletes it whatever becomes of the runtime.
//!
//! The runtime needs only `create`, `get` and `delete` on `sandboxclaims`
//! in its namespace: readiness is polled, not watched.

use std::time::{Duration, Instant, SystemTime};

use avm_common::backoff::Backoff;
use avm_sandbox::{KubernetesSandboxes, SandboxEnvironment, ToolFailure};
use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};

const GROUP: &str = "extensions.agents.x-k8s.io";
const VERSION: &str = "v1beta1";

/// The claims' API, reached on first use.
#[derive(Debug)]
pub struct Claims {
    settings: KubernetesSandboxes,
    api: tokio::sync::OnceCell<Api<DynamicObject>>,
}

/// A claimed sandbox pod: deleted (with its pod) when dropped.
#[derive(Debug)]
pub struct Claim {
    api: Api<DynamicObject>,
    name: String,
    /// When the controller deletes it on its own.
    pub expires: Instant,
}

impl Drop for Claim {
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (api, name) = (self.api.clone(), std::mem::take(&mut self.name));
        runtime.spawn(async move {
            match api.delete(&name, &DeleteParams::background()).await {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(err) => tracing::warn!(
                    claim = %name,
                    error = %refusal("delete", &err),
                    "cannot delete a sandbox claim; the controller deletes it at its shutdown time"
                ),
            }
        });
    }
}

impl Claims {
    /// Checks the settings; the API server is reached on the first claim.
    pub fn new(settings: &KubernetesSandboxes) -> Result<Self, String> {
        let field = |name: &str| format!("[runtime.sandbox.kubernetes] {name}");
        if let Some(namespace) = &settings.namespace {
            dns_name(namespace, 63).map_err(|why| format!("{}: {why}", field("namespace")))?;
        }
        for (environment, pool) in [
            SandboxEnvironment::Shell,
            SandboxEnvironment::Python,
            SandboxEnvironment::Node,
        ]
        .map(|environment| (environment, settings.warm_pools.of(environment)))
        {
            dns_name(pool, 253)
                .map_err(|why| format!("{}: {why}", field(&format!("warm_pools.{}", environment.name()))))?;
        }
        if settings.port == 0 {
            return Err(format!("{} must be a port (1-65535)", field("port")));
        }
        if settings.ready_timeout_seconds == 0 {
            return Err(format!("{} must be at least 1", field("ready_timeout_seconds")));
        }
        if settings.lifetime_seconds < 600 {
            return Err(format!(
                "{} must be at least 600: a claim is replaced a few minutes before it ends",
                field("lifetime_seconds")
            ));
        }
        Ok(Self {
            settings: settings.clone(),
            api: tokio::sync::OnceCell::new(),
        })
    }

    /// Returns the claims' API in the configured namespace.
    async fn api(&self) -> Result<&Api<DynamicObject>, ToolFailure> {
        self.api
            .get_or_try_init(|| async {
                // The process has two TLS backends linked in (this one and
                // another crate's): the client's must be named. Already
                // installed is fine.
                let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
                let config = match &self.settings.kubeconfig {
                    Some(path) => {
                        let file = kube::config::Kubeconfig::read_from(path)
                            .map_err(|err| format!("cannot read the kubeconfig {}: {err}", path.display()))?;
                        kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
                            .await
                            .map_err(|err| format!("cannot use the kubeconfig {}: {err}", path.display()))?
                    }
                    None => kube::Config::infer()
                        .await
                        .map_err(|err| format!("cannot find the Kubernetes API server: {err}"))?,
                };
                let namespace = self
                    .settings
                    .namespace
                    .clone()
                    .unwrap_or_else(|| config.default_namespace.clone());
                let client =
                    kube::Client::try_from(config).map_err(|err| format!("cannot make a Kubernetes client: {err}"))?;
                let gvk = GroupVersionKind::gvk(GROUP, VERSION, "SandboxClaim");
                let resource = ApiResource::from_gvk_with_plural(&gvk, "sandboxclaims");
                Ok::<_, ToolFailure>(Api::namespaced_with(client, &namespace, &resource))
            })
            .await
    }

    /// Claims a sandbox pod of `environment`'s warm pool for `image_id` and
    /// waits until it is ready; returns the claim and the pod's `avm sandbox`.
    pub async fn claim(&self, image_id: &str, environment: SandboxEnvironment) -> Result<(Claim, String), ToolFailure> {
        let api = self.api().await?.clone();
        let lifetime = Duration::from_secs(self.settings.lifetime_seconds);
        let mut labels = json!({
            "app.kubernetes.io/managed-by": "agentvm",
            "agentvm.io/environment": environment.name(),
        });
        if dns_label_value(image_id) {
            labels["agentvm.io/image"] = json!(image_id);
        }
        let object = json!({
            "apiVersion": format!("{GROUP}/{VERSION}"),
            "kind": "SandboxClaim",
            "metadata": {"generateName": "avm-sandbox-", "labels": labels},
            "spec": {
                "warmPoolRef": {"name": self.settings.warm_pools.of(environment)},
                "lifecycle": {
                    "shutdownTime": humantime::format_rfc3339_seconds(SystemTime::now() + lifetime).to_string(),
                    "shutdownPolicy": "Delete",
                },
            },
        });
        let object: DynamicObject =
            serde_json::from_value(object).map_err(|err| format!("cannot make a sandbox claim: {err}"))?;
        let created = api
            .create(&PostParams::default(), &object)
            .await
            .map_err(|err| refusal("create", &err))?;
        let Some(name) = created.metadata.name else {
            return Err("Kubernetes made a sandbox claim without a name".to_owned());
        };
        let claim = Claim {
            api: api.clone(),
            name: name.clone(),
            expires: Instant::now() + lifetime,
        };
        let timeout = Duration::from_secs(self.settings.ready_timeout_seconds);
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::new(Duration::from_millis(25), Duration::from_millis(400));
        let mut pause = backoff.next_pause();
        loop {
            let current = api.get(&name).await.map_err(|err| refusal("get", &err))?;
            if let Some(address) = ready_address(&current.data) {
                let url = match address {
                    std::net::IpAddr::V4(ip) => format!("http://{ip}:{}", self.settings.port),
                    std::net::IpAddr::V6(ip) => format!("http://[{ip}]:{}", self.settings.port),
                };
                return Ok((claim, url));
            }
            if Instant::now() + pause > deadline {
                let why = not_ready(&current.data);
                return Err(format!(
                    "the sandbox claim {name} (warm pool {}) had no ready pod within {timeout:?}{why}",
                    self.settings.warm_pools.of(environment)
                ));
            }
            tokio::time::sleep(pause).await;
            pause = backoff.next_pause();
        }
    }
}

/// Returns the pod address of a claim whose `Ready` condition is true.
fn ready_address(claim: &Value) -> Option<std::net::IpAddr> {
    let status = &claim["status"];
    let ready = status["conditions"]
        .as_array()?
        .iter()
        .any(|condition| condition["type"] == "Ready" && condition["status"] == "True");
    if !ready {
        return None;
    }
    status["sandbox"]["podIPs"]
        .as_array()?
        .iter()
        .find_map(|ip| ip.as_str()?.parse().ok())
}

/// Says why a claim is not ready, from its `Ready` condition.
fn not_ready(claim: &Value) -> String {
    let conditions = claim["status"]["conditions"].as_array();
    let ready = conditions.and_then(|all| all.iter().find(|condition| condition["type"] == "Ready"));
    match ready {
        Some(condition) => format!(
            " ({}: {})",
            condition["reason"].as_str().unwrap_or("no reason"),
            condition["message"].as_str().unwrap_or("")
        ),
        None => " (the agent-sandbox controller has not answered it: is it running?)".to_owned(),
    }
}

/// Says what Kubernetes refused, and what an operator does about it.
fn refusal(verb: &str, err: &kube::Error) -> ToolFailure {
    match err {
        kube::Error::Api(status) => {
            let hint = match status.code {
                401 | 403 => format!(
                    "; the runtime's ServiceAccount needs create, get and delete on sandboxclaims.{GROUP} in its \
                     namespace (the chart's Role grants them)"
                ),
                404 if verb == "create" => format!(
                    "; is agent-sandbox (v0.5.6 or later, with its extensions) installed, serving {GROUP}/{VERSION}?"
                ),
                _ => String::new(),
            };
            format!(
                "Kubernetes refused to {verb} a sandbox claim ({} {}): {}{hint}",
                status.code, status.reason, status.message
            )
        }
        other => format!("cannot reach the Kubernetes API server to {verb} a sandbox claim: {other}"),
    }
}

/// Checks a DNS-1123 name (a namespace: a label of 63; an object: a subdomain of 253).
fn dns_name(name: &str, max: usize) -> Result<(), String> {
    let label_ok = |label: &str| {
        !label.is_empty()
            && label.len() <= 63
            && label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !label.starts_with('-')
            && !label.ends_with('-')
    };
    let ok = name.len() <= max
        && if max == 63 {
            label_ok(name)
        } else {
            name.split('.').all(label_ok)
        };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not a Kubernetes name (lowercase letters, digits and '-', at most {max} characters)"
        ))
    }
}

/// Whether `value` may be a label's value.
fn dns_label_value(value: &str) -> bool {
    value.len() <= 63
        && value.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && value.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && value.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_is_ready_with_its_ready_condition_and_a_pod_address() {
        let ready = json!({"status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "sandbox": {"name": "s", "podIPs": ["10.1.2.3"]},
        }});
        assert_eq!(ready_address(&ready), Some("10.1.2.3".parse().unwrap()));
        let waiting = json!({"status": {
            "conditions": [{"type": "Ready", "status": "False", "reason": "SandboxNotReady", "message": "pulling"}],
            "sandbox": {"podIPs": ["10.1.2.3"]},
        }});
        assert_eq!(ready_address(&waiting), None);
        assert_eq!(not_ready(&waiting), " (SandboxNotReady: pulling)");
        let no_pod = json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}});
        assert_eq!(ready_address(&no_pod), None);
        assert!(not_ready(&json!({})).contains("controller"));
    }

    #[test]
    fn bad_settings_are_refused_with_the_setting_named() {
        let mut settings = KubernetesSandboxes::default();
        assert!(Claims::new(&settings).is_ok());
        settings.warm_pools.python = "Bad_Pool".to_owned();
        let err = Claims::new(&settings).unwrap_err();
        assert!(err.contains("warm_pools.python"), "{err}");
        settings = KubernetesSandboxes {
            namespace: Some("a".repeat(64)),
            ..KubernetesSandboxes::default()
        };
        assert!(Claims::new(&settings).unwrap_err().contains("namespace"));
        settings = KubernetesSandboxes {
            lifetime_seconds: 60,
            ..KubernetesSandboxes::default()
        };
        assert!(Claims::new(&settings).unwrap_err().contains("lifetime_seconds"));
        assert!(dns_label_value("img_0123abc"));
        assert!(!dns_label_value(&"x".repeat(64)));
        assert!(!dns_label_value("a\0b"));
    }
}
