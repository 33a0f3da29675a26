//! The runtime's view of the session service: images, history and appends.

use avm_common::{ApiError, RequestContext};
use avm_proto::session::v1 as pb;
use avm_proto::session::v1::SessionServiceHandle;

/// What the runtime needs to know about an image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageInfo {
    pub image_id: String,
    pub container_id: String,
    pub session_id: String,
    pub name: String,
    pub system_prompt: Option<String>,
    /// A `resource://agents/…` definition the image runs.
    pub agent: Option<String>,
    /// Values of the prompt's variables, a JSON object.
    pub variables_json: String,
}

impl From<pb::Image> for ImageInfo {
    fn from(image: pb::Image) -> Self {
        Self {
            image_id: image.image_id,
            container_id: image.container_id,
            session_id: image.session_id,
            name: image.name,
            system_prompt: image.system_prompt.filter(|prompt| !prompt.is_empty()),
            agent: image.agent.filter(|agent| !agent.is_empty()),
            variables_json: image.variables_json,
        }
    }
}

/// The session service, as the runtime uses it.
#[derive(Clone)]
pub struct SessionClient {
    inner: SessionServiceHandle,
}

impl SessionClient {
    /// Wraps the session service (in process or remote).
    pub fn new(inner: SessionServiceHandle) -> Self {
        Self { inner }
    }

    /// Returns an image of the caller's tenant.
    pub async fn get_image(&self, ctx: &RequestContext, image_id: &str) -> Result<ImageInfo, ApiError> {
        let request = ctx.request(pb::GetImageRequest {
            image_id: image_id.to_owned(),
        });
        let response = self.inner.get_image(request).await?.into_inner();
        response
            .image
            .map(ImageInfo::from)
            .ok_or_else(|| ApiError::internal("session service returned no image"))
    }

    /// Fails with CONTAINER_NOT_FOUND unless the caller may see the container.
    pub async fn check_container(&self, ctx: &RequestContext, container_id: &str) -> Result<(), ApiError> {
        let request = ctx.request(pb::GetContainerRequest {
            container_id: container_id.to_owned(),
        });
        self.inner.get_container(request).await?;
        Ok(())
    }

    /// Returns the ids of the containers the caller may see.
    pub async fn visible_containers(&self, ctx: &RequestContext) -> Result<Vec<String>, ApiError> {
        let request = ctx.request(pb::ListContainersRequest {});
        let response = self.inner.list_containers(request).await?.into_inner();
        Ok(response.containers.into_iter().map(|c| c.container_id).collect())
    }

    /// Returns the image that owns a session of the caller's tenant.
    pub async fn get_session(&self, ctx: &RequestContext, session_id: &str) -> Result<ImageInfo, ApiError> {
        let request = ctx.request(pb::GetSessionRequest {
            session_id: session_id.to_owned(),
        });
        let response = self.inner.get_session(request).await?.into_inner();
        response
            .image
            .map(ImageInfo::from)
            .ok_or_else(|| ApiError::internal("session service returned no image"))
    }

    /// Returns a session's messages in stored order.
    pub async fn list_messages(&self, ctx: &RequestContext, session_id: &str) -> Result<Vec<pb::Message>, ApiError> {
        let request = ctx.request(pb::ListMessagesRequest {
            session_id: session_id.to_owned(),
        });
        Ok(self.inner.list_messages(request).await?.into_inner().messages)
    }

    /// Appends a message and returns it as stored.
    pub async fn append(&self, ctx: &RequestContext, message: pb::Message) -> Result<pb::Message, ApiError> {
        let request = ctx.request(pb::AppendMessageRequest {
            session_id: message.session_id.clone(),
            message: Some(message),
        });
        let response = self.inner.append_message(request).await?.into_inner();
        response
            .message
            .ok_or_else(|| ApiError::internal("session service returned no message"))
    }
}
