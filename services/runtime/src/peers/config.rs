//! The config service, as the runtime reads it: a tenant's effective
//! settings, and the stream of changes.

use avm_common::RequestContext;
use avm_proto::config::v1 as pb;
use avm_proto::config::v1::ConfigServiceHandle;
use futures::stream::{BoxStream, StreamExt};
use serde_json::{Map, Value};

use crate::error::RuntimeError;

/// Which layer a value comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigSource {
    /// Built in, the deployment or the system overrides.
    System,
    /// The tenant's own override.
    Tenant,
}

/// One key of an effective configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigEntry {
    pub key: String,
    pub value: Value,
    pub source: ConfigSource,
}

/// One update of the watch.
#[derive(Clone, Debug, PartialEq)]
pub enum ConfigUpdate {
    /// The system layers as they are now (a snapshot, or after a change).
    System {
        revision: u64,
        snapshot: bool,
        tree: Map<String, Value>,
    },
    /// A tenant's overrides changed; what was known of it is stale.
    TenantChanged { revision: u64, tenant_id: String },
}

/// The config service as the runtime uses it; cheap to clone.
#[derive(Clone)]
pub struct Configs {
    service: ConfigServiceHandle,
}

impl Configs {
    /// Wraps the config service (in process or remote).
    pub fn new(service: ConfigServiceHandle) -> Self {
        Self { service }
    }

    /// Returns the effective configuration of the context's tenant (with secrets, for a service).
    pub async fn effective(&self, ctx: &RequestContext) -> Result<Vec<ConfigEntry>, RuntimeError> {
        let request = ctx.request(pb::GetConfigRequest::default());
        let entries = self.service.get_config(request).await?.into_inner().entries;
        Ok(entries.into_iter().filter_map(entry).collect())
    }

    /// Follows the system layers and every tenant's changes.
    pub async fn watch(
        &self,
        ctx: &RequestContext,
    ) -> Result<BoxStream<'static, Result<ConfigUpdate, RuntimeError>>, RuntimeError> {
        let request = ctx.request(pb::WatchConfigRequest {
            tenant_id: String::new(),
            all_tenants: true,
        });
        let stream = self.service.watch_config(request).await?.into_inner();
        Ok(stream
            .map(|item| {
                let update = item?;
                Ok(if update.changed_tenant_id.is_empty() {
                    ConfigUpdate::System {
                        revision: update.revision,
                        snapshot: update.snapshot,
                        tree: update
                            .entries
                            .into_iter()
                            .filter_map(entry)
                            .map(|entry| (entry.key, entry.value))
                            .collect(),
                    }
                } else {
                    ConfigUpdate::TenantChanged {
                        revision: update.revision,
                        tenant_id: update.changed_tenant_id,
                    }
                })
            })
            .boxed())
    }
}

/// Returns an entry whose value reads as JSON.
fn entry(entry: pb::Entry) -> Option<ConfigEntry> {
    let value = serde_json::from_str(&entry.value_json).ok()?;
    let source = if entry.source == pb::Source::Tenant as i32 {
        ConfigSource::Tenant
    } else {
        ConfigSource::System
    };
    Some(ConfigEntry {
        key: entry.key,
        value,
        source,
    })
}

/// The credentials users stored for MCP servers, read from the config
/// service with the runtime's own identity.
pub struct StoredCredentials {
    configs: Configs,
    identity: avm_common::auth::ServiceIdentity,
}

impl StoredCredentials {
    /// Reads through `configs` as `identity`.
    pub fn new(configs: Configs, identity: avm_common::auth::ServiceIdentity) -> Self {
        Self { configs, identity }
    }
}

#[async_trait::async_trait]
impl crate::tools::CredentialSource for StoredCredentials {
    async fn headers(
        &self,
        tenant_id: &str,
        user_id: &str,
        server: &str,
        url: &str,
    ) -> Result<Option<std::collections::BTreeMap<String, String>>, String> {
        let ctx = self
            .identity
            .tenant_context(tenant_id)
            .await
            .map_err(|err| err.message.clone())?;
        let request = ctx.request(pb::ResolveCredentialRequest {
            tenant_id: tenant_id.to_owned(),
            user_id: user_id.to_owned(),
            server: server.to_owned(),
            url: url.to_owned(),
        });
        let response = self
            .configs
            .service
            .resolve_credential(request)
            .await
            .map_err(|status| status.message().to_owned())?
            .into_inner();
        Ok(response.found.then(|| response.headers.into_iter().collect()))
    }

    async fn secrets(
        &self,
        tenant_id: &str,
        names: &[String],
    ) -> Result<std::collections::BTreeMap<String, String>, String> {
        let ctx = self
            .identity
            .tenant_context(tenant_id)
            .await
            .map_err(|err| err.message.clone())?;
        let request = ctx.request(pb::ResolveSecretsRequest {
            tenant_id: tenant_id.to_owned(),
            names: names.to_vec(),
        });
        let response = self
            .configs
            .service
            .resolve_secrets(request)
            .await
            .map_err(|status| status.message().to_owned())?
            .into_inner();
        Ok(response.values.into_iter().collect())
    }
}
