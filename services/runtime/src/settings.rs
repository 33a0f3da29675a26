//! The LLM settings a turn runs with, from the config service: the system
//! layers followed live through `WatchConfig`, each tenant's effective
//! configuration fetched when its first turn needs it and dropped when the
//! config service says it changed. A changed model or key applies from the
//! next turn, without a restart, and no turn waits on the config service
//! once its tenant is known.

use avm_common::backoff::Backoff;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use avm_common::RequestContext;
use avm_common::auth::ServiceIdentity;
use avm_common::settings::{LLM_API_KEY, LLM_BASE_URL, LLM_PROVIDER};
use futures::StreamExt;
use serde_json::{Map, Value};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::{BillingConfig, LlmConfig};
use crate::error::RuntimeError;
use crate::llm::{LlmProvider, build_provider};
use crate::peers::{ConfigSource, ConfigUpdate, Configs};

/// How long a turn waits for the first system configuration.
const FIRST_SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(5);

/// Tenants whose settings are kept; past it the cache starts over (a fetch
/// per tenant is cheap, unbounded memory is not).
const MAX_CACHED_TENANTS: usize = 10_000;

/// Distinct provider clients kept (one per provider, URL, key and timeouts).
const MAX_CACHED_PROVIDERS: usize = 1_000;

/// What one tenant's turns run with.
pub struct TenantLlm {
    pub config: LlmConfig,
    pub provider: Arc<dyn LlmProvider>,
    /// Prices and markup.
    pub billing: BillingConfig,
    /// Whether the API key is the tenant's own (its calls are not billed).
    pub own_key: bool,
}

