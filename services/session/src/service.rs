//! The domain logic: validation, ids, timestamps and logs around the store.

use std::sync::Arc;

use avm_common::auth::{Role, Scopes};
use avm_common::ids::new_id;
use avm_common::mcp::McpServerRules;
use avm_common::{ApiError, Code, RequestContext, now_ms};
use avm_store::events::EventBus;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio_util::sync::CancellationToken;
use tracing::instrument;

pub use crate::checks::{MAX_ID_BYTES, MAX_MESSAGE_BYTES};
use crate::checks::{is_valid_client_id, validate_message, validate_message_id};
use crate::error::SessionError;
use crate::recent::{DEFAULT_RECENT_PAGE_SIZE, MAX_RECENT_PAGE_SIZE, RecentPage, read_token, token_after};
use crate::record::{
    AgentState, AgentStateChange, Compaction, ContainerAccess, ContainerRecord, ImageRecord, ImageSummary, ImageUpdate,
    Lifecycle, MessageBody, MessageRecord, NewImage, NewMessage, OpenTurn, SessionChange, ShareRecord, ShareRole,
    Truncated, WatchItem,
};
use crate::references::{RESOURCE_URI_PREFIX, References};
use crate::search::{
    DEFAULT_SEARCH_PAGE_SIZE, MAX_SEARCH_OFFSET, MAX_SEARCH_PAGE_SIZE, SEARCH_ROLES, SearchHit, SearchPage,
    SearchRequest, Terms, page_offset,
};
use crate::store::{Scope, SessionStore};
use crate::transfer::{EXPORT_CHUNK_BYTES, ExportWriter, ImportWrite, Imported, container_header, read_import};

mod groups;
mod retention;

pub use groups::{
    DEFAULT_GROUP_MESSAGE_LIMIT, DEFAULT_GROUP_PAGE_SIZE, MAX_GROUP_MESSAGE_LIMIT, MAX_GROUP_PAGE_SIZE,
    MAX_INITIAL_MEMBERS, MAX_MENTIONS,
};

/// The name of an image created without one.
pub const DEFAULT_IMAGE_NAME: &str = "New Conversation";
/// Open turns per `ListOpenTurns` page unless asked otherwise, and at most.
const DEFAULT_OPEN_TURNS_PAGE: u32 = 500;
const MAX_OPEN_TURNS_PAGE: u32 = 1000;
/// Longest image name, in characters.
pub const MAX_NAME_CHARS: usize = 256;
/// Longest image description, in characters.
pub const MAX_DESCRIPTION_CHARS: usize = 4096;
/// Largest system prompt, in bytes.
pub const MAX_SYSTEM_PROMPT_BYTES: usize = 256 * 1024;
/// Largest summary a compaction records.
pub const MAX_SUMMARY_BYTES: usize = 256 * 1024;
/// Largest MCP server definition document, in bytes.
pub const MAX_MCP_SERVERS_BYTES: usize = 64 * 1024;

/// What an image's agent reference starts with.
pub const AGENT_URI_PREFIX: &str = "resource://agents/";

/// Largest agent reference.
pub const MAX_AGENT_URI_BYTES: usize = 512;

/// Largest JSON of prompt variables.
pub const MAX_VARIABLES_BYTES: usize = 16 * 1024;
/// Longest error an agent in the `error` state keeps, in characters.
pub const MAX_AGENT_ERROR_CHARS: usize = 2048;

/// Containers, images, sessions and messages of every tenant.
///
/// Cheap to clone: the store sits behind an `Arc`.
#[derive(Clone)]
pub struct SessionService {
    store: Arc<dyn SessionStore>,
    events: Arc<EventBus<SessionChange>>,
    /// Resolves `resource://` references at image creation; without it only their form is checked.
    references: Option<References>,
    /// What an image's `mcpServers` may start or reach: the runtime's rules.
    mcp_rules: Arc<McpServerRules>,
}

/// What a user's devices are told, each change with the id of the request
/// that made it; `None` first, when the feed is live.
pub type UserChanges = BoxStream<'static, Result<Option<(Lifecycle, String)>, SessionError>>;

