//! The domain logic: who may do what, ids, key and token minting, usage,
//! events and logs around the store.

use std::sync::Arc;
use std::time::Duration;

use avm_common::auth::{AuthConfig, Claims, Limits, Principal, Role, Scopes, TokenVerifier};
use avm_common::calendar::month_of;
use avm_common::ids::new_id;
use avm_common::{ApiError, RequestContext, now_ms};
use futures::StreamExt;
use futures::stream::BoxStream;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio_util::sync::CancellationToken;
use tracing::instrument;

use crate::api_key;
use crate::error::AuthError;
use crate::events::{AuthEvent, AuthEventKind, WatchItem};
use crate::oidc::ExternalIssuer;
use crate::record::{
    AccessToken, ApiKeyRecord, ApiKeySpec, CreatedApiKey, CreatedTenant, NewApiKey, QuotaState, Reach, ReserveOutcome,
    TenantRecord, TenantUpdate, TokenReservation, TombstoneKind, UsageRecord, UsageReport, UserRecord,
};
use crate::seal::KeySeal;
use crate::signing::{CURRENT_KEY_REFRESH, SigningKeys, StoreKeySource};
use crate::store::AuthStore;
use avm_store::events::{EventBus, FeedError};

/// The tenant id inside service principals' tokens.
pub const SERVICE_TENANT: &str = "system";
/// Longest tenant, user or key name, in characters.
pub const MAX_NAME_CHARS: usize = 128;
/// Longest id a caller may send, in bytes.
pub const MAX_ID_BYTES: usize = 128;
/// How long a watcher waits for the cross-replica feed before giving up.
const FEED_READY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a token reservation holds without its call's report: a runtime
/// that died mid-call must not hold a quota forever; a live call is reported
/// well before (the observability service's budget reservations last as long).
const RESERVATION_TTL: Duration = Duration::from_secs(600);

/// The live events and, first, what a new watcher must know.
pub type AuthEventStream = BoxStream<'static, Result<WatchItem, AuthError>>;

/// What `bootstrap` made: the operator tenant, its admin and their API key.
#[derive(Clone)]
pub struct Bootstrap {
    /// The operator tenant.
    pub tenant_id: String,
    /// Its admin user.
    pub user_id: String,
    /// The admin's API key.
    pub key_id: String,
    /// The full API key, shown this once.
    pub secret: String,
}

impl std::fmt::Debug for Bootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bootstrap")
            .field("tenant_id", &self.tenant_id)
            .field("user_id", &self.user_id)
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

struct Inner {
    store: Arc<dyn AuthStore>,
    config: AuthConfig,
    /// SHA-256 of the service key, compared in constant time at exchange.
    service_key_hash: Option<[u8; 32]>,
    signing: Arc<SigningKeys>,
    verifier: TokenVerifier,
    events: Arc<EventBus<AuthEvent>>,
    oidc: Option<ExternalIssuer>,
}

impl Inner {
    /// Sends an auth event, stamped now, to every watcher of every replica.
    async fn emit(&self, kind: AuthEventKind) {
        tracing::debug!(event = kind.name(), "auth event");
        self.events.emit(AuthEvent { at_ms: now_ms(), kind }).await;
    }
}

/// Returns the error ending a watcher's stream.
fn feed_error(err: FeedError) -> AuthError {
    match err {
        FeedError::Lagged => AuthError::EventsLagged,
        FeedError::Unavailable => AuthError::EventsUnavailable,
    }
}

/// Tenants, users, API keys, signing keys, usage and auth events.
///
/// Cheap to clone: everything sits behind an `Arc`.
#[derive(Clone)]
pub struct AuthService {
    inner: Arc<Inner>,
}

impl AuthService {
    /// Returns a service over `store`, checking `config` and making sure a
    /// current signing key exists, its private half sealed with `seal`.
    ///
    /// Keys stored plain by an earlier version are sealed now, and a current
    /// one among them is replaced (it lay in the database in the clear).
    pub async fn new(store: Arc<dyn AuthStore>, config: AuthConfig, seal: KeySeal) -> Result<Self, ApiError> {
        let service_key_hash = if config.service_key.is_set() {
            Some(sha256(config.require_service_key()?))
        } else {
            None
        };
        let oidc = config
            .oidc
            .as_ref()
            .map(|oidc| ExternalIssuer::new(oidc, config.leeway_secs()))
            .transpose()?;
        let events = Arc::new(EventBus::new("auth", store.event_transport()));
        let signing = Arc::new(SigningKeys::new(Arc::clone(&store), seal, Arc::clone(&events), &config));
        if signing.seal_plain_keys().await? {
            let kid = signing.rotate().await?;
            tracing::info!(kid = %kid, "signing key rotated: the previous one was stored unsealed");
        }
        let kid = signing.current_kid().await?;
        let verifier = TokenVerifier::new(
            &config,
            Arc::new(StoreKeySource {
                keys: Arc::clone(&signing),
            }),
        );
        tracing::debug!(kid = %kid, "auth service ready");
        Ok(Self {
            inner: Arc::new(Inner {
                store,
                config,
                service_key_hash,
                signing,
                verifier,
                events,
                oidc,
            }),
        })
    }

    /// Returns a verifier of this service's tokens, reading keys from the store.
    pub fn verifier(&self) -> TokenVerifier {
        self.inner.verifier.clone()
    }

