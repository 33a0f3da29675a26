//! End-to-end suites of AgentVM: each scenario runs against the one-process
//! cluster and against one `avm` process per component.

mod bad_input;
mod binary;
mod conversation;
mod failures;
mod interrupt;
mod isolation;
mod lifecycle;
mod llm_drivers;
mod postgres;
mod providers;
mod rest;
mod resume;
mod support;
