//! The AgentVM runtime: the agent pool, LLM drivers and session event streams.

pub mod config;
pub mod llm;

pub use config::{LlmConfig, RuntimeConfig};
