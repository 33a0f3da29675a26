//! AgentVM's test support: the mock LLM and the cluster harness.

pub mod mock_llm;
