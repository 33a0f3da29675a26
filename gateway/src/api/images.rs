//! Images (conversations) and what happens in them: create, read, change,
//! delete, run and stop their agent, send a message, interrupt, read the
//! history and follow the events.

use std::pin::Pin;

use avm_common::event::EventKind;
use avm_common::{ApiError, RequestContext};
use avm_proto::runtime::v1 as rt;
use avm_proto::session::v1 as ss;
use futures::Stream;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::ToSchema;

use super::messages::{MessageContent, MessageObject};
use super::missing;
use crate::frames;
use crate::peers::Peers;

/// Settings of a new image (the body of `POST /v1/containers/{id}/images`,
/// the `config` of `image_create_request`).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", default, expecting = "an object", deny_unknown_fields)]
pub struct ImageConfig {
    /// Defaults to "New Conversation".
    pub name: Option<String>,
    pub description: Option<String>,
    /// Text, or a `resource://prompts/…` URI rendered with `variables`.
    pub system_prompt: Option<String>,
    /// MCP servers by name: `{command, args?, env?}`, `{type:"sse", url, headers?}`
    /// or `{type:"http", url, headers?}`.
    #[schema(value_type = Option<Object>)]
    pub mcp_servers: Option<Value>,
    /// A `resource://agents/…` definition to run.
    pub agent: Option<String>,
    /// Values of the prompt's variables, strings by name.
    #[schema(value_type = Option<Object>)]
    pub variables: Option<Value>,
    /// The tools the agent may call: built-in names (`read_file`, `write_file`,
    /// `edit_file`, `list_files`, `search_files`, `run_command`, `fetch_url`) and
    /// `resource://tools/…` URIs.
    /// None: the agent has no tools (and no workspace).
    pub tools: Option<Vec<String>>,
    /// AVM: a JSON object the conversation's clients keep with it (at most
    /// 16 KiB), returned as given.
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
}

/// The changes to an image; absent fields stay as they are.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(default, expecting = "an object", deny_unknown_fields)]
pub struct ImageUpdate {
    pub name: Option<String>,
    /// An empty description clears it.
    pub description: Option<String>,
    /// New tools, replacing the image's (`[]`: none), checked as at creation;
    /// its running agent is stopped (a running turn interrupted) and the next
    /// message starts it with them.
    pub tools: Option<Vec<String>>,
    /// New metadata, an object replacing the conversation's (`{}` clears it).
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Value>,
}

/// An image as the protocol's `record` shows it.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageRecord {
    pub image_id: String,
    pub container_id: String,
    /// The image's one session; subscribe to it for the image's events.
    pub session_id: String,
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub mcp_servers: Option<Map<String, Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub variables: Option<Map<String, Value>>,
    /// The tools its agent may call.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<String>,
    /// What its clients keep with it (AVM), when anything.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub metadata: Option<Map<String, Value>>,
    /// Unix milliseconds.
    pub created_at: i64,
    /// Unix milliseconds.
    pub updated_at: i64,
    /// Whether an agent of the image is running.
    pub online: bool,
    /// The running agent, when online.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<String>,
    /// Whether its agent may run: `active`, `paused`, `error` (stopped by a
    /// failure retrying would not fix, until resumed) or `terminated`.
    pub agent_state: &'static str,
    /// What stopped its agent, in the `error` state.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_error: Option<String>,
    /// The image whose agent started this one (`spawn_agent`), for a child agent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_image_id: Option<String>,
    /// Levels below an agent nobody started; 0 for one a client made.
    pub depth: u32,
}

impl ImageRecord {
    fn new(view: rt::ImageView) -> Result<Self, ApiError> {
        let image = view.image.ok_or_else(|| missing("image"))?;
        let agent_id = view.agent.map(|agent| agent.agent_id);
        Ok(Self {
            online: agent_id.is_some(),
            agent_id,
            mcp_servers: non_empty_object(&image.mcp_servers_json),
            variables: non_empty_object(&image.variables_json),
            metadata: non_empty_object(&image.metadata_json),
            image_id: image.image_id,
            container_id: image.container_id,
            session_id: image.session_id,
            name: image.name,
            description: image.description,
            system_prompt: image.system_prompt,
            agent: image.agent,
            tools: image.tools,
            created_at: image.created_at_ms,
            updated_at: image.updated_at_ms,
            agent_state: agent_state_name(image.agent_state),
            agent_error: image.agent_error,
            parent_image_id: image.parent_image_id,
            depth: image.depth,
        })
    }
}

