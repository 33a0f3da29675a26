//! Draining at shutdown: running turns finish (or are interrupted), then
//! workspaces are saved and usage sent.

use std::time::Duration;

use super::AgentPool;

impl AgentPool {
    /// Drains at shutdown (SIGTERM): lets running turns finish for at most
    /// `grace` (then interrupts them, so they store what they have). With
    /// replicas it takes no new agent (another replica does), drops its
    /// agents, releases their leases and leaves; alone, it starts no new
    /// turn (`RUNTIME_DRAINING`).
    pub async fn drain(&self, grace: Duration) {
        let deadline = tokio::time::Instant::now() + grace;
        let handing_over = self.inner.placement.begin_drain();
        self.finish_turns(deadline).await;
        if handing_over {
            for agent in self.live_agents() {
                agent.stopped().await;
                self.retire(&agent, "draining");
            }
            // Their workspaces are saved before another replica may claim them.
            self.save_workspaces(grace).await;
        }
        self.inner.placement.leave().await;
    }

    /// Waits until `deadline` for running turns to end, then interrupts
    /// those left (they store their partial replies).
    pub(super) async fn finish_turns(&self, deadline: tokio::time::Instant) {
        tracing::info!(
            running = self.live_agents().iter().filter(|a| a.is_running()).count(),
            "draining"
        );
        for agent in self.live_agents() {
            if tokio::time::timeout_at(deadline, agent.stopped()).await.is_err() {
                agent.interrupt();
            }
        }
    }

    /// Waits, at most `limit`, until the usage of every finished call was
    /// reported (at shutdown, before the services it reports to stop).
    pub async fn flush_usage(&self, limit: Duration) -> bool {
        self.inner.ports.metering.flush(limit).await
    }

    /// Returns whether any turn is still running.
    pub fn any_running(&self) -> bool {
        self.live_agents().iter().any(|agent| agent.is_running())
    }
}
