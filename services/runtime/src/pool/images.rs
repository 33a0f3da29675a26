//! The image and agent facade: what a caller may see and do to images,
//! containers and agents, checked with the session service.

use std::collections::HashSet;
use std::sync::Arc;

use avm_common::auth::Scopes;
use avm_common::{Code, RequestContext};
use tracing::instrument;

use super::{AgentPool, ImageView, parse_cursor, validate_id};
use crate::agent::{Agent, AgentInfo};
use crate::error::{AgentTarget, RuntimeError};
use crate::hub::Subscription;
use crate::peers::{Image, ImageChanges, Role};

impl AgentPool {
    /// Returns the caller's agent named by `target`, or AGENT_NOT_FOUND when
    /// there is none or the caller may not see its container.
    pub(super) async fn find(
        &self,
        ctx: &RequestContext,
        target: &AgentTarget,
        need: Option<Role>,
    ) -> Result<Arc<Agent>, RuntimeError> {
        let not_found = || RuntimeError::AgentNotFound(target.clone());
        let agent = self.lookup(&ctx.tenant_id, target).ok_or_else(not_found)?;
        match self.authorize(ctx, &agent.image.container_id, need).await {
            Ok(()) => Ok(agent),
            Err(RuntimeError::Api(err)) if err.code == Code::NotFound => Err(not_found()),
            Err(err) => Err(err),
        }
    }

    /// Fails unless the caller may see the container and, with `need`, do
    /// what that role allows in it: admins and services may do everything in
    /// the tenant; members ask the session service (a share's role).
    pub(super) async fn authorize(
        &self,
        ctx: &RequestContext,
        container_id: &str,
        need: Option<Role>,
    ) -> Result<(), RuntimeError> {
        if ctx.owner_filter().is_none() {
            return Ok(());
        }
        match need {
            None => self.sessions().check_container(ctx, container_id).await,
            Some(need) => self.sessions().require_role(ctx, container_id, need).await,
        }
    }

    /// Returns an image the caller may see and, with `need`, do what that
    /// role allows in its container; a foreign or missing image is not found.
    pub(super) async fn image_with_role(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        need: Option<Role>,
    ) -> Result<Image, RuntimeError> {
        validate_id("IMAGE_NOT_FOUND", "image", image_id)?;
        let image = self.sessions().get_image(ctx, image_id).await?;
        if need.is_some() {
            self.authorize(ctx, &image.container_id, need).await?;
        }
        Ok(image)
    }

