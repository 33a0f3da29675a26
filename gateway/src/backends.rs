//! The gateway's gRPC clients and the operations the WebSocket and REST
//! surfaces share. Results are JSON in the protocol's shapes.

use std::collections::HashMap;

use avm_common::config::GrpcConfig;
use avm_common::{ApiError, Code, RequestContext};
use avm_proto::config::v1::config_service_client::ConfigServiceClient;
use avm_proto::observability::v1::observability_service_client::ObservabilityServiceClient;
use avm_proto::resource::v1 as rs;
use avm_proto::resource::v1::resource_service_client::ResourceServiceClient;
use avm_proto::runtime::v1 as rt;
use avm_proto::runtime::v1::runtime_service_client::RuntimeServiceClient;
use avm_proto::session::v1 as ss;
use avm_proto::session::v1::session_service_client::SessionServiceClient;
use serde_json::{Value, json};
use tonic::transport::Channel;

/// gRPC clients of the services the gateway fronts.
#[derive(Clone)]
pub struct Backends {
    pub session: SessionServiceClient<Channel>,
    pub runtime: RuntimeServiceClient<Channel>,
    pub resource: ResourceServiceClient<Channel>,
    pub config: ConfigServiceClient<Channel>,
    pub observability: ObservabilityServiceClient<Channel>,
    /// Raw channels, for health checks.
    pub(crate) channels: Vec<(&'static str, Channel)>,
}

/// Channels to the gateway's peers.
#[derive(Clone, Debug)]
pub struct PeerChannels {
    /// Only health-checked here; the authenticator calls it.
    pub auth: Channel,
    pub session: Channel,
    pub runtime: Channel,
    pub resource: Channel,
    pub config: Channel,
    pub observability: Channel,
}

/// Image settings a client may give at creation.
#[derive(Debug, Default)]
pub struct ImageConfig {
    pub name: Option<String>,
    pub description: Option<String>,
    /// Text, or a `resource://prompts/…` URI rendered with `variables`.
    pub system_prompt: Option<String>,
    pub mcp_servers: Option<Value>,
    /// A `resource://agents/…` definition to run (AVM).
    pub agent: Option<String>,
    /// Values of the prompt's variables (AVM).
    pub variables: Option<Value>,
}

impl Backends {
    /// Returns clients over the given channels with the shared size limits.
    pub fn new(peers: PeerChannels, config: &GrpcConfig) -> Self {
        let limit = config.max_message_bytes;
        Self {
            session: SessionServiceClient::new(peers.session.clone())
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
            runtime: RuntimeServiceClient::new(peers.runtime.clone())
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
            resource: ResourceServiceClient::new(peers.resource.clone())
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
            config: ConfigServiceClient::new(peers.config.clone())
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
            observability: ObservabilityServiceClient::new(peers.observability.clone())
                .max_decoding_message_size(limit)
                .max_encoding_message_size(limit),
            channels: vec![
                ("avm.auth.v1.AuthService", peers.auth),
                ("avm.session.v1.SessionService", peers.session),
                ("avm.runtime.v1.RuntimeService", peers.runtime),
                ("avm.resource.v1.ResourceService", peers.resource),
                ("avm.config.v1.ConfigService", peers.config),
                ("avm.observability.v1.ObservabilityService", peers.observability),
            ],
        }
    }

    /// Creates a container, or returns the existing one.
    pub async fn create_container(&self, ctx: &RequestContext, container_id: &str) -> Result<(Value, bool), ApiError> {
        let request = ctx.request(ss::CreateContainerRequest {
            container_id: container_id.to_owned(),
        });
        let response = self.session.clone().create_container(request).await?.into_inner();
        let container = response
            .container
            .ok_or_else(|| ApiError::internal("no container returned"))?;
        Ok((container_json(&container), response.created))
    }

