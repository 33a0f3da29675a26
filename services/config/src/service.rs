//! The configuration center: layering, validation, secrets, change events.
//!
//! Layers, lowest first: built-in defaults and the deployment (file,
//! environment, flags) as the binary loaded them, then stored system
//! overrides, then the tenant's own overrides. Secrets are sealed at rest and
//! shown redacted to everyone but AgentVM's own components.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use crate::schema::{self, KeySpec};
use avm_common::RequestContext;
use avm_common::auth::{Role, Scopes};
use avm_common::config::REDACTED;
use avm_common::settings::{LLM_API_KEY, LLM_BASE_URL, LLM_PROVIDER};
use avm_store::events::EventBus;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt, future};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;
use tracing::instrument;

use crate::cipher::SecretCipher;
use crate::error::ConfigError;
use crate::store::{Change, ConfigStore, SYSTEM_SCOPE, StoredValue};

/// How long a watcher waits for the cross-replica feed to go live.
const FEED_READY_TIMEOUT: Duration = Duration::from_secs(5);

/// Most keys one update may change.
pub const MAX_VALUES_PER_UPDATE: usize = 100;

/// The provider that answers without a network.
const OFFLINE_PROVIDER: &str = "offline";

/// The deployment's layers as the binary loaded them: flat trees of dotted
/// keys to JSON values, secrets in clear (they never leave this service
/// unredacted, except to AgentVM's components).
#[derive(Clone, Debug, Default)]
pub struct Deployment {
    /// AgentVM's built-in defaults.
    pub defaults: Map<String, Value>,
    /// The effective values of defaults, file, environment and flags.
    pub values: Map<String, Value>,
}

/// Which layer a value comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Default,
    Deployment,
    System,
    Tenant,
}

/// One key's effective value.
#[derive(Clone, Debug, PartialEq)]
pub struct EntryView {
    pub spec: &'static KeySpec,
    /// `null` when unset; `"<redacted>"` for a set secret shown to a non-component.
    pub value: Value,
    pub source: Source,
}

/// The effective configuration of a scope at a revision.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub revision: u64,
    pub entries: Vec<EntryView>,
}

/// Whose overrides an update changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpdateScope {
    System,
    /// A tenant; empty means the caller's.
    Tenant(String),
}

/// A change, as every replica's watchers hear it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigChanged {
    pub revision: u64,
    /// The tenant whose overrides changed; `None` for the system's.
    pub tenant_id: Option<String>,
}

/// One message of a watch.
#[derive(Clone, Debug, PartialEq)]
pub enum WatchUpdate {
    /// The effective entries of the watched scope; `snapshot` on the first.
    Entries { snapshot: bool, state: Snapshot },
    /// For whole-deployment watchers: a tenant's overrides changed.
    TenantChanged { revision: u64, tenant_id: String },
}

/// The stream of a watch.
pub type WatchStream = BoxStream<'static, Result<WatchUpdate, ConfigError>>;

struct Inner {
    store: Arc<dyn ConfigStore>,
    deployment: Deployment,
    cipher: SecretCipher,
    events: Arc<EventBus<ConfigChanged>>,
}

/// The config service.
#[derive(Clone)]
pub struct ConfigService {
    inner: Arc<Inner>,
}

impl ConfigService {
    /// Returns the service over `store`, with the deployment's layers and
    /// the key material that seals stored secrets.
    pub fn new(store: Arc<dyn ConfigStore>, deployment: Deployment, secret_key: &str) -> Result<Self, ConfigError> {
        let cipher = SecretCipher::new(secret_key)?;
        let events = Arc::new(EventBus::new("config", store.event_transport()));
        Ok(Self {
            inner: Arc::new(Inner {
                store,
                deployment,
                cipher,
                events,
            }),
        })
    }

    /// Returns the store (for the credentials, which keep beside the overrides).
    pub(crate) fn store(&self) -> &dyn ConfigStore {
        self.inner.store.as_ref()
    }

    /// Seals a value bound to its scope and key, as secrets are.
    pub(crate) fn seal(&self, scope: &str, key: &str, plain: &str) -> Result<String, ConfigError> {
        self.inner.cipher.seal(&seal_context(scope, key), plain)
    }

    /// Opens a value sealed by [`Self::seal`].
    pub(crate) fn open(&self, scope: &str, key: &str, sealed: &str) -> Result<String, ConfigError> {
        self.inner.cipher.open(&seal_context(scope, key), key, sealed)
    }

    /// Follows every replica's changes (Postgres `LISTEN`) until `shutdown`;
    /// a finished task when changes stay in process (SQLite).
    pub fn spawn_background(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        Arc::clone(&self.inner.events).spawn_listener(shutdown)
    }