/// Returns the name of an image's agent state.
pub(crate) fn agent_state_name(state: i32) -> &'static str {
    match ss::AgentState::try_from(state) {
        Ok(ss::AgentState::Paused) => "paused",
        Ok(ss::AgentState::Terminated) => "terminated",
        Ok(ss::AgentState::Error) => "error",
        _ => "active",
    }
}

/// Returns a stored JSON object, unless it is empty or not an object.
fn non_empty_object(json: &str) -> Option<Map<String, Value>> {
    match serde_json::from_str(json) {
        Ok(Value::Object(map)) if !map.is_empty() => Some(map),
        _ => None,
    }
}

/// Images of a container, newest first.
#[derive(Debug, Serialize, ToSchema)]
pub struct ImageList {
    pub images: Vec<ImageRecord>,
}

/// What deleting an image answers.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageDeleted {
    pub image_id: String,
    pub deleted: bool,
}

/// The agent an image runs, once started.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageRun {
    pub image_id: String,
    pub agent_id: String,
    /// Whether the agent was already running.
    pub reused: bool,
}

/// Whether stopping an image stopped a running agent.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageStopped {
    pub image_id: String,
    pub stopped: bool,
}

/// Where to rewind a conversation to (the body of `POST /v1/images/{id}/rewind`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", expecting = "an object", deny_unknown_fields)]
pub struct RewindPoint {
    /// The last message to keep: a reply, an error or a tool result (a user
    /// message or a tool call would leave a turn open).
    pub after_message_id: String,
}

/// What rewinding or clearing a conversation removed.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Rewound {
    pub image_id: String,
    pub session_id: String,
    /// Messages deleted; the usage they cost stays recorded.
    pub removed_messages: u64,
}

/// An image's history, in stored order.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MessageList {
    pub image_id: String,
    /// User, assistant, tool-call, tool-result and error messages.
    pub messages: Vec<MessageObject>,
}

/// What an interrupt found.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Interrupted {
    pub image_id: String,
    pub agent_id: String,
    /// Whether a turn was running (and is now interrupted).
    pub interrupted: bool,
}

/// A user message for an image.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewMessage {
    /// A string, or a list of parts (`{type:"text",text}`,
    /// `{type:"image",data,mediaType}`, `{type:"file",data,mediaType,filename?}`).
    pub content: MessageContent,
}

/// What a sent message answers before its turn's events.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MessageAccepted {
    pub image_id: String,
    pub agent_id: String,
    pub user_message_id: String,
    /// The cursor of the last event before the turn's.
    pub cursor: String,
    /// The session whose events the turn is.
    #[serde(skip)]
    pub session_id: String,
}

/// A session's events, as the runtime streams them.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<rt::Event, ApiError>> + Send>>;

/// Creates an image (and its session) in a container; the session service
/// checks its settings and that its `resource://` references resolve.
pub async fn create(
    peers: &Peers,
    ctx: &RequestContext,
    container_id: String,
    config: ImageConfig,
) -> Result<ImageRecord, ApiError> {
    let json = |value: Option<Value>| value.map(|value| value.to_string()).unwrap_or_default();
    let request = ctx.request(ss::CreateImageRequest {
        container_id,
        name: config.name,
        description: config.description,
        system_prompt: config.system_prompt,
        mcp_servers_json: json(config.mcp_servers),
        agent: config.agent,
        variables_json: json(config.variables),
        tools: config.tools.unwrap_or_default(),
        metadata_json: json(config.metadata),
        parent_image_id: None,
    });
    let image = peers.session.create_image(request).await?.into_inner().image;
    ImageRecord::new(rt::ImageView { image, agent: None })
}

/// Returns an image, online when its agent runs.
pub async fn get(peers: &Peers, ctx: &RequestContext, image_id: String) -> Result<ImageRecord, ApiError> {
    let request = ctx.request(rt::GetImageRequest { image_id });
    let view = peers.runtime.get_image(request).await?.into_inner().image;
    ImageRecord::new(view.ok_or_else(|| missing("image"))?)
}

