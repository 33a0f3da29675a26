//! Fresh databases for the services' own suites (feature `testing`): a
//! SQLite file in a temporary directory, or a schema of `AVM_TEST_DATABASE_URL`.

use avm_common::testing::{DATABASE_URL_VAR, external_service};

/// A database made for one test: a SQLite file in a temporary directory, or
/// a fresh schema of `AVM_TEST_DATABASE_URL`, dropped with this value.
pub struct TestDatabase {
    /// The url a store opens (the Postgres one is bound to the schema).
    pub url: String,
    cleanup: Cleanup,
}

enum Cleanup {
    Sqlite(#[allow(dead_code, reason = "removed on drop")] tempfile::TempDir),
    Postgres { url: String, schema: String },
}

impl TestDatabase {
    /// Returns a fresh SQLite database named `file` in a new temporary directory.
    pub fn sqlite(file: &str) -> TestDatabase {
        let dir = tempfile::tempdir().unwrap_or_else(|err| panic!("cannot make a temp dir: {err}"));
        TestDatabase {
            url: format!("sqlite://{}", dir.path().join(file).display()),
            cleanup: Cleanup::Sqlite(dir),
        }
    }

    /// Returns a fresh schema (named after `prefix`) of `AVM_TEST_DATABASE_URL`,
    /// or `None` when the variable is unset and not required.
    pub async fn postgres(prefix: &str) -> Option<TestDatabase> {
        use sqlx::Connection;
        let url = external_service(DATABASE_URL_VAR)?;
        let schema = avm_common::ids::new_id(prefix);
        let mut admin = sqlx::PgConnection::connect(&url)
            .await
            .unwrap_or_else(|err| panic!("{DATABASE_URL_VAR} is set but postgres is unreachable: {err}"));
        sqlx::query(&format!("CREATE SCHEMA {schema}"))
            .execute(&mut admin)
            .await
            .unwrap_or_else(|err| panic!("cannot create schema {schema}: {err}"));
        let _ = admin.close().await;
        let separator = if url.contains('?') { '&' } else { '?' };
        Some(TestDatabase {
            url: format!("{url}{separator}options=-c%20search_path%3D{schema}"),
            cleanup: Cleanup::Postgres { url, schema },
        })
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let Cleanup::Postgres { url, schema } = &self.cleanup else {
            return;
        };
        drop_schemas(url, std::slice::from_ref(schema));
    }
}

/// Drops Postgres schemas with everything in them, warning when it cannot.
///
/// It runs on a thread with its own runtime: a `Drop` cannot await, and the
/// test's runtime may be a current-thread one, or shutting down.
pub fn drop_schemas(url: &str, schemas: &[String]) {
    use sqlx::Connection;
    let (url, owned) = (url.to_owned(), schemas.to_vec());
    let dropped = std::thread::spawn(move || -> Result<(), String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|err| err.to_string())?;
        runtime.block_on(async {
            let mut admin = sqlx::PgConnection::connect(&url).await.map_err(|err| err.to_string())?;
            for schema in &owned {
                sqlx::query(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
                    .execute(&mut admin)
                    .await
                    .map_err(|err| err.to_string())?;
            }
            let _ = admin.close().await;
            Ok(())
        })
    })
    .join();
    if !matches!(dropped, Ok(Ok(()))) {
        eprintln!("warning: could not drop test schemas {schemas:?}: {dropped:?}");
    }
}
