//! Integration tests of the config service.

// The conformance bodies and helpers are plain functions, which clippy's
// `allow-unwrap-in-tests` does not cover; a failed unwrap is a failed test here.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod conformance;
mod grpc;
mod support;