    /// Returns a container.
    pub async fn get_container(&self, ctx: &RequestContext, container_id: &str) -> Result<Value, ApiError> {
        let request = ctx.request(ss::GetContainerRequest {
            container_id: container_id.to_owned(),
        });
        let response = self.session.clone().get_container(request).await?.into_inner();
        let container = response
            .container
            .ok_or_else(|| ApiError::internal("no container returned"))?;
        Ok(container_json(&container))
    }

    /// Lists the caller's containers.
    pub async fn list_containers(&self, ctx: &RequestContext) -> Result<Vec<Value>, ApiError> {
        let response = self
            .session
            .clone()
            .list_containers(ctx.request(ss::ListContainersRequest {}))
            .await?;
        Ok(response.into_inner().containers.iter().map(container_json).collect())
    }

    /// Stops a container's agents and deletes it with everything inside.
    pub async fn delete_container(&self, ctx: &RequestContext, container_id: &str) -> Result<(), ApiError> {
        // Existence first, so a missing container is NOT_FOUND before anything is touched.
        self.get_container(ctx, container_id).await?;
        let request = ctx.request(rt::DestroyAllAgentsRequest {
            container_id: container_id.to_owned(),
        });
        self.runtime.clone().destroy_all_agents(request).await?;
        let request = ctx.request(ss::DeleteContainerRequest {
            container_id: container_id.to_owned(),
        });
        self.session.clone().delete_container(request).await?;
        Ok(())
    }

    /// Shares a container with a user of the caller's tenant.
    pub async fn share_container(
        &self,
        ctx: &RequestContext,
        container_id: &str,
        user_id: &str,
    ) -> Result<(), ApiError> {
        let request = ctx.request(ss::ShareContainerRequest {
            container_id: container_id.to_owned(),
            user_id: user_id.to_owned(),
        });
        self.session.clone().share_container(request).await?;
        Ok(())
    }

    /// Stops sharing a container with a user.
    pub async fn unshare_container(
        &self,
        ctx: &RequestContext,
        container_id: &str,
        user_id: &str,
    ) -> Result<(), ApiError> {
        let request = ctx.request(ss::UnshareContainerRequest {
            container_id: container_id.to_owned(),
            user_id: user_id.to_owned(),
        });
        self.session.clone().unshare_container(request).await?;
        Ok(())
    }

    /// Lists the users a container is shared with.
    pub async fn container_shares(&self, ctx: &RequestContext, container_id: &str) -> Result<Vec<Value>, ApiError> {
        let request = ctx.request(ss::ListContainerSharesRequest {
            container_id: container_id.to_owned(),
        });
        let shares = self
            .session
            .clone()
            .list_container_shares(request)
            .await?
            .into_inner()
            .shares;
        Ok(shares
            .iter()
            .map(|share| json!({"userId": share.user_id, "createdAt": share.created_at_ms}))
            .collect())
    }

    /// Creates an image (and its session) in a container.
    pub async fn create_image(
        &self,
        ctx: &RequestContext,
        container_id: &str,
        config: ImageConfig,
    ) -> Result<(Value, String), ApiError> {
        let mcp_servers_json = match config.mcp_servers {
            None | Some(Value::Null) => String::new(),
            Some(servers @ Value::Object(_)) => servers.to_string(),
            Some(_) => return Err(ApiError::invalid("INVALID_MCP_SERVERS", "mcpServers must be an object")),
        };
        let variables_json = match config.variables {
            None | Some(Value::Null) => String::new(),
            Some(variables @ Value::Object(_)) => variables.to_string(),
            Some(_) => return Err(ApiError::invalid("INVALID_VARIABLES", "variables must be an object")),
        };
        // Resource references are checked now, rendered as the agent will
        // render them, so a typo or a missing variable fails here rather than
        // when the agent first starts.
        let prompt_uri = config
            .system_prompt
            .as_deref()
            .filter(|prompt| prompt.starts_with(RESOURCE_URI_PREFIX));
        let render_with = if variables_json.is_empty() {
            "{}"
        } else {
            &variables_json
        };
        for uri in [config.agent.as_deref(), prompt_uri].into_iter().flatten() {
            self.resolve_resource(ctx, uri, render_with).await?;
        }
        let request = ctx.request(ss::CreateImageRequest {
            container_id: container_id.to_owned(),
            name: config.name,
            description: config.description,
            system_prompt: config.system_prompt,
            mcp_servers_json,
            agent: config.agent,
            variables_json,
        });
        let image = self.session.clone().create_image(request).await?.into_inner().image;
        let image = image.ok_or_else(|| ApiError::internal("no image returned"))?;
        let session_id = image.session_id.clone();
        Ok((image_record(&image, None), session_id))
    }