    /// Returns the effective configuration of a tenant (the caller's when
    /// `tenant_id` is empty), or of the system layers alone; one key when
    /// `key` is not empty.
    #[instrument(name = "config.get_config", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn get(
        &self,
        ctx: &RequestContext,
        tenant_id: &str,
        system_only: bool,
        key: &str,
    ) -> Result<Snapshot, ConfigError> {
        ctx.require(Scopes::READ)?;
        let tenant = target_tenant(ctx, tenant_id)?;
        let only = match key {
            "" => None,
            key => Some(known(key)?),
        };
        if let Some(spec) = only
            && !shows(ctx, spec)
        {
            return Err(operator_setting(spec));
        }
        let tenant = (!system_only).then_some(tenant.as_str());
        let mut snapshot = self.snapshot(tenant, Audience::of(ctx)).await?;
        if let Some(spec) = only {
            snapshot.entries.retain(|entry| entry.spec.key == spec.key);
        }
        Ok(snapshot)
    }

    /// Sets (or, with a JSON `null`, removes) overrides of a scope; `values`
    /// maps keys to JSON text. Every key is checked before anything is stored.
    #[instrument(name = "config.update_config", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn update(
        &self,
        ctx: &RequestContext,
        scope: UpdateScope,
        values: &[(String, String)],
    ) -> Result<Snapshot, ConfigError> {
        ctx.require(Scopes::WRITE)?;
        let tenant = match &scope {
            UpdateScope::System => {
                ctx.principal.require_operator()?;
                None
            }
            UpdateScope::Tenant(tenant_id) => {
                ctx.principal.require_admin()?;
                Some(target_tenant(ctx, tenant_id)?)
            }
        };
        if values.is_empty() {
            return Err(ConfigError::invalid("NO_CONFIG_VALUES", "no values to set"));
        }
        if values.len() > MAX_VALUES_PER_UPDATE {
            return Err(ConfigError::invalid(
                "TOO_MANY_CONFIG_VALUES",
                format!("at most {MAX_VALUES_PER_UPDATE} keys may change at once"),
            ));
        }
        let store_scope = tenant.as_deref().unwrap_or(SYSTEM_SCOPE);
        let mut changes = Vec::new();
        for (key, json) in values {
            if let Some(change) = self.change(store_scope, tenant.is_some(), key, json)? {
                changes.push(change);
            }
        }
        let revision = if changes.is_empty() {
            self.inner.store.revision().await?
        } else {
            let by = &ctx.principal.user_id;
            let revision = self
                .inner
                .store
                .apply(store_scope, &changes, by, avm_common::now_ms())
                .await?;
            let keys: BTreeSet<&str> = changes.iter().map(|change| change.key.as_str()).collect();
            tracing::info!(
                scope = tenant.as_deref().unwrap_or("system"),
                ?keys,
                revision,
                "config updated"
            );
            self.inner
                .events
                .emit(ConfigChanged {
                    revision,
                    tenant_id: tenant.clone(),
                })
                .await;
            revision
        };
        let mut snapshot = self.snapshot(tenant.as_deref(), Audience::of(ctx)).await?;
        snapshot.revision = snapshot.revision.max(revision);
        Ok(snapshot)
    }

    /// Returns the stored form of one requested change, `None` when it keeps
    /// the stored value (a secret's redacted form).
    fn change(&self, scope: &str, for_tenant: bool, key: &str, json: &str) -> Result<Option<Change>, ConfigError> {
        let spec = known(key)?;
        if !spec.writable {
            return Err(ConfigError::invalid(
                "READ_ONLY_CONFIG_KEY",
                format!(
                    "{key} is set by the deployment (configuration file, environment or flags), not through the API"
                ),
            ));
        }
        if for_tenant && !spec.tenant_overridable {
            return Err(ConfigError::invalid(
                "NOT_TENANT_OVERRIDABLE",
                format!("{key} applies to the whole deployment; a tenant cannot override it"),
            ));
        }
        let value: Value = serde_json::from_str(json)
            .map_err(|_| ConfigError::invalid("INVALID_CONFIG_VALUE", format!("{key}: the value is not valid JSON")))?;
        if spec.secret && value.as_str() == Some(REDACTED) {
            return Ok(None);
        }
        if value.is_null() {
            return Ok(Some(Change {
                key: key.to_owned(),
                value: None,
            }));
        }
        let value = spec
            .check(&value)
            .map_err(|why| ConfigError::invalid("INVALID_CONFIG_VALUE", format!("{key}: {why}")))?;
        let stored = if spec.secret {
            StoredValue {
                key: key.to_owned(),
                value: self.inner.cipher.seal(&seal_context(scope, key), &value.to_string())?,
                encrypted: true,
            }
        } else {
            StoredValue {
                key: key.to_owned(),
                value: value.to_string(),
                encrypted: false,
            }
        };
        Ok(Some(Change {
            key: key.to_owned(),
            value: Some(stored),
        }))
    }

    /// Streams the effective configuration of a tenant (the caller's when
    /// `tenant_id` is empty) now and after every change that touches it; with
    /// `all_tenants` (components only), the system layers and a notice for
    /// each tenant's change.
    #[instrument(name = "config.watch_config", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn watch(
        &self,
        ctx: &RequestContext,
        tenant_id: &str,
        all_tenants: bool,
    ) -> Result<WatchStream, ConfigError> {
        ctx.require(Scopes::READ)?;
        let tenant = if all_tenants {
            ctx.principal.require_service()?;
            None
        } else {
            Some(target_tenant(ctx, tenant_id)?)
        };
        let audience = Audience::of(ctx);
        let events = &self.inner.events;
        events.wait_live(FEED_READY_TIMEOUT).await?;
        // Subscribe before reading the snapshot, so no change falls in
        // between; a change in both is skipped by its revision.
        let live = events.subscribe();
        let first = self.snapshot(tenant.as_deref(), audience).await?;
        // Each change is announced after its commit by the replica that made
        // it, so announcements may arrive out of revision order (6 before 5).
        // A state re-read after a change covers every change up to the
        // revision it read, whatever order they were announced in; a
        // tenant's change that a whole-deployment watch only notices is
        // covered by nothing but its own notice (or the first snapshot).
        let since = first.revision;
        let mut read = first.revision;
        let service = self.clone();
        let updates = live.filter_map(move |event| {
            let change = match event {
                Ok(change) => change,
                Err(err) => return future::ready(Some(Err(ConfigError::from(err)))).left_future(),
            };
            let notice = match (&tenant, &change.tenant_id) {
                (None, Some(tenant_id)) => Some(tenant_id.clone()),
                _ => None,
            };
            if let Some(tenant_id) = notice {
                let news = (change.revision > since).then_some(Ok(WatchUpdate::TenantChanged {
                    revision: change.revision,
                    tenant_id,
                }));
                return future::ready(news).left_future();
            }
            let concerns = match (&tenant, &change.tenant_id) {
                (Some(watched), Some(changed)) => watched == changed,
                _ => true,
            };
            if !concerns || change.revision <= read {
                return future::ready(None).left_future();
            }
            // Read ahead of the state, which covers at least this change.
            read = change.revision;
            let service = service.clone();
            let tenant = tenant.clone();
            async move {
                Some(service.snapshot(tenant.as_deref(), audience).await.map(|mut state| {
                    state.revision = state.revision.max(change.revision);
                    WatchUpdate::Entries { snapshot: false, state }
                }))
            }
            .right_future()
        });
        let first = WatchUpdate::Entries {
            snapshot: true,
            state: first,
        };
        Ok(futures::stream::once(future::ready(Ok(first))).chain(updates).boxed())
    }

    /// Computes the effective entries of the system layers, and of `tenant`'s
    /// overrides when given.
    async fn snapshot(&self, tenant: Option<&str>, audience: Audience) -> Result<Snapshot, ConfigError> {
        let reveal = audience.reveal;
        let store = &self.inner.store;
        let revision = store.revision().await?;
        let deployment = &self.inner.deployment;
        let mut entries: Vec<EntryView> = schema::KEYS
            .iter()
            .map(|spec| {
                let value = deployment.values.get(spec.key).cloned().unwrap_or(Value::Null);
                let source = if deployment.defaults.get(spec.key).unwrap_or(&Value::Null) == &value {
                    Source::Default
                } else {
                    Source::Deployment
                };
                EntryView { spec, value, source }
            })
            .collect();
        let mut layers = vec![(SYSTEM_SCOPE, Source::System)];
        if let Some(tenant) = tenant {
            layers.push((tenant, Source::Tenant));
        }
        let mut system_provider = None;
        for (scope, source) in layers {
            if source == Source::Tenant {
                system_provider = Some(answering_provider(&entries));
            }
            for stored in store.overrides(scope).await? {
                let Some(entry) = entries.iter_mut().find(|entry| entry.spec.key == stored.key) else {
                    // A key this version no longer knows stays stored, unused.
                    continue;
                };
                entry.value = self.stored_value(scope, &stored, reveal)?;
                entry.source = source;
            }
        }
        resolve_llm(&mut entries, system_provider.as_deref());
        entries.retain(|entry| audience.operator_settings || entry.spec.tenant_overridable);
        if !reveal {
            for entry in entries
                .iter_mut()
                .filter(|entry| entry.spec.secret && !entry.value.is_null())
            {
                entry.value = Value::String(REDACTED.to_owned());
            }
        }
        Ok(Snapshot { revision, entries })
    }

    /// Reads a stored value; a sealed one is opened only when it will be shown.
    fn stored_value(&self, scope: &str, stored: &StoredValue, reveal: bool) -> Result<Value, ConfigError> {
        let json = match (stored.encrypted, reveal) {
            (true, false) => return Ok(Value::String(REDACTED.to_owned())),
            (true, true) => self
                .inner
                .cipher
                .open(&seal_context(scope, &stored.key), &stored.key, &stored.value)?,
            (false, _) => stored.value.clone(),
        };
        serde_json::from_str(&json).map_err(|_| ConfigError::corrupt(format!("stored value of {}", stored.key)))
    }
}