async fn session_of(peers: &Peers, ctx: &RequestContext, image_id: String) -> Result<String, ApiError> {
    let request = ctx.request(ss::GetImageRequest { image_id });
    let image = peers.session.get_image(request).await?.into_inner().image;
    Ok(image.ok_or_else(|| missing("image"))?.session_id)
}

/// Lists images newest first, of one container or of all the caller's; with
/// `parent_image_id`, only the agents that image's agent started.
pub async fn list(
    peers: &Peers,
    ctx: &RequestContext,
    container_id: Option<String>,
    parent_image_id: Option<String>,
) -> Result<ImageList, ApiError> {
    let request = ctx.request(rt::ListImagesRequest {
        container_id,
        parent_image_id,
    });
    let views = peers.runtime.list_images(request).await?.into_inner().images;
    Ok(ImageList {
        images: views.into_iter().map(ImageRecord::new).collect::<Result<_, _>>()?,
    })
}

/// Changes an image's name, description or tools.
pub async fn update(
    peers: &Peers,
    ctx: &RequestContext,
    image_id: String,
    update: ImageUpdate,
) -> Result<ImageRecord, ApiError> {
    // The runtime stops the agent whose tools change.
    let request = ctx.request(rt::UpdateImageRequest {
        image_id: image_id.clone(),
        name: update.name,
        description: update.description,
        tools: update.tools.map(|tools| ss::ToolList { tools }),
        metadata_json: update.metadata.map(|metadata| metadata.to_string()),
    });
    peers.runtime.update_image(request).await?;
    get(peers, ctx, image_id).await
}

/// Deletes an image (and its descendants) with its session and messages;
/// the runtimes hear it from the session service, and stop its agent and
/// remove its workspace.
pub async fn delete(peers: &Peers, ctx: &RequestContext, image_id: String) -> Result<ImageDeleted, ApiError> {
    let request = ctx.request(ss::DeleteImageRequest {
        image_id: image_id.clone(),
    });
    peers.session.delete_image(request).await?;
    Ok(ImageDeleted {
        image_id,
        deleted: true,
    })
}

/// Starts an image's agent, or finds the running one.
pub async fn run(peers: &Peers, ctx: &RequestContext, image_id: String) -> Result<ImageRun, ApiError> {
    let request = ctx.request(rt::RunImageRequest {
        image_id: image_id.clone(),
    });
    let response = peers.runtime.run_image(request).await?.into_inner();
    let agent = response.agent.ok_or_else(|| missing("agent"))?;
    Ok(ImageRun {
        image_id,
        agent_id: agent.agent_id,
        reused: response.reused,
    })
}

/// Stops an image's agent; `stopped` is false when none was running.
pub async fn stop(peers: &Peers, ctx: &RequestContext, image_id: String) -> Result<ImageStopped, ApiError> {
    let request = ctx.request(rt::StopImageRequest {
        image_id: image_id.clone(),
    });
    let stopped = peers.runtime.stop_image(request).await?.into_inner().stopped;
    Ok(ImageStopped { image_id, stopped })
}

/// Deletes a conversation's messages after `after_message_id` (all of them
/// when `None`: a clear) and rebuilds its agent's context; refused while a
/// turn runs.
pub async fn rewind(
    peers: &Peers,
    ctx: &RequestContext,
    image_id: String,
    after_message_id: Option<String>,
) -> Result<Rewound, ApiError> {
    let request = ctx.request(rt::RewindImageRequest {
        image_id,
        after_message_id,
    });
    let rewound = peers.runtime.rewind_image(request).await?.into_inner();
    Ok(Rewound {
        image_id: rewound.image_id,
        session_id: rewound.session_id,
        removed_messages: rewound.removed_messages,
    })
}