    /// Resolves a `resource://` URI with prompt variables (a JSON object, or empty).
    pub async fn resolve_resource(
        &self,
        ctx: &RequestContext,
        uri: &str,
        variables_json: &str,
    ) -> Result<rs::ResolveResourceResponse, ApiError> {
        let request = ctx.request(rs::ResolveResourceRequest {
            uri: uri.to_owned(),
            variables_json: variables_json.to_owned(),
        });
        Ok(self.resource.clone().resolve_resource(request).await?.into_inner())
    }

    /// Returns an image's record with its online state.
    pub async fn get_image(&self, ctx: &RequestContext, image_id: &str) -> Result<(Value, String), ApiError> {
        let image = self.image(ctx, image_id).await?;
        let agents = self.agents_by_image(ctx, Some(&image.container_id)).await?;
        let session_id = image.session_id.clone();
        Ok((
            image_record(&image, agents.get(&image.image_id).map(String::as_str)),
            session_id,
        ))
    }

    async fn image(&self, ctx: &RequestContext, image_id: &str) -> Result<ss::Image, ApiError> {
        let request = ctx.request(ss::GetImageRequest {
            image_id: image_id.to_owned(),
        });
        let image = self.session.clone().get_image(request).await?.into_inner().image;
        image.ok_or_else(|| ApiError::internal("no image returned"))
    }

    /// Lists images newest first, with their session ids.
    pub async fn list_images(
        &self,
        ctx: &RequestContext,
        container_id: Option<&str>,
    ) -> Result<Vec<(Value, String)>, ApiError> {
        if let Some(id) = container_id {
            self.get_container(ctx, id).await?;
        }
        let request = ctx.request(ss::ListImagesRequest {
            container_id: container_id.map(str::to_owned),
        });
        let images = self.session.clone().list_images(request).await?.into_inner().images;
        let agents = self.agents_by_image(ctx, container_id).await?;
        Ok(images
            .iter()
            .map(|image| {
                (
                    image_record(image, agents.get(&image.image_id).map(String::as_str)),
                    image.session_id.clone(),
                )
            })
            .collect())
    }

    async fn agents_by_image(
        &self,
        ctx: &RequestContext,
        container_id: Option<&str>,
    ) -> Result<HashMap<String, String>, ApiError> {
        let agents = self.list_agents(ctx, container_id).await?;
        Ok(agents
            .into_iter()
            .map(|agent| (agent.image_id, agent.agent_id))
            .collect())
    }

    /// Changes an image's name or description.
    pub async fn update_image(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        name: Option<String>,
        description: Option<String>,
    ) -> Result<Value, ApiError> {
        let request = ctx.request(ss::UpdateImageRequest {
            image_id: image_id.to_owned(),
            name,
            description,
        });
        self.session.clone().update_image(request).await?;
        Ok(self.get_image(ctx, image_id).await?.0)
    }

    /// Stops an image's agent and deletes the image with its session and messages.
    pub async fn delete_image(&self, ctx: &RequestContext, image_id: &str) -> Result<(), ApiError> {
        let request = ctx.request(rt::StopImageRequest {
            image_id: image_id.to_owned(),
        });
        self.runtime.clone().stop_image(request).await?;
        let request = ctx.request(ss::DeleteImageRequest {
            image_id: image_id.to_owned(),
        });
        self.session.clone().delete_image(request).await?;
        Ok(())
    }

