//! Test support for the services' own suites (feature `testing`): request
//! contexts of any identity, tokens, a gRPC server on a free port, and the
//! variables of the external test services (fresh databases are
//! `avm_store::testing`'s).

use crate::RequestContext;
use crate::auth::{Limits, Principal, Role, Scopes};

/// The variable naming the Postgres server of the test suites.
pub const DATABASE_URL_VAR: &str = "AVM_TEST_DATABASE_URL";

/// The variable naming the Redis server of the test suites.
pub const REDIS_URL_VAR: &str = "AVM_TEST_REDIS_URL";

/// Returns the value of an external test service's variable, or `None` after
/// saying loudly that the test is skipped; with `AVM_TEST_REQUIRE_EXTERNAL=1`
/// a missing service fails the test instead.
pub fn external_service(variable: &str) -> Option<String> {
    match std::env::var(variable) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            let required = std::env::var("AVM_TEST_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1");
            assert!(!required, "AVM_TEST_REQUIRE_EXTERNAL=1 but {variable} is not set");
            eprintln!("SKIPPED: {variable} not set");
            None
        }
    }
}

/// Returns the context of a principal with the given identity.
pub fn principal_ctx(tenant_id: &str, user_id: &str, role: Role, scopes: Scopes) -> RequestContext {
    let principal = Principal {
        tenant_id: tenant_id.to_owned(),
        user_id: user_id.to_owned(),
        role,
        operator: false,
        key_id: None,
        scopes,
        tenant_limits: Limits::default(),
        key_limits: Limits::default(),
    };
    RequestContext::new(principal, None, "req_test".to_owned())
}

/// Returns the context of an admin (user `usr_admin`) of `tenant_id`.
pub fn admin_ctx(tenant_id: &str) -> RequestContext {
    principal_ctx(tenant_id, "usr_admin", Role::Admin, Scopes::ALL)
}

/// Returns the context of member `user_id` of `tenant_id`.
pub fn member_ctx(tenant_id: &str, user_id: &str) -> RequestContext {
    principal_ctx(tenant_id, user_id, Role::Member, Scopes::READ.union(Scopes::WRITE))
}

/// Returns the context of an operator: an admin of the operator tenant `tenant_id`.
pub fn operator_ctx(tenant_id: &str) -> RequestContext {
    let mut principal = (*admin_ctx(tenant_id).principal).clone();
    principal.operator = true;
    RequestContext::new(principal, None, "req_test".to_owned())
}

/// Returns the context of an AgentVM component acting for `tenant_id`.
pub fn service_ctx(tenant_id: &str) -> RequestContext {
    principal_ctx(tenant_id, crate::auth::SERVICE_USER, Role::Service, Scopes::ALL)
}

/// A signing key made for a test: a verifier that trusts it, and tokens it signs.
pub struct TestKeys {
    key: crate::auth::SigningKey,
    config: crate::auth::AuthConfig,
}

impl Default for TestKeys {
    fn default() -> Self {
        Self::new()
    }
}

impl TestKeys {
    /// Returns a fresh key with the default `[auth]` settings.
    pub fn new() -> TestKeys {
        TestKeys {
            key: crate::auth::SigningKey::generate().unwrap_or_else(|err| panic!("cannot make a signing key: {err}")),
            config: crate::auth::AuthConfig::default(),
        }
    }

    /// Returns a verifier that trusts this key (and nothing else).
    pub fn verifier(&self) -> crate::auth::TokenVerifier {
        let jwks = jsonwebtoken::jwk::JwkSet {
            keys: vec![self.key.public_jwk().clone()],
        };
        crate::auth::TokenVerifier::new(&self.config, std::sync::Arc::new(crate::auth::StaticKeySource(jwks)))
    }

    /// Returns an access token for the principal of `ctx`, valid for five minutes.
    pub fn token(&self, ctx: &RequestContext) -> String {
        let now = u64::try_from(crate::now_ms() / 1000).unwrap_or_default();
        let claims = crate::auth::Claims::new(
            &ctx.principal,
            &self.config.issuer,
            now,
            std::time::Duration::from_secs(300),
        );
        self.key
            .sign(&claims)
            .unwrap_or_else(|err| panic!("cannot sign a token: {err}"))
    }
}

/// Serves `router` on a free loopback port and returns a channel to it.
pub async fn serve_grpc(router: tonic::transport::server::Router) -> tonic::transport::Channel {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|err| panic!("cannot bind: {err}"));
    let addr = listener
        .local_addr()
        .unwrap_or_else(|err| panic!("no local address: {err}"));
    tokio::spawn(router.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap_or_else(|err| panic!("bad endpoint: {err}"))
        .connect()
        .await
        .unwrap_or_else(|err| panic!("cannot connect to the test server: {err}"))
}

/// Returns an interceptor that sends `authorization: Bearer <token>`.
pub fn bearer(
    token: &str,
) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone + use<> {
    let value: tonic::metadata::MetadataValue<tonic::metadata::Ascii> = format!("Bearer {token}")
        .parse()
        .unwrap_or_else(|err| panic!("token is not ascii: {err}"));
    move |mut request: tonic::Request<()>| {
        request.metadata_mut().insert("authorization", value.clone());
        Ok(request)
    }
}
