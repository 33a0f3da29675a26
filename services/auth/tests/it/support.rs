//! Test stores (a SQLite file per test, a Postgres schema per test), a
//! bootstrapped service served on a `bind(0)` port, and helpers.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use avm_auth::{AuthError, AuthService, AuthStore, Bootstrap, KeySeal, grpc_server, open_store};
use avm_common::auth::AuthConfig;
use avm_common::config::{GrpcConfig, Secret};
use avm_common::{ApiError, RequestContext};
use avm_proto::auth::v1::auth_service_client::AuthServiceClient;
use avm_store::testing::TestDatabase;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};

/// The deployment's service key in every test.
pub const SERVICE_KEY: &str = "test-service-key-0123456789abcdef0123456789abcdef";

/// The key material sealing the signing keys in every test.
pub const SEAL_KEY: &str = "test-seal-key-0123456789abcdef0123456789abcdef";

/// Returns the seal of the signing keys in every test.
pub fn seal() -> KeySeal {
    KeySeal::new(SEAL_KEY).expect("a long enough seal key")
}

/// A store under test and the database it lives in (dropped with it).
pub struct TestDb {
    pub store: Arc<dyn AuthStore>,
    /// The url that opens this same database (and schema) again.
    pub url: String,
    _db: TestDatabase,
}

impl TestDb {
    /// Returns a store in a fresh SQLite file.
    pub async fn sqlite() -> TestDb {
        Self::on(TestDatabase::sqlite("auth.db")).await
    }

    /// Returns a store in a fresh schema of `AVM_TEST_DATABASE_URL`, or `None`
    /// (after saying so) when the variable is unset and not required.
    pub async fn postgres() -> Option<TestDb> {
        Some(Self::on(TestDatabase::postgres("avm_auth_t").await?).await)
    }

    async fn on(db: TestDatabase) -> TestDb {
        let store = open_store(&db.url, Some(4)).await.expect("open auth store");
        TestDb {
            store,
            url: db.url.clone(),
            _db: db,
        }
    }
}

/// Returns the `[auth]` settings of the tests: a service key, defaults otherwise.
pub fn config() -> AuthConfig {
    AuthConfig {
        service_key: Secret::new(SERVICE_KEY),
        ..AuthConfig::default()
    }
}

/// A bootstrapped service over a test store, served over gRPC on a free port.
pub struct Harness {
    pub db: TestDb,
    pub service: AuthService,
    pub config: AuthConfig,
    /// The operator tenant's admin and their key.
    pub admin: Bootstrap,
    /// `http://127.0.0.1:<port>` of the gRPC server.
    pub url: String,
    pub shutdown: CancellationToken,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Harness {
    /// Returns a harness over a fresh SQLite store with the test settings.
    pub async fn sqlite() -> Harness {
        Harness::start(TestDb::sqlite().await, config()).await
    }

    /// Returns a harness over `db` with `config`.
    pub async fn start(db: TestDb, config: AuthConfig) -> Harness {
        let service = AuthService::new(db.store.clone(), config.clone(), seal())
            .await
            .expect("start auth service");
        let shutdown = CancellationToken::new();
        service.spawn_background(shutdown.clone());
        let admin = service.bootstrap().await.unwrap().expect("a fresh store bootstraps");
        let (url, server) = serve(&service).await;
        Harness {
            db,
            service,
            config,
            admin,
            url,
            shutdown,
            server,
        }
    }

    /// Returns the context of the holder of `key` (an API key or the service
    /// key), as the gRPC adapter would build it.
    pub async fn ctx(&self, key: &str) -> RequestContext {
        context(&self.service, key).await
    }

    /// Returns the operator admin's context.
    pub async fn operator(&self) -> RequestContext {
        self.ctx(&self.admin.secret).await
    }

    /// Returns a gRPC client of the served service.
    pub async fn client(&self) -> AuthServiceClient<Channel> {
        AuthServiceClient::connect(self.url.clone()).await.expect("connect")
    }

    /// Returns a lazily connecting channel to the served service.
    pub fn channel(&self) -> Channel {
        avm_common::grpc::channel(&self.url, &GrpcConfig::default()).expect("channel")
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.shutdown.cancel();
        self.server.abort();
    }
}

/// Serves `service` on a free loopback port; returns its url and the server task.
pub async fn serve(service: &AuthService) -> (String, tokio::task::JoinHandle<Result<(), tonic::transport::Error>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = grpc_server(service.clone(), &GrpcConfig::default());
    let handle = tokio::spawn(
        Server::builder()
            .add_service(server)
            .serve_with_incoming(TcpIncoming::from(listener)),
    );
    (format!("http://{addr}"), handle)
}

/// Returns the context of the holder of `key` at `service`.
pub async fn context(service: &AuthService, key: &str) -> RequestContext {
    let token = service.exchange_api_key(key).await.expect("exchange key");
    let principal = service.verifier().verify(&token.token).await.expect("verify token");
    RequestContext::new(principal, Some(Arc::from(token.token.as_str())), "req_test".to_owned())
}

/// Returns the error a caller would see, failing the test when there is none.
pub fn api_err<T: std::fmt::Debug>(result: Result<T, AuthError>) -> ApiError {
    match result {
        Ok(value) => panic!("expected an error, got {value:?}"),
        Err(err) => ApiError::from(err),
    }
}

/// Returns the stable reason of the error a caller would see.
pub fn reason<T: std::fmt::Debug>(result: Result<T, AuthError>) -> String {
    api_err(result).reason.into_owned()
}

/// Asserts that an error about `foreign` reads exactly like one about
/// `missing`, once each id is replaced by a placeholder.
pub fn assert_same_answer(foreign: &ApiError, foreign_id: &str, missing: &ApiError, missing_id: &str) {
    assert_eq!(foreign.code, missing.code, "{foreign:?} vs {missing:?}");
    assert_eq!(foreign.reason, missing.reason, "{foreign:?} vs {missing:?}");
    assert_eq!(
        foreign.message.replace(foreign_id, "<id>"),
        missing.message.replace(missing_id, "<id>"),
    );
}

/// Polls `check` until it returns `Some`, failing after `timeout`.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
