//! REST adapters of containers, images (conversations) and agents.

use std::convert::Infallible;
use std::sync::Arc;

use avm_common::event::EventKind;
use avm_common::{ApiError, RequestContext};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;
use futures::{Stream, StreamExt};
use serde::Deserialize;
use utoipa::IntoParams;

use crate::api::agents::{self, Agent, AgentDestroyed, AgentFilter, AgentLifecycle, AgentList, LifecycleAction};
use crate::api::containers::{
    self, Container, ContainerDeleted, ContainerList, ContainerRef, ShareList, ShareRequest, ShareState,
};
use crate::api::images::{
    self, AgentTarget, EventStream, ImageConfig, ImageDeleted, ImageList, ImageRecord, ImageRun, ImageStopped,
    ImageUpdate, Interrupted, MessageAccepted, MessageList, NewMessage, RewindPoint, Rewound,
};
use crate::frames::{self, event_frame, system_error_frame};
use crate::http::{Body, Ctx, Path, Query, error_response, ok, reply, with_request_id};
use crate::state::GatewayState;

type St = State<Arc<GatewayState>>;

#[utoipa::path(post, path = "/v1/containers", tag = "containers", request_body = ContainerRef,
    responses((status = 201, description = "Created", body = Container),
              (status = 200, description = "It existed already", body = Container)))]
pub async fn create_container(State(state): St, Ctx(ctx): Ctx, Body(request): Body<ContainerRef>) -> Response {
    match containers::create(&state.peers, &ctx, request).await {
        Ok((container, created)) => {
            let status = if created { StatusCode::CREATED } else { StatusCode::OK };
            reply(&ctx, status, Ok(container))
        }
        Err(err) => error_response(&err, &ctx.request_id),
    }
}

#[utoipa::path(get, path = "/v1/containers", tag = "containers",
    responses((status = 200, description = "The caller's containers, oldest first", body = ContainerList)))]
pub async fn list_containers(State(state): St, Ctx(ctx): Ctx) -> Response {
    ok(&ctx, containers::list(&state.peers, &ctx).await)
}

#[utoipa::path(get, path = "/v1/containers/{id}", tag = "containers", params(("id" = String, Path)),
    responses((status = 200, description = "The container", body = Container)))]
pub async fn get_container(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, containers::get(&state.peers, &ctx, id).await)
}

#[utoipa::path(delete, path = "/v1/containers/{id}", tag = "containers", params(("id" = String, Path)),
    responses((status = 200, description = "Deleted, with its images; their agents are stopped", body = ContainerDeleted)))]
pub async fn delete_container(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, containers::delete(&state.peers, &ctx, id).await)
}

#[utoipa::path(post, path = "/v1/containers/{id}/shares", tag = "containers", params(("id" = String, Path)),
    request_body = ShareRequest, responses((status = 200, description = "Shared", body = ShareState)))]
pub async fn share_container(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    Body(request): Body<ShareRequest>,
) -> Response {
    let identity = state.auth.identity();
    ok(&ctx, containers::share(&state.peers, identity, &ctx, id, request).await)
}

#[utoipa::path(get, path = "/v1/containers/{id}/shares", tag = "containers", params(("id" = String, Path)),
    responses((status = 200, description = "Who the container is shared with", body = ShareList)))]
pub async fn list_shares(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, containers::shares(&state.peers, &ctx, id).await)
}

#[utoipa::path(delete, path = "/v1/containers/{id}/shares/{user}", tag = "containers",
    params(("id" = String, Path), ("user" = String, Path)),
    responses((status = 200, description = "No longer shared", body = ShareState)))]
pub async fn unshare_container(State(state): St, Ctx(ctx): Ctx, Path((id, user)): Path<(String, String)>) -> Response {
    ok(&ctx, containers::unshare(&state.peers, &ctx, id, user).await)
}

