//! Export and import: a conversation as a versioned JSON document, a
//! container as JSON Lines, both streamed from the session service as it
//! reads them; an import is sent whole (at most 15 MiB) and checked whole
//! there before anything is written.

use avm_common::{ApiError, RequestContext};
use avm_proto::session::v1 as pb;
use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use serde::Serialize;
use utoipa::ToSchema;

use crate::peers::Peers;

/// The largest import the gateway passes on, in bytes (the session service's bound).
pub const MAX_IMPORT_BYTES: usize = 15 * 1024 * 1024;

/// An export's bytes, as the session service writes them.
pub type ExportBody = BoxStream<'static, Result<Bytes, std::io::Error>>;

/// What one imported document became.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImportedConversation {
    /// The document's `documentId`.
    pub document_id: String,
    pub image_id: String,
    pub session_id: String,
    pub container_id: String,
    pub name: String,
    /// False when an earlier import of this document into this container made it.
    pub created: bool,
}

/// What an import made, in the import's order.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImportResult {
    pub conversations: Vec<ImportedConversation>,
}

impl ImportResult {
    /// Whether anything new was made.
    pub fn created(&self) -> bool {
        self.conversations.iter().any(|conversation| conversation.created)
    }
}

/// Turns the session service's pieces into a body; a failure after the first
/// piece ends the body early (the client sees it cut, not complete).
fn body<T: Send + 'static>(pieces: avm_proto::BoxStream<T>, data: fn(T) -> Vec<u8>, what: &'static str) -> ExportBody {
    pieces
        .map_ok(move |piece| Bytes::from(data(piece)))
        .map_err(move |status| {
            tracing::warn!(code = ?status.code(), message = status.message(), "{what} export cut");
            std::io::Error::other(format!("the {what} export failed"))
        })
        .boxed()
}

/// Exports a conversation the caller may read.
pub async fn export_image(peers: &Peers, ctx: &RequestContext, image_id: String) -> Result<ExportBody, ApiError> {
    let call = ctx.request(pb::ExportImageRequest { image_id });
    let pieces = peers.session.export_image(call).await?.into_inner();
    Ok(body(
        pieces,
        |piece: pb::ExportImageResponse| piece.data,
        "conversation",
    ))
}

/// Exports a container the caller may read, every conversation in it.
pub async fn export_container(
    peers: &Peers,
    ctx: &RequestContext,
    container_id: String,
) -> Result<ExportBody, ApiError> {
    let call = ctx.request(pb::ExportContainerRequest { container_id });
    let pieces = peers.session.export_container(call).await?.into_inner();
    Ok(body(
        pieces,
        |piece: pb::ExportContainerResponse| piece.data,
        "container",
    ))
}

/// Imports a conversation document or a container export into a container.
pub async fn import(
    peers: &Peers,
    ctx: &RequestContext,
    container_id: String,
    document: Bytes,
) -> Result<ImportResult, ApiError> {
    let call = ctx.request(pb::ImportConversationsRequest {
        container_id,
        document: document.to_vec(),
    });
    let imported = peers.session.import_conversations(call).await?.into_inner();
    Ok(ImportResult {
        conversations: imported
            .conversations
            .into_iter()
            .map(|item| {
                let image = item.image.unwrap_or_default();
                ImportedConversation {
                    document_id: item.document_id,
                    image_id: image.image_id,
                    session_id: image.session_id,
                    container_id: image.container_id,
                    name: image.name,
                    created: item.created,
                }
            })
            .collect(),
    })
}
