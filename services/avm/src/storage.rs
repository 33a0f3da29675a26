//! Where each service keeps its data, and opening each service on it: a
//! SQLite file per service under the data dir, or its own schema of
//! `AVM_DATABASE_URL`; the files `avm serve` keeps beside them (the admin
//! key, the key sealing stored secrets and signing keys).

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use avm_common::auth::AuthConfig;

use crate::AvmConfig;

/// The file the first run's admin API key is written to.
pub const ADMIN_KEY_FILE: &str = "admin.key";

/// The file `avm serve` keeps the config service's secret key in.
pub const CONFIG_KEY_FILE: &str = "config.key";

/// Returns the database url of `service`: its own file or schema of the
/// configured database, or a SQLite file under the data dir.
pub fn store_url(config: &AvmConfig, service: &str) -> anyhow::Result<String> {
    if let Some(url) = config.database.url.as_ref().and_then(|secret| secret.expose()) {
        return Ok(avm_store::db::service_url(url, service)?);
    }
    let dir = data_dir(config)?;
    Ok(format!("sqlite://{}", dir.join(format!("{service}.db")).display()))
}

/// Returns the data directory, creating it readable only by the user: it
/// holds the databases (the auth one with the token signing keys) and the
/// admin key.
pub fn data_dir(config: &AvmConfig) -> anyhow::Result<PathBuf> {
    let dir = config.server.data_dir();
    if !dir.exists() {
        let mut builder = std::fs::DirBuilder::new();
        builder.recursive(true);
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
        builder
            .create(&dir)
            .with_context(|| format!("cannot create data dir {}", dir.display()))?;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&dir)
            .with_context(|| format!("cannot read data dir {}", dir.display()))?
            .permissions()
            .mode();
        // Each component of `avm serve` asks for the directory: said once.
        static WARNED: std::sync::Once = std::sync::Once::new();
        if mode & 0o077 != 0 {
            WARNED.call_once(|| {
                tracing::warn!(
                    data_dir = %dir.display(),
                    mode = format!("{:o}", mode & 0o777),
                    "the data dir is readable by others; it holds signing keys (chmod 700 it)"
                );
            });
        }
    }
    Ok(dir)
}

/// Returns a url without the password a Postgres url may carry.
pub fn redact_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => format!("{}://…{}", &url[..scheme], &url[at..]),
        _ => url.to_owned(),
    }
}

/// Writes a secret to a new file readable only by its owner; an existing
/// file is never overwritten (`AlreadyExists`): a key shown once and lost
/// cannot be shown again.
pub fn write_private(path: &Path, secret: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options.open(path)?;
    writeln!(file, "{secret}")
}

/// Returns 256 random bits as hex, for keys a deployment makes itself.
pub fn random_key() -> String {
    let bits: [u64; 4] = rand::random();
    bits.iter().map(|b| format!("{b:016x}")).collect()
}

/// Opens the auth service's store, its signing keys sealed with the
/// deployment's secret key (or, `avm serve` only, the one kept in the data
/// dir), and, on a fresh store, creates the operator tenant and prints its
/// admin key once (and writes it to a file only the user can read).
pub async fn open_auth(
    config: &AvmConfig,
    auth_config: AuthConfig,
    allow_data_dir_key: bool,
) -> anyhow::Result<avm_auth::AuthService> {
    let url = store_url(config, "auth")?;
    let store = avm_auth::open_store(&url, config.database.max_connections).await?;
    let seal = avm_auth::KeySeal::new(&secret_key(config, allow_data_dir_key)?).map_err(avm_common::ApiError::from)?;
    let auth = avm_auth::AuthService::new(store, auth_config, seal).await?;
    if let Some(first) = auth.bootstrap().await? {
        let dir = data_dir(config)?;
        let path = save_admin_key(&dir, &first)?;
        let database = redact_url(&url);
        println!(
            "created the operator tenant {} in {database} with an admin API key (shown only this once):",
            first.tenant_id
        );
        println!();
        println!("    {}", first.secret);
        println!();
        println!("saved to {} (readable only by you)", path.display());
        if path.file_name() != Some(std::ffi::OsStr::new(ADMIN_KEY_FILE)) {
            let earlier = dir.join(ADMIN_KEY_FILE);
            println!(
                "{} was left as it is: it holds the admin key of another database's operator tenant \
                 (point AVM_DATABASE_URL at that database to use it)",
                earlier.display()
            );
            tracing::warn!(
                tenant_id = %first.tenant_id,
                file = %path.display(),
                kept = %earlier.display(),
                %database,
                "an empty database got its own operator tenant; the data dir's admin.key belongs to another database"
            );
        }
        tracing::info!(tenant_id = %first.tenant_id, key_id = %first.key_id, file = %path.display(), "first run: admin key created");
    }
    Ok(auth)
}

