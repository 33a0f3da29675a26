//! Integration tests of the session service.

// The conformance bodies and helpers are plain functions, which clippy's
// `allow-unwrap-in-tests` does not cover; a failed unwrap is a failed test here.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// First, so the modules after it can expand `conformance_suite!`.
#[macro_use]
mod support;

mod agent_state;
mod conformance;
mod groups;
mod grpc;
mod history;
mod persistence;
mod retention;
mod search;
mod transfer;
