//! The runtime's view of the resource service: what an image's
//! `resource://` references resolve to when its agent starts.

use avm_common::{ApiError, RequestContext};
use avm_proto::resource::v1 as pb;
use avm_proto::resource::v1::ResourceServiceHandle;
use serde_json::Value;

use crate::session_client::ImageInfo;

/// What a system prompt that names a resource starts with.
pub const RESOURCE_URI_PREFIX: &str = "resource://";

/// What an agent runs with, once its image's references are resolved.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentPlan {
    /// The system prompt, rendered.
    pub system_prompt: Option<String>,
    /// The agent definition's model, over the tenant's configured one.
    pub model: Option<String>,
    /// The agent definition's reply limit, over the configured one.
    pub max_tokens: Option<u32>,
    /// The exact resources (`resource://…@<version>`), recorded on each reply.
    pub resources: Vec<String>,
}

/// The resource service, as the runtime uses it.
#[derive(Clone)]
pub struct ResourceClient {
    inner: ResourceServiceHandle,
}

impl ResourceClient {
    /// Wraps the resource service (in process or remote).
    pub fn new(inner: ResourceServiceHandle) -> Self {
        Self { inner }
    }

    /// Returns what an image's agent runs with: its agent definition (when it
    /// names one), then its system prompt (a `resource://prompts/…` URI is
    /// rendered with the image's variables; plain text is used as it is).
    pub async fn plan(&self, ctx: &RequestContext, image: &ImageInfo) -> Result<AgentPlan, ApiError> {
        let mut plan = AgentPlan::default();
        if let Some(agent) = &image.agent {
            let resolved = self.resolve(ctx, agent, &image.variables_json).await?;
            let content: Value = serde_json::from_str(&resolved.root_content).unwrap_or_default();
            plan.system_prompt = resolved.rendered_prompt;
            plan.model = content["model"].as_str().map(str::to_owned);
            plan.max_tokens = content["parameters"]["maxTokens"]
                .as_u64()
                .and_then(|n| u32::try_from(n).ok());
            plan.resources.extend(resolved.uris);
        }
        match &image.system_prompt {
            Some(uri) if uri.starts_with(RESOURCE_URI_PREFIX) => {
                let resolved = self.resolve(ctx, uri, &image.variables_json).await?;
                plan.system_prompt = resolved.rendered_prompt;
                for uri in resolved.uris {
                    if !plan.resources.contains(&uri) {
                        plan.resources.push(uri);
                    }
                }
            }
            Some(text) => plan.system_prompt = Some(text.clone()),
            None => {}
        }
        Ok(plan)
    }

    async fn resolve(&self, ctx: &RequestContext, uri: &str, variables_json: &str) -> Result<Resolved, ApiError> {
        let request = ctx.request(pb::ResolveResourceRequest {
            uri: uri.to_owned(),
            variables_json: variables_json.to_owned(),
        });
        let response = self.inner.resolve_resource(request).await?.into_inner();
        let root = response
            .root
            .ok_or_else(|| ApiError::internal("the resource service resolved nothing"))?;
        let mut uris = vec![root.uri.clone()];
        uris.extend(response.dependencies.into_iter().map(|dependency| dependency.uri));
        Ok(Resolved {
            root_content: root.content_json,
            rendered_prompt: response.rendered_prompt,
            uris,
        })
    }
}

struct Resolved {
    root_content: String,
    rendered_prompt: Option<String>,
    /// The root first, then its dependencies.
    uris: Vec<String>,
}
