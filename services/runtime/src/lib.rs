//! The AgentVM runtime: the agent pool, LLM drivers and session event streams.

pub mod config;
mod context;
pub mod grpc;
pub mod hub;
pub mod llm;
pub mod metering;
pub mod resources;
pub mod service;
pub mod session_client;
pub mod settings;
mod turn;

pub use config::{BillingConfig, LlmConfig, ModelPrice, RuntimeConfig};
pub use grpc::{RuntimeGrpc, grpc_server};
pub use metering::Metering;
pub use resources::ResourceClient;
pub use service::AgentPool;
pub use session_client::SessionClient;
pub use settings::LlmSettings;