/// Returns a session's messages, in stored order, as the events carry them.
pub async fn session_history(
    peers: &Peers,
    ctx: &RequestContext,
    session_id: &str,
) -> Result<Vec<avm_common::event::MessageObject>, ApiError> {
    let request = ctx.request(ss::ListMessagesRequest {
        session_id: session_id.to_owned(),
        context_only: false,
    });
    let messages = peers.session.list_messages(request).await?.into_inner().messages;
    Ok(messages
        .into_iter()
        .filter_map(MessageObject::new)
        .filter_map(|message| match serde_json::to_value(message) {
            Ok(Value::Object(object)) => Some(object),
            _ => None,
        })
        .collect())
}

/// Returns an image's messages, in stored order.
pub async fn messages(peers: &Peers, ctx: &RequestContext, image_id: String) -> Result<MessageList, ApiError> {
    let session_id = session_of(peers, ctx, image_id.clone()).await?;
    let request = ctx.request(ss::ListMessagesRequest {
        session_id,
        context_only: false,
    });
    let messages = peers.session.list_messages(request).await?.into_inner().messages;
    Ok(MessageList {
        image_id,
        messages: messages.into_iter().filter_map(MessageObject::new).collect(),
    })
}

/// Sends a user message: returns its acceptance and the turn's events.
pub async fn send(
    peers: &Peers,
    ctx: &RequestContext,
    image_id: String,
    message: NewMessage,
) -> Result<(MessageAccepted, EventStream), ApiError> {
    let (content, plain_text) = message.content.into_parts();
    let request = ctx.request(rt::SendMessageRequest {
        image_id: image_id.clone(),
        content,
        plain_text,
    });
    let mut stream = peers.runtime.send_message(request).await?.into_inner();
    let accepted = match futures::StreamExt::next(&mut stream).await.transpose()? {
        Some(rt::SendMessageResponse {
            kind: Some(rt::send_message_response::Kind::Accepted(accepted)),
        }) => accepted,
        _ => return Err(ApiError::internal("runtime did not accept the message")),
    };
    let agent = accepted.agent.ok_or_else(|| missing("agent"))?;
    let events = futures::StreamExt::filter_map(stream, |item| async move {
        match item {
            Ok(rt::SendMessageResponse {
                kind: Some(rt::send_message_response::Kind::Event(event)),
            }) => Some(Ok(event)),
            Ok(_) => None,
            Err(status) => Some(Err(status)),
        }
    });
    let events = resumable(
        peers.clone(),
        ctx.clone(),
        agent.session_id.clone(),
        Box::pin(events),
        Some(accepted.cursor.clone()),
        true,
    );
    let accepted = MessageAccepted {
        image_id,
        agent_id: agent.agent_id,
        user_message_id: accepted.user_message_id,
        cursor: accepted.cursor,
        session_id: agent.session_id,
    };
    Ok((accepted, events))
}

/// Names an agent by its image or its own id.
#[derive(Debug, Clone)]
pub enum AgentTarget {
    Image(String),
    Agent(String),
}

/// Interrupts the running turn of an agent.
pub async fn interrupt(peers: &Peers, ctx: &RequestContext, target: AgentTarget) -> Result<Interrupted, ApiError> {
    let target = match target {
        AgentTarget::Image(id) => rt::interrupt_agent_request::Target::ImageId(id),
        AgentTarget::Agent(id) => rt::interrupt_agent_request::Target::AgentId(id),
    };
    let request = ctx.request(rt::InterruptAgentRequest { target: Some(target) });
    let response = peers.runtime.interrupt_agent(request).await?.into_inner();
    let agent = response.agent.ok_or_else(|| missing("agent"))?;
    Ok(Interrupted {
        image_id: agent.image_id,
        agent_id: agent.agent_id,
        interrupted: response.interrupted,
    })
}

/// Follows a session's events after an optional cursor, then live.
pub async fn subscribe(
    peers: &Peers,
    ctx: &RequestContext,
    session_id: String,
    after_cursor: Option<String>,
) -> Result<EventStream, ApiError> {
    let (first, start) = follow(peers, ctx, &session_id, after_cursor.clone()).await?;
    // Followed again after a cut, a stream that showed nothing yet resumes
    // where it began.
    let cursor = after_cursor.or(start);
    Ok(resumable(peers.clone(), ctx.clone(), session_id, first, cursor, false))
}