/// How long a watch waits for the change feed to be live.
const FEED_READY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl SessionService {
    /// Returns a service over `store`.
    pub fn new(store: Arc<dyn SessionStore>) -> Self {
        let events = Arc::new(EventBus::new("session", store.event_transport()));
        Self {
            store,
            events,
            references: None,
            mcp_rules: Arc::default(),
        }
    }

    /// Returns the service checking images' `mcpServers` against `rules` (the
    /// operator's `[runtime.mcp]` and `[runtime.fetch]`) when they are
    /// created, as the runtime does before it starts or reaches a server
    /// (issue 26 item 18); without, no command and no internal address pass.
    pub fn with_mcp_rules(self, rules: McpServerRules) -> Self {
        Self {
            mcp_rules: Arc::new(rules),
            ..self
        }
    }

    /// Returns the service checking `resource://` references with `references`.
    pub fn with_references(self, references: References) -> Self {
        Self {
            references: Some(references),
            ..self
        }
    }

    /// Follows every replica's deletions (Postgres `LISTEN`) until
    /// `shutdown`; a finished task when they stay in process (SQLite).
    pub fn spawn_background(&self, shutdown: CancellationToken) -> tokio::task::JoinHandle<()> {
        Arc::clone(&self.events).spawn_listener(shutdown)
    }

    /// Streams the images deleted and the group messages posted from now
    /// on, of every tenant, after a first [`WatchItem::Live`] (for the
    /// runtimes: they stop the agents of what is gone and wake those a
    /// message concerns).
    #[instrument(name = "session.watch_session_events", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn watch(
        &self,
        ctx: &RequestContext,
    ) -> Result<BoxStream<'static, Result<WatchItem, SessionError>>, SessionError> {
        ctx.principal.require_service().map_err(SessionError::Denied)?;
        self.events
            .wait_live(FEED_READY_TIMEOUT)
            .await
            .map_err(|_| SessionError::EventsUnavailable)?;
        // The runtimes act on deletions, posts and tools; what users' devices
        // are told goes to them alone (`watch_user`).
        let changes = self.events.subscribe().filter_map(|change| {
            std::future::ready(match change {
                Ok(SessionChange::Lifecycle { .. }) => None,
                Ok(change) => Some(Ok(WatchItem::Changed(change))),
                Err(_) => Some(Err(SessionError::EventsUnavailable)),
            })
        });
        Ok(futures::stream::once(async { Ok(WatchItem::Live) })
            .chain(changes)
            .boxed())
    }

    /// Follows the changes the caller's devices are told of: containers
    /// made, conversations made, changed and deleted, by the caller or in a
    /// container the caller owns, each with the id of the request that made
    /// it. `None` first, when the feed is live.
    #[instrument(name = "session.watch_user_events", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn watch_user(&self, ctx: &RequestContext) -> Result<UserChanges, SessionError> {
        allow(ctx, Scopes::READ)?;
        self.events
            .wait_live(FEED_READY_TIMEOUT)
            .await
            .map_err(|_| SessionError::EventsUnavailable)?;
        let (tenant, user) = (ctx.tenant_id.clone(), ctx.principal.user_id.clone());
        let changes = self.events.subscribe().filter_map(move |change| {
            std::future::ready(match change {
                Ok(SessionChange::Lifecycle {
                    tenant_id,
                    users,
                    origin,
                    what,
                }) if tenant_id == tenant && users.contains(&user) => Some(Ok(Some((what, origin)))),
                Ok(_) => None,
                Err(_) => Some(Err(SessionError::EventsUnavailable)),
            })
        });
        Ok(futures::stream::once(async { Ok(None) }).chain(changes).boxed())
    }

    /// Tells the devices of the caller and of the container's owner (looked
    /// up unless given) of a change.
    async fn announce(&self, ctx: &RequestContext, container_id: &str, owner: Option<&str>, change: Lifecycle) {
        let mut users = Vec::with_capacity(2);
        if ctx.principal.role != Role::Service && !ctx.principal.user_id.is_empty() {
            users.push(ctx.principal.user_id.clone());
        }
        let whole = Scope {
            tenant_id: &ctx.tenant_id,
            user_id: None,
        };
        let owner = match owner {
            Some(owner) => Some(owner.to_owned()),
            None => match self.store.get_container(&whole, container_id).await {
                Ok(container) => Some(container.owner_id),
                Err(err) => {
                    tracing::debug!(error = %err, container_id, "no owner to tell of a change");
                    None
                }
            },
        };
        if let Some(owner) = owner.filter(|owner| !owner.is_empty() && !users.contains(owner)) {
            users.push(owner);
        }
        if users.is_empty() {
            return;
        }
        self.events
            .emit(SessionChange::Lifecycle {
                tenant_id: ctx.tenant_id.clone(),
                users,
                origin: ctx.request_id.clone(),
                what: change,
            })
            .await;
    }

    /// Tells of the images a deletion removed, with the sessions `before`
    /// (the container's images read before it) names.
    async fn announce_deleted(
        &self,
        ctx: &RequestContext,
        container_id: &str,
        before: &[ImageRecord],
        deleted: &[String],
    ) {
        for image in before.iter().filter(|image| deleted.contains(&image.image_id)) {
            let change = Lifecycle::ImageDeleted {
                container_id: container_id.to_owned(),
                image_id: image.image_id.clone(),
                session_id: image.session_id.clone(),
            };
            self.announce(ctx, container_id, None, change).await;
        }
    }

    /// Returns the container `container_id`, creating it if needed, and whether it is new.
    #[instrument(
        name = "session.create_container",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn create_container(
        &self,
        ctx: &RequestContext,
        container_id: &str,
    ) -> Result<(ContainerRecord, bool), SessionError> {
        let (container, created) = self.make_container(ctx, container_id).await?;
        if created {
            let change = Lifecycle::ContainerCreated {
                container_id: container.container_id.clone(),
                created_at_ms: container.created_at_ms,
            };
            self.announce(ctx, container_id, Some(&container.owner_id), change)
                .await;
        }
        Ok((container, created))
    }

    async fn make_container(
        &self,
        ctx: &RequestContext,
        container_id: &str,
    ) -> Result<(ContainerRecord, bool), SessionError> {
        allow(ctx, Scopes::WRITE)?;
        validate_container_id(container_id)?;
        let (container, created) = self
            .store
            .create_container(&scope(ctx), container_id, &ctx.principal.user_id, now_ms())
            .await?;
        if created {
            tracing::info!(container_id, "container created");
        }
        Ok((container, created))
    }

    /// Returns a container of the caller's tenant.
    #[instrument(
        name = "session.get_container",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn get_container(
        &self,
        ctx: &RequestContext,
        container_id: &str,
        need: Option<ShareRole>,
    ) -> Result<ContainerRecord, SessionError> {
        allow(ctx, Scopes::READ)?;
        validate_container_id(container_id)?;
        let container = self.store.get_container(&scope(ctx), container_id).await?;
        if let Some(need) = need {
            self.require_role(ctx, container_id, need).await?;
        }
        Ok(container)
    }

    /// Returns the caller's containers, oldest first.
    #[instrument(
        name = "session.list_containers",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn list_containers(&self, ctx: &RequestContext) -> Result<Vec<ContainerRecord>, SessionError> {
        allow(ctx, Scopes::READ)?;
        self.store.list_containers(&scope(ctx)).await
    }

    /// Deletes a container with its images, sessions and messages; returns the deleted image ids.
    #[instrument(
        name = "session.delete_container",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn delete_container(
        &self,
        ctx: &RequestContext,
        container_id: &str,
    ) -> Result<Vec<String>, SessionError> {
        allow(ctx, Scopes::WRITE)?;
        validate_container_id(container_id)?;
        let before = self.store.list_images(&scope(ctx), Some(container_id)).await?;
        let owner = self.store.get_container(&scope(ctx), container_id).await?.owner_id;
        let image_ids = self.store.delete_container(&scope(ctx), container_id).await?;
        tracing::info!(container_id, images = image_ids.len(), "container deleted");
        for image in before.iter().filter(|image| image_ids.contains(&image.image_id)) {
            let change = Lifecycle::ImageDeleted {
                container_id: container_id.to_owned(),
                image_id: image.image_id.clone(),
                session_id: image.session_id.clone(),
            };
            self.announce(ctx, container_id, Some(&owner), change).await;
        }
        self.events
            .emit(SessionChange::Deleted {
                tenant_id: ctx.tenant_id.clone(),
                image_ids: image_ids.clone(),
            })
            .await;
        Ok(image_ids)
    }

    /// Creates an image and its session in an existing container. A child
    /// image names a parent of the same container whose agent is not
    /// terminated, and sits one level below it.
    #[instrument(
        name = "session.create_image",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn create_image(&self, ctx: &RequestContext, new: NewImage) -> Result<ImageRecord, SessionError> {
        allow(ctx, Scopes::WRITE)?;
        validate_container_id(&new.container_id)?;
        let image = self.prepare_image(ctx, new, true).await?;
        self.store.create_image(&scope(ctx), &image).await?;
        self.announce(
            ctx,
            &image.container_id,
            None,
            Lifecycle::ImageCreated(ImageSummary::of(&image)),
        )
        .await;
        tracing::info!(
            image_id = %image.image_id,
            container_id = %image.container_id,
            session_id = %image.session_id,
            parent_image_id = image.parent_image_id.as_deref(),
            depth = image.depth,
            "image created"
        );
        Ok(image)
    }

    /// Checks what a new image asks for and returns the image to store, with
    /// new ids and times; with `check_role`, also that the caller may create
    /// images in its container (`use` or more).
    async fn prepare_image(
        &self,
        ctx: &RequestContext,
        new: NewImage,
        check_role: bool,
    ) -> Result<ImageRecord, SessionError> {
        let name = match new.name {
            Some(name) if !name.trim().is_empty() => validate_name(name)?,
            _ => DEFAULT_IMAGE_NAME.to_owned(),
        };
        let description = non_empty(new.description).map(validate_description).transpose()?;
        let system_prompt = non_empty(new.system_prompt).map(validate_system_prompt).transpose()?;
        let mcp_servers_json = validate_mcp_servers(new.mcp_servers_json)?;
        self.check_mcp_servers(ctx, &mcp_servers_json)?;
        let agent = non_empty(new.agent).map(validate_agent).transpose()?;
        let variables_json = validate_variables(new.variables_json)?;
        let tools = validate_tools(new.tools)?;
        let metadata_json = validate_metadata(new.metadata_json)?;
        if check_role {
            self.require_role(ctx, &new.container_id, ShareRole::Use).await?;
        }
        let parent = match non_empty(new.parent_image_id) {
            Some(parent_id) => Some(self.parent(ctx, &parent_id, &new.container_id).await?),
            None => None,
        };
        if let Some(references) = &self.references {
            let prompt = system_prompt
                .as_deref()
                .filter(|prompt| prompt.starts_with(RESOURCE_URI_PREFIX));
            let tool_uris = tools
                .iter()
                .map(String::as_str)
                .filter(|tool| tool.starts_with(RESOURCE_URI_PREFIX));
            for uri in [agent.as_deref(), prompt].into_iter().flatten().chain(tool_uris) {
                references
                    .check(ctx, uri, &variables_json)
                    .await
                    .map_err(SessionError::Peer)?;
            }
        }
        let now = now_ms();
        Ok(ImageRecord {
            image_id: new_id("img"),
            container_id: new.container_id,
            session_id: new_id("sess"),
            name,
            description,
            system_prompt,
            mcp_servers_json,
            agent,
            variables_json,
            tools,
            metadata_json,
            created_at_ms: now,
            updated_at_ms: now,
            agent_state: AgentState::Active,
            agent_error: None,
            depth: parent.as_ref().map_or(0, |parent| parent.depth.saturating_add(1)),
            parent_image_id: parent.map(|parent| parent.image_id),
        })
    }

    /// Returns a conversation as a document, a piece at a time: its image's
    /// configuration, its messages, the resources its turns ran with and its
    /// usage totals (`transfer.rs`). NOT_FOUND before any piece when the
    /// image is not the caller's to read.
    #[instrument(
        name = "session.export_image",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn export_image(&self, ctx: &RequestContext, image_id: &str) -> Result<ExportStream, SessionError> {
        allow(ctx, Scopes::READ)?;
        let image = self.store.get_image(&scope(ctx), image_id).await?;
        tracing::info!(image_id, "conversation exported");
        Ok(export_stream(self.store.clone(), Vec::new(), vec![image]))
    }

    /// Returns a container as JSON Lines, a piece at a time: a header line,
    /// then each conversation's document on a line of its own, oldest first.
    #[instrument(
        name = "session.export_container",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn export_container(
        &self,
        ctx: &RequestContext,
        container_id: &str,
    ) -> Result<ExportStream, SessionError> {
        allow(ctx, Scopes::READ)?;
        validate_container_id(container_id)?;
        let scope = scope(ctx);
        self.store.get_container(&scope, container_id).await?;
        let mut images = self.store.list_images(&scope, Some(container_id)).await?;
        images.reverse();
        let header = container_header(container_id, images.len(), now_ms())?;
        tracing::info!(container_id, conversations = images.len(), "container exported");
        Ok(export_stream(self.store.clone(), header, images))
    }

    /// Imports a conversation document, or a container export, into a
    /// container: everything is read and checked first, then written in one
    /// transaction; a document imported here before is found, not copied.
    #[instrument(
        name = "session.import",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn import(
        &self,
        ctx: &RequestContext,
        container_id: &str,
        document: &[u8],
    ) -> Result<Vec<Imported>, SessionError> {
        allow(ctx, Scopes::WRITE)?;
        validate_container_id(container_id)?;
        let conversations = read_import(document)?;
        self.require_role(ctx, container_id, ShareRole::Use).await?;
        let mut items = Vec::with_capacity(conversations.len());
        for (index, conversation) in conversations.into_iter().enumerate() {
            let config = conversation.image;
            let new = NewImage {
                container_id: container_id.to_owned(),
                name: Some(config.name),
                description: config.description,
                system_prompt: config.system_prompt,
                mcp_servers_json: config.mcp_servers.get().to_owned(),
                agent: config.agent,
                variables_json: config.variables.get().to_owned(),
                tools: config.tools,
                metadata_json: config
                    .metadata
                    .map(|metadata| metadata.get().to_owned())
                    .unwrap_or_default(),
                parent_image_id: None,
            };
            let image = self.prepare_image(ctx, new, false).await.map_err(|err| match err {
                SessionError::Invalid { reason, message } => SessionError::Invalid {
                    reason,
                    message: format!("conversation {} ({}): {message}", index + 1, conversation.document_id),
                },
                other => other,
            })?;
            items.push(ImportWrite {
                document_id: conversation.document_id,
                image,
                messages: conversation.messages,
            });
        }
        let imported = self
            .store
            .import_conversations(&scope(ctx), container_id, &items, now_ms())
            .await?;
        for item in imported.iter().filter(|item| item.created) {
            let change = Lifecycle::ImageCreated(ImageSummary::of(&item.image));
            self.announce(ctx, container_id, None, change).await;
        }
        for item in &imported {
            tracing::info!(
                container_id,
                image_id = %item.image.image_id,
                document_id = %item.document_id,
                created = item.created,
                "conversation imported"
            );
        }
        Ok(imported)
    }

    /// Returns an image of the caller's tenant.
    #[instrument(
        name = "session.get_image",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn get_image(&self, ctx: &RequestContext, image_id: &str) -> Result<ImageRecord, SessionError> {
        allow(ctx, Scopes::READ)?;
        self.store.get_image(&scope(ctx), image_id).await
    }

    /// Returns the image that owns a session of the caller's tenant.
    #[instrument(
        name = "session.get_session",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn get_session(&self, ctx: &RequestContext, session_id: &str) -> Result<ImageRecord, SessionError> {
        allow(ctx, Scopes::READ)?;
        self.store.get_session_image(&scope(ctx), session_id).await
    }

    /// Returns images newest first, of one container (none when it does not exist)
    /// or of all the caller's containers.
    #[instrument(
        name = "session.list_images",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn list_images(
        &self,
        ctx: &RequestContext,
        container_id: Option<&str>,
    ) -> Result<Vec<ImageRecord>, SessionError> {
        allow(ctx, Scopes::READ)?;
        if let Some(container_id) = container_id {
            validate_container_id(container_id)?;
        }
        self.store.list_images(&scope(ctx), container_id).await
    }

    /// Returns the direct children of an image, newest first (none when it
    /// does not exist).
    #[instrument(
        name = "session.list_images",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn list_child_images(
        &self,
        ctx: &RequestContext,
        parent_image_id: &str,
    ) -> Result<Vec<ImageRecord>, SessionError> {
        allow(ctx, Scopes::READ)?;
        self.store.list_child_images(&scope(ctx), parent_image_id).await
    }

    /// Pauses, resumes, fails or terminates an image's agent. Terminating
    /// one terminates its descendants in the same transaction and is final:
    /// a terminated agent may only be terminated again, which changes
    /// nothing. `Error` needs `error`, the failure to show (cut to
    /// [`MAX_AGENT_ERROR_CHARS`]); making it active again clears it.
    #[instrument(
        name = "session.set_agent_state",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn set_agent_state(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        state: AgentState,
        error: Option<&str>,
    ) -> Result<AgentStateChange, SessionError> {
        allow(ctx, Scopes::WRITE)?;
        if state == AgentState::Error {
            // The error state records what the runtime saw fail; a user
            // setting it would put words in the agent's mouth.
            ctx.principal.require_service().map_err(|_| {
                SessionError::Denied(ApiError::new(
                    Code::PermissionDenied,
                    "RUNTIME_ONLY_STATE",
                    "only the runtime puts an agent in the error state",
                ))
            })?;
        }
        let error = match (state, error.map(str::trim)) {
            (AgentState::Error, Some(error)) if !error.is_empty() => {
                Some(error.chars().take(MAX_AGENT_ERROR_CHARS).collect::<String>())
            }
            (AgentState::Error, _) => {
                return Err(SessionError::invalid(
                    "MISSING_AGENT_ERROR",
                    "an agent set to the error state needs the error",
                ));
            }
            _ => None,
        };
        self.require_image_role(ctx, image_id, ShareRole::Manage).await?;
        let change = self
            .store
            .set_agent_state(&scope(ctx), image_id, state, error.as_deref(), now_ms())
            .await?;
        tracing::info!(
            image_id,
            agent_state = state.as_str(),
            terminated = change.terminated_image_ids.len(),
            "agent state set"
        );
        Ok(change)
    }

    /// Changes an image's name, description or tools; an empty description
    /// clears it, an empty tool list leaves the image without tools. Tools
    /// are checked as at creation.
    #[instrument(
        name = "session.update_image",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn update_image(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        update: ImageUpdate,
    ) -> Result<ImageRecord, SessionError> {
        allow(ctx, Scopes::WRITE)?;
        let update = ImageUpdate {
            name: update.name.map(validate_name).transpose()?,
            description: update.description.map(validate_description).transpose()?,
            tools: update.tools.map(validate_tools).transpose()?,
            metadata_json: update.metadata_json.map(validate_metadata).transpose()?,
        };
        self.require_image_role(ctx, image_id, ShareRole::Manage).await?;
        if let (Some(references), Some(tools)) = (&self.references, &update.tools) {
            for uri in tools.iter().filter(|tool| tool.starts_with(RESOURCE_URI_PREFIX)) {
                references.check(ctx, uri, "").await.map_err(SessionError::Peer)?;
            }
        }
        let image = self
            .store
            .update_image(&scope(ctx), image_id, &update, now_ms())
            .await?;
        tracing::info!(image_id, "image updated");
        self.announce(
            ctx,
            &image.container_id,
            None,
            Lifecycle::ImageUpdated(ImageSummary::of(&image)),
        )
        .await;
        if update.tools.is_some() {
            // Whoever changed them, a running agent restarts with them.
            self.events
                .emit(SessionChange::Retooled {
                    tenant_id: ctx.tenant_id.clone(),
                    image_id: image.image_id.clone(),
                    tools: image.tools.clone(),
                })
                .await;
        }
        Ok(image)
    }

    /// Deletes an image and its descendants with their sessions and messages.
    #[instrument(
        name = "session.delete_image",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn delete_image(&self, ctx: &RequestContext, image_id: &str) -> Result<(), SessionError> {
        allow(ctx, Scopes::WRITE)?;
        self.require_image_role(ctx, image_id, ShareRole::Manage).await?;
        let image_ids = self.remove_image(ctx, image_id, None).await?;
        tracing::info!(image_id, descendants = image_ids.len() - 1, "image deleted");
        Ok(())
    }

    /// Deletes an image and its descendants with their sessions and
    /// messages, and tells of it: the devices of the caller and of the
    /// container's owner, and the runtimes. The one way a conversation is
    /// deleted, whether a user asked or retention did (which passes the
    /// last activity it saw in `unchanged`: see
    /// [`SessionStore::delete_unchanged_image`]). Returns the deleted ids.
    async fn remove_image(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        unchanged: Option<i64>,
    ) -> Result<Vec<String>, SessionError> {
        // What the deletion takes, with its sessions, for the devices to be told.
        let image = self.store.get_image(&scope(ctx), image_id).await?;
        let before = self.store.list_images(&scope(ctx), Some(&image.container_id)).await?;
        let image_ids = match unchanged {
            None => self.store.delete_image(&scope(ctx), image_id).await?,
            Some(at) => self.store.delete_unchanged_image(&scope(ctx), image_id, at).await?,
        };
        self.announce_deleted(ctx, &image.container_id, &before, &image_ids)
            .await;
        self.events
            .emit(SessionChange::Deleted {
                tenant_id: ctx.tenant_id.clone(),
                image_ids: image_ids.clone(),
            })
            .await;
        Ok(image_ids)
    }

    /// Appends a message to a session of the caller's tenant and returns it as stored.
    ///
    /// Idempotent on the message id: appending an id the session already holds
    /// returns the stored message unchanged. Only a service principal (the
    /// runtime) writes model, tool and error messages and chooses their time;
    /// a user appends user messages, stamped by this service.
    #[instrument(
        name = "session.append_message",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn append_message(
        &self,
        ctx: &RequestContext,
        session_id: &str,
        message: NewMessage,
    ) -> Result<MessageRecord, SessionError> {
        allow(ctx, Scopes::WRITE)?;
        validate_message(&message)?;
        check_author(ctx, &message)?;
        if ctx.owner_filter().is_some() {
            let image = self.store.get_session_image(&scope(ctx), session_id).await?;
            self.require_role(ctx, &image.container_id, ShareRole::Use).await?;
        }
        let message = NewMessage {
            created_at_ms: if message.created_at_ms > 0 {
                message.created_at_ms
            } else {
                now_ms()
            },
            ..message
        };
        let stored = self.store.append_message(&scope(ctx), session_id, &message).await?;
        tracing::debug!(
            session_id,
            message_id = %stored.message_id,
            seq = stored.seq,
            kind = stored.body.kind(),
            "message appended"
        );
        Ok(stored)
    }

    /// Returns a session's messages in stored order.
    #[instrument(
        name = "session.list_messages",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn list_messages(
        &self,
        ctx: &RequestContext,
        session_id: &str,
    ) -> Result<Vec<MessageRecord>, SessionError> {
        allow(ctx, Scopes::READ)?;
        self.store.list_messages(&scope(ctx), session_id).await
    }

    /// Returns what the model reads of a session: its latest compaction and
    /// the messages from it on (every message when it has none).
    #[instrument(
        name = "session.list_context",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn list_context(
        &self,
        ctx: &RequestContext,
        session_id: &str,
    ) -> Result<(Option<Compaction>, Vec<MessageRecord>), SessionError> {
        allow(ctx, Scopes::READ)?;
        self.store.list_context(&scope(ctx), session_id).await
    }

    /// Records a compaction of a session's context (the runtime only: a
    /// summary is what the model believes was said).
    #[instrument(
        name = "session.record_compaction",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn record_compaction(
        &self,
        ctx: &RequestContext,
        session_id: &str,
        compaction: Compaction,
    ) -> Result<Compaction, SessionError> {
        allow(ctx, Scopes::WRITE)?;
        if ctx.principal.role != Role::Service {
            return Err(SessionError::Denied(ApiError::new(
                Code::PermissionDenied,
                "RUNTIME_ONLY",
                "only the runtime records a compaction",
            )));
        }
        validate_message_id(&compaction.from_message_id)?;
        if !matches!(compaction.method.as_str(), "summarized" | "dropped") {
            return Err(SessionError::invalid(
                "INVALID_COMPACTION",
                "method must be summarized or dropped",
            ));
        }
        if compaction.summary.len() > MAX_SUMMARY_BYTES {
            return Err(SessionError::invalid(
                "INVALID_COMPACTION",
                format!("summary must be at most {} KiB", MAX_SUMMARY_BYTES / 1024),
            ));
        }
        let compaction = Compaction {
            created_at_ms: now_ms(),
            ..compaction
        };
        let from_seq = self
            .store
            .record_compaction(&scope(ctx), session_id, &compaction)
            .await?;
        tracing::info!(
            session_id,
            from_seq,
            method = %compaction.method,
            compacted = compaction.compacted_messages,
            tokens_before = compaction.tokens_before,
            tokens_after = compaction.tokens_after,
            "context compacted"
        );
        Ok(Compaction { from_seq, ..compaction })
    }

    /// Deletes a session's messages after one of them (all when `None`):
    /// the caller must be able to manage the conversation. The runtime calls
    /// it holding the conversation's turn slot, so no turn writes meanwhile.
    #[instrument(
        name = "session.truncate_messages",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn truncate_messages(
        &self,
        ctx: &RequestContext,
        session_id: &str,
        after_message_id: Option<&str>,
    ) -> Result<Truncated, SessionError> {
        allow(ctx, Scopes::WRITE)?;
        if let Some(message_id) = after_message_id {
            validate_message_id(message_id)?;
        }
        let image = self.store.get_session_image(&scope(ctx), session_id).await?;
        self.require_role(ctx, &image.container_id, ShareRole::Manage).await?;
        let truncated = self
            .store
            .truncate_messages(&scope(ctx), session_id, after_message_id)
            .await?;
        tracing::info!(
            image_id = %image.image_id,
            session_id,
            removed = truncated.removed_messages,
            last_seq = truncated.last_seq,
            "conversation rewound"
        );
        Ok(truncated)
    }

    /// Finds the messages and conversation names of the caller's scope that
    /// hold every word of a query, best first, a page at a time: what
    /// listing shows the caller is all a search can find.
    #[instrument(
        name = "session.search",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn search(&self, ctx: &RequestContext, request: SearchRequest) -> Result<SearchPage, SessionError> {
        allow(ctx, Scopes::READ)?;
        let terms = Terms::parse(&request.query)?;
        if let Some(container_id) = &request.container_id {
            validate_container_id(container_id)?;
        }
        if request
            .image_id
            .as_ref()
            .is_some_and(|id| id.is_empty() || id.len() > MAX_ID_BYTES)
        {
            return Err(SessionError::invalid(
                "INVALID_IMAGE_ID",
                format!("image id must be 1 to {MAX_ID_BYTES} bytes"),
            ));
        }
        if let Some(role) = &request.role
            && !SEARCH_ROLES.contains(&role.as_str())
        {
            return Err(SessionError::invalid(
                "INVALID_ROLE",
                format!("role must be one of {}", SEARCH_ROLES.join(", ")),
            ));
        }
        if let (Some(from), Some(to)) = (request.from_ms, request.to_ms)
            && from > to
        {
            return Err(SessionError::invalid("INVALID_TIME_RANGE", "from must not be after to"));
        }
        let limit = match request.page_size {
            0 => DEFAULT_SEARCH_PAGE_SIZE,
            size => size.min(MAX_SEARCH_PAGE_SIZE),
        };
        let offset = page_offset(&request.page_token)?;
        // One more than the page says whether another follows.
        let mut rows = self
            .store
            .search(&scope(ctx), &terms, &request, limit + 1, offset)
            .await?;
        let more = rows.len() > limit as usize;
        rows.truncate(limit as usize);
        let next = offset + u64::from(limit);
        Ok(SearchPage {
            hits: rows.into_iter().map(|row| SearchHit::new(row, &terms)).collect(),
            next_page_token: if more && next <= MAX_SEARCH_OFFSET {
                next.to_string()
            } else {
                String::new()
            },
        })
    }

    /// Returns the conversations the caller may read, most recently active
    /// first, a page at a time, each with its last message and the caller's
    /// read marker.
    #[instrument(
        name = "session.list_recent",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn list_recent(
        &self,
        ctx: &RequestContext,
        page_size: u32,
        page_token: &str,
    ) -> Result<RecentPage, SessionError> {
        allow(ctx, Scopes::READ)?;
        let after = read_token(page_token)?;
        let limit = match page_size {
            0 => DEFAULT_RECENT_PAGE_SIZE,
            size => size.min(MAX_RECENT_PAGE_SIZE),
        };
        let after = after.as_ref().map(|(at, session)| (*at, session.as_str()));
        let mut rows = self
            .store
            .list_recent(&scope(ctx), &ctx.principal.user_id, after, limit + 1)
            .await?;
        let more = rows.len() > limit as usize;
        rows.truncate(limit as usize);
        Ok(RecentPage {
            next_page_token: if more {
                rows.last().map(token_after).unwrap_or_default()
            } else {
                String::new()
            },
            conversations: rows,
        })
    }

    /// Marks a conversation read by the caller up to `seq` (its last message
    /// when `None`); the marker never moves back. Returns it.
    #[instrument(
        name = "session.mark_read",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn mark_read(&self, ctx: &RequestContext, image_id: &str, seq: Option<u64>) -> Result<u64, SessionError> {
        allow(ctx, Scopes::READ)?;
        if image_id.is_empty() || image_id.len() > MAX_ID_BYTES {
            return Err(SessionError::ImageNotFound(image_id.chars().take(64).collect()));
        }
        self.store
            .mark_read(&scope(ctx), image_id, &ctx.principal.user_id, seq, now_ms())
            .await
    }

    /// Returns, across tenants, the turns left open by sessions whose last
    /// message was stored before `before_ms`, a page at a time by session id
    /// after `after_session_id` (components only: a runtime starting alone
    /// records them as lost).
    #[instrument(name = "session.list_open_turns", skip_all, fields(request_id = %ctx.request_id))]
    pub async fn list_open_turns(
        &self,
        ctx: &RequestContext,
        before_ms: i64,
        after_session_id: &str,
        page_size: u32,
    ) -> Result<Vec<OpenTurn>, SessionError> {
        ctx.principal.require_service().map_err(SessionError::Denied)?;
        if after_session_id.len() > MAX_ID_BYTES {
            return Err(SessionError::invalid(
                "INVALID_SESSION_ID",
                format!("after_session_id must be at most {MAX_ID_BYTES} bytes"),
            ));
        }
        let limit = match page_size {
            0 => DEFAULT_OPEN_TURNS_PAGE,
            size => size.min(MAX_OPEN_TURNS_PAGE),
        };
        self.store.list_open_turns(before_ms, after_session_id, limit).await
    }

    /// Shares a container with another user of the tenant with `role`, or
    /// changes their role; its owner or an admin may.
    #[instrument(
        name = "session.share_container",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn share_container(
        &self,
        ctx: &RequestContext,
        container_id: &str,
        user_id: &str,
        role: ShareRole,
    ) -> Result<(), SessionError> {
        allow(ctx, Scopes::WRITE)?;
        validate_container_id(container_id)?;
        validate_user_id(user_id)?;
        self.store
            .share_container(&scope(ctx), container_id, user_id, role, now_ms())
            .await?;
        tracing::info!(container_id, user_id, role = role.as_str(), "container shared");
        Ok(())
    }

    /// Stops sharing a container with a user; its owner or an admin may.
    #[instrument(
        name = "session.unshare_container",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn unshare_container(
        &self,
        ctx: &RequestContext,
        container_id: &str,
        user_id: &str,
    ) -> Result<(), SessionError> {
        allow(ctx, Scopes::WRITE)?;
        validate_container_id(container_id)?;
        validate_user_id(user_id)?;
        self.store.unshare_container(&scope(ctx), container_id, user_id).await?;
        tracing::info!(container_id, user_id, "container unshared");
        Ok(())
    }

    /// Returns the users a container is shared with.
    #[instrument(
        name = "session.list_container_shares",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn list_shares(
        &self,
        ctx: &RequestContext,
        container_id: &str,
    ) -> Result<Vec<ShareRecord>, SessionError> {
        allow(ctx, Scopes::READ)?;
        validate_container_id(container_id)?;
        self.store.list_shares(&scope(ctx), container_id).await
    }

    /// Fails unless the caller may do what `need` allows in `container_id`:
    /// admins, services and the owner may do everything, a user it is shared
    /// with what the share's role allows (`SHARE_ROLE_TOO_LOW`). A container
    /// the caller does not see is `ContainerNotFound`, as everywhere.
    pub(crate) async fn require_role(
        &self,
        ctx: &RequestContext,
        container_id: &str,
        need: ShareRole,
    ) -> Result<(), SessionError> {
        if ctx.owner_filter().is_none() {
            return Ok(());
        }
        match self.store.container_access(&scope(ctx), container_id).await? {
            ContainerAccess::Shared(role) if role < need => Err(SessionError::ShareRoleTooLow {
                container_id: container_id.to_owned(),
                role: role.as_str(),
                need: need.as_str(),
            }),
            _ => Ok(()),
        }
    }

    /// Does what [`Self::require_role`] does for the container of an image.
    async fn require_image_role(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        need: ShareRole,
    ) -> Result<(), SessionError> {
        if ctx.owner_filter().is_none() {
            return Ok(());
        }
        let image = self.store.get_image(&scope(ctx), image_id).await?;
        self.require_role(ctx, &image.container_id, need).await
    }

    /// Returns the parent a new image of `container_id` names: visible to
    /// the caller, in that container and not terminated.
    async fn parent(
        &self,
        ctx: &RequestContext,
        parent_image_id: &str,
        container_id: &str,
    ) -> Result<ImageRecord, SessionError> {
        let parent = self.store.get_image(&scope(ctx), parent_image_id).await?;
        if parent.container_id != container_id {
            return Err(SessionError::invalid(
                "PARENT_IN_OTHER_CONTAINER",
                format!(
                    "parent image {parent_image_id} is in container {}, not in {container_id}",
                    parent.container_id
                ),
            ));
        }
        if parent.agent_state == AgentState::Terminated {
            return Err(SessionError::AgentTerminated(parent.image_id));
        }
        Ok(parent)
    }
}

