//! The identity a component uses when it acts on its own (storing a reply
//! after the caller left, reporting usage, following auth events): the
//! deployment's service key, exchanged for short-lived access tokens that are
//! renewed before they expire.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use avm_proto::auth::v1 as pb;
use avm_proto::auth::v1::AuthServiceHandle;

use super::Principal;
use crate::context::RequestContext;
use crate::{ApiError, Code};

struct Cached {
    token: Arc<str>,
    principal: Principal,
    renew_at: Instant,
}

struct Inner {
    key: String,
    auth: AuthServiceHandle,
    cached: tokio::sync::Mutex<Option<Cached>>,
    /// Whether the auth service refused the key at the last exchange.
    refused: AtomicBool,
}

/// A component's own credential; cheap to clone.
#[derive(Clone)]
pub struct ServiceIdentity {
    inner: Arc<Inner>,
}

impl ServiceIdentity {
    /// Returns an identity that exchanges `service_key` at `auth`.
    pub fn new(service_key: &str, auth: AuthServiceHandle) -> Self {
        Self {
            inner: Arc::new(Inner {
                key: service_key.to_owned(),
                auth,
                cached: tokio::sync::Mutex::new(None),
                refused: AtomicBool::new(false),
            }),
        }
    }

    /// Returns the auth service.
    pub fn auth(&self) -> &AuthServiceHandle {
        &self.inner.auth
    }

    /// Returns whether the auth service refused the service key the last
    /// time it was presented (a wrong `AVM_AUTH_SERVICE_KEY`): nothing this
    /// process does on its own account works until it accepts it.
    pub fn is_refused(&self) -> bool {
        self.inner.refused.load(Ordering::Acquire)
    }

    /// Returns a context acting as the service itself.
    pub async fn own_context(&self) -> Result<RequestContext, ApiError> {
        let (token, principal) = self.token().await?;
        Ok(RequestContext::new(principal, Some(token), crate::ids::new_id("req")))
    }

    /// Returns a context acting for `caller`'s tenant, in its request and
    /// trace (for work done on a caller's behalf that must outlive its token).
    pub async fn context_for(&self, caller: &RequestContext) -> Result<RequestContext, ApiError> {
        let (token, mut principal) = self.token().await?;
        caller.tenant_id.clone_into(&mut principal.tenant_id);
        Ok(RequestContext::new(principal, Some(token), caller.request_id.clone()).with_trace(caller.trace))
    }

    /// Returns a context acting for `tenant_id` on the service's own account
    /// (background work that no caller asked for, such as a reconciliation).
    pub async fn tenant_context(&self, tenant_id: &str) -> Result<RequestContext, ApiError> {
        let (token, mut principal) = self.token().await?;
        tenant_id.clone_into(&mut principal.tenant_id);
        Ok(RequestContext::new(principal, Some(token), crate::ids::new_id("req")))
    }

    /// Returns a valid token, exchanging the key again when a third of the
    /// current token's life is left.
    async fn token(&self) -> Result<(Arc<str>, Principal), ApiError> {
        let mut cached = self.inner.cached.lock().await;
        if let Some(current) = cached.as_ref()
            && Instant::now() < current.renew_at
        {
            return Ok((Arc::clone(&current.token), current.principal.clone()));
        }
        let request = tonic::Request::new(pb::ExchangeApiKeyRequest {
            api_key: self.inner.key.clone(),
        });
        let response = self
            .inner
            .auth
            .exchange_api_key(request)
            .await
            .map_err(|status| {
                let err = ApiError::from_status(&status);
                if matches!(err.code, Code::Unauthenticated | Code::PermissionDenied) {
                    self.inner.refused.store(true, Ordering::Release);
                    tracing::warn!(reason = %err.reason, "the service key was refused by the auth service");
                } else {
                    tracing::warn!(reason = %err.reason, "the service key could not be exchanged");
                }
                err
            })?
            .into_inner();
        self.inner.refused.store(false, Ordering::Release);
        let life_ms = u64::try_from(response.expires_at_ms.saturating_sub(crate::now_ms())).unwrap_or(0);
        let renew_at = Instant::now() + Duration::from_millis(life_ms * 2 / 3);
        let caller = response.caller.unwrap_or_default();
        if caller.role != pb::Role::Service as i32 {
            return Err(ApiError::internal("the service key does not name a service principal"));
        }
        let principal = Principal {
            operator: caller.operator,
            key_id: caller.key_id,
            ..Principal::service(caller.tenant_id)
        };
        let token: Arc<str> = Arc::from(response.access_token);
        *cached = Some(Cached {
            token: Arc::clone(&token),
            principal: principal.clone(),
            renew_at,
        });
        Ok((token, principal))
    }
}