    /// Creates the operator tenant `admin` with its admin user `admin` and an
    /// API key `admin` when no tenant exists yet; `None` otherwise.
    #[instrument(name = "auth.bootstrap", skip_all)]
    pub async fn bootstrap(&self) -> Result<Option<Bootstrap>, ApiError> {
        let store = &self.inner.store;
        if !store.list_tenants(&Reach::all()).await?.is_empty() {
            return Ok(None);
        }
        let now = now_ms();
        let tenant = new_tenant("admin".to_owned(), true, Limits::default(), now);
        let admin = new_user(&tenant.tenant_id, "admin".to_owned(), Role::Admin, None, now);
        let key = new_key(&admin, "admin".to_owned(), Scopes::ALL, Limits::default(), None, now);
        if !store.bootstrap(&tenant, &admin, &key.stored).await? {
            return Ok(None);
        }
        tracing::info!(
            tenant_id = %tenant.tenant_id,
            user_id = %admin.user_id,
            key_id = %key.stored.key.key_id,
            "operator tenant created"
        );
        Ok(Some(Bootstrap {
            tenant_id: tenant.tenant_id,
            user_id: admin.user_id,
            key_id: key.stored.key.key_id,
            secret: key.secret,
        }))
    }

    /// Returns a new API key of the admin `dev` of the local tenant `dev`,
    /// creating both when needed and revoking earlier keys named `dev`.
    #[instrument(name = "auth.dev_key", skip_all)]
    pub async fn dev_key(&self) -> Result<String, ApiError> {
        const DEV: &str = "dev";
        let store = &self.inner.store;
        let now = now_ms();
        let Some(tenant) = store.find_tenant_by_name(DEV).await? else {
            let tenant = new_tenant(DEV.to_owned(), false, self.default_limits(), now);
            let admin = new_user(&tenant.tenant_id, DEV.to_owned(), Role::Admin, None, now);
            let key = new_key(&admin, DEV.to_owned(), Scopes::ALL, Limits::default(), None, now);
            store.create_tenant(&tenant, &admin, &key.stored).await?;
            tracing::info!(tenant_id = %tenant.tenant_id, key_id = %key.stored.key.key_id, "dev tenant created");
            return Ok(key.secret);
        };
        let users = store.list_users(&Reach::all(), &tenant.tenant_id).await?;
        let admin = match users.into_iter().find(|u| u.name == DEV && u.role == Role::Admin) {
            Some(admin) => admin,
            None => {
                let admin = new_user(&tenant.tenant_id, DEV.to_owned(), Role::Admin, None, now);
                store.create_user(&Reach::all(), &admin).await?;
                admin
            }
        };
        for key_id in store.revoke_api_keys_named(&admin.user_id, DEV, now).await? {
            tracing::info!(key_id = %key_id, "earlier dev key revoked");
            self.inner.emit(AuthEventKind::KeyRevoked(key_id)).await;
        }
        let key = new_key(&admin, DEV.to_owned(), Scopes::ALL, Limits::default(), None, now);
        store.create_api_key(&key.stored).await?;
        tracing::info!(tenant_id = %tenant.tenant_id, key_id = %key.stored.key.key_id, "dev key created");
        Ok(key.secret)
    }

    /// Follows every replica's events (Postgres `LISTEN`) until `shutdown`,
    /// and with them the signing-key rotations of other replicas.
    ///
    /// Call it once per service: on Postgres, `WatchAuthEvents` answers
    /// UNAVAILABLE until this listens, since events reach watchers only
    /// through it; until then, too, the current signing key is re-read from
    /// the store every second.
    pub fn spawn_background(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        let listener = Arc::clone(&self.inner.events).spawn_listener(shutdown.clone());
        let rotations = tokio::spawn(Arc::clone(&self.inner.signing).follow(shutdown));
        tokio::spawn(async move {
            for task in [listener, rotations] {
                if let Err(err) = task.await {
                    tracing::error!(error = %err, "auth background task failed");
                }
            }
        })
    }