/// Returns the part of the store the caller may see.
fn scope(ctx: &RequestContext) -> Scope<'_> {
    Scope {
        tenant_id: &ctx.tenant_id,
        user_id: ctx.owner_filter(),
    }
}

fn allow(ctx: &RequestContext, scope: Scopes) -> Result<(), SessionError> {
    ctx.require(scope).map_err(SessionError::Denied)
}

fn validate_user_id(user_id: &str) -> Result<(), SessionError> {
    if is_valid_client_id(user_id) {
        Ok(())
    } else {
        Err(SessionError::invalid(
            "INVALID_USER_ID",
            "user id must be 1 to 128 characters of letters, digits and . _ : @ -",
        ))
    }
}

fn validate_container_id(container_id: &str) -> Result<(), SessionError> {
    if is_valid_client_id(container_id) {
        Ok(())
    } else {
        Err(SessionError::invalid(
            "INVALID_CONTAINER_ID",
            "container id must be 1 to 128 characters of letters, digits and . _ : @ -",
        ))
    }
}

fn validate_name(name: String) -> Result<String, SessionError> {
    if name.trim().is_empty() {
        return Err(SessionError::invalid(
            "INVALID_IMAGE_NAME",
            "image name must not be blank",
        ));
    }
    if name.chars().count() > MAX_NAME_CHARS {
        return Err(SessionError::invalid(
            "INVALID_IMAGE_NAME",
            format!("image name must be at most {MAX_NAME_CHARS} characters"),
        ));
    }
    Ok(name)
}

