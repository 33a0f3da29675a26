//! End-to-end suites of AgentVM: each scenario runs against the one-process
//! cluster and against one `avm` process per component.

mod attack_fence;
mod attack_keys;
mod attack_ledger;
mod attack_quota;
mod attack_relay;
mod auth;
mod bad_input;
mod binary;
mod config_center;
mod conversation;
mod failures;
mod faults;
mod forged;
mod group_agents;
mod groups;
mod interrupt;
mod isolation;
mod lifecycle;
mod llm_drivers;
mod mcp;
mod metering;
mod openapi;
mod ownership;
mod postgres;
mod providers;
mod replicas;
mod resources;
mod rest;
mod resume;
mod rules;
mod scale;
mod support;
mod telemetry;
mod tools;
mod workspaces;