    /// Creates a tenant with its first admin and that admin's key (operators only).
    #[instrument(name = "auth.create_tenant", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn create_tenant(
        &self,
        ctx: &RequestContext,
        name: &str,
        limits: Option<Limits>,
        admin_name: &str,
    ) -> Result<CreatedTenant, AuthError> {
        self.authorize(ctx).await?;
        ctx.principal.require_operator()?;
        let name = validate_name("tenant", "INVALID_TENANT_NAME", name)?;
        let admin_name = match admin_name.trim() {
            "" => "admin".to_owned(),
            other => validate_name("user", "INVALID_USER_NAME", other)?,
        };
        let now = now_ms();
        let tenant = new_tenant(name, false, limits.unwrap_or_else(|| self.default_limits()), now);
        let admin = new_user(&tenant.tenant_id, admin_name.clone(), Role::Admin, None, now);
        let key = new_key(&admin, admin_name, Scopes::ALL, Limits::default(), None, now);
        self.inner.store.create_tenant(&tenant, &admin, &key.stored).await?;
        tracing::info!(
            tenant_id = %tenant.tenant_id,
            user_id = %admin.user_id,
            key_id = %key.stored.key.key_id,
            "tenant created"
        );
        Ok(CreatedTenant {
            tenant,
            admin,
            api_key: CreatedApiKey {
                api_key: key.stored.key,
                secret: key.secret,
            },
        })
    }

    /// Returns a tenant: any for operators, the caller's own otherwise.
    #[instrument(name = "auth.get_tenant", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn get_tenant(&self, ctx: &RequestContext, tenant_id: &str) -> Result<TenantRecord, AuthError> {
        self.authorize(ctx).await?;
        ctx.require(Scopes::READ)?;
        check_id("TENANT_ID_REQUIRED", "tenant_id", tenant_id)?;
        self.inner.store.get_tenant(&tenant_reach(ctx), tenant_id).await
    }

    /// Returns the tenants the caller may see, oldest first.
    #[instrument(name = "auth.list_tenants", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn list_tenants(&self, ctx: &RequestContext) -> Result<Vec<TenantRecord>, AuthError> {
        self.authorize(ctx).await?;
        ctx.require(Scopes::READ)?;
        self.inner.store.list_tenants(&tenant_reach(ctx)).await
    }

    /// Changes a tenant's name (its admins) or limits (operators only).
    #[instrument(name = "auth.update_tenant", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn update_tenant(
        &self,
        ctx: &RequestContext,
        tenant_id: &str,
        update: TenantUpdate,
    ) -> Result<TenantRecord, AuthError> {
        self.authorize(ctx).await?;
        if update.limits.is_some() {
            ctx.principal.require_operator()?;
        } else {
            ctx.principal.require_admin()?;
        }
        check_id("TENANT_ID_REQUIRED", "tenant_id", tenant_id)?;
        let update = TenantUpdate {
            name: update
                .name
                .map(|name| validate_name("tenant", "INVALID_TENANT_NAME", &name))
                .transpose()?,
            limits: update.limits,
        };
        let store = &self.inner.store;
        let reach = tenant_reach(ctx);
        if update == TenantUpdate::default() {
            return store.get_tenant(&reach, tenant_id).await;
        }
        let now = now_ms();
        let (before, after) = store.update_tenant(&reach, tenant_id, &update, now).await?;
        tracing::info!(tenant_id, limits_changed = update.limits.is_some(), "tenant updated");
        self.inner
            .emit(AuthEventKind::TenantUpdated(tenant_id.to_owned()))
            .await;
        if before.limits.tokens_per_month != after.limits.tokens_per_month {
            let month = month_of(now);
            let used = store.usage(tenant_id, None, &month).await?;
            let exhausted = |quota: u64| quota > 0 && used >= quota;
            let state = QuotaState {
                tenant_id: tenant_id.to_owned(),
                key_id: None,
                month,
            };
            match (
                exhausted(before.limits.tokens_per_month),
                exhausted(after.limits.tokens_per_month),
            ) {
                (true, false) => self.inner.emit(AuthEventKind::QuotaRestored(state)).await,
                (false, true) => self.inner.emit(AuthEventKind::QuotaExhausted(state)).await,
                _ => {}
            }
        }
        Ok(after)
    }

    /// Deletes a tenant with its users and keys (operators only; never the operator tenant).
    #[instrument(name = "auth.delete_tenant", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn delete_tenant(&self, ctx: &RequestContext, tenant_id: &str) -> Result<(), AuthError> {
        self.authorize(ctx).await?;
        ctx.principal.require_operator()?;
        check_id("TENANT_ID_REQUIRED", "tenant_id", tenant_id)?;
        let store = &self.inner.store;
        let tenant = store.get_tenant(&Reach::all(), tenant_id).await?;
        if tenant.operator {
            return Err(AuthError::precondition(
                "OPERATOR_TENANT_PROTECTED",
                "the operator tenant cannot be deleted",
            ));
        }
        store.delete_tenant(tenant_id, now_ms()).await?;
        tracing::info!(tenant_id, "tenant deleted");
        self.inner
            .emit(AuthEventKind::TenantDeleted(tenant_id.to_owned()))
            .await;
        Ok(())
    }

    /// Creates a user in a tenant (the caller's when `tenant_id` is empty).
    #[instrument(name = "auth.create_user", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn create_user(
        &self,
        ctx: &RequestContext,
        tenant_id: &str,
        name: &str,
        role: Role,
    ) -> Result<UserRecord, AuthError> {
        self.authorize(ctx).await?;
        ctx.principal.require_admin()?;
        let tenant_id = if tenant_id.is_empty() {
            ctx.tenant_id.as_str()
        } else {
            tenant_id
        };
        check_id("TENANT_ID_REQUIRED", "tenant_id", tenant_id)?;
        if role == Role::Service {
            return Err(AuthError::invalid("INVALID_ROLE", "a user's role is admin or member"));
        }
        let name = validate_name("user", "INVALID_USER_NAME", name)?;
        let user = new_user(tenant_id, name, role, None, now_ms());
        self.inner.store.create_user(&tenant_reach(ctx), &user).await?;
        tracing::info!(tenant_id, user_id = %user.user_id, role = role.as_str(), "user created");
        Ok(user)
    }

    /// Returns a user: admins see their tenant's, members only themselves.
    #[instrument(name = "auth.get_user", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn get_user(&self, ctx: &RequestContext, user_id: &str) -> Result<UserRecord, AuthError> {
        self.authorize(ctx).await?;
        ctx.require(Scopes::READ)?;
        check_id("USER_ID_REQUIRED", "user_id", user_id)?;
        self.inner.store.get_user(&reach(ctx), user_id).await
    }

    /// Returns the users of a tenant (the caller's when empty), oldest first.
    #[instrument(name = "auth.list_users", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn list_users(&self, ctx: &RequestContext, tenant_id: &str) -> Result<Vec<UserRecord>, AuthError> {
        self.authorize(ctx).await?;
        ctx.principal.require_admin()?;
        let tenant_id = if tenant_id.is_empty() {
            ctx.tenant_id.as_str()
        } else {
            tenant_id
        };
        check_id("TENANT_ID_REQUIRED", "tenant_id", tenant_id)?;
        self.inner.store.list_users(&tenant_reach(ctx), tenant_id).await
    }

    /// Deletes a user and their keys; never the caller.
    #[instrument(name = "auth.delete_user", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn delete_user(&self, ctx: &RequestContext, user_id: &str) -> Result<(), AuthError> {
        self.authorize(ctx).await?;
        ctx.principal.require_admin()?;
        check_id("USER_ID_REQUIRED", "user_id", user_id)?;
        if user_id == ctx.principal.user_id && ctx.principal.role != Role::Service {
            return Err(AuthError::precondition(
                "CANNOT_DELETE_SELF",
                "a user cannot delete themselves",
            ));
        }
        let user = self.inner.store.delete_user(&reach(ctx), user_id, now_ms()).await?;
        tracing::info!(tenant_id = %user.tenant_id, user_id, "user deleted");
        self.inner.emit(AuthEventKind::UserDeleted(user_id.to_owned())).await;
        Ok(())
    }

    /// Creates an API key for the caller or (admins) another user of their tenant.
    #[instrument(name = "auth.create_api_key", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn create_api_key(&self, ctx: &RequestContext, spec: ApiKeySpec) -> Result<CreatedApiKey, AuthError> {
        self.authorize(ctx).await?;
        let caller = &ctx.principal;
        let user_id = match spec.user_id.as_deref().filter(|id| !id.is_empty()) {
            Some(user_id) => user_id,
            None if caller.role == Role::Service => {
                return Err(AuthError::invalid(
                    "USER_ID_REQUIRED",
                    "a service must name the user the key acts as",
                ));
            }
            None => caller.user_id.as_str(),
        };
        check_id("USER_ID_REQUIRED", "user_id", user_id)?;
        if user_id == caller.user_id {
            caller.require(Scopes::WRITE)?;
        } else {
            caller.require_admin()?;
        }
        let name = match spec.name.trim() {
            "" => "default".to_owned(),
            name => validate_name("api key", "INVALID_KEY_NAME", name)?,
        };
        let now = now_ms();
        if spec.expires_at_ms.is_some_and(|at| at <= now) {
            return Err(AuthError::invalid(
                "INVALID_EXPIRY",
                "expires_at_ms must be in the future",
            ));
        }
        let store = &self.inner.store;
        let user = store.get_user(&reach(ctx), user_id).await?;
        let scopes = key_scopes(&spec.scopes, user.role, caller.scopes)?;
        let limits = spec.limits.unwrap_or_default();
        let tenant = store.get_tenant(&Reach::all(), &user.tenant_id).await?;
        let exceeds = |own: u64, tenant: u64| tenant > 0 && own > tenant;
        if exceeds(
            u64::from(limits.requests_per_minute),
            u64::from(tenant.limits.requests_per_minute),
        ) || exceeds(limits.tokens_per_month, tenant.limits.tokens_per_month)
        {
            return Err(AuthError::invalid(
                "KEY_LIMITS_EXCEED_TENANT",
                "an API key's limits must be within its tenant's",
            ));
        }
        let key = new_key(&user, name, scopes, limits, spec.expires_at_ms, now);
        store.create_api_key(&key.stored).await?;
        tracing::info!(
            tenant_id = %user.tenant_id,
            user_id = %user.user_id,
            key_id = %key.stored.key.key_id,
            "api key created"
        );
        Ok(CreatedApiKey {
            api_key: key.stored.key,
            secret: key.secret,
        })
    }

    /// Returns one API key's metadata.
    #[instrument(name = "auth.get_api_key", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn get_api_key(&self, ctx: &RequestContext, key_id: &str) -> Result<ApiKeyRecord, AuthError> {
        self.authorize(ctx).await?;
        ctx.require(Scopes::READ)?;
        check_id("KEY_ID_REQUIRED", "key_id", key_id)?;
        self.inner.store.get_api_key(&reach(ctx), key_id).await
    }

    /// Returns API keys newest first: the caller's own, or (admins) their
    /// tenant's, or one user's.
    #[instrument(name = "auth.list_api_keys", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn list_api_keys(
        &self,
        ctx: &RequestContext,
        user_id: Option<&str>,
    ) -> Result<Vec<ApiKeyRecord>, AuthError> {
        self.authorize(ctx).await?;
        ctx.require(Scopes::READ)?;
        let store = &self.inner.store;
        let keys_reach = match user_id.filter(|id| !id.is_empty()) {
            Some(user_id) => {
                check_id("USER_ID_REQUIRED", "user_id", user_id)?;
                let user = store.get_user(&reach(ctx), user_id).await?;
                Reach::user(&user.tenant_id, &user.user_id)
            }
            None => match ctx.principal.role {
                Role::Member => Reach::user(&ctx.tenant_id, &ctx.principal.user_id),
                Role::Admin | Role::Service => Reach::tenant(&ctx.tenant_id),
            },
        };
        store.list_api_keys(&keys_reach).await
    }

    /// Revokes an API key: the caller's own, or (admins) any of their tenant's.
    #[instrument(name = "auth.revoke_api_key", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn revoke_api_key(&self, ctx: &RequestContext, key_id: &str) -> Result<ApiKeyRecord, AuthError> {
        self.authorize(ctx).await?;
        ctx.require(Scopes::WRITE)?;
        check_id("KEY_ID_REQUIRED", "key_id", key_id)?;
        let store = &self.inner.store;
        let reach = reach(ctx);
        let key = store.get_api_key(&reach, key_id).await?;
        if key.user_id != ctx.principal.user_id {
            ctx.principal.require_admin()?;
        }
        let (key, revoked_now) = store.revoke_api_key(&reach, key_id, now_ms()).await?;
        if revoked_now {
            tracing::info!(tenant_id = %key.tenant_id, key_id, "api key revoked");
            self.inner.emit(AuthEventKind::KeyRevoked(key_id.to_owned())).await;
        }
        Ok(key)
    }

    /// Exchanges an API key (or the deployment's service key) for an access token.
    #[instrument(name = "auth.exchange_api_key", skip_all)]
    pub async fn exchange_api_key(&self, presented: &str) -> Result<AccessToken, AuthError> {
        if let Some(expected) = &self.inner.service_key_hash
            && bool::from(sha256(presented).ct_eq(expected))
        {
            return self.mint(Principal::service(SERVICE_TENANT), None).await;
        }
        let Some(parsed) = api_key::parse(presented) else {
            tracing::debug!("api key refused: malformed");
            return Err(AuthError::InvalidApiKey);
        };
        let Some(credential) = self.inner.store.key_credential(&parsed.key_id).await? else {
            // Hash anyway, so an unknown id costs what a wrong secret does.
            let _ = api_key::secret_matches(parsed.secret, "");
            tracing::debug!(key_id = %parsed.key_id, "api key refused: unknown");
            return Err(AuthError::InvalidApiKey);
        };
        let key = &credential.key;
        let now = now_ms();
        let why = if !api_key::secret_matches(parsed.secret, &credential.secret_hash) {
            Some("wrong secret")
        } else if key.revoked_at_ms.is_some() {
            Some("revoked")
        } else if key.expires_at_ms.is_some_and(|at| at <= now) {
            Some("expired")
        } else {
            None
        };
        if let Some(why) = why {
            tracing::debug!(key_id = %key.key_id, why, "api key refused");
            return Err(AuthError::InvalidApiKey);
        }
        let user = &credential.user;
        let principal = Principal {
            tenant_id: credential.tenant.tenant_id.clone(),
            user_id: user.user_id.clone(),
            role: user.role,
            operator: user.role == Role::Admin && credential.tenant.operator,
            key_id: Some(key.key_id.clone()),
            scopes: intersect(key.scopes, user.role.allowed_scopes()),
            tenant_limits: credential.tenant.limits,
            key_limits: key.limits,
        };
        self.mint(principal, key.expires_at_ms).await
    }

    /// Exchanges a token of the configured external issuer for an access
    /// token, provisioning its user on first sight.
    #[instrument(name = "auth.exchange_external_token", skip_all)]
    pub async fn exchange_external_token(&self, token: &str) -> Result<AccessToken, AuthError> {
        let oidc = self.inner.oidc.as_ref().ok_or(AuthError::OidcNotConfigured)?;
        let identity = oidc.verify(token).await?;
        let store = &self.inner.store;
        let tenant = match store.get_tenant(&Reach::all(), &identity.tenant_id).await {
            Ok(tenant) => tenant,
            Err(AuthError::TenantNotFound(_)) => {
                tracing::debug!(tenant_id = %identity.tenant_id, "external token refused: unknown tenant");
                return Err(AuthError::InvalidExternalToken);
            }
            Err(err) => return Err(err),
        };
        let candidate = new_user(
            &tenant.tenant_id,
            identity.name,
            identity.role,
            Some(identity.subject),
            now_ms(),
        );
        let user = store.upsert_external_user(&candidate).await?;
        if user.user_id == candidate.user_id {
            tracing::info!(tenant_id = %tenant.tenant_id, user_id = %user.user_id, "external user provisioned");
        }
        let principal = Principal {
            tenant_id: tenant.tenant_id.clone(),
            user_id: user.user_id.clone(),
            role: user.role,
            operator: user.role == Role::Admin && tenant.operator,
            key_id: None,
            scopes: user.role.allowed_scopes(),
            tenant_limits: tenant.limits,
            key_limits: Limits::default(),
        };
        self.mint(principal, None).await
    }

    /// Returns the JWKS document of the keys that verify live tokens.
    pub async fn jwks_json(&self) -> Result<String, AuthError> {
        let jwks = self.inner.signing.jwks().await?;
        serde_json::to_string(&jwks).map_err(|err| AuthError::corrupt(format!("jwks: {err}")))
    }

    /// Starts signing with a new key; returns its kid (operators only).
    #[instrument(name = "auth.rotate_signing_key", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn rotate_signing_key(&self, ctx: &RequestContext) -> Result<String, AuthError> {
        self.authorize(ctx).await?;
        ctx.principal.require_operator()?;
        let kid = self.inner.signing.rotate().await?;
        tracing::info!(kid = %kid, "signing key rotated");
        Ok(kid)
    }

    /// Returns the caller as their token describes them.
    #[instrument(name = "auth.get_caller", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn caller(&self, ctx: &RequestContext) -> Result<Principal, AuthError> {
        self.authorize(ctx).await?;
        let mut principal = (*ctx.principal).clone();
        principal.tenant_id.clone_from(&ctx.tenant_id);
        Ok(principal)
    }

    /// Counts a report's tokens once; returns the tenant's use this month (services only).
    #[instrument(name = "auth.record_usage", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn record_usage(&self, ctx: &RequestContext, report: UsageReport) -> Result<u64, AuthError> {
        self.authorize(ctx).await?;
        ctx.principal.require_service()?;
        check_id("TENANT_ID_REQUIRED", "tenant_id", &report.tenant_id)?;
        check_id("REPORT_ID_REQUIRED", "report_id", &report.report_id)?;
        if let Some(key_id) = report.key_id.as_deref() {
            check_id("KEY_ID_REQUIRED", "key_id", key_id)?;
        }
        let month = month_of(now_ms());
        let outcome = self.inner.store.record_usage(&report, &month, now_ms()).await?;
        let exhausted = |key_id: Option<String>| {
            AuthEventKind::QuotaExhausted(QuotaState {
                tenant_id: report.tenant_id.clone(),
                key_id,
                month: month.clone(),
            })
        };
        if outcome.counted && outcome.tenant.exhausted_now() {
            tracing::info!(tenant_id = %report.tenant_id, month = %month, "tenant token quota exhausted");
            self.inner.emit(exhausted(None)).await;
        }
        if outcome.counted && outcome.key.is_some_and(|key| key.exhausted_now()) {
            tracing::info!(tenant_id = %report.tenant_id, key_id = ?report.key_id, "api key token quota exhausted");
            self.inner.emit(exhausted(report.key_id.clone())).await;
        }
        Ok(outcome.tenant.after)
    }

    /// Holds an LLM call's estimated tokens against its tenant's and key's
    /// monthly quotas until the call's report (the same id) arrives or
    /// [`RESERVATION_TTL`] passes, or refuses the call when their use plus
    /// the calls in flight reached a quota (services only). Reservations live
    /// in the database, taken one at a time per tenant, so every replica
    /// counts the others' calls in flight.
    #[instrument(name = "auth.reserve_tokens", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn reserve_tokens(
        &self,
        ctx: &RequestContext,
        reservation: TokenReservation,
    ) -> Result<ReserveOutcome, AuthError> {
        self.authorize(ctx).await?;
        ctx.principal.require_service()?;
        check_id("TENANT_ID_REQUIRED", "tenant_id", &reservation.tenant_id)?;
        check_id("RESERVATION_ID_REQUIRED", "reservation_id", &reservation.reservation_id)?;
        if let Some(key_id) = reservation.key_id.as_deref() {
            check_id("KEY_ID_REQUIRED", "key_id", key_id)?;
        }
        let now = now_ms();
        let ttl = i64::try_from(RESERVATION_TTL.as_millis()).unwrap_or(i64::MAX);
        let outcome = self
            .inner
            .store
            .reserve_tokens(&reservation, &month_of(now), now, now.saturating_add(ttl))
            .await?;
        if let ReserveOutcome::Refused { quota, used_up } = &outcome {
            tracing::debug!(tenant_id = %quota.tenant_id, key_id = ?quota.key_id, used_up, "token reservation refused");
        }
        Ok(outcome)
    }

    /// Returns a tenant's (the caller's when empty) token use this month and
    /// its quota; a member's own use and quota (their key's).
    #[instrument(name = "auth.get_usage", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn usage(&self, ctx: &RequestContext, tenant_id: &str) -> Result<UsageRecord, AuthError> {
        self.authorize(ctx).await?;
        ctx.require(Scopes::READ)?;
        let tenant_id = if tenant_id.is_empty() {
            ctx.tenant_id.as_str()
        } else {
            tenant_id
        };
        check_id("TENANT_ID_REQUIRED", "tenant_id", tenant_id)?;
        let store = &self.inner.store;
        let tenant = store.get_tenant(&tenant_reach(ctx), tenant_id).await?;
        let month = month_of(now_ms());
        if ctx.principal.role == Role::Member {
            // A member sees their own figures: what the key they call with
            // used, against its quota (the tenant's when it has none of its
            // own), never the tenant's spend (issue 26 item 13).
            let tokens_used = match ctx.principal.key_id.as_deref() {
                Some(key_id) => store.usage(tenant_id, Some(key_id), &month).await?,
                None => 0,
            };
            let own = ctx.principal.key_limits.tokens_per_month;
            return Ok(UsageRecord {
                month,
                tokens_used,
                tokens_per_month: if own == 0 { tenant.limits.tokens_per_month } else { own },
            });
        }
        let tokens_used = store.usage(tenant_id, None, &month).await?;
        Ok(UsageRecord {
            month,
            tokens_used,
            tokens_per_month: tenant.limits.tokens_per_month,
        })
    }

    /// Returns the auth events: a snapshot of those still relevant, a
    /// `SnapshotComplete` marker, then live ones (services only).
    #[instrument(name = "auth.watch_auth_events", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn watch_events(&self, ctx: &RequestContext) -> Result<AuthEventStream, AuthError> {
        self.authorize(ctx).await?;
        ctx.principal.require_service()?;
        let events = &self.inner.events;
        events.wait_live(FEED_READY_TIMEOUT).await.map_err(feed_error)?;
        // Subscribe before reading the snapshot, so nothing falls in between;
        // an event in both is applied twice, which changes nothing.
        let live = events
            .subscribe()
            .map(|item| item.map(WatchItem::Event).map_err(feed_error));
        let snapshot = self.snapshot().await?;
        tracing::debug!(events = snapshot.len(), "auth event watcher subscribed");
        let snapshot = snapshot
            .into_iter()
            .map(|event| Ok(WatchItem::Event(event)))
            .chain(std::iter::once(Ok(WatchItem::SnapshotComplete)));
        Ok(futures::stream::iter(snapshot).chain(live).boxed())
    }

    /// Returns the events a verifier that starts now must know.
    async fn snapshot(&self) -> Result<Vec<AuthEvent>, AuthError> {
        let store = &self.inner.store;
        let config = &self.inner.config;
        let now = now_ms();
        let window = config.token_ttl + Duration::from_secs(config.leeway_secs()) + CURRENT_KEY_REFRESH;
        let since = now.saturating_sub(i64::try_from(window.as_millis()).unwrap_or(i64::MAX));
        let mut events = Vec::new();
        for (key_id, at_ms) in store.revoked_keys_since(since).await? {
            events.push(AuthEvent {
                at_ms,
                kind: AuthEventKind::KeyRevoked(key_id),
            });
        }
        for tombstone in store.tombstones_since(since).await? {
            let kind = match tombstone.kind {
                TombstoneKind::User => AuthEventKind::UserDeleted(tombstone.id),
                TombstoneKind::Tenant => AuthEventKind::TenantDeleted(tombstone.id),
            };
            events.push(AuthEvent {
                at_ms: tombstone.at_ms,
                kind,
            });
        }
        for (tenant_id, at_ms) in store.tenants_updated_since(since).await? {
            events.push(AuthEvent {
                at_ms,
                kind: AuthEventKind::TenantUpdated(tenant_id),
            });
        }
        for quota in store.exhausted_quotas(&month_of(now)).await? {
            events.push(AuthEvent {
                at_ms: now,
                kind: AuthEventKind::QuotaExhausted(quota),
            });
        }
        Ok(events)
    }

    /// Fails unless the caller's key, user and tenant still exist, the key
    /// is unrevoked and an operator's token is an operator's: auth RPCs are
    /// rare, and this keeps several replicas exact without waiting for
    /// events (and a token claiming more than its user holds does nothing here).
    async fn authorize(&self, ctx: &RequestContext) -> Result<(), AuthError> {
        let principal = &ctx.principal;
        if principal.role == Role::Service {
            return Ok(());
        }
        let alive = self
            .inner
            .store
            .credential_alive(
                &principal.tenant_id,
                &principal.user_id,
                principal.key_id.as_deref(),
                principal.operator,
            )
            .await?;
        if !alive {
            tracing::debug!(user_id = %principal.user_id, key_id = ?principal.key_id, "caller's credential is gone");
            return Err(AuthError::CredentialRevoked);
        }
        Ok(())
    }

    /// Signs a token for `principal`, ending no later than `not_after_ms`.
    async fn mint(&self, principal: Principal, not_after_ms: Option<i64>) -> Result<AccessToken, AuthError> {
        let config = &self.inner.config;
        let now_s = u64::try_from(now_ms() / 1000).unwrap_or(0);
        let mut claims = Claims::new(&principal, &config.issuer, now_s, config.token_ttl);
        if let Some(limit) = not_after_ms.and_then(|ms| u64::try_from(ms.saturating_add(999) / 1000).ok()) {
            // A token outliving its key would keep an expired key working.
            claims.exp = claims.exp.min(limit);
        }
        let token = self.inner.signing.sign(&claims).await?;
        Ok(AccessToken {
            token,
            expires_at_ms: i64::try_from(claims.exp.saturating_mul(1000)).unwrap_or(i64::MAX),
            principal,
        })
    }

    fn default_limits(&self) -> Limits {
        Limits {
            requests_per_minute: self.inner.config.default_requests_per_minute,
            tokens_per_month: self.inner.config.default_tokens_per_month,
        }
    }
}

