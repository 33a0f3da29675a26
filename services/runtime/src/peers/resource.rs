//! The resource service, as the runtime reads it: what an image's
//! `resource://` references resolve to when its agent starts.

use avm_common::RequestContext;
use avm_proto::resource::v1 as pb;
use avm_proto::resource::v1::ResourceServiceHandle;

use crate::error::RuntimeError;

/// What the URI of a tool resource starts with.
const TOOL_URI_PREFIX: &str = "resource://tools/";
/// What a sandbox resource's URI starts with.
const SANDBOX_URI_PREFIX: &str = "resource://sandboxes/";

/// A reference resolved at exact versions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resolved {
    /// The root resource's content, a JSON object.
    pub root_content: String,
    /// A prompt's template filled with the variables.
    pub rendered_prompt: Option<String>,
    /// The exact URIs: the root first, then its dependencies.
    pub uris: Vec<String>,
    /// The tools among the dependencies, in order.
    pub tools: Vec<ToolResource>,
    /// Whether the root resource is public (published by an operator).
    pub root_public: bool,
    /// The content of the sandbox among the dependencies (an agent's), if any.
    pub sandbox: Option<String>,
}

/// A tool resource's content (a JSON object) and whether it is public.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolResource {
    pub content: String,
    pub public: bool,
}

/// The resource service as the runtime uses it; cheap to clone.
#[derive(Clone)]
pub struct Resources {
    service: ResourceServiceHandle,
}

impl Resources {
    /// Wraps the resource service (in process or remote).
    pub fn new(service: ResourceServiceHandle) -> Self {
        Self { service }
    }

    /// Resolves `uri`, rendering a prompt with `variables_json` (a JSON object, or empty).
    pub async fn resolve(
        &self,
        ctx: &RequestContext,
        uri: &str,
        variables_json: &str,
    ) -> Result<Resolved, RuntimeError> {
        let request = ctx.request(pb::ResolveResourceRequest {
            uri: uri.to_owned(),
            variables_json: variables_json.to_owned(),
        });
        let response = self.service.resolve_resource(request).await?.into_inner();
        let root = response.root.ok_or_else(|| {
            RuntimeError::Api(avm_common::ApiError::internal("the resource service resolved nothing"))
        })?;
        let public = |uri: &str| response.public_uris.iter().any(|public| public == uri);
        let root_public = public(&root.uri);
        let mut uris = vec![root.uri];
        let mut tools = Vec::new();
        let mut sandbox = None;
        for dependency in response.dependencies {
            if sandbox.is_none() && dependency.uri.starts_with(SANDBOX_URI_PREFIX) {
                sandbox = Some(dependency.content_json.clone());
            }
            if dependency.uri.starts_with(TOOL_URI_PREFIX) {
                tools.push(ToolResource {
                    public: public(&dependency.uri),
                    content: dependency.content_json,
                });
            }
            uris.push(dependency.uri);
        }
        Ok(Resolved {
            root_content: root.content_json,
            rendered_prompt: response.rendered_prompt,
            uris,
            tools,
            root_public,
            sandbox,
        })
    }
}
