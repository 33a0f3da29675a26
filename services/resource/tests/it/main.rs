//! Integration tests of the resource service.
//!
//! Every module but `grpc` runs each of its bodies on SQLite and on Postgres
//! (`support::conformance_suite!`); Postgres is skipped, loudly, without
//! `AVM_TEST_DATABASE_URL`.

// The conformance bodies and helpers are plain functions, which clippy's
// `allow-unwrap-in-tests` does not cover; a failed unwrap is a failed test here.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod deletion;
mod dependencies;
mod grpc;
mod publishing;
mod search;
mod support;
mod templates;
mod tenancy;
mod versions;