fn validate_description(description: String) -> Result<String, SessionError> {
    if description.chars().count() > MAX_DESCRIPTION_CHARS {
        return Err(SessionError::invalid(
            "INVALID_IMAGE_DESCRIPTION",
            format!("image description must be at most {MAX_DESCRIPTION_CHARS} characters"),
        ));
    }
    Ok(description)
}

fn validate_system_prompt(system_prompt: String) -> Result<String, SessionError> {
    if system_prompt.len() > MAX_SYSTEM_PROMPT_BYTES {
        return Err(SessionError::invalid(
            "INVALID_SYSTEM_PROMPT",
            format!("system prompt must be at most {} KiB", MAX_SYSTEM_PROMPT_BYTES / 1024),
        ));
    }
    Ok(system_prompt)
}

impl SessionService {
    /// Refuses an image whose `mcpServers` (a JSON object, validated) hold a
    /// server the runtime would refuse; an operator's, like a public tool
    /// resource, may start any command.
    fn check_mcp_servers(&self, ctx: &RequestContext, json: &str) -> Result<(), SessionError> {
        let servers: serde_json::Map<String, serde_json::Value> = serde_json::from_str(json).unwrap_or_default();
        let operator = ctx.principal.require_operator().is_ok();
        for (name, definition) in &servers {
            self.mcp_rules
                .check(name, definition, operator)
                .map_err(SessionError::Denied)?;
        }
        Ok(())
    }
}

