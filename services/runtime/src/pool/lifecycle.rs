//! An agent's lifecycle: paused or in error (not woken; what reaches it waits unread),
//! resumed (it reads what waited), terminated (never runs again, with every
//! agent it started). The state lives with the image, so a sleeping agent
//! keeps it without holding anything here.

use avm_common::auth::Scopes;
use avm_common::{ApiError, Code, RequestContext};

use super::{AgentPool, validate_id};
use crate::error::{AgentTarget, RuntimeError};
use crate::peers::{Image, Lifecycle};

/// Refuses to start the agent of an image that may not run.
pub(super) fn check_runnable(image: &Image) -> Result<(), RuntimeError> {
    let (reason, message) = match image.agent_state() {
        // Unspecified: an image stored before agents had states.
        Lifecycle::Active | Lifecycle::Unspecified => return Ok(()),
        Lifecycle::Paused => (
            "AGENT_PAUSED",
            format!("the agent of image {} is paused; resume it first", image.image_id),
        ),
        Lifecycle::Terminated => (
            "AGENT_TERMINATED",
            format!("the agent of image {} was terminated", image.image_id),
        ),
        Lifecycle::Error => (
            "AGENT_ERROR",
            format!(
                "the agent of image {} stopped after an error retrying would not fix ({}); resume it once that is fixed",
                image.image_id,
                image.agent_error.as_deref().unwrap_or("unknown")
            ),
        ),
    };
    Err(RuntimeError::Api(ApiError::new(
        Code::FailedPrecondition,
        reason,
        message,
    )))
}

/// Whether an error says the agent may not run (paused, terminated or in error).
pub(super) fn not_runnable(err: &RuntimeError) -> bool {
    matches!(err, RuntimeError::Api(api) if api.code == Code::FailedPrecondition
        && matches!(api.reason.as_ref(), "AGENT_PAUSED" | "AGENT_TERMINATED" | "AGENT_ERROR"))
}

impl AgentPool {
    /// Pauses an image's agent: it leaves the pool (a running turn is
    /// interrupted and stores what it has) and is not woken until resumed.
    #[tracing::instrument(name = "runtime.pause_agent", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn pause(&self, ctx: &RequestContext, image_id: &str) -> Result<Image, RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        validate_id("IMAGE_NOT_FOUND", "image", image_id)?;
        let (image, _) = self.sessions().set_lifecycle(ctx, image_id, Lifecycle::Paused).await?;
        self.leave(&ctx.tenant_id, image_id, "paused");
        tracing::info!(image_id, "agent paused");
        Ok(image)
    }

    /// Resumes a paused agent, or one in error, and wakes it to read what waited.
    #[tracing::instrument(name = "runtime.resume_agent", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn resume(&self, ctx: &RequestContext, image_id: &str) -> Result<Image, RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        validate_id("IMAGE_NOT_FOUND", "image", image_id)?;
        let (image, _) = self.sessions().set_lifecycle(ctx, image_id, Lifecycle::Active).await?;
        tracing::info!(image_id, "agent resumed");
        if let Err(err) = self.wake_member(ctx, image_id, false).await {
            tracing::warn!(image_id, error = %err, "a resumed agent could not be woken; its next message wakes it");
        }
        Ok(image)
    }

    /// Terminates an image's agent and every agent it started, below it at
    /// any depth; returns the image and the ids of all terminated.
    #[tracing::instrument(name = "runtime.terminate_agent", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn terminate(&self, ctx: &RequestContext, image_id: &str) -> Result<(Image, Vec<String>), RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        validate_id("IMAGE_NOT_FOUND", "image", image_id)?;
        let (image, terminated) = self
            .sessions()
            .set_lifecycle(ctx, image_id, Lifecycle::Terminated)
            .await?;
        for id in &terminated {
            self.leave(&ctx.tenant_id, id, "terminated");
        }
        tracing::info!(image_id, terminated = terminated.len(), "agent terminated");
        Ok((image, terminated))
    }

    /// Takes an image's agent out of the pool, if this replica runs it.
    pub(crate) fn leave(&self, tenant_id: &str, image_id: &str, why: &'static str) -> bool {
        match self.lookup(tenant_id, &AgentTarget::Image(image_id.to_owned())) {
            Some(agent) => {
                self.retire(&agent, why);
                true
            }
            None => false,
        }
    }
}