#[utoipa::path(post, path = "/v1/containers/{id}/images", tag = "images", params(("id" = String, Path)),
    request_body = ImageConfig, responses((status = 201, description = "Created, with its session", body = ImageRecord)))]
pub async fn create_image(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(container_id): Path<String>,
    Body(config): Body<ImageConfig>,
) -> Response {
    reply(
        &ctx,
        StatusCode::CREATED,
        images::create(&state.peers, &ctx, container_id, config).await,
    )
}

#[utoipa::path(get, path = "/v1/containers/{id}/images", tag = "images", params(("id" = String, Path)),
    responses((status = 200, description = "The container's images, newest first", body = ImageList)))]
pub async fn list_images(State(state): St, Ctx(ctx): Ctx, Path(container_id): Path<String>) -> Response {
    ok(&ctx, images::list(&state.peers, &ctx, Some(container_id), None).await)
}

#[utoipa::path(get, path = "/v1/images/{id}/children", tag = "images", params(("id" = String, Path)),
    responses((status = 200, description = "The agents this image's agent started (spawn_agent), newest first", body = ImageList)))]
pub async fn list_children(State(state): St, Ctx(ctx): Ctx, Path(image_id): Path<String>) -> Response {
    ok(&ctx, images::list(&state.peers, &ctx, None, Some(image_id)).await)
}

#[utoipa::path(get, path = "/v1/images/{id}", tag = "images", params(("id" = String, Path)),
    responses((status = 200, description = "The image, online when its agent runs", body = ImageRecord)))]
pub async fn get_image(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, images::get(&state.peers, &ctx, id).await)
}

#[utoipa::path(patch, path = "/v1/images/{id}", tag = "images", params(("id" = String, Path)),
    request_body = ImageUpdate, responses((status = 200, description = "The changed image", body = ImageRecord)))]
pub async fn update_image(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    Body(update): Body<ImageUpdate>,
) -> Response {
    ok(&ctx, images::update(&state.peers, &ctx, id, update).await)
}

#[utoipa::path(delete, path = "/v1/images/{id}", tag = "images", params(("id" = String, Path)),
    responses((status = 200, description = "Deleted with its session and messages; its agent is stopped", body = ImageDeleted)))]
pub async fn delete_image(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, images::delete(&state.peers, &ctx, id).await)
}

#[utoipa::path(post, path = "/v1/images/{id}/run", tag = "images", params(("id" = String, Path)),
    responses((status = 200, description = "The image's agent, started or found running", body = ImageRun)))]
pub async fn run_image(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, images::run(&state.peers, &ctx, id).await)
}

#[utoipa::path(post, path = "/v1/images/{id}/stop", tag = "images", params(("id" = String, Path)),
    responses((status = 200, description = "Whether an agent was stopped", body = ImageStopped)))]
pub async fn stop_image(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, images::stop(&state.peers, &ctx, id).await)
}

/// Rewinds a conversation: the messages after `afterMessageId` are
/// deleted and the agent's context is rebuilt from the rest; subscribers get
/// `conversation_rewound`. Refused (`TURN_RUNNING`) while a turn runs.
#[utoipa::path(post, path = "/v1/images/{id}/rewind", tag = "images", params(("id" = String, Path)),
    request_body = RewindPoint,
    responses((status = 200, description = "What was removed", body = Rewound)))]
pub async fn rewind_image(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    Body(point): Body<RewindPoint>,
) -> Response {
    ok(
        &ctx,
        images::rewind(&state.peers, &ctx, id, Some(point.after_message_id)).await,
    )
}

/// Clears a conversation: every message is deleted, its record (name,
/// settings, metadata) stays; subscribers get `conversation_rewound`.
/// Refused (`TURN_RUNNING`) while a turn runs.
#[utoipa::path(post, path = "/v1/images/{id}/clear", tag = "images", params(("id" = String, Path)),
    responses((status = 200, description = "What was removed", body = Rewound)))]
pub async fn clear_image(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, images::rewind(&state.peers, &ctx, id, None).await)
}

