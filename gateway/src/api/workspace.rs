//! An image's workspace, as clients see it: list a directory, read a file,
//! write one. Whoever may see the image may read its workspace; whoever may
//! use it may write there.

use avm_common::{ApiError, RequestContext};
use avm_proto::runtime::v1 as rt;
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::missing;
use crate::peers::Peers;

/// Which directory to list (the workspace's root by default).
#[derive(Debug, Default, Deserialize, IntoParams)]
#[serde(rename_all = "camelCase")]
#[into_params(parameter_in = Query)]
pub struct WorkspacePath {
    /// Relative to the workspace.
    #[serde(default)]
    pub path: String,
}

/// A file or directory of a workspace.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceEntry {
    /// Relative to the workspace, `/`-separated.
    pub path: String,
    /// `file` or `directory`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Bytes (files).
    pub size: u64,
    /// Unix milliseconds.
    pub modified_at: i64,
}

impl From<rt::WorkspaceEntry> for WorkspaceEntry {
    fn from(entry: rt::WorkspaceEntry) -> Self {
        Self {
            path: entry.path,
            kind: if entry.directory { "directory" } else { "file" },
            size: entry.size,
            modified_at: entry.modified_at_ms,
        }
    }
}

/// A directory of a workspace.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceListing {
    pub image_id: String,
    pub path: String,
    pub entries: Vec<WorkspaceEntry>,
}

/// A file of a workspace, as the WebSocket carries it.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceFile {
    pub image_id: String,
    #[serde(flatten)]
    pub entry: WorkspaceEntry,
    /// The content: text, or base64 when it is not UTF-8 (see `encoding`).
    pub content: String,
    /// `utf-8` or `base64`.
    pub encoding: &'static str,
}

/// A file to write over the WebSocket.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WorkspaceUpload {
    pub path: String,
    pub content: String,
    /// `utf-8` (the default) or `base64`.
    #[serde(default)]
    pub encoding: Option<String>,
}

impl WorkspaceUpload {
    /// Returns the bytes to write.
    pub fn bytes(self) -> Result<Vec<u8>, ApiError> {
        match self.encoding.as_deref() {
            None | Some("utf-8") => Ok(self.content.into_bytes()),
            Some("base64") => STANDARD
                .decode(self.content.as_bytes())
                .map_err(|_| ApiError::invalid("INVALID_FIELD", "content is not valid base64")),
            Some(other) => Err(ApiError::invalid(
                "INVALID_FIELD",
                format!("encoding must be utf-8 or base64, not {other:?}"),
            )),
        }
    }
}

/// Lists a directory of an image's workspace.
pub async fn list(
    peers: &Peers,
    ctx: &RequestContext,
    image_id: String,
    path: WorkspacePath,
) -> Result<WorkspaceListing, ApiError> {
    let request = ctx.request(rt::ListWorkspaceRequest {
        image_id: image_id.clone(),
        path: path.path.clone(),
    });
    let entries = peers.runtime.list_workspace(request).await?.into_inner().entries;
    Ok(WorkspaceListing {
        image_id,
        path: path.path,
        entries: entries.into_iter().map(WorkspaceEntry::from).collect(),
    })
}

/// Reads a file of an image's workspace.
pub async fn read(
    peers: &Peers,
    ctx: &RequestContext,
    image_id: String,
    path: String,
) -> Result<(WorkspaceEntry, Vec<u8>), ApiError> {
    let request = ctx.request(rt::ReadWorkspaceFileRequest { image_id, path });
    let file = peers.runtime.read_workspace_file(request).await?.into_inner();
    let entry = file.entry.ok_or_else(|| missing("entry"))?;
    Ok((entry.into(), file.content))
}

/// Reads a file as the WebSocket carries it: text, or base64.
pub async fn read_text(
    peers: &Peers,
    ctx: &RequestContext,
    image_id: String,
    path: String,
) -> Result<WorkspaceFile, ApiError> {
    let (entry, content) = read(peers, ctx, image_id.clone(), path).await?;
    let (content, encoding) = match String::from_utf8(content) {
        Ok(text) => (text, "utf-8"),
        Err(bytes) => (STANDARD.encode(bytes.into_bytes()), "base64"),
    };
    Ok(WorkspaceFile {
        image_id,
        entry,
        content,
        encoding,
    })
}

/// Writes a file of an image's workspace, creating its directories.
pub async fn write(
    peers: &Peers,
    ctx: &RequestContext,
    image_id: String,
    path: String,
    content: Vec<u8>,
) -> Result<WorkspaceEntry, ApiError> {
    let request = ctx.request(rt::WriteWorkspaceFileRequest {
        image_id,
        path,
        content,
    });
    let entry = peers.runtime.write_workspace_file(request).await?.into_inner().entry;
    Ok(entry.ok_or_else(|| missing("entry"))?.into())
}

/// What `DELETE /v1/images/{id}/workspace/files/{path}` answers.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceRemoved {
    pub image_id: String,
    /// What was removed, relative to the workspace.
    pub path: String,
    pub removed: bool,
}

/// Removes a file or a directory (with what it holds) of an image's workspace.
pub async fn remove(
    peers: &Peers,
    ctx: &RequestContext,
    image_id: String,
    path: String,
) -> Result<WorkspaceRemoved, ApiError> {
    let request = ctx.request(rt::RemoveWorkspaceFileRequest {
        image_id: image_id.clone(),
        path: path.clone(),
    });
    peers.runtime.remove_workspace_file(request).await?;
    Ok(WorkspaceRemoved {
        image_id,
        path,
        removed: true,
    })
}