/// Writes a new operator tenant's admin key into `dir` without touching an
/// existing key file: `admin.key`, or, when that one exists (the operator
/// of another database, on the same data dir), `admin-<tenantId>.key`.
fn save_admin_key(dir: &Path, first: &avm_auth::Bootstrap) -> anyhow::Result<PathBuf> {
    let beside = format!("admin-{}.key", first.tenant_id);
    for name in [ADMIN_KEY_FILE, beside.as_str()] {
        let path = dir.join(name);
        match write_private(&path, &first.secret) {
            Ok(()) => return Ok(path),
            Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(err) => return Err(err).with_context(|| format!("cannot write {}", path.display())),
        }
    }
    bail!(
        "cannot save the admin key of the operator tenant {}: {} exists already",
        first.tenant_id,
        dir.join(beside).display()
    )
}

/// Returns the runtime's rules for MCP servers, which the services storing
/// their definitions (resources, images) apply at registration: every
/// component of a deployment reads the same `[runtime]` section.
fn mcp_rules(config: &AvmConfig) -> anyhow::Result<avm_common::mcp::McpServerRules> {
    Ok(avm_common::mcp::McpServerRules::new(
        config.runtime.mcp.allowed_commands.clone(),
        &config.runtime.fetch.allow,
    )?)
}

/// Opens the session service on its store.
pub async fn open_session(config: &AvmConfig) -> anyhow::Result<avm_session::SessionService> {
    let store = avm_session::open_store(&store_url(config, "session")?, config.database.max_connections).await?;
    Ok(avm_session::SessionService::new(store).with_mcp_rules(mcp_rules(config)?))
}

/// Opens the resource service on its store.
pub async fn open_resources(config: &AvmConfig) -> anyhow::Result<avm_resource::ResourceService> {
    let store = avm_resource::open_store(&store_url(config, "resource")?, config.database.max_connections).await?;
    Ok(avm_resource::ResourceService::new(store).with_mcp_rules(mcp_rules(config)?))
}

/// Opens the config service on its store, over the deployment's layers; its
/// secrets are sealed with the configured key, or (`avm serve` only) one
/// kept in the data dir.
pub async fn open_config(config: &AvmConfig, allow_data_dir_key: bool) -> anyhow::Result<avm_config::ConfigService> {
    let key = secret_key(config, allow_data_dir_key)?;
    let store = avm_config::open_store(&store_url(config, "config")?, config.database.max_connections).await?;
    Ok(avm_config::ConfigService::new(store, config.deployment(), &key)?)
}

/// Opens the observability service on its store.
pub async fn open_observability(config: &AvmConfig) -> anyhow::Result<avm_observability::ObservabilityService> {
    let store =
        avm_observability::open_store(&store_url(config, "observability")?, config.database.max_connections).await?;
    Ok(avm_observability::ObservabilityService::new(
        store,
        avm_observability::LedgerSettings::default(),
    ))
}

/// Returns the key material that seals stored secrets: the config
/// service's (LLM keys, MCP credentials) and the auth service's token
/// signing keys.
fn secret_key(config: &AvmConfig, allow_data_dir: bool) -> anyhow::Result<String> {
    if let Some(key) = config.config.secret_key.expose() {
        return Ok(key.to_owned());
    }
    if !allow_data_dir {
        bail!(
            "AVM_CONFIG_SECRET_KEY is required: 32+ random characters (e.g. `openssl rand -hex 32`), \
             the same on every config and auth replica; it encrypts stored secrets such as llm.apiKey \
             and the keys that sign access tokens"
        );
    }
    let path = data_dir(config)?.join(CONFIG_KEY_FILE);
    match std::fs::read_to_string(&path) {
        Ok(key) => Ok(key.trim().to_owned()),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
            let key = random_key();
            write_private(&path, &key).with_context(|| format!("cannot write {}", path.display()))?;
            tracing::info!(file = %path.display(), "made the key that encrypts stored secrets");
            Ok(key)
        }
        Err(err) => Err(err).with_context(|| format!("cannot read {}", path.display())),
    }
}
