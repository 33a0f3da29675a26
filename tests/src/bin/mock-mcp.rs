//! `mock-mcp`: the mock MCP server over stdio, for the tools suites and
//! manual runs (a tool resource's `mcpServer.command`).

use avm_tests::mock_mcp::MockMcp;
use rmcp::ServiceExt;

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let service = MockMcp::default().serve(rmcp::transport::stdio()).await?;
    service.waiting().await?;
    Ok(())
}