type ProviderKey = (&'static str, Option<String>, Option<String>, Duration, Duration);

struct Inner {
    config: Configs,
    identity: ServiceIdentity,
    /// The system layers (defaults, deployment, system overrides), revealed.
    system: watch::Sender<Option<Arc<Map<String, Value>>>>,
    tenants: Mutex<HashMap<String, Arc<TenantLlm>>>,
    providers: Mutex<HashMap<ProviderKey, Arc<dyn LlmProvider>>>,
    /// Bumped by every invalidation, so a fetch that raced with one is not cached.
    epoch: AtomicU64,
}

/// The runtime's live view of the LLM settings; cheap to clone.
#[derive(Clone)]
pub struct LlmSettings {
    inner: Arc<Inner>,
}

impl LlmSettings {
    /// Returns the config service these settings are read from.
    pub(crate) fn configs(&self) -> Configs {
        self.inner.config.clone()
    }

    /// Returns settings read from the config service.
    pub fn new(config: Configs, identity: ServiceIdentity) -> Self {
        let (system, _) = watch::channel(None);
        Self {
            inner: Arc::new(Inner {
                config,
                identity,
                system,
                tenants: Mutex::new(HashMap::new()),
                providers: Mutex::new(HashMap::new()),
                epoch: AtomicU64::new(0),
            }),
        }
    }

    fn tenants(&self) -> MutexGuard<'_, HashMap<String, Arc<TenantLlm>>> {
        self.inner.tenants.lock().unwrap_or_else(|poison| poison.into_inner())
    }

    /// Forgets every tenant's settings (or one tenant's).
    fn invalidate(&self, tenant_id: Option<&str>) {
        self.inner.epoch.fetch_add(1, Ordering::SeqCst);
        let mut tenants = self.tenants();
        match tenant_id {
            Some(tenant_id) => {
                tenants.remove(tenant_id);
            }
            None => tenants.clear(),
        }
    }

    /// Returns what the caller's tenant runs with now.
    pub async fn for_tenant(&self, ctx: &RequestContext) -> Result<Arc<TenantLlm>, RuntimeError> {
        if let Some(known) = self.tenants().get(&ctx.tenant_id) {
            return Ok(Arc::clone(known));
        }
        let system = self.system().await?;
        let epoch = self.inner.epoch.load(Ordering::SeqCst);
        let service = self.inner.identity.context_for(ctx).await?;
        let entries = self.inner.config.effective(&service).await?;
        let mut tree: Map<String, Value> = entries
            .iter()
            .map(|entry| (entry.key.clone(), entry.value.clone()))
            .collect();
        // A tenant that chose another provider does not inherit the
        // deployment's API root, which belongs to the deployment's provider.
        let tenants = |key: &str| {
            entries
                .iter()
                .any(|entry| entry.key == key && entry.source == ConfigSource::Tenant)
        };
        let provider_is_tenants = tenants(LLM_PROVIDER);
        if provider_is_tenants && !tenants(LLM_BASE_URL) && tree.get(LLM_PROVIDER) != system.get(LLM_PROVIDER) {
            tree.insert(LLM_BASE_URL.to_owned(), Value::Null);
        }
        let config = LlmConfig::from_settings(&tree);
        let tenant = Arc::new(TenantLlm {
            provider: self.provider(&config)?,
            config,
            billing: BillingConfig::from_settings(&tree),
            own_key: tenants(LLM_API_KEY),
        });
        let mut tenants = self.tenants();
        if self.inner.epoch.load(Ordering::SeqCst) == epoch {
            if tenants.len() >= MAX_CACHED_TENANTS {
                tenants.clear();
            }
            tenants.insert(ctx.tenant_id.clone(), Arc::clone(&tenant));
        }
        Ok(tenant)
    }

    /// Returns the system layers, waiting briefly for the first snapshot.
    async fn system(&self) -> Result<Arc<Map<String, Value>>, RuntimeError> {
        let mut system = self.inner.system.subscribe();
        match tokio::time::timeout(FIRST_SNAPSHOT_TIMEOUT, system.wait_for(Option::is_some)).await {
            Ok(Ok(tree)) => Ok(tree.as_ref().map(Arc::clone).unwrap_or_default()),
            _ => Err(RuntimeError::ConfigUnavailable),
        }
    }

    /// Returns the provider client for `config`, sharing one per distinct setup.
    fn provider(&self, config: &LlmConfig) -> Result<Arc<dyn LlmProvider>, RuntimeError> {
        let key: ProviderKey = (
            config.provider_kind().as_str(),
            config.base_url.clone(),
            config.api_key.expose().map(str::to_owned),
            config.request_timeout,
            config.idle_timeout,
        );
        let mut providers = self.inner.providers.lock().unwrap_or_else(|poison| poison.into_inner());
        if let Some(provider) = providers.get(&key) {
            return Ok(Arc::clone(provider));
        }
        let provider = build_provider(config).map_err(|err| RuntimeError::LlmMisconfigured(err.to_string()))?;
        if providers.len() >= MAX_CACHED_PROVIDERS {
            providers.clear();
        }
        providers.insert(key, Arc::clone(&provider));
        Ok(provider)
    }

    /// Follows the config service until `shutdown`, reconnecting with backoff.
    pub fn spawn_watch(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        let settings = self.clone();
        tokio::spawn(async move {
            let mut backoff = Backoff::default();
            loop {
                let result = tokio::select! {
                    () = shutdown.cancelled() => break,
                    result = settings.follow(&mut backoff) => result,
                };
                // Whatever changed while disconnected is unknown: start over.
                settings.invalidate(None);
                if let Err(err) = result {
                    tracing::warn!(error = %err, "config watch ended; reconnecting");
                }
                if !backoff.wait(&shutdown).await {
                    break;
                }
            }
        })
    }

    /// Applies one watch until it ends.
    async fn follow(&self, backoff: &mut Backoff) -> Result<(), RuntimeError> {
        let ctx = self.inner.identity.own_context().await?;
        let mut stream = self.inner.config.watch(&ctx).await?;
        while let Some(update) = stream.next().await.transpose()? {
            match update {
                ConfigUpdate::System {
                    revision,
                    snapshot,
                    tree,
                } => {
                    // The provider that will answer, so an operator sees at start
                    // and on every change whether replies come from a real LLM.
                    let llm = LlmConfig::from_settings(&tree);
                    let (provider, model) = (llm.provider_kind().as_str(), llm.answering_model(None));
                    tracing::info!(revision, snapshot, provider, model, "llm settings loaded");
                    self.inner.system.send_replace(Some(Arc::new(tree)));
                    self.invalidate(None);
                    backoff.reset();
                }
                ConfigUpdate::TenantChanged { revision, tenant_id } => {
                    tracing::debug!(%tenant_id, revision, "tenant settings changed");
                    self.invalidate(Some(&tenant_id));
                }
            }
        }
        Err(RuntimeError::Api(avm_common::ApiError::unavailable(
            "CONFIG_WATCH_ENDED",
            "the config service ended the watch",
        )))
    }
}