/// Returns the MCP server definitions to store: `"{}"` for none, else a JSON object.
fn validate_mcp_servers(json: String) -> Result<String, SessionError> {
    if json.trim().is_empty() {
        return Ok("{}".to_owned());
    }
    if json.len() > MAX_MCP_SERVERS_BYTES {
        return Err(SessionError::invalid(
            "INVALID_MCP_SERVERS",
            format!("mcp servers must be at most {} KiB", MAX_MCP_SERVERS_BYTES / 1024),
        ));
    }
    match serde_json::from_str::<serde_json::Value>(&json) {
        Ok(serde_json::Value::Object(_)) => Ok(json),
        Ok(_) => Err(SessionError::invalid(
            "INVALID_MCP_SERVERS",
            "mcp servers must be a json object",
        )),
        Err(err) => Err(SessionError::invalid(
            "INVALID_MCP_SERVERS",
            format!("mcp servers are not valid json: {err}"),
        )),
    }
}

/// Returns an agent reference to store: a `resource://agents/…` URI. Whether
/// it resolves is the resource service's to say, when the agent starts.
fn validate_agent(agent: String) -> Result<String, SessionError> {
    if !agent.starts_with(AGENT_URI_PREFIX) || agent.len() > MAX_AGENT_URI_BYTES {
        return Err(SessionError::invalid(
            "INVALID_AGENT",
            format!("agent must be a {AGENT_URI_PREFIX}<name>[@<version>] URI of at most {MAX_AGENT_URI_BYTES} bytes"),
        ));
    }
    Ok(agent)
}