/// A session's events as a runtime streams them.
type RawEvents = Pin<Box<dyn Stream<Item = Result<rt::Event, tonic::Status>> + Send>>;

/// Subscribes to a session's events through any runtime; returns them and
/// the cursor of the session's latest event when they began.
async fn follow(
    peers: &Peers,
    ctx: &RequestContext,
    session_id: &str,
    after_cursor: Option<String>,
) -> Result<(RawEvents, Option<String>), ApiError> {
    let request = ctx.request(rt::SubscribeEventsRequest {
        session_id: session_id.to_owned(),
        after_cursor,
    });
    let response = peers.runtime.subscribe_events(request).await?;
    let start = response
        .metadata()
        .get(avm_common::context::START_CURSOR_HEADER)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let stream = response.into_inner();
    let events = Box::pin(futures::StreamExt::filter_map(stream, |item| async move {
        match item {
            Ok(rt::SubscribeEventsResponse { event: Some(event) }) => Some(Ok(event)),
            Ok(_) => None,
            Err(status) => Some(Err(status)),
        }
    }));
    Ok((events, start))
}

/// Times in a row a broken event stream is followed again before its error
/// goes to the client.
const RESUMES: u32 = 5;

/// Whether a stream broke because its runtime went away (rather than
/// ending with the runtime's own answer).
fn broken(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

struct Resume {
    peers: Peers,
    ctx: RequestContext,
    session_id: String,
    stream: Option<RawEvents>,
    cursor: Option<String>,
    resumes: u32,
    until_turn_end: bool,
    done: bool,
}

/// Keeps following a session's events when their runtime goes away: the
/// stream is followed again, through another runtime, after the last cursor
/// it delivered, so the client misses nothing and gets nothing twice (a turn
/// its runtime was running when it died ends there with `RUNTIME_LOST`).
/// Any other error, or a stream that keeps breaking, ends it with a typed
/// error. With `until_turn_end`, it ends after the turn's last event.
fn resumable(
    peers: Peers,
    ctx: RequestContext,
    session_id: String,
    first: RawEvents,
    cursor: Option<String>,
    until_turn_end: bool,
) -> EventStream {
    let state = Resume {
        peers,
        ctx,
        session_id,
        stream: Some(first),
        cursor,
        resumes: 0,
        until_turn_end,
        done: false,
    };
    Box::pin(futures::stream::unfold(state, |mut state| async move {
        loop {
            if state.done {
                return None;
            }
            let next = match state.stream.as_mut() {
                Some(stream) => futures::StreamExt::next(stream).await,
                None => None,
            };
            let cut = match next {
                Some(Ok(event)) => {
                    state.resumes = 0;
                    state.cursor = Some(event.cursor.clone());
                    state.done = state.until_turn_end && frames::kind(&event).is_some_and(EventKind::ends_turn);
                    return Some((Ok(event), state));
                }
                Some(Err(status)) if !broken(&status) => {
                    state.done = true;
                    return Some((Err(ApiError::from_status(&status)), state));
                }
                Some(Err(status)) => ApiError::from_status(&status),
                // A stream the runtime ended without a turn's end: cut too.
                None => ApiError::unavailable("EVENT_STREAM_ENDED", "the event stream ended"),
            };
            if state.resumes >= RESUMES {
                state.done = true;
                return Some((Err(cut), state));
            }
            state.resumes += 1;
            tracing::info!(session_id = %state.session_id, resumes = state.resumes, error = %cut.message, "event stream cut; following it again");
            // A moment for a runtime to notice another is gone; all the
            // tries take 1.5 s, so a client learns within 2 s that no runtime
            // answers.
            tokio::time::sleep(std::time::Duration::from_millis(100) * state.resumes).await;
            state.stream = follow(&state.peers, &state.ctx, &state.session_id, state.cursor.clone())
                .await
                .ok()
                .map(|(events, _)| events);
        }
    }))
}

/// Follows an image's events after an optional cursor, then live.
pub async fn events(
    peers: &Peers,
    ctx: &RequestContext,
    image_id: String,
    after_cursor: Option<String>,
) -> Result<EventStream, ApiError> {
    let session_id = session_of(peers, ctx, image_id).await?;
    subscribe(peers, ctx, session_id, after_cursor).await
}