/// Returns the LLM provider that answers with `entries`: the one set, else
/// `anthropic` when an API key is set and `offline` otherwise (the runtime's
/// rule, `LlmConfig::provider_kind`).
fn answering_provider(entries: &[EntryView]) -> String {
    let value = |key: &str| {
        entries
            .iter()
            .find(|entry| entry.spec.key == key)
            .map(|entry| &entry.value)
    };
    match value(LLM_PROVIDER).and_then(Value::as_str) {
        Some(provider) => provider.to_owned(),
        None if value(LLM_API_KEY).is_some_and(|key| !key.is_null()) => "anthropic".to_owned(),
        None => OFFLINE_PROVIDER.to_owned(),
    }
}

/// Makes the LLM entries say what a turn runs with, so `GET /v1/config`
/// shows the caller the values their own turns use: the provider that
/// answers (an unset one resolved), and no inherited API root for a tenant
/// that chose another provider than the system's (the root belongs to that
/// provider). The model stays as set: the offline provider answers as
/// `offline` whatever it says, and its replies and records say so.
fn resolve_llm(entries: &mut [EntryView], system_provider: Option<&str>) {
    let provider = answering_provider(entries);
    for entry in entries.iter_mut() {
        match entry.spec.key {
            LLM_PROVIDER => entry.value = Value::String(provider.clone()),
            LLM_BASE_URL
                if entry.source != Source::Tenant && system_provider.is_some_and(|system| system != provider) =>
            {
                entry.value = Value::Null;
            }
            _ => {}
        }
    }
}

