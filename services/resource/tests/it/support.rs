//! Test stores (a SQLite file per test, a Postgres schema per test), the suite
//! macro that runs each body on both, and helpers.

use std::sync::Arc;

use avm_common::{ApiError, Code, RequestContext};
use avm_resource::{
    Kind, NewResource, NewVersion, Published, ResourceError, ResourceService, ResourceStore, VersionRecord, open_store,
};
use avm_store::testing::TestDatabase;

/// Expands each body, an `async fn(Arc<dyn ResourceStore>)` of the calling
/// module, into `sqlite::<name>` and `postgres::<name>` tests.
macro_rules! conformance_suite {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test]
                async fn $name() {
                    let db = crate::support::TestStore::sqlite().await;
                    super::$name(db.store.clone()).await;
                }
            )*
        }

        mod postgres {
            $(
                #[tokio::test]
                async fn $name() {
                    let Some(db) = crate::support::TestStore::postgres().await else { return };
                    super::$name(db.store.clone()).await;
                }
            )*
        }
    };
}

pub(crate) use conformance_suite;

/// A store under test and the database that must outlive it.
pub struct TestStore {
    pub store: Arc<dyn ResourceStore>,
    _db: TestDatabase,
}

impl TestStore {
    /// Returns a store in a fresh SQLite file.
    pub async fn sqlite() -> TestStore {
        let db = TestDatabase::sqlite("resource.db");
        let store = open_store(&db.url, None).await.expect("open sqlite store");
        TestStore { store, _db: db }
    }

    /// Returns a store in a fresh Postgres schema, or `None` (said loudly) without Postgres.
    pub async fn postgres() -> Option<TestStore> {
        let db = TestDatabase::postgres("avm_resource_test").await?;
        let store = open_store(&db.url, Some(4)).await.expect("open postgres store");
        Some(TestStore { store, _db: db })
    }
}

/// Returns the error a caller would see, failing the test when there is none.
pub fn api_err<T: std::fmt::Debug>(result: Result<T, ResourceError>) -> ApiError {
    match result {
        Ok(value) => panic!("expected an error, got {value:?}"),
        Err(err) => ApiError::from(err),
    }
}

/// Asserts the error a caller would see has this code and reason and a
/// message containing `says`.
#[track_caller]
pub fn assert_err<T: std::fmt::Debug>(result: Result<T, ResourceError>, code: Code, reason: &str, says: &str) {
    let err = api_err(result);
    assert_eq!((err.code, err.reason.as_ref()), (code, reason), "{}", err.message);
    assert!(
        err.message.contains(says),
        "{:?} does not contain {says:?}",
        err.message
    );
}

/// Returns the smallest valid content of `kind` (an agent's prompt is `resource://prompts/p`).
pub fn content(kind: Kind) -> &'static str {
    match kind {
        Kind::Prompt => r#"{"template":"hello"}"#,
        Kind::Tool => r#"{"name":"echo","inputSchema":{"type":"object"},"builtin":"echo"}"#,
        Kind::Sandbox => r#"{"limits":{}}"#,
        Kind::Agent => r#"{"prompt":"resource://prompts/p"}"#,
        Kind::Knowledge => r#"{"documents":[{"text":"fact"}]}"#,
    }
}

/// Returns a registration of `kind`/`name`@`version` with `content_json` and no extras.
pub fn new_resource(kind: Kind, name: &str, version: &str, content_json: &str) -> NewResource {
    NewResource {
        kind,
        name: name.to_owned(),
        version: version.to_owned(),
        content_json: content_json.to_owned(),
        description: String::new(),
        tags: Vec::new(),
        dependencies: Vec::new(),
        public: false,
    }
}

/// Returns a publish of `version` of `resource_id` with `content_json` and no extras.
pub fn new_version(resource_id: &str, version: &str, content_json: &str) -> NewVersion {
    NewVersion {
        resource_id: resource_id.to_owned(),
        version: version.to_owned(),
        content_json: content_json.to_owned(),
        dependencies: Vec::new(),
        description: None,
        tags: None,
    }
}

/// Registers `kind`/`name`@`version` with the smallest content of its kind
/// and `dependencies`, failing the test when refused.
pub async fn register(
    service: &ResourceService,
    ctx: &RequestContext,
    kind: Kind,
    name: &str,
    version: &str,
    dependencies: &[&str],
) -> Published {
    let new = NewResource {
        dependencies: dependencies.iter().map(|d| (*d).to_owned()).collect(),
        ..new_resource(kind, name, version, content(kind))
    };
    service
        .register(ctx, new)
        .await
        .unwrap_or_else(|err| panic!("register {kind} {name}@{version}: {err}"))
}

/// Registers `kind`/`name`@`version` with `content_json`, failing the test when refused.
pub async fn register_with(
    service: &ResourceService,
    ctx: &RequestContext,
    kind: Kind,
    name: &str,
    version: &str,
    content_json: &str,
) -> Published {
    service
        .register(ctx, new_resource(kind, name, version, content_json))
        .await
        .unwrap_or_else(|err| panic!("register {kind} {name}@{version}: {err}"))
}

/// Returns the exact URIs of versions, in order.
pub fn uris(versions: &[VersionRecord]) -> Vec<String> {
    versions.iter().map(|v| v.uri().to_string()).collect()
}
