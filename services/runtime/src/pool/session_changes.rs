//! Following the session service's changes: the agents of deleted images
//! stop and their workspaces go, whoever deleted them; a new group message
//! wakes the agents it concerns (`groups.rs`), whoever posted it; an agent
//! whose image's tools changed stops, to start with the new ones, whoever
//! changed them.

use avm_common::backoff::Backoff;

use avm_common::Code;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::AgentPool;
use crate::error::{AgentTarget, RuntimeError};
use crate::peers::SessionChange;

impl AgentPool {
    /// Stops the agents of images the session service deleted and wakes
    /// those a new group message concerns (whoever asked it to),
    /// reconnecting with backoff until `shutdown`.
    pub(super) async fn follow_sessions(self, shutdown: CancellationToken) {
        let mut backoff = Backoff::default();
        loop {
            let result = tokio::select! {
                () = shutdown.cancelled() => return,
                result = self.watch_sessions(&mut backoff) => result,
            };
            if let Err(err) = result {
                tracing::warn!(error = %err, "session changes watch ended; reconnecting");
            }
            if !backoff.wait(&shutdown).await {
                return;
            }
        }
    }

    async fn watch_sessions(&self, backoff: &mut Backoff) -> Result<(), RuntimeError> {
        let ctx = self.inner.ports.identity.own_context().await?;
        let mut stream = self.sessions().watch_changes(&ctx).await?;
        while let Some(change) = stream.next().await.transpose()? {
            match change {
                SessionChange::Live => {
                    backoff.reset();
                    self.inner.sessions_followed.send_replace(true);
                    // What was deleted while nobody watched: every live agent's image is checked.
                    self.reconcile().await;
                }
                SessionChange::Deleted { tenant_id, image_ids } => {
                    for image_id in image_ids {
                        if let Some(agent) = self.lookup(&tenant_id, &AgentTarget::Image(image_id.clone())) {
                            self.retire(&agent, "image deleted");
                        }
                        // Deleted on the session service directly: the workspace goes too.
                        self.remove_workspace(&tenant_id, &image_id).await;
                    }
                }
                SessionChange::Retooled {
                    tenant_id,
                    image_id,
                    tools,
                } => {
                    // An agent started since with these tools (the runtime's
                    // own update stops the old one before it answers) stays.
                    if let Some(agent) = self.lookup(&tenant_id, &AgentTarget::Image(image_id))
                        && agent.image.tools != tools
                    {
                        self.retire(&agent, "tools changed");
                    }
                }
                SessionChange::Posted {
                    tenant_id,
                    group_id,
                    seq,
                    message_id,
                } => {
                    // Not awaited: the stream goes on while the agents wake.
                    let pool = self.clone();
                    tokio::spawn(
                        async move { pool.group_message_posted(&tenant_id, &group_id, seq, &message_id).await },
                    );
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
