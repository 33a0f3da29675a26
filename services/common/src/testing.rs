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

/// An S3-compatible server for the suites: moto's (`python3 -m moto.server`,
/// which `.ci/run` installs with `pip install 'moto[server]'`), on a free
/// loopback port, with its objects in memory; stopped when dropped.
pub struct S3Server {
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    _child: tokio::process::Child,
    log: std::path::PathBuf,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.log);
    }
}

impl S3Server {
    /// Starts a server, or returns `None` after saying loudly that the test
    /// is skipped when moto is not installed; with
    /// `AVM_TEST_REQUIRE_EXTERNAL=1` a missing server fails the test instead.
    pub async fn start() -> Option<S3Server> {
        match Self::spawn().await {
            Ok(server) => Some(server),
            Err(why) => {
                let required = std::env::var("AVM_TEST_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1");
                assert!(
                    !required,
                    "AVM_TEST_REQUIRE_EXTERNAL=1 but no S3-compatible server could be started: {why}"
                );
                eprintln!("SKIPPED: no S3-compatible server ({why}); pip install 'moto[server]'");
                None
            }
        }
    }

    async fn spawn() -> Result<S3Server, String> {
        let log = std::env::temp_dir().join(format!("{}.log", crate::ids::new_id("moto")));
        let file = std::fs::File::create(&log).map_err(|err| format!("cannot make {}: {err}", log.display()))?;
        let errors = file.try_clone().map_err(|err| err.to_string())?;
        let mut child = tokio::process::Command::new("python3")
            .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", "0"])
            .stdin(std::process::Stdio::null())
            .stdout(file)
            .stderr(errors)
            .kill_on_drop(true)
            .spawn()
            .map_err(|err| format!("cannot run python3: {err}"))?;
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let said = std::fs::read_to_string(&log).unwrap_or_default();
            if let Some(address) = said
                .split_once("Running on http://")
                .and_then(|(_, rest)| rest.split_whitespace().next())
            {
                return Ok(S3Server {
                    endpoint: format!("http://{address}"),
                    _child: child,
                    log,
                });
            }
            if let Ok(Some(status)) = child.try_wait() {
                let _ = std::fs::remove_file(&log);
                return Err(format!("python3 -m moto.server exited ({status}): {}", said.trim()));
            }
            if tokio::time::Instant::now() > deadline {
                let _ = std::fs::remove_file(&log);
                return Err("python3 -m moto.server did not start within 30 s".to_owned());
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Returns the variables that point an object store at this server.
    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ENDPOINT", self.endpoint.as_str()),
            ("AWS_ALLOW_HTTP", "true"),
            ("AWS_ACCESS_KEY_ID", "testing"),
            ("AWS_SECRET_ACCESS_KEY", "testing-secret"),
            ("AWS_REGION", "us-east-1"),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect()
    }

    /// Creates a bucket.
    pub async fn create_bucket(&self, bucket: &str) {
        let (status, body) = self.request("PUT", &format!("/{bucket}")).await;
        assert_eq!(status, 200, "cannot create bucket {bucket}: {body}");
    }

    /// Returns the keys under `prefix` in `bucket`.
    pub async fn keys(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let (status, body) = self
            .request("GET", &format!("/{bucket}?list-type=2&prefix={prefix}"))
            .await;
        assert_eq!(status, 200, "cannot list bucket {bucket}: {body}");
        body.split("<Key>")
            .skip(1)
            .filter_map(|rest| rest.split_once("</Key>").map(|(key, _)| key.to_owned()))
            .collect()
    }

    /// Sends a bodiless, unsigned request (moto does not check signatures).
    async fn request(&self, method: &str, target: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let address = self.endpoint.trim_start_matches("http://");
        let mut stream = tokio::net::TcpStream::connect(address)
            .await
            .unwrap_or_else(|err| panic!("cannot reach the S3 server: {err}"));
        let request =
            format!("{method} {target} HTTP/1.1\r\nHost: {address}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .unwrap_or_else(|err| panic!("cannot send to the S3 server: {err}"));
        let mut answer = String::new();
        stream
            .read_to_string(&mut answer)
            .await
            .unwrap_or_else(|err| panic!("no answer from the S3 server: {err}"));
        let status = answer
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or(0);
        (status, answer)
    }
}