#[utoipa::path(post, path = "/v1/images/{id}/interrupt", tag = "images", params(("id" = String, Path)),
    responses((status = 200, description = "Whether a turn was interrupted", body = Interrupted)))]
pub async fn interrupt(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(
        &ctx,
        images::interrupt(&state.peers, &ctx, AgentTarget::Image(id)).await,
    )
}

#[utoipa::path(get, path = "/v1/images/{id}/messages", tag = "images", params(("id" = String, Path)),
    responses((status = 200, description = "The history, in stored order", body = MessageList)))]
pub async fn list_messages(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, images::messages(&state.peers, &ctx, id).await)
}

/// Sends a message and streams its turn: first `message_send_response`, then
/// every event of the turn (the WebSocket's events, each with `id: <cursor>`).
#[utoipa::path(post, path = "/v1/images/{id}/messages", tag = "images", params(("id" = String, Path)),
    request_body = NewMessage,
    responses((status = 200, description = "The turn as server-sent events: `message_send_response` (data: MessageAccepted), then the protocol's events",
        content_type = "text/event-stream", body = String)))]
pub async fn send_message(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    Body(message): Body<NewMessage>,
) -> Response {
    if state.auth.verifier().quota_exhausted(&ctx.principal) {
        return error_response(&crate::auth::quota_exceeded(), &ctx.request_id);
    }
    match images::send(&state.peers, &ctx, id, message).await {
        Ok((accepted, events)) => {
            let first = accepted_event(&accepted);
            sse(
                &state,
                futures::stream::once(async { first }).chain(sse_events(events)),
                &ctx,
            )
        }
        Err(err) => error_response(&err, &ctx.request_id),
    }
}

fn accepted_event(accepted: &MessageAccepted) -> Event {
    Event::default()
        .event("message_send_response")
        .data(serde_json::to_string(accepted).unwrap_or_default())
}

/// Where to resume an image's events.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// The last cursor the client saw (or send `Last-Event-ID`).
    pub after: Option<String>,
}

impl EventsQuery {
    /// Where to resume: `after`, else the `Last-Event-ID` header, bounded
    /// like any cursor (`after` already is, as a query parameter).
    pub(crate) fn resume_after(self, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
        if self.after.is_some() {
            return Ok(self.after);
        }
        let Some(header) = headers.get("last-event-id").and_then(|v| v.to_str().ok()) else {
            return Ok(None);
        };
        crate::bounds::check("Last-Event-ID", header, Some(crate::bounds::MAX_ID_BYTES))?;
        Ok(Some(header.to_owned()))
    }
}

/// Streams an image's events after a cursor, then live.
#[utoipa::path(get, path = "/v1/images/{id}/events", tag = "images", params(("id" = String, Path), EventsQuery),
    responses((status = 200, description = "The protocol's events as server-sent events, each with `id: <cursor>`",
        content_type = "text/event-stream", body = String)))]
pub async fn image_events(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(id): Path<String>,
    Query(query): Query<EventsQuery>,
    headers: HeaderMap,
) -> Response {
    let after = match query.resume_after(&headers) {
        Ok(after) => after,
        Err(err) => return error_response(&err, &ctx.request_id),
    };
    match images::events(&state.peers, &ctx, id, after).await {
        Ok(events) => sse(&state, sse_events(events), &ctx),
        Err(err) => error_response(&err, &ctx.request_id),
    }
}

