//! Images' workspaces as clients reach them (list, read, write, remove),
//! and their removal and saving.

use std::time::Duration;

use avm_common::RequestContext;
use avm_common::auth::Scopes;
use tracing::instrument;

use super::AgentPool;
use crate::config::RuntimeConfig;
use crate::error::RuntimeError;
use crate::peers::Role;
use crate::tools::{Workspace, access};
use avm_sandbox::FileSystem;

impl AgentPool {
    /// Returns an image's workspace (not created until a tool needs it).
    pub(super) fn workspace(&self, tenant_id: &str, image_id: &str) -> Workspace {
        let dir = workspace_root(&self.inner.config).join(tenant_id).join(image_id);
        match &self.inner.tools.store {
            Some(store) => store.workspace(tenant_id, image_id, dir),
            None => Workspace::new(dir),
        }
    }

    /// Lists a directory of an image's workspace (for whoever may see the image).
    #[instrument(name = "runtime.list_workspace", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn list_workspace(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        path: &str,
    ) -> Result<Vec<access::Entry>, RuntimeError> {
        let workspace = self.workspace_of(ctx, image_id, Scopes::READ, None).await?;
        accessed(workspace.entries(path).await)
    }

    /// Returns a file of an image's workspace (for whoever may see the image).
    #[instrument(name = "runtime.read_workspace_file", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn read_workspace_file(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        path: &str,
    ) -> Result<(access::Entry, Vec<u8>), RuntimeError> {
        let workspace = self.workspace_of(ctx, image_id, Scopes::READ, None).await?;
        accessed(workspace.fetch(path).await)
    }

    /// Writes a file of an image's workspace (for whoever may use the image).
    #[instrument(name = "runtime.write_workspace_file", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn write_workspace_file(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        path: &str,
        content: Vec<u8>,
    ) -> Result<access::Entry, RuntimeError> {
        let workspace = self.workspace_of(ctx, image_id, Scopes::WRITE, Some(Role::Use)).await?;
        let entry = accessed(workspace.store(path, content).await)?;
        workspace.save().await.map_err(|_| crate::tools::disk::unavailable())?;
        Ok(entry)
    }

    /// Removes a file or directory of an image's workspace (for whoever may use the image).
    #[instrument(name = "runtime.remove_workspace_file", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn remove_workspace_file(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        path: &str,
    ) -> Result<(), RuntimeError> {
        let workspace = self.workspace_of(ctx, image_id, Scopes::WRITE, Some(Role::Use)).await?;
        accessed(workspace.remove(path).await)?;
        workspace.save().await.map_err(|_| crate::tools::disk::unavailable())?;
        Ok(())
    }

    /// Returns the workspace of an image the caller may reach with `scope`;
    /// a foreign or missing image is not found, as everywhere.
    pub(super) async fn workspace_of(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        scope: Scopes,
        need: Option<Role>,
    ) -> Result<Workspace, RuntimeError> {
        ctx.require(scope)?;
        let image = self.image_with_role(ctx, image_id, need).await?;
        let workspace = self.workspace(&ctx.tenant_id, &image.image_id);
        // Kept in a store: restored first, as for a tool (unless its agent runs here).
        workspace.load().await.map_err(|_| crate::tools::disk::unavailable())?;
        Ok(workspace)
    }

    /// Deletes an image's workspace, if it has one; a failure is logged.
    pub(super) async fn remove_workspace(&self, tenant_id: &str, image_id: &str) {
        if let Some(store) = &self.inner.tools.store
            && let Err(err) = store.delete(tenant_id, image_id).await
        {
            tracing::warn!(image_id, error = %err, "cannot delete the image's workspace from the store");
        }
        let dir = self.workspace(tenant_id, image_id).dir().to_owned();
        let removed = tokio::task::spawn_blocking(move || match std::fs::remove_dir_all(&dir) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => Err(err),
            _ => Ok(()),
        })
        .await;
        if let Ok(Err(err)) | Err(err) = removed.map_err(std::io::Error::other) {
            tracing::warn!(image_id, error = %err, "cannot remove the image's workspace");
        }
    }

    /// Saves, within `limit`, the workspaces that changed since their last
    /// save (at shutdown, once turns ended); `true` without a store.
    pub async fn save_workspaces(&self, limit: Duration) -> bool {
        match &self.inner.tools.store {
            Some(store) => store.flush(limit).await,
            None => true,
        }
    }
}

/// Returns where images' workspaces live.
pub(super) fn workspace_root(config: &RuntimeConfig) -> std::path::PathBuf {
    config
        .workspace_root
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("avm-workspaces"))
}

/// Returns a client's workspace access as the API answers it.
fn accessed<T>(result: Result<T, access::AccessError>) -> Result<T, RuntimeError> {
    use avm_common::ApiError;
    result.map_err(|err| {
        RuntimeError::Api(match err {
            access::AccessError::Refused(message) => ApiError::invalid("INVALID_WORKSPACE_PATH", message),
            access::AccessError::NotFound(message) => ApiError::not_found("WORKSPACE_PATH_NOT_FOUND", message),
            access::AccessError::TooLarge(message) => ApiError::invalid("WORKSPACE_FILE_TOO_LARGE", message),
            access::AccessError::Failed(message) => ApiError::internal(message),
        })
    })
}