/// Returns how far the caller reaches for users and keys: everything for
/// operators and services, the tenant for admins, themselves for members.
fn reach(ctx: &RequestContext) -> Reach {
    let principal = &ctx.principal;
    match principal.role {
        Role::Service => Reach::all(),
        Role::Admin if principal.operator => Reach::all(),
        Role::Admin => Reach::tenant(&ctx.tenant_id),
        Role::Member => Reach::user(&ctx.tenant_id, &principal.user_id),
    }
}

/// Returns how far the caller reaches for tenants: all of them for operators
/// and services, their own otherwise.
fn tenant_reach(ctx: &RequestContext) -> Reach {
    let principal = &ctx.principal;
    if principal.role == Role::Service || (principal.role == Role::Admin && principal.operator) {
        Reach::all()
    } else {
        Reach::tenant(&ctx.tenant_id)
    }
}

/// Returns the scopes of a new key: the requested ones, or everything
/// allowed when none are named; never more than the user's role and the
/// creating caller hold.
fn key_scopes(requested: &[String], role: Role, caller: Scopes) -> Result<Scopes, AuthError> {
    let allowed = intersect(role.allowed_scopes(), caller);
    let requested = Scopes::parse(requested)?;
    if requested == Scopes::NONE {
        return Ok(allowed);
    }
    if let Some(name) = requested
        .names()
        .into_iter()
        .find(|name| !Scopes::parse(std::slice::from_ref(name)).is_ok_and(|s| allowed.contains(s)))
    {
        return Err(AuthError::invalid(
            "SCOPE_NOT_ALLOWED",
            format!("scope {name:?} exceeds what the user's role and the caller's credential allow"),
        ));
    }
    Ok(requested)
}