/// Returns the spec of a key the tree has, or an error naming it.
fn known(key: &str) -> Result<&'static KeySpec, ConfigError> {
    schema::spec(key).ok_or_else(|| {
        ConfigError::invalid(
            "UNKNOWN_CONFIG_KEY",
            format!(
                "unknown key {}; known keys: {}",
                printable(key),
                schema::KEYS.iter().map(|spec| spec.key).collect::<Vec<_>>().join(", ")
            ),
        )
    })
}

/// Returns at most 64 characters of a caller's key, for an error message.
fn printable(key: &str) -> String {
    let shown: String = key.chars().take(64).collect();
    format!("{shown:?}")
}

/// Returns the tenant a call is about: the caller's when `tenant_id` is
/// empty or its own; another only for operators and components.
fn target_tenant(ctx: &RequestContext, tenant_id: &str) -> Result<String, ConfigError> {
    if tenant_id.is_empty() || tenant_id == ctx.tenant_id {
        return Ok(ctx.tenant_id.clone());
    }
    ctx.principal.require_operator()?;
    if tenant_id.len() > 128 || !tenant_id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ConfigError::invalid("INVALID_TENANT_ID", "invalid tenant id"));
    }
    Ok(tenant_id.to_owned())
}

/// Returns whether the caller sees secrets: AgentVM's own components only.
/// What a caller is shown of the configuration.
#[derive(Clone, Copy, Debug)]
struct Audience {
    /// Secrets in clear (AgentVM's components only).
    reveal: bool,
    /// The keys a tenant may not override: where the LLM is reached, the
    /// data directory, billing, the runtime's limits. They are the
    /// operator's, shown to operators and components only (issue 26 item 13);
    /// a tenant sees the settings it may change.
    operator_settings: bool,
}

impl Audience {
    fn of(ctx: &RequestContext) -> Self {
        Self {
            reveal: reveals(ctx),
            operator_settings: ctx.principal.role == Role::Service || ctx.principal.require_operator().is_ok(),
        }
    }
}

/// Returns whether the caller is shown `spec`.
fn shows(ctx: &RequestContext, spec: &KeySpec) -> bool {
    spec.tenant_overridable || Audience::of(ctx).operator_settings
}

/// Returns the refusal of a tenant asking for an operator's setting.
fn operator_setting(spec: &KeySpec) -> ConfigError {
    ConfigError::Api(avm_common::ApiError::new(
        avm_common::Code::PermissionDenied,
        "OPERATOR_REQUIRED",
        format!("{} is a setting of the deployment's operator", spec.key),
    ))
}

fn reveals(ctx: &RequestContext) -> bool {
    ctx.principal.role == Role::Service
}

/// Returns what a sealed value is bound to: its scope and key.
fn seal_context(scope: &str, key: &str) -> String {
    format!("{scope}/{key}")
}
