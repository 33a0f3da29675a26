//! REST adapters of groups, their members, messages and read cursors.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header::ACCEPT;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;

use crate::api::groups::{
    self, Group, GroupDeleted, GroupList, GroupMessage, GroupMessageList, GroupPageQuery, GroupUpdate, Member,
    MemberList, MemberRef, MemberRemoved, MessageQuery, NewGroup, NewGroupMessage, ReadMark, UnreadList, UnreadQuery,
};
use crate::http::{Body, Ctx, Path, Query, error_response, ok, reply};
use crate::rest::conversations::{EventsQuery, sse, sse_events};
use crate::state::GatewayState;

type St = State<Arc<GatewayState>>;

/// Creates a group; the caller joins it as a user member.
#[utoipa::path(post, path = "/v1/containers/{id}/groups", tag = "groups",
    params(("id" = String, Path)), request_body = NewGroup,
    responses((status = 201, description = "Created, with the caller and the named members", body = Group)))]
pub async fn create_group(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(container_id): Path<String>,
    Body(request): Body<NewGroup>,
) -> Response {
    reply(
        &ctx,
        StatusCode::CREATED,
        groups::create(&state.peers, &ctx, container_id, request).await,
    )
}

#[utoipa::path(get, path = "/v1/containers/{id}/groups", tag = "groups",
    params(("id" = String, Path), GroupPageQuery),
    responses((status = 200, description = "A page of the container's groups, newest first", body = GroupList)))]
pub async fn list_groups(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(container_id): Path<String>,
    Query(page): Query<GroupPageQuery>,
) -> Response {
    ok(&ctx, groups::list(&state.peers, &ctx, container_id, page).await)
}

#[utoipa::path(get, path = "/v1/groups/{id}", tag = "groups", params(("id" = String, Path)),
    responses((status = 200, description = "The group", body = Group)))]
pub async fn get_group(State(state): St, Ctx(ctx): Ctx, Path(group_id): Path<String>) -> Response {
    ok(&ctx, groups::get(&state.peers, &ctx, group_id).await)
}

#[utoipa::path(patch, path = "/v1/groups/{id}", tag = "groups", params(("id" = String, Path)),
    request_body = GroupUpdate, responses((status = 200, description = "The changed group", body = Group)))]
pub async fn update_group(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(group_id): Path<String>,
    Body(update): Body<GroupUpdate>,
) -> Response {
    ok(&ctx, groups::update(&state.peers, &ctx, group_id, update).await)
}

#[utoipa::path(delete, path = "/v1/groups/{id}", tag = "groups", params(("id" = String, Path)),
    responses((status = 200, description = "Deleted with its members and messages", body = GroupDeleted)))]
pub async fn delete_group(State(state): St, Ctx(ctx): Ctx, Path(group_id): Path<String>) -> Response {
    ok(&ctx, groups::delete(&state.peers, &ctx, group_id).await)
}

#[utoipa::path(post, path = "/v1/groups/{id}/members", tag = "groups", params(("id" = String, Path)),
    request_body = MemberRef, responses((status = 201, description = "Added, with nothing read yet", body = Member)))]
pub async fn add_group_member(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(group_id): Path<String>,
    Body(member): Body<MemberRef>,
) -> Response {
    reply(
        &ctx,
        StatusCode::CREATED,
        groups::add_member(&state.peers, &ctx, group_id, member).await,
    )
}

#[utoipa::path(get, path = "/v1/groups/{id}/members", tag = "groups", params(("id" = String, Path)),
    responses((status = 200, description = "The members in the order they joined, with their read cursors", body = MemberList)))]
pub async fn list_group_members(State(state): St, Ctx(ctx): Ctx, Path(group_id): Path<String>) -> Response {
    ok(&ctx, groups::members(&state.peers, &ctx, group_id).await)
}

#[utoipa::path(delete, path = "/v1/groups/{id}/members/{memberId}", tag = "groups",
    params(("id" = String, Path), ("memberId" = String, Path)),
    responses((status = 200, description = "Removed; what it posted stays", body = MemberRemoved)))]
