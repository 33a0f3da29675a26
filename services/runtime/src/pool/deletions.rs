//! Following the session service's deletions: the agents of deleted images
//! stop and their workspaces go, whoever deleted them.

use avm_common::backoff::Backoff;

use avm_common::Code;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::AgentPool;
use crate::error::{AgentTarget, RuntimeError};
use crate::peers::Deletion;

impl AgentPool {
    /// Stops the agents of images the session service deleted (whoever asked
    /// it to), reconnecting with backoff until `shutdown`.
    pub(super) async fn follow_deletions(self, shutdown: CancellationToken) {
        let mut backoff = Backoff::default();
        loop {
            let result = tokio::select! {
                () = shutdown.cancelled() => return,
                result = self.watch_deletions(&mut backoff) => result,
            };
            if let Err(err) = result {
                tracing::warn!(error = %err, "session deletions watch ended; reconnecting");
            }
            if !backoff.wait(&shutdown).await {
                return;
            }
        }
    }

    pub(super) async fn watch_deletions(&self, backoff: &mut Backoff) -> Result<(), RuntimeError> {
        let ctx = self.inner.ports.identity.own_context().await?;
        let mut stream = self.sessions().watch_deletions(&ctx).await?;
        while let Some(deletion) = stream.next().await.transpose()? {
            match deletion {
                Deletion::Live => {
                    backoff.reset();
                    // What was deleted while nobody watched: every live agent's image is checked.
                    self.reconcile().await;
                }
                Deletion::Images { tenant_id, image_ids } => {
                    for image_id in image_ids {
                        if let Some(agent) = self.lookup(&tenant_id, &AgentTarget::Image(image_id.clone())) {
                            self.retire(&agent, "image deleted");
                        }
                        // Deleted on the session service directly: the workspace goes too.
                        self.remove_workspace(&tenant_id, &image_id).await;
                    }
                }
            }
        }
        Ok(())
    }

    /// Retires the agents whose image no longer exists.
    pub(super) async fn reconcile(&self) {
        for agent in self.live_agents() {
            let found = match self.inner.ports.identity.tenant_context(&agent.tenant_id).await {
                Ok(ctx) => self.sessions().get_image(&ctx, &agent.image.image_id).await,
                Err(err) => Err(err.into()),
            };
            if let Err(RuntimeError::Api(err)) = found
                && err.code == Code::NotFound
            {
                self.retire(&agent, "image deleted");
            }
        }
    }
}
