//! Integration tests of the auth service.

// The conformance bodies and helpers are plain functions, which clippy's
// `allow-unwrap-in-tests` does not cover; a failed unwrap is a failed test here.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod conformance;
mod grpc;
mod oidc;
mod service;
mod support;
mod tokens;
mod usage;
mod watch;