    /// Starts an image's agent.
    pub async fn run_image(&self, ctx: &RequestContext, image_id: &str) -> Result<(rt::Agent, bool), ApiError> {
        let request = ctx.request(rt::RunImageRequest {
            image_id: image_id.to_owned(),
        });
        let response = self.runtime.clone().run_image(request).await?.into_inner();
        let agent = response.agent.ok_or_else(|| ApiError::internal("no agent returned"))?;
        Ok((agent, response.reused))
    }

    /// Stops an image's agent; `false` when none was running.
    pub async fn stop_image(&self, ctx: &RequestContext, image_id: &str) -> Result<bool, ApiError> {
        let request = ctx.request(rt::StopImageRequest {
            image_id: image_id.to_owned(),
        });
        Ok(self.runtime.clone().stop_image(request).await?.into_inner().stopped)
    }

    /// Returns an image's messages as protocol message objects, in stored order.
    pub async fn messages(&self, ctx: &RequestContext, image_id: &str) -> Result<Vec<Value>, ApiError> {
        let image = self.image(ctx, image_id).await?;
        let request = ctx.request(ss::ListMessagesRequest {
            session_id: image.session_id,
        });
        let messages = self.session.clone().list_messages(request).await?.into_inner().messages;
        Ok(messages.iter().map(avm_common::wire::message_object).collect())
    }

    /// Sends a user message; the stream's first item is the acceptance.
    pub async fn send_message(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        content: &Value,
    ) -> Result<(rt::SendMessageAccepted, tonic::Streaming<rt::SendMessageResponse>), ApiError> {
        let request = ctx.request(rt::SendMessageRequest {
            image_id: image_id.to_owned(),
            content_json: content.to_string(),
        });
        let mut stream = self.runtime.clone().send_message(request).await?.into_inner();
        match stream.message().await? {
            Some(rt::SendMessageResponse {
                kind: Some(rt::send_message_response::Kind::Accepted(accepted)),
            }) => Ok((accepted, stream)),
            _ => Err(ApiError::internal("runtime did not accept the message")),
        }
    }

    /// Interrupts an agent named by image or agent id.
    pub async fn interrupt(
        &self,
        ctx: &RequestContext,
        target: rt::interrupt_agent_request::Target,
    ) -> Result<(rt::Agent, bool), ApiError> {
        let request = ctx.request(rt::InterruptAgentRequest { target: Some(target) });
        let response = self.runtime.clone().interrupt_agent(request).await?.into_inner();
        let agent = response.agent.ok_or_else(|| ApiError::internal("no agent returned"))?;
        Ok((agent, response.interrupted))
    }

    /// Returns one agent.
    pub async fn get_agent(&self, ctx: &RequestContext, agent_id: &str) -> Result<rt::Agent, ApiError> {
        let request = ctx.request(rt::GetAgentRequest {
            agent_id: agent_id.to_owned(),
        });
        let agent = self.runtime.clone().get_agent(request).await?.into_inner().agent;
        agent.ok_or_else(|| ApiError::internal("no agent returned"))
    }

    /// Returns whether an agent exists; other failures are errors.
    pub async fn agent_exists(&self, ctx: &RequestContext, agent_id: &str) -> Result<Option<rt::Agent>, ApiError> {
        match self.get_agent(ctx, agent_id).await {
            Ok(agent) => Ok(Some(agent)),
            Err(err) if err.code == Code::NotFound => Ok(None),
            Err(err) => Err(err),
        }
    }

    /// Lists running agents.
    pub async fn list_agents(
        &self,
        ctx: &RequestContext,
        container_id: Option<&str>,
    ) -> Result<Vec<rt::Agent>, ApiError> {
        let request = ctx.request(rt::ListAgentsRequest {
            container_id: container_id.map(str::to_owned),
        });
        Ok(self.runtime.clone().list_agents(request).await?.into_inner().agents)
    }