    /// Returns one agent of the caller.
    #[instrument(name = "runtime.get_agent", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn get_agent(&self, ctx: &RequestContext, agent_id: &str) -> Result<AgentInfo, RuntimeError> {
        ctx.require(Scopes::READ)?;
        let target = AgentTarget::Agent(agent_id.to_owned());
        Ok(self.find(ctx, &target, None).await?.info())
    }

    /// Lists the caller's agents, optionally of one container, oldest first.
    #[instrument(name = "runtime.list_agents", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn list_agents(
        &self,
        ctx: &RequestContext,
        container_id: Option<&str>,
    ) -> Result<Vec<AgentInfo>, RuntimeError> {
        ctx.require(Scopes::READ)?;
        let visible: Option<HashSet<String>> = match ctx.owner_filter() {
            None => None,
            Some(_) => Some(self.sessions().visible_containers(ctx).await?.into_iter().collect()),
        };
        let mut agents: Vec<AgentInfo> = self
            .live_agents()
            .into_iter()
            .filter(|agent| agent.tenant_id == ctx.tenant_id)
            .filter(|agent| container_id.is_none_or(|id| agent.image.container_id == id))
            .filter(|agent| {
                visible
                    .as_ref()
                    .is_none_or(|ids| ids.contains(&agent.image.container_id))
            })
            .map(|agent| agent.info())
            .collect();
        agents.sort_by(|a, b| {
            a.started_at_ms
                .cmp(&b.started_at_ms)
                .then_with(|| a.agent_id.cmp(&b.agent_id))
        });
        Ok(agents)
    }

    /// Returns an image with its running agent, if any.
    #[instrument(name = "runtime.get_image", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn get_image(&self, ctx: &RequestContext, image_id: &str) -> Result<ImageView, RuntimeError> {
        ctx.require(Scopes::READ)?;
        let image = self.sessions().get_image(ctx, image_id).await?;
        let agent = self
            .lookup(&ctx.tenant_id, &AgentTarget::Image(image.image_id.clone()))
            .map(|agent| agent.info());
        Ok(ImageView { image, agent })
    }

    /// Lists images, newest first, of one container or of all the caller's
    /// (or the children of one image), each with its running agent.
    #[instrument(name = "runtime.list_images", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn list_images(
        &self,
        ctx: &RequestContext,
        container_id: Option<&str>,
        parent_image_id: Option<&str>,
    ) -> Result<Vec<ImageView>, RuntimeError> {
        ctx.require(Scopes::READ)?;
        let images = match parent_image_id {
            Some(parent_image_id) => {
                validate_id("IMAGE_NOT_FOUND", "image", parent_image_id)?;
                // The session service decides whether the caller may see it.
                let parent = self.sessions().get_image(ctx, parent_image_id).await?;
                // Children live in their parent's container: naming another leaves none.
                if container_id.is_some_and(|id| id != parent.container_id) {
                    Vec::new()
                } else {
                    self.sessions().children(ctx, parent_image_id).await?
                }
            }
            None => self.sessions().list_images(ctx, container_id).await?,
        };
        Ok(images
            .into_iter()
            .map(|image| {
                let agent = self
                    .lookup(&ctx.tenant_id, &AgentTarget::Image(image.image_id.clone()))
                    .map(|agent| agent.info());
                ImageView { image, agent }
            })
            .collect())
    }

    /// Stops the agent of an image; `false` when none was running. An image
    /// that does not exist is NOT_FOUND.
    #[instrument(name = "runtime.stop_image", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn stop_image(&self, ctx: &RequestContext, image_id: &str) -> Result<bool, RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        validate_id("IMAGE_NOT_FOUND", "image", image_id)?;
        // The session service decides whether the caller may see the image,
        // and a member needs to manage it: stopping cuts whoever is talking.
        self.image_with_role(ctx, image_id, Some(Role::Manage)).await?;
        Ok(self.leave(&ctx.tenant_id, image_id, "stopped"))
    }

    /// Changes an image; new tools stop its agent (interrupting a running
    /// turn), so the next message starts it with them. Returns whether an
    /// agent was stopped.
    #[instrument(name = "runtime.update_image", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn update_image(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        changes: ImageChanges,
    ) -> Result<bool, RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        validate_id("IMAGE_NOT_FOUND", "image", image_id)?;
        let retools = changes.tools.is_some();
        self.sessions().update_image(ctx, image_id, changes).await?;
        if !retools {
            return Ok(false);
        }
        match self.lookup(&ctx.tenant_id, &AgentTarget::Image(image_id.to_owned())) {
            Some(agent) => {
                self.retire(&agent, "tools changed");
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Stops and forgets one agent.
    #[instrument(name = "runtime.destroy_agent", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn destroy_agent(&self, ctx: &RequestContext, agent_id: &str) -> Result<(), RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        let target = AgentTarget::Agent(agent_id.to_owned());
        let agent = self.find(ctx, &target, Some(Role::Manage)).await?;
        self.retire(&agent, "destroyed");
        Ok(())
    }

    /// Stops every agent of a container; returns how many.
    #[instrument(name = "runtime.destroy_all_agents", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn destroy_all(&self, ctx: &RequestContext, container_id: &str) -> Result<u32, RuntimeError> {
        ctx.require(Scopes::WRITE)?;
        self.authorize(ctx, container_id, Some(Role::Manage)).await?;
        Ok(self.retire_container(&ctx.tenant_id, container_id))
    }

    /// Subscribes to a session's events, replaying retained ones after `after_cursor`.
    #[instrument(name = "runtime.subscribe_events", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn subscribe(
        &self,
        ctx: &RequestContext,
        session_id: &str,
        after_cursor: Option<&str>,
    ) -> Result<Subscription, RuntimeError> {
        ctx.require(Scopes::READ)?;
        let after = parse_cursor(after_cursor)?;
        validate_id("SESSION_NOT_FOUND", "session", session_id)?;
        // Ownership: the session must be one the caller may see.
        self.sessions().get_session(ctx, session_id).await?;
        Ok(self.inner.hubs.open(session_id).await.subscribe(after))
    }
}
