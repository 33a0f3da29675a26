//! Integration tests of the observability service.

// The conformance bodies and helpers are plain functions, which clippy's
// `allow-unwrap-in-tests` does not cover; a failed unwrap is a failed test here.
#![allow(clippy::unwrap_used, clippy::expect_used)]

/// Runs each body on a fresh SQLite database and, when configured, on a
/// fresh Postgres schema.
macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let db = avm_store::testing::TestDatabase::sqlite("observability.db");
                    super::$name(crate::support::Harness::on(db).await).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let Some(db) = avm_store::testing::TestDatabase::postgres("avm_obs_test").await else {
                        return;
                    };
                    super::$name(crate::support::Harness::on(db).await).await;
                }
            )*
        }
    };
}

mod budgets;
mod grpc;
mod ledger;
mod logs;
mod support;
mod tenancy;
