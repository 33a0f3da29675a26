//! Containers: a tenant's isolation units, their ids chosen by the client,
//! and the users they are shared with.

use avm_common::auth::ServiceIdentity;
use avm_common::{ApiError, RequestContext};
use avm_proto::session::v1 as ss;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{missing, require_tenant_user};
use crate::peers::Peers;

/// Names a container (`POST /v1/containers`, `container_create_request`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ContainerRef {
    /// Chosen by the client: 1 to 128 letters, digits and `. _ : @ -`.
    pub container_id: String,
}

/// A container.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Container {
    pub container_id: String,
    /// The user who created it.
    pub owner_id: String,
    /// Unix milliseconds.
    pub created_at: i64,
}

impl From<ss::Container> for Container {
    fn from(container: ss::Container) -> Self {
        Self {
            container_id: container.container_id,
            owner_id: container.owner_user_id,
            created_at: container.created_at_ms,
        }
    }
}

/// The caller's containers.
#[derive(Debug, Serialize, ToSchema)]
pub struct ContainerList {
    pub containers: Vec<Container>,
}

/// What deleting a container answers.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ContainerDeleted {
    pub container_id: String,
    pub deleted: bool,
}

/// Names the user to share a container with, and their role.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ShareRequest {
    pub user_id: String,
    /// What they may do; `use` when absent. Sharing again changes it.
    #[serde(default)]
    pub role: Option<ShareRole>,
}

/// What a user a container is shared with may do in it; the owner and the
/// tenant's admins may do everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ShareRole {
    /// See the container, its images, histories, groups and events.
    Read,
    /// Also talk: send messages, interrupt, create images and groups, post.
    Use,
    /// Also change and destroy: edit and delete images and groups, pause,
    /// resume, terminate and stop agents.
    Manage,
}

impl ShareRole {
    fn pb(self) -> ss::ShareRole {
        match self {
            ShareRole::Read => ss::ShareRole::Read,
            ShareRole::Use => ss::ShareRole::Use,
            ShareRole::Manage => ss::ShareRole::Manage,
        }
    }

    /// Returns the role a stored share has; unset (an older service) is `use`.
    fn of(role: i32) -> ShareRole {
        match ss::ShareRole::try_from(role) {
            Ok(ss::ShareRole::Read) => ShareRole::Read,
            Ok(ss::ShareRole::Manage) => ShareRole::Manage,
            _ => ShareRole::Use,
        }
    }
}

/// Whether a container is shared with a user, after a change.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShareState {
    pub container_id: String,
    pub user_id: String,
    pub shared: bool,
    /// Their role, when shared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<ShareRole>,
}

/// A user a container is shared with.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Share {
    pub user_id: String,
    /// Unix milliseconds.
    pub created_at: i64,
    pub role: ShareRole,
}

/// The users a container is shared with.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShareList {
    pub container_id: String,
    pub shares: Vec<Share>,
}

/// Creates a container, or returns the existing one; `true` when it is new.
pub async fn create(peers: &Peers, ctx: &RequestContext, request: ContainerRef) -> Result<(Container, bool), ApiError> {
    let request = ctx.request(ss::CreateContainerRequest {
        container_id: request.container_id,
    });
    let response = peers.session.create_container(request).await?.into_inner();
    let container = response.container.ok_or_else(|| missing("container"))?;
    Ok((container.into(), response.created))
}

/// Returns a container.
pub async fn get(peers: &Peers, ctx: &RequestContext, container_id: String) -> Result<Container, ApiError> {
    let request = ctx.request(ss::GetContainerRequest {
        container_id,
        need: None,
    });
    let response = peers.session.get_container(request).await?.into_inner();
    Ok(response.container.ok_or_else(|| missing("container"))?.into())
}

/// Lists the caller's containers, oldest first.
pub async fn list(peers: &Peers, ctx: &RequestContext) -> Result<ContainerList, ApiError> {
    let request = ctx.request(ss::ListContainersRequest {});
    let response = peers.session.list_containers(request).await?.into_inner();
    Ok(ContainerList {
        containers: response.containers.into_iter().map(Container::from).collect(),
    })
}

/// Deletes a container with everything inside; the runtimes hear it from
/// the session service, and stop its agents and remove their workspaces.
pub async fn delete(peers: &Peers, ctx: &RequestContext, container_id: String) -> Result<ContainerDeleted, ApiError> {
    let request = ctx.request(ss::DeleteContainerRequest {
        container_id: container_id.clone(),
    });
    peers.session.delete_container(request).await?;
    Ok(ContainerDeleted {
        container_id,
        deleted: true,
    })
}

/// Shares a container with a user of the caller's tenant. Another tenant's
/// user and a missing one answer alike, `USER_NOT_FOUND`, after a container
/// the caller may not see; `identity` looks the user up, since a member may
/// not see the tenant's other users itself.
pub async fn share(
    peers: &Peers,
    identity: &ServiceIdentity,
    ctx: &RequestContext,
    container_id: String,
    request: ShareRequest,
) -> Result<ShareState, ApiError> {
    get(peers, ctx, container_id.clone()).await?;
    let lookup = identity.context_for(ctx).await?;
    require_tenant_user(peers, &lookup, &request.user_id).await?;
    let role = request.role.unwrap_or(ShareRole::Use);
    let call = ctx.request(ss::ShareContainerRequest {
        container_id: container_id.clone(),
        user_id: request.user_id.clone(),
        role: role.pb().into(),
    });
    peers.session.share_container(call).await?;
    Ok(ShareState {
        container_id,
        user_id: request.user_id,
        shared: true,
        role: Some(role),
    })
}

/// Stops sharing a container with a user.
pub async fn unshare(
    peers: &Peers,
    ctx: &RequestContext,
    container_id: String,
    user_id: String,
) -> Result<ShareState, ApiError> {
    let call = ctx.request(ss::UnshareContainerRequest {
        container_id: container_id.clone(),
        user_id: user_id.clone(),
    });
    peers.session.unshare_container(call).await?;
    Ok(ShareState {
        container_id,
        user_id,
        shared: false,
        role: None,
    })
}

/// Lists the users a container is shared with.
pub async fn shares(peers: &Peers, ctx: &RequestContext, container_id: String) -> Result<ShareList, ApiError> {
    let call = ctx.request(ss::ListContainerSharesRequest {
        container_id: container_id.clone(),
    });
    let shares = peers.session.list_container_shares(call).await?.into_inner().shares;
    Ok(ShareList {
        container_id,
        shares: shares
            .into_iter()
            .map(|share| Share {
                user_id: share.user_id,
                created_at: share.created_at_ms,
                role: ShareRole::of(share.role),
            })
            .collect(),
    })
}