pub async fn remove_group_member(
    State(state): St,
    Ctx(ctx): Ctx,
    Path((group_id, member_id)): Path<(String, String)>,
) -> Response {
    ok(
        &ctx,
        groups::remove_member(&state.peers, &ctx, group_id, member_id).await,
    )
}

/// Lists a group's messages; with `Accept: text/event-stream`, streams them
/// and then, live, every message posted and every member agent's events.
#[utoipa::path(get, path = "/v1/groups/{id}/messages", tag = "groups",
    params(("id" = String, Path), MessageQuery),
    responses((status = 200, description = "Messages after `after`, oldest first; as server-sent events (`Accept: text/event-stream`): \
        each stored message after `after` as a `group_message` event, then live `group_message` events and every member agent's \
        events (their context names the agent and, as `sessionId`, the group), each with `id: <cursor>`",
        body = GroupMessageList)))]
pub async fn list_group_messages(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(group_id): Path<String>,
    Query(query): Query<MessageQuery>,
    headers: HeaderMap,
) -> Response {
    let streamed = headers
        .get(ACCEPT)
        .and_then(|accept| accept.to_str().ok())
        .is_some_and(|accept| accept.contains("text/event-stream"));
    if !streamed {
        return ok(&ctx, groups::messages(&state.peers, &ctx, group_id, query).await);
    }
    let history = Some(query.after.unwrap_or(0));
    match groups::events(&state.peers, &ctx, group_id, None, history).await {
        Ok(events) => sse(&state, sse_events(events), &ctx),
        Err(err) => error_response(&err, &ctx.request_id),
    }
}

/// Streams a group's events after a cursor, then live.
#[utoipa::path(get, path = "/v1/groups/{id}/events", tag = "groups", params(("id" = String, Path), EventsQuery),
    responses((status = 200, description = "`group_message` events and every member agent's events as server-sent events, \
        each with `id: <cursor>`", content_type = "text/event-stream", body = String)))]
pub async fn group_events(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(group_id): Path<String>,
    Query(query): Query<EventsQuery>,
    headers: HeaderMap,
) -> Response {
    let after = match query.resume_after(&headers) {
        Ok(after) => after,
        Err(err) => return error_response(&err, &ctx.request_id),
    };
    match groups::events(&state.peers, &ctx, group_id, after, None).await {
        Ok(events) => sse(&state, sse_events(events), &ctx),
        Err(err) => error_response(&err, &ctx.request_id),
    }
}

/// Posts a message as the caller, who must be a user member.
#[utoipa::path(post, path = "/v1/groups/{id}/messages", tag = "groups", params(("id" = String, Path)),
    request_body = NewGroupMessage,
    responses((status = 201, description = "Posted", body = GroupMessage),
              (status = 200, description = "A re-post of a `messageId` the group holds: the stored message", body = GroupMessage)))]
pub async fn post_group_message(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(group_id): Path<String>,
    Body(message): Body<NewGroupMessage>,
) -> Response {
    match groups::post(&state.peers, &ctx, group_id, message).await {
        Ok((message, created)) => {
            let status = if created { StatusCode::CREATED } else { StatusCode::OK };
            reply(&ctx, status, Ok(message))
        }
        Err(err) => error_response(&err, &ctx.request_id),
    }
}

/// Moves the caller's read cursor forward.
#[utoipa::path(post, path = "/v1/groups/{id}/read", tag = "groups", params(("id" = String, Path)),
    request_body = ReadMark,
    responses((status = 200, description = "The caller as a member, with its cursor", body = Member)))]
pub async fn mark_group_read(
    State(state): St,
    Ctx(ctx): Ctx,
    Path(group_id): Path<String>,
    Body(mark): Body<ReadMark>,
) -> Response {
    ok(&ctx, groups::mark_read(&state.peers, &ctx, group_id, mark).await)
}

/// The caller's groups with unread messages, across containers.
#[utoipa::path(get, path = "/v1/groups/unread", tag = "groups", params(UnreadQuery),
    responses((status = 200, description = "The groups in which the caller has unread messages", body = UnreadList)))]
pub async fn list_unread_groups(State(state): St, Ctx(ctx): Ctx, Query(query): Query<UnreadQuery>) -> Response {
    ok(&ctx, groups::unread(&state.peers, &ctx, query).await)
}