/// Returns the scopes in both sets.
fn intersect(a: Scopes, b: Scopes) -> Scopes {
    [Scopes::READ, Scopes::WRITE, Scopes::ADMIN]
        .into_iter()
        .filter(|scope| a.contains(*scope) && b.contains(*scope))
        .fold(Scopes::NONE, Scopes::union)
}

fn validate_name(what: &str, reason: &'static str, name: &str) -> Result<String, AuthError> {
    let name = name.trim();
    if name.is_empty() || name.chars().count() > MAX_NAME_CHARS || name.chars().any(char::is_control) {
        return Err(AuthError::invalid(
            reason,
            format!("a {what} name must be 1 to {MAX_NAME_CHARS} printable characters"),
        ));
    }
    Ok(name.to_owned())
}

fn check_id(reason: &'static str, field: &str, id: &str) -> Result<(), AuthError> {
    if id.is_empty() {
        return Err(AuthError::invalid(reason, format!("{field} is required")));
    }
    if id.len() > MAX_ID_BYTES {
        return Err(AuthError::invalid(
            "INVALID_ID",
            format!("{field} must be at most {MAX_ID_BYTES} bytes"),
        ));
    }
    Ok(())
}

fn sha256(value: &str) -> [u8; 32] {
    Sha256::digest(value.as_bytes()).into()
}