/// Returns the prompt variables to store: `"{}"` for none, else a JSON object of strings.
/// Largest metadata object of an image, in bytes.
pub const MAX_METADATA_BYTES: usize = 16 * 1024;

/// Checks a client's metadata: a JSON object of at most [`MAX_METADATA_BYTES`];
/// empty means none (`{}`).
fn validate_metadata(json: String) -> Result<String, SessionError> {
    if json.trim().is_empty() {
        return Ok("{}".to_owned());
    }
    if json.len() > MAX_METADATA_BYTES {
        return Err(SessionError::invalid(
            "INVALID_METADATA",
            format!("metadata must be at most {} KiB", MAX_METADATA_BYTES / 1024),
        ));
    }
    match serde_json::from_str::<serde_json::Value>(&json) {
        Ok(serde_json::Value::Object(_)) => Ok(json),
        _ => Err(SessionError::invalid(
            "INVALID_METADATA",
            "metadata must be a JSON object",
        )),
    }
}

fn validate_variables(json: String) -> Result<String, SessionError> {
    if json.trim().is_empty() {
        return Ok("{}".to_owned());
    }
    if json.len() > MAX_VARIABLES_BYTES {
        return Err(SessionError::invalid(
            "INVALID_VARIABLES",
            format!("variables must be at most {} KiB", MAX_VARIABLES_BYTES / 1024),
        ));
    }
    match serde_json::from_str::<serde_json::Value>(&json) {
        Ok(serde_json::Value::Object(map)) if map.values().all(serde_json::Value::is_string) => Ok(json),
        _ => Err(SessionError::invalid(
            "INVALID_VARIABLES",
            "variables must be a json object of strings",
        )),
    }
}

