//! The AgentVM runtime: the agent pool, LLM drivers and session event streams.
//!
//! ```text
//! grpc.rs      proto ⇄ domain: the RuntimeService adapter
//! peers/       the services it calls, each a client speaking domain types
//! pool.rs      the agents of this process: start, find, stop, reap, cascades
//! agent.rs     one agent: its conversation, one turn at a time
//! turn.rs      one turn: the LLM call streamed as events, then stored, metered
//! context.rs   the history as the LLM reads it, shared with each turn
//! message.rs   what users send (and its rules) and what agents answer
//! outbox.rs    messages the session service could not take, stored when it is back
//! plan.rs      an image's resource:// references, resolved at start
//! hub.rs       each session's events: cursors, retention, subscribers
//! replicas/    several runtimes: leases, heartbeats, lost turns, events over Redis
//! settings.rs  each tenant's LLM settings, followed live
//! metering.rs  prices, the usage queue, budget checks
//! llm/         the provider drivers
//! error.rs     the runtime's errors; config.rs: its settings
//! ```

mod agent;
mod compaction;
pub mod config;
mod context;
mod error;
pub mod event;
mod grpc;
pub mod hub;
pub mod llm;
mod message;
pub mod metering;
mod outbox;
pub mod peers;
mod plan;
mod pool;
pub mod replicas;
mod router;
pub mod settings;
pub mod tools;
mod turn;

pub use agent::AgentInfo;
pub use config::{BillingConfig, LlmConfig, ModelPrice, RuntimeConfig};
pub use error::{AgentTarget, RuntimeError};
pub use grpc::{RuntimeGrpc, grpc_server};
pub use metering::Metering;
pub use pool::AgentPool;
pub use settings::LlmSettings;