/// Renders events as SSE: each with its type and `id: <cursor>`; a failure
/// as a `system_error` event. The runtime's `message_accepted` marks are the
/// WebSocket's business (its `message_send_response`), not events to relay.
pub(crate) fn sse_events(events: EventStream) -> impl Stream<Item = Event> + Send {
    events.filter_map(|item| {
        futures::future::ready(match item {
            Ok(event) if frames::kind(&event) == Some(EventKind::MessageAccepted) => None,
            Ok(event) => Some(
                Event::default()
                    .id(event.cursor.clone())
                    .event(event.r#type.clone())
                    .data(event_frame(&event)),
            ),
            Err(err) => Some(sse_error(&err)),
        })
    })
}

fn sse_error(err: &ApiError) -> Event {
    Event::default()
        .event(EventKind::SystemError.name())
        .data(system_error_frame(err, None))
}

/// Serves events as SSE until they end, or until the caller's key is
/// revoked (or its user or tenant deleted): then a `system_error` event
/// (`CREDENTIAL_REVOKED`) ends the stream.
pub(crate) fn sse(
    state: &GatewayState,
    events: impl Stream<Item = Event> + Send + 'static,
    ctx: &RequestContext,
) -> Response {
    let auth = state.auth.clone();
    let principal = Arc::clone(&ctx.principal);
    let revoked: BoxFuture<'static, ApiError> = Box::pin(async move { auth.revoked(&principal).await });
    let events = futures::stream::unfold(Some((Box::pin(events), revoked)), |open| async move {
        let (mut events, mut revoked) = open?;
        tokio::select! {
            biased;
            err = &mut revoked => Some((sse_error(&err), None)),
            event = events.next() => event.map(|event| (event, Some((events, revoked)))),
        }
    });
    let stream = events.map(Ok::<_, Infallible>);
    with_request_id(
        Sse::new(stream).keep_alive(KeepAlive::default()).into_response(),
        &ctx.request_id,
    )
}

#[utoipa::path(get, path = "/v1/agents", tag = "agents", params(AgentFilter),
    responses((status = 200, description = "The caller's running agents, oldest first", body = AgentList)))]
pub async fn list_agents(State(state): St, Ctx(ctx): Ctx, Query(filter): Query<AgentFilter>) -> Response {
    ok(&ctx, agents::list(&state.peers, &ctx, filter).await)
}

#[utoipa::path(get, path = "/v1/agents/{id}", tag = "agents", params(("id" = String, Path)),
    responses((status = 200, description = "The agent", body = Agent)))]
pub async fn get_agent(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, agents::get(&state.peers, &ctx, id).await)
}

#[utoipa::path(delete, path = "/v1/agents/{id}", tag = "agents", params(("id" = String, Path)),
    responses((status = 200, description = "Stopped and forgotten", body = AgentDestroyed)))]
pub async fn destroy_agent(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(&ctx, agents::destroy(&state.peers, &ctx, id).await)
}

/// Pauses an agent, named by its image id (or its running agent's id): a
/// running turn is interrupted, and it is not woken until resumed; what
/// reaches it meanwhile stays unread.
#[utoipa::path(post, path = "/v1/agents/{id}/pause", tag = "agents", params(("id" = String, Path)),
    responses((status = 200, description = "Paused", body = AgentLifecycle)))]
pub async fn pause_agent(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(
        &ctx,
        agents::change(&state.peers, &ctx, id, LifecycleAction::Pause).await,
    )
}

/// Resumes a paused agent; it reads what waited.
#[utoipa::path(post, path = "/v1/agents/{id}/resume", tag = "agents", params(("id" = String, Path)),
    responses((status = 200, description = "Resumed", body = AgentLifecycle)))]
pub async fn resume_agent(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(
        &ctx,
        agents::change(&state.peers, &ctx, id, LifecycleAction::Resume).await,
    )
}

/// Terminates an agent and every agent it started: they stop and never run again.
#[utoipa::path(post, path = "/v1/agents/{id}/terminate", tag = "agents", params(("id" = String, Path)),
    responses((status = 200, description = "Terminated, with every agent terminated with it", body = AgentLifecycle)))]
pub async fn terminate_agent(State(state): St, Ctx(ctx): Ctx, Path(id): Path<String>) -> Response {
    ok(
        &ctx,
        agents::change(&state.peers, &ctx, id, LifecycleAction::Terminate).await,
    )
}