/// Most tools one image may name.
const MAX_TOOLS: usize = 64;

/// Returns an image's tools, each once: built-in names and `resource://tools/…`
/// URIs (whether those resolve is checked with the other references).
fn validate_tools(tools: Vec<String>) -> Result<Vec<String>, SessionError> {
    use avm_common::tools::{BUILTIN_TOOLS, TOOL_URI_PREFIX};
    if tools.len() > MAX_TOOLS {
        return Err(SessionError::invalid(
            "INVALID_TOOLS",
            format!("an image may name at most {MAX_TOOLS} tools"),
        ));
    }
    let mut kept: Vec<String> = Vec::with_capacity(tools.len());
    for tool in tools {
        let known = BUILTIN_TOOLS.contains(&tool.as_str())
            || (tool.starts_with(TOOL_URI_PREFIX) && tool.len() > TOOL_URI_PREFIX.len() && tool.len() <= 512);
        if !known {
            return Err(SessionError::invalid(
                "UNKNOWN_TOOL",
                format!(
                    "unknown tool {tool:?}: name a built-in tool ({}) or a resource://tools/… URI",
                    BUILTIN_TOOLS.join(", ")
                ),
            ));
        }
        if !kept.contains(&tool) {
            kept.push(tool);
        }
    }
    Ok(kept)
}

