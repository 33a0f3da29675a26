//! Test stores (a SQLite file per test, a Postgres schema per test) and helpers.

use std::sync::Arc;

use avm_common::auth::{Limits, Principal, Role, Scopes};
use avm_common::{ApiError, RequestContext};
use avm_session::{MessageBody, NewMessage, SessionError, SessionStore, open_store};
use sqlx::Connection;

/// A store under test and whatever must outlive it.
pub struct TestDb {
    pub store: Arc<dyn SessionStore>,
    cleanup: Cleanup,
}

enum Cleanup {
    /// The directory holding the SQLite file; removed on drop.
    Sqlite { _dir: tempfile::TempDir },
    /// The Postgres schema to drop, and the url that reaches it.
    Postgres { url: String, schema: String },
}

impl TestDb {
    /// Returns a store in a fresh SQLite file.
    pub async fn sqlite() -> TestDb {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = sqlite_url(&dir);
        let store = open_store(&url, None).await.expect("open sqlite store");
        TestDb {
            store,
            cleanup: Cleanup::Sqlite { _dir: dir },
        }
    }

    /// Returns a store in a fresh schema of `AVM_TEST_DATABASE_URL`, or `None`
    /// (after saying so) when the variable is unset and not required.
    pub async fn postgres() -> Option<TestDb> {
        let url = postgres_url()?;
        let schema = avm_common::ids::new_id("avm_session_test");
        let mut admin = sqlx::PgConnection::connect(&url)
            .await
            .unwrap_or_else(|err| panic!("AVM_TEST_DATABASE_URL is set but postgres is unreachable: {err}"));
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&mut admin)
            .await
            .expect("create schema");
        admin.close().await.expect("close admin connection");
        let cleanup = Cleanup::Postgres {
            url: url.clone(),
            schema: schema.clone(),
        };
        let separator = if url.contains('?') { '&' } else { '?' };
        let store_url = format!("{url}{separator}options=-c%20search_path%3D{schema}");
        let store = open_store(&store_url, Some(4)).await.expect("open postgres store");
        Some(TestDb { store, cleanup })
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let Cleanup::Postgres { url, schema } = &self.cleanup else {
            return;
        };
        let (url, schema) = (url.clone(), schema.clone());
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

/// Returns the url of `session.db` inside `dir`.
pub fn sqlite_url(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}", dir.path().join("session.db").display())
}

/// Returns the context of an admin of `tenant_id` (sees the whole tenant).
pub fn ctx(tenant_id: &str) -> RequestContext {
    principal_ctx(tenant_id, "usr_admin", Role::Admin, Scopes::ALL)
}

/// Returns the context of member `user_id` of `tenant_id`.
pub fn member(tenant_id: &str, user_id: &str) -> RequestContext {
    principal_ctx(tenant_id, user_id, Role::Member, Scopes::READ.union(Scopes::WRITE))
}

/// Returns a context with the given identity.
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

/// Returns the error a caller would see, failing the test when there is none.
pub fn api_err<T: std::fmt::Debug>(result: Result<T, SessionError>) -> ApiError {
    match result {
        Ok(value) => panic!("expected an error, got {value:?}"),
        Err(err) => ApiError::from(err),
    }
}

/// Returns the stable reason of the error a caller would see.
pub fn reason<T: std::fmt::Debug>(result: Result<T, SessionError>) -> String {
    api_err(result).reason.into_owned()
}

/// Returns a user message whose content is the JSON string `text`.
pub fn user(message_id: &str, text: &str) -> NewMessage {
    NewMessage {
        message_id: message_id.to_owned(),
        created_at_ms: 0,
        body: MessageBody::User {
            content_json: serde_json::Value::String(text.to_owned()).to_string(),
        },
    }
}
