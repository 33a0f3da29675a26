//! AgentVM's test support: the mock LLM, the cluster harness and a protocol client.

pub mod accounts;
pub mod cluster;
pub mod fake_kube;
pub mod mock_llm;
pub mod mock_mcp;
pub mod raw_http;
pub mod ws_client;
