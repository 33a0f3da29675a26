//! Test stores (a SQLite file per test, a Postgres schema per test), a
//! bootstrapped service served on a `bind(0)` port, and helpers.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use avm_auth::{AuthError, AuthService, AuthStore, Bootstrap, grpc_server, open_store};
use avm_common::auth::AuthConfig;
use avm_common::config::{GrpcConfig, Secret};
use avm_common::{ApiError, RequestContext};
use avm_proto::auth::v1::auth_service_client::AuthServiceClient;
use sqlx::Connection;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};

/// The deployment's service key in every test.
pub const SERVICE_KEY: &str = "test-service-key-0123456789abcdef0123456789abcdef";

/// A store under test and whatever must outlive it.
pub struct TestDb {
    pub store: Arc<dyn AuthStore>,
    /// The url that opens this same database (and schema) again.
    pub url: String,
    cleanup: Cleanup,
}

enum Cleanup {
    /// The directory holding the SQLite file; removed on drop.
    Sqlite { _dir: tempfile::TempDir },
    /// The Postgres schema to drop, and the url that reaches it.
    Postgres { admin_url: String, schema: String },
}

impl TestDb {
    /// Returns a store in a fresh SQLite file.
    pub async fn sqlite() -> TestDb {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", dir.path().join("auth.db").display());
        let store = open_store(&url, None).await.expect("open sqlite store");
        TestDb {
            store,
            url,
            cleanup: Cleanup::Sqlite { _dir: dir },
        }
    }

    /// Returns a store in a fresh schema of `AVM_TEST_DATABASE_URL`, or `None`
    /// (after saying so) when the variable is unset and not required.
    pub async fn postgres() -> Option<TestDb> {
        let admin_url = postgres_url()?;
        let schema = avm_common::ids::new_id("avm_auth_t");
        let mut admin = sqlx::PgConnection::connect(&admin_url)
            .await
            .unwrap_or_else(|err| panic!("AVM_TEST_DATABASE_URL is set but postgres is unreachable: {err}"));
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&mut admin)
            .await
            .expect("create schema");
        admin.close().await.expect("close admin connection");
        let separator = if admin_url.contains('?') { '&' } else { '?' };
        let url = format!("{admin_url}{separator}options=-c%20search_path%3D{schema}");
        let store = open_store(&url, Some(4)).await.expect("open postgres store");
        Some(TestDb {
            store,
            url,
            cleanup: Cleanup::Postgres { admin_url, schema },
        })
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let Cleanup::Postgres { admin_url, schema } = &self.cleanup else {
            return;
        };
        let (url, schema) = (admin_url.clone(), schema.clone());
        // Drop cannot await, and the test's runtime may be a current-thread one,
        // so the schema is dropped from a thread with its own runtime.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(async {
                let mut admin = sqlx::PgConnection::connect(&url).await?;
                sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                    .execute(&mut admin)
                    .await?;
                admin.close().await?;
                anyhow::Ok(())
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("warning: could not drop test schema: {dropped:?}");
        }
    }
}

/// Returns `AVM_TEST_DATABASE_URL`; when unset, fails under `AVM_TEST_REQUIRE_EXTERNAL=1`
/// and otherwise says loudly that the test is skipped.
pub fn postgres_url() -> Option<String> {
    match std::env::var("AVM_TEST_DATABASE_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            let required = std::env::var("AVM_TEST_REQUIRE_EXTERNAL").is_ok_and(|v| v == "1");
            assert!(
                !required,
                "AVM_TEST_REQUIRE_EXTERNAL=1 but AVM_TEST_DATABASE_URL is not set"
            );
            eprintln!("SKIPPED: AVM_TEST_DATABASE_URL not set");
            None
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
        let service = AuthService::new(db.store.clone(), config.clone())
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