    /// Stops and forgets an agent.
    pub async fn destroy_agent(&self, ctx: &RequestContext, agent_id: &str) -> Result<(), ApiError> {
        let request = ctx.request(rt::DestroyAgentRequest {
            agent_id: agent_id.to_owned(),
        });
        self.runtime.clone().destroy_agent(request).await?;
        Ok(())
    }

    /// Stops every agent of a container.
    pub async fn destroy_all_agents(&self, ctx: &RequestContext, container_id: &str) -> Result<u32, ApiError> {
        self.get_container(ctx, container_id).await?;
        let request = ctx.request(rt::DestroyAllAgentsRequest {
            container_id: container_id.to_owned(),
        });
        Ok(self
            .runtime
            .clone()
            .destroy_all_agents(request)
            .await?
            .into_inner()
            .destroyed)
    }

    /// Opens a session's event stream after an optional cursor.
    pub async fn subscribe(
        &self,
        ctx: &RequestContext,
        session_id: &str,
        after_cursor: Option<String>,
    ) -> Result<tonic::Streaming<rt::SubscribeEventsResponse>, ApiError> {
        let request = ctx.request(rt::SubscribeEventsRequest {
            session_id: session_id.to_owned(),
            after_cursor,
        });
        Ok(self.runtime.clone().subscribe_events(request).await?.into_inner())
    }

    /// Returns the services that do not answer their health check as SERVING.
    pub async fn unhealthy(&self) -> Vec<&'static str> {
        let mut failing = Vec::new();
        for (name, channel) in &self.channels {
            let mut client = tonic_health::pb::health_client::HealthClient::new(channel.clone());
            let request = tonic_health::pb::HealthCheckRequest {
                service: (*name).to_owned(),
            };
            let serving = matches!(
                tokio::time::timeout(std::time::Duration::from_secs(2), client.check(request)).await,
                Ok(Ok(response)) if response.get_ref().status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32
            );
            if !serving {
                failing.push(*name);
            }
        }
        failing
    }
}

fn container_json(container: &ss::Container) -> Value {
    json!({"containerId": container.container_id, "ownerId": container.owner_user_id, "createdAt": container.created_at_ms})
}

/// Renders an image as the protocol's `record`.
pub fn image_record(image: &ss::Image, agent_id: Option<&str>) -> Value {
    let mut record = json!({
        "imageId": image.image_id,
        "containerId": image.container_id,
        "sessionId": image.session_id,
        "name": image.name,
        "createdAt": image.created_at_ms,
        "updatedAt": image.updated_at_ms,
        "online": agent_id.is_some(),
    });
    if let Some(description) = &image.description {
        record["description"] = Value::String(description.clone());
    }
    if let Some(prompt) = &image.system_prompt {
        record["systemPrompt"] = Value::String(prompt.clone());
    }
    if let Ok(servers @ Value::Object(_)) = serde_json::from_str::<Value>(&image.mcp_servers_json)
        && servers.as_object().is_some_and(|map| !map.is_empty())
    {
        record["mcpServers"] = servers;
    }
    if let Some(agent) = &image.agent {
        record["agent"] = Value::String(agent.clone());
    }
    if let Ok(variables @ Value::Object(_)) = serde_json::from_str::<Value>(&image.variables_json)
        && variables.as_object().is_some_and(|map| !map.is_empty())
    {
        record["variables"] = variables;
    }
    if let Some(agent_id) = agent_id {
        record["agentId"] = Value::String(agent_id.to_owned());
    }
    record
}

/// What a system prompt that names a resource starts with.
pub const RESOURCE_URI_PREFIX: &str = "resource://";

/// Renders an agent as `{agentId, containerId, imageId, sessionId, state}`.
pub fn agent_json(agent: &rt::Agent) -> Value {
    let state = if agent.state == rt::AgentState::Running as i32 {
        "running"
    } else {
        "idle"
    };
    json!({
        "agentId": agent.agent_id,
        "containerId": agent.container_id,
        "imageId": agent.image_id,
        "sessionId": agent.session_id,
        "state": state,
        "startedAt": agent.started_at_ms,
    })
}