fn new_tenant(name: String, operator: bool, limits: Limits, now: i64) -> TenantRecord {
    TenantRecord {
        tenant_id: new_id("ten"),
        name,
        operator,
        limits,
        created_at_ms: now,
        updated_at_ms: now,
    }
}

fn new_user(tenant_id: &str, name: String, role: Role, external_subject: Option<String>, now: i64) -> UserRecord {
    UserRecord {
        user_id: new_id("usr"),
        tenant_id: tenant_id.to_owned(),
        name,
        role,
        external_subject,
        created_at_ms: now,
    }
}

/// A key ready to store, with the full key to show once.
struct MadeKey {
    stored: NewApiKey,
    secret: String,
}

fn new_key(
    user: &UserRecord,
    name: String,
    scopes: Scopes,
    limits: Limits,
    expires_at_ms: Option<i64>,
    now: i64,
) -> MadeKey {
    let generated = api_key::generate();
    MadeKey {
        stored: NewApiKey {
            key: ApiKeyRecord {
                key_id: generated.key_id,
                tenant_id: user.tenant_id.clone(),
                user_id: user.user_id.clone(),
                name,
                prefix: generated.prefix,
                scopes,
                limits,
                created_at_ms: now,
                expires_at_ms,
                revoked_at_ms: None,
            },
            secret_hash: generated.secret_hash,
        },
        secret: generated.full,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_scopes_stay_within_role_and_caller() {
        let all = Scopes::ALL;
        let rw = Scopes::READ.union(Scopes::WRITE);
        assert_eq!(key_scopes(&[], Role::Admin, all).unwrap(), all);
        assert_eq!(key_scopes(&[], Role::Member, all).unwrap(), rw);
        assert_eq!(key_scopes(&[], Role::Admin, Scopes::READ).unwrap(), Scopes::READ);
        assert_eq!(key_scopes(&["read".into()], Role::Member, all).unwrap(), Scopes::READ);
        let err = ApiError::from(key_scopes(&["admin".into()], Role::Member, all).unwrap_err());
        assert_eq!(err.reason, "SCOPE_NOT_ALLOWED");
        assert!(err.message.contains("admin"));
        let err = ApiError::from(key_scopes(&["root".into()], Role::Admin, all).unwrap_err());
        assert_eq!(err.reason, "INVALID_SCOPE");
        assert!(err.message.contains("root"));
    }

    #[test]
    fn names_are_trimmed_and_bounded() {
        assert_eq!(validate_name("user", "R", "  ann ").unwrap(), "ann");
        assert!(validate_name("user", "R", "   ").is_err());
        assert!(validate_name("user", "R", &"x".repeat(129)).is_err());
        assert!(validate_name("user", "R", &"é".repeat(128)).is_ok());
        assert!(validate_name("user", "R", "a\nb").is_err());
    }
}
