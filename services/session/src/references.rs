//! Whether an image's `resource://` references resolve, asked of the
//! resource service when the image is created: a typo or a missing variable
//! fails then, rendered as the agent will render it, rather than when the
//! agent first starts.

use avm_common::{ApiError, RequestContext};
use avm_proto::resource::v1 as pb;
use avm_proto::resource::v1::ResourceServiceHandle;

/// What a reference to a resource starts with.
pub const RESOURCE_URI_PREFIX: &str = "resource://";

/// The resource service, as the session service asks it; cheap to clone.
#[derive(Clone)]
pub struct References {
    resources: ResourceServiceHandle,
}

impl References {
    /// Asks `resources` (in process or remote).
    pub fn new(resources: ResourceServiceHandle) -> Self {
        Self { resources }
    }

    /// Fails unless `uri` resolves for the caller, rendered with
    /// `variables_json` (a JSON object).
    pub async fn check(&self, ctx: &RequestContext, uri: &str, variables_json: &str) -> Result<(), ApiError> {
        let request = ctx.request(pb::ResolveResourceRequest {
            uri: uri.to_owned(),
            variables_json: variables_json.to_owned(),
        });
        self.resources.resolve_resource(request).await?;
        Ok(())
    }
}