/// Fails unless the caller may write `message`: a service principal (the
/// runtime) writes any message at any time; anyone else only user messages,
/// whose time this service stamps.
fn check_author(ctx: &RequestContext, message: &NewMessage) -> Result<(), SessionError> {
    if ctx.principal.role == Role::Service {
        return Ok(());
    }
    check_user_message_id(&message.message_id)?;
    if !matches!(message.body, MessageBody::User { .. }) {
        return Err(SessionError::Denied(ApiError::new(
            Code::PermissionDenied,
            "RUNTIME_ONLY_MESSAGE",
            format!(
                "only the runtime writes {} messages; a user appends user messages",
                message.body.kind()
            ),
        )));
    }
    if message.created_at_ms != 0 {
        return Err(SessionError::invalid(
            "CREATED_AT_NOT_ALLOWED",
            "the service stamps a user's message with its own time; leave created_at_ms unset",
        ));
    }
    Ok(())
}

/// Refuses a user's message id in a form the runtime writes under (a lost
/// turn's marker `<id>.lost`, an agent's group reply `reply.<member>.<seq>`):
/// claimed first, the runtime's idempotent write would keep the user's
/// message in place of its own (issue 26 item 7).
pub(crate) fn check_user_message_id(message_id: &str) -> Result<(), SessionError> {
    if message_id.ends_with(".lost") || message_id.starts_with("reply.") {
        return Err(SessionError::Denied(ApiError::new(
            Code::PermissionDenied,
            "RUNTIME_MESSAGE_ID",
            "ids ending in .lost or starting with reply. are the runtime's; choose another message id",
        )));
    }
    Ok(())
}

fn non_empty(value: Option<String>) -> Option<String> {
    value.filter(|v| !v.is_empty())
}

/// An export, a piece at a time.
pub type ExportStream = BoxStream<'static, Result<Vec<u8>, SessionError>>;

/// Messages read per page of an export.
const EXPORT_PAGE: u32 = 64;

/// Writes `opening` (a container's header line, or nothing), then each
/// image's document (on a line of its own when there is an opening), reading
/// its messages a page at a time, and hands the bytes on in pieces of at
/// most [`EXPORT_CHUNK_BYTES`] (however large one message).
fn export_stream(store: Arc<dyn SessionStore>, opening: Vec<u8>, images: Vec<ImageRecord>) -> ExportStream {
    struct State {
        store: Arc<dyn SessionStore>,
        lines: bool,
        images: std::collections::VecDeque<ImageRecord>,
        current: Option<(ExportWriter, String, u64)>,
        pending: bytes::BytesMut,
    }
    let state = State {
        store,
        lines: !opening.is_empty(),
        images: images.into(),
        current: None,
        pending: bytes::BytesMut::from(&opening[..]),
    };
    futures::stream::try_unfold(state, |mut state| async move {
        loop {
            if state.pending.len() >= EXPORT_CHUNK_BYTES {
                let piece = state.pending.split_to(EXPORT_CHUNK_BYTES);
                return Ok(Some((piece.to_vec(), state)));
            }
            match state.current.take() {
                None => {
                    let Some(image) = state.images.pop_front() else {
                        if state.pending.is_empty() {
                            return Ok(None);
                        }
                        let rest = state.pending.split();
                        return Ok(Some((rest.to_vec(), state)));
                    };
                    let (writer, bytes) = ExportWriter::begin(&image, &new_id("doc"), now_ms())?;
                    state.pending.extend_from_slice(&bytes);
                    state.current = Some((writer, image.session_id, 0));
                }
                Some((mut writer, session_id, after)) => {
                    let page = state.store.list_messages_page(&session_id, after, EXPORT_PAGE).await?;
                    let Some(last) = page.last().map(|message| message.seq) else {
                        state.pending.extend_from_slice(&writer.end()?);
                        if state.lines {
                            state.pending.extend_from_slice(b"\n");
                        }
                        continue;
                    };
                    let mut out = Vec::new();
                    for message in &page {
                        writer.message(message, &mut out)?;
                    }
                    state.pending.extend_from_slice(&out);
                    state.current = Some((writer, session_id, last));
                }
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_ids_allow_the_documented_alphabet_only() {
        assert!(is_valid_client_id("default"));
        assert!(is_valid_client_id("user@example.com:team-1_a.b"));
        assert!(is_valid_client_id(&"a".repeat(128)));
        assert!(!is_valid_client_id(""));
        assert!(!is_valid_client_id(&"a".repeat(129)));
        assert!(!is_valid_client_id("a b"));
        assert!(!is_valid_client_id("a/b"));
        assert!(!is_valid_client_id("é"));
    }

    #[test]
    fn mcp_servers_must_be_an_object() {
        assert_eq!(validate_mcp_servers(String::new()).ok().as_deref(), Some("{}"));
        assert_eq!(validate_mcp_servers("  ".into()).ok().as_deref(), Some("{}"));
        let fs = r#"{"fs":{"command":"mcp-fs"}}"#;
        assert_eq!(validate_mcp_servers(fs.into()).ok().as_deref(), Some(fs));
        for bad in ["[]", "1", "\"x\"", "{", "null"] {
            let err = validate_mcp_servers(bad.into()).err();
            assert!(
                matches!(
                    err,
                    Some(SessionError::Invalid {
                        reason: "INVALID_MCP_SERVERS",
                        ..
                    })
                ),
                "{bad}"
            );
        }
    }
}
