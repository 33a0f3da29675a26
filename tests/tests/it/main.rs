//! End-to-end suites of AgentVM.

mod llm_drivers;
