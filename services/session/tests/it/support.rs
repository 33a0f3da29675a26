//! Test stores (a SQLite file per test, a Postgres schema per test) and helpers.

use std::sync::Arc;

use avm_common::ApiError;
use avm_session::{MessageBody, NewMessage, SessionError, SessionStore, open_store};
use avm_store::testing::TestDatabase;

/// Expands each body into `sqlite::<name>` and `postgres::<name>` tests.
macro_rules! conformance_suite {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $name() {
                    let db = crate::support::TestDb::sqlite().await;
                    super::$name(db.store.clone()).await;
                }
            )*
        }

        mod postgres {
            $(
                #[tokio::test]
                async fn $name() {
                    let Some(db) = crate::support::TestDb::postgres().await else { return };
                    super::$name(db.store.clone()).await;
                }
            )*
        }
    };
}

/// A store under test and the database it lives in (dropped with it).
pub struct TestDb {
    pub store: Arc<dyn SessionStore>,
    _db: TestDatabase,
}

impl TestDb {
    /// Returns a store in a fresh SQLite file.
    pub async fn sqlite() -> TestDb {
        Self::on(TestDatabase::sqlite("session.db")).await
    }

    /// Returns a store in a fresh schema of `AVM_TEST_DATABASE_URL`, or `None`
    /// (after saying so) when the variable is unset and not required.
    pub async fn postgres() -> Option<TestDb> {
        Some(Self::on(TestDatabase::postgres("avm_session_test").await?).await)
    }

    /// Returns the url of the database the store lives in, for tests that
    /// write rows the service never would (a conversation idle for months).
    pub fn url(&self) -> &str {
        &self._db.url
    }

    async fn on(db: TestDatabase) -> TestDb {
        // Two connections a store: the suite runs many Postgres tests at once, and
        // the server takes at most 100 clients.
        let store = open_store(&db.url, Some(2)).await.expect("open session store");
        TestDb { store, _db: db }
    }
}

/// Returns the context of an admin of `tenant_id` (sees the whole tenant).
pub use avm_common::testing::admin_ctx as ctx;
/// Returns the context of member `user_id` of `tenant_id`.
pub use avm_common::testing::member_ctx as member;
pub use avm_common::testing::principal_ctx;

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
