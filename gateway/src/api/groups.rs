//! Groups: conversations of several agents and users inside one container,
//! their members, their messages and each member's read cursor.
//!
//! The caller takes part as a user member: the creator of a group joins it
//! on creation, posts as themself (posting as an agent is the runtime's, not
//! the public API's) and reads with their own cursor.

use avm_common::auth::Role;
use avm_common::event::{Event, EventKind, data};
use avm_common::{ApiError, RequestContext};
use avm_proto::runtime::v1 as rt;
use avm_proto::session::v1 as ss;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::images::EventStream;
use super::{missing, require_tenant_user};
use crate::frames;
use crate::peers::Peers;

/// Which agent members a group message wakes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum WakeMode {
    /// Every agent member, by every message.
    All,
    /// Only the agents a message mentions.
    Mentions,
}

impl WakeMode {
    fn pb(self) -> ss::GroupWakeMode {
        match self {
            WakeMode::All => ss::GroupWakeMode::All,
            WakeMode::Mentions => ss::GroupWakeMode::Mentions,
        }
    }

    fn from_pb(value: i32) -> Self {
        match ss::GroupWakeMode::try_from(value) {
            Ok(ss::GroupWakeMode::Mentions) => WakeMode::Mentions,
            _ => WakeMode::All,
        }
    }
}

/// What a group member is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum MemberKind {
    /// An agent: an image of the group's container; its member id is the image id.
    Agent,
    /// A user of the tenant; its member id is the user id.
    User,
}

impl MemberKind {
    fn pb(self) -> ss::GroupMemberKind {
        match self {
            MemberKind::Agent => ss::GroupMemberKind::Agent,
            MemberKind::User => ss::GroupMemberKind::User,
        }
    }

    fn from_pb(value: i32) -> Self {
        match ss::GroupMemberKind::try_from(value) {
            Ok(ss::GroupMemberKind::User) => MemberKind::User,
            _ => MemberKind::Agent,
        }
    }
}

/// Names a group member, or a message's sender.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "camelCase", expecting = "an object", deny_unknown_fields)]
pub struct MemberRef {
    pub kind: MemberKind,
    /// The image id of an agent, the user id of a user.
    pub member_id: String,
}

impl MemberRef {
    fn pb(&self) -> ss::GroupMemberRef {
        ss::GroupMemberRef {
            kind: self.kind.pb().into(),
            member_id: self.member_id.clone(),
        }
    }

    fn user(user_id: &str) -> Self {
        Self {
            kind: MemberKind::User,
            member_id: user_id.to_owned(),
        }
    }
}

impl From<ss::GroupMemberRef> for MemberRef {
    fn from(member: ss::GroupMemberRef) -> Self {
        Self {
            kind: MemberKind::from_pb(member.kind),
            member_id: member.member_id,
        }
    }
}

/// A new group (the body of `POST /v1/containers/{id}/groups`).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", expecting = "an object", deny_unknown_fields)]
pub struct NewGroup {
    /// 1 to 256 characters.
    pub name: String,
    /// Defaults to `all`.
    #[serde(default)]
    pub wake_mode: Option<WakeMode>,
    /// The members it starts with (at most 64, the creator included): agents
    /// (images of the container) and users. The creator joins as a user
    /// member whether named or not.
    #[serde(default)]
    pub members: Vec<MemberRef>,
}

/// The changes to a group; absent fields stay as they are.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", default, expecting = "an object", deny_unknown_fields)]
pub struct GroupUpdate {
    /// 1 to 256 characters.
    pub name: Option<String>,
    pub wake_mode: Option<WakeMode>,
}

/// A group.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Group {
    /// `grp_…`.
    pub group_id: String,
    pub container_id: String,
    pub name: String,
    pub wake_mode: WakeMode,
    /// The seq of the newest message; 0 when there is none.
    pub last_seq: u64,
    /// Messages since the last one a user posted.
    pub consecutive_agent_messages: u64,
    /// Unix milliseconds.
    pub created_at: i64,
    /// Unix milliseconds.
    pub updated_at: i64,
}

impl From<ss::Group> for Group {
    fn from(group: ss::Group) -> Self {
        Self {
            wake_mode: WakeMode::from_pb(group.wake_mode),
            group_id: group.group_id,
            container_id: group.container_id,
            name: group.name,
            last_seq: group.last_seq,
            consecutive_agent_messages: group.consecutive_agent_messages,
            created_at: group.created_at_ms,
            updated_at: group.updated_at_ms,
        }
    }
}

/// Which page of a container's groups.
#[derive(Debug, Default, Deserialize, IntoParams, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct GroupPageQuery {
    /// Most groups to return: default 50, at most 500.
    pub page_size: Option<u32>,
    /// The `nextPageToken` of the previous page.
    pub page_token: Option<String>,
}

/// A page of a container's groups, newest first.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct GroupList {
    pub groups: Vec<Group>,
    /// Present when another page follows.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

/// What deleting a group answers.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct GroupDeleted {
    pub group_id: String,
    pub deleted: bool,
}

/// A member of a group and how far it has read.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Member {
    pub group_id: String,
    pub kind: MemberKind,
    pub member_id: String,
    /// Unix milliseconds.
    pub joined_at: i64,
    /// The seq of the last message it read; 0 when none.
    pub read_seq: u64,
}

impl Member {
    fn new(member: ss::GroupMember) -> Result<Self, ApiError> {
        let who = MemberRef::from(member.member.ok_or_else(|| missing("member"))?);
        Ok(Self {
            group_id: member.group_id,
            kind: who.kind,
            member_id: who.member_id,
            joined_at: member.joined_at_ms,
            read_seq: member.read_seq,
        })
    }
}

/// A group's members in the order they joined.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemberList {
    pub group_id: String,
    pub members: Vec<Member>,
}

/// What removing a member answers.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemberRemoved {
    pub group_id: String,
    pub member_id: String,
    pub removed: bool,
}

/// A message of a group.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct GroupMessage {
    pub group_id: String,
    /// The poster's idempotency key, or `gmsg_…`.
    pub message_id: String,
    /// Position in the group, from 1, without gaps.
    pub seq: u64,
    pub sender: MemberRef,
    pub content: String,
    /// The member ids it mentions.
    pub mentions: Vec<String>,
    /// Unix milliseconds.
    pub created_at: i64,
}

impl GroupMessage {
    fn new(message: ss::GroupMessage) -> Result<Self, ApiError> {
        Ok(Self {
            sender: message.sender.ok_or_else(|| missing("sender"))?.into(),
            group_id: message.group_id,
            message_id: message.message_id,
            seq: message.seq,
            content: message.content,
            mentions: message.mentions,
            created_at: message.created_at_ms,
        })
    }
}

/// A message the caller posts into a group, as themself.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", expecting = "an object", deny_unknown_fields)]
pub struct NewGroupMessage {
    /// Text, not blank.
    pub content: String,
    /// Member ids to mention (each a member); in a `mentions` group only these agents wake.
    #[serde(default)]
    pub mentions: Vec<String>,
    /// The caller's idempotency key (1 to 128 letters, digits and `. _ : @ -`):
    /// posting an id the group holds answers the stored message.
    #[serde(default)]
    pub message_id: Option<String>,
}

/// Where to read a group's messages.
#[derive(Debug, Default, Deserialize, IntoParams, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct MessageQuery {
    /// Messages with a greater seq; default 0, from the first.
    pub after: Option<u64>,
    /// Most messages: default 100, at most 1000.
    pub limit: Option<u32>,
}

/// Messages of a group, oldest first.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct GroupMessageList {
    pub group_id: String,
    pub messages: Vec<GroupMessage>,
}

/// How far the caller has read (the body of `POST /v1/groups/{groupId}/read`).
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(rename_all = "camelCase", default, expecting = "an object", deny_unknown_fields)]
pub struct ReadMark {
    /// The seq of the last message read; absent means the newest. A cursor
    /// never moves back nor past the newest message.
    pub seq: Option<u64>,
}

/// How many unread messages to return with the caller's unread groups.
#[derive(Debug, Default, Deserialize, IntoParams, ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct UnreadQuery {
    /// Unread messages per group, oldest first: default 0 (counts only), at most 1000.
    pub message_limit: Option<u32>,
}

/// A group in which the caller has unread messages.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct UnreadGroup {
    pub group: Group,
    /// The caller's read cursor.
    pub read_seq: u64,
    /// How many messages follow it.
    pub unread_count: u64,
    /// The first unread messages, as many as `messageLimit`.
    pub messages: Vec<GroupMessage>,
}

/// The caller's groups with unread messages.
#[derive(Debug, Serialize, ToSchema)]
pub struct UnreadList {
    pub groups: Vec<UnreadGroup>,
}

/// Returns the caller as a group member, when the caller is a user.
fn caller(ctx: &RequestContext) -> Option<MemberRef> {
    (ctx.principal.role != Role::Service).then(|| MemberRef::user(&ctx.principal.user_id))
}

/// Returns the caller as a user member, or why a service cannot act as one.
fn caller_member(ctx: &RequestContext) -> Result<MemberRef, ApiError> {
    caller(ctx).ok_or_else(|| ApiError::invalid("USER_REQUIRED", "only a user takes part in groups through this API"))
}

/// Creates a group in a container; the creator is its first user member.
pub async fn create(
    peers: &Peers,
    ctx: &RequestContext,
    container_id: String,
    request: NewGroup,
) -> Result<Group, ApiError> {
    let mut members: Vec<ss::GroupMemberRef> = Vec::with_capacity(request.members.len() + 1);
    if let Some(me) = caller(ctx)
        && !request.members.contains(&me)
    {
        members.push(me.pb());
    }
    if request.members.iter().any(|member| member.kind == MemberKind::User) {
        // A container the caller may not see answers first, as everywhere.
        super::containers::get(peers, ctx, container_id.clone()).await?;
        for member in &request.members {
            check_user_member(peers, ctx, member).await?;
        }
    }
    members.extend(request.members.iter().map(MemberRef::pb));
    let call = ctx.request(ss::CreateGroupRequest {
        container_id,
        name: request.name,
        wake_mode: request
            .wake_mode
            .map_or(ss::GroupWakeMode::Unspecified, WakeMode::pb)
            .into(),
        members,
    });
    let response = peers.session.create_group(call).await?.into_inner();
    Ok(response.group.ok_or_else(|| missing("group"))?.into())
}

/// Returns a group.
pub async fn get(peers: &Peers, ctx: &RequestContext, group_id: String) -> Result<Group, ApiError> {
    let call = ctx.request(ss::GetGroupRequest { group_id });
    let response = peers.session.get_group(call).await?.into_inner();
    Ok(response.group.ok_or_else(|| missing("group"))?.into())
}

/// Lists a page of a container's groups, newest first.
pub async fn list(
    peers: &Peers,
    ctx: &RequestContext,
    container_id: String,
    page: GroupPageQuery,
) -> Result<GroupList, ApiError> {
    let call = ctx.request(ss::ListGroupsRequest {
        container_id,
        page_size: page.page_size.unwrap_or(0),
        page_token: page.page_token.unwrap_or_default(),
    });
    let response = peers.session.list_groups(call).await?.into_inner();
    Ok(GroupList {
        groups: response.groups.into_iter().map(Group::from).collect(),
        next_page_token: Some(response.next_page_token).filter(|token| !token.is_empty()),
    })
}

/// Changes a group's name or wake mode.
pub async fn update(
    peers: &Peers,
    ctx: &RequestContext,
    group_id: String,
    update: GroupUpdate,
) -> Result<Group, ApiError> {
    let call = ctx.request(ss::UpdateGroupRequest {
        group_id,
        name: update.name,
        wake_mode: update.wake_mode.map(|mode| mode.pb().into()),
    });
    let response = peers.session.update_group(call).await?.into_inner();
    Ok(response.group.ok_or_else(|| missing("group"))?.into())
}

/// Deletes a group with its members and messages.
pub async fn delete(peers: &Peers, ctx: &RequestContext, group_id: String) -> Result<GroupDeleted, ApiError> {
    let call = ctx.request(ss::DeleteGroupRequest {
        group_id: group_id.clone(),
    });
    peers.session.delete_group(call).await?;
    Ok(GroupDeleted {
        group_id,
        deleted: true,
    })
}

/// Fails unless a user member is a user of the caller's tenant whom the
/// caller may see (an admin any of the tenant's users, a member themself):
/// others answer like a user that does not exist.
async fn check_user_member(peers: &Peers, ctx: &RequestContext, member: &MemberRef) -> Result<(), ApiError> {
    if member.kind != MemberKind::User || member.member_id == ctx.principal.user_id {
        return Ok(());
    }
    require_tenant_user(peers, ctx, &member.member_id).await
}

/// Adds an agent or a user (of the caller's tenant) to a group.
pub async fn add_member(
    peers: &Peers,
    ctx: &RequestContext,
    group_id: String,
    member: MemberRef,
) -> Result<Member, ApiError> {
    if member.kind == MemberKind::User {
        // A group the caller may not see answers first, as everywhere.
        get(peers, ctx, group_id.clone()).await?;
        check_user_member(peers, ctx, &member).await?;
    }
    let call = ctx.request(ss::AddGroupMemberRequest {
        group_id,
        member: Some(member.pb()),
    });
    let response = peers.session.add_group_member(call).await?.into_inner();
    Member::new(response.member.ok_or_else(|| missing("member"))?)
}

/// Removes a member, named by its id alone (ids are unique within a group);
/// what it posted stays.
pub async fn remove_member(
    peers: &Peers,
    ctx: &RequestContext,
    group_id: String,
    member_id: String,
) -> Result<MemberRemoved, ApiError> {
    let members = members(peers, ctx, group_id.clone()).await?.members;
    let Some(member) = members.into_iter().find(|member| member.member_id == member_id) else {
        return Err(ApiError::not_found(
            "GROUP_MEMBER_NOT_FOUND",
            format!("{member_id} is not a member of group {group_id}"),
        ));
    };
    let call = ctx.request(ss::RemoveGroupMemberRequest {
        group_id: group_id.clone(),
        member: Some(ss::GroupMemberRef {
            kind: member.kind.pb().into(),
            member_id: member.member_id,
        }),
    });
    peers.session.remove_group_member(call).await?;
    Ok(MemberRemoved {
        group_id,
        member_id,
        removed: true,
    })
}

/// Lists a group's members in the order they joined, with their read cursors.
pub async fn members(peers: &Peers, ctx: &RequestContext, group_id: String) -> Result<MemberList, ApiError> {
    let call = ctx.request(ss::ListGroupMembersRequest {
        group_id: group_id.clone(),
    });
    let response = peers.session.list_group_members(call).await?.into_inner();
    Ok(MemberList {
        group_id,
        members: response
            .members
            .into_iter()
            .map(Member::new)
            .collect::<Result<_, _>>()?,
    })
}

/// Posts a message into a group as the caller; `true` when it is new (not
/// a re-post of a message id the group holds).
///
/// The session service moves the caller's read cursor to the message (they
/// read what they answer) and announces it; the runtimes wake the agents it
/// concerns.
pub async fn post(
    peers: &Peers,
    ctx: &RequestContext,
    group_id: String,
    message: NewGroupMessage,
) -> Result<(GroupMessage, bool), ApiError> {
    let call = ctx.request(ss::PostGroupMessageRequest {
        group_id,
        message_id: message.message_id.unwrap_or_default(),
        sender: Some(caller_member(ctx)?.pb()),
        content: message.content,
        mentions: message.mentions,
        read_seq: None,
    });
    let response = peers.session.post_group_message(call).await?.into_inner();
    let stored = GroupMessage::new(response.message.ok_or_else(|| missing("message"))?)?;
    Ok((stored, response.created))
}

/// Returns a group's messages after a seq, oldest first.
pub async fn messages(
    peers: &Peers,
    ctx: &RequestContext,
    group_id: String,
    query: MessageQuery,
) -> Result<GroupMessageList, ApiError> {
    let call = ctx.request(ss::ListGroupMessagesRequest {
        group_id: group_id.clone(),
        after_seq: query.after.unwrap_or(0),
        limit: query.limit.unwrap_or(0),
    });
    let response = peers.session.list_group_messages(call).await?.into_inner();
    Ok(GroupMessageList {
        group_id,
        messages: response
            .messages
            .into_iter()
            .map(GroupMessage::new)
            .collect::<Result<_, _>>()?,
    })
}

/// Moves the caller's read cursor in a group forward.
pub async fn mark_read(
    peers: &Peers,
    ctx: &RequestContext,
    group_id: String,
    mark: ReadMark,
) -> Result<Member, ApiError> {
    let call = ctx.request(ss::AdvanceReadCursorRequest {
        group_id,
        member: Some(caller_member(ctx)?.pb()),
        // The service never moves a cursor past the newest message.
        seq: mark.seq.unwrap_or(u64::MAX),
    });
    let response = peers.session.advance_read_cursor(call).await?.into_inner();
    Member::new(response.member.ok_or_else(|| missing("member"))?)
}

/// Returns the caller's groups with unread messages, with counts and the
/// first unread messages.
pub async fn unread(peers: &Peers, ctx: &RequestContext, query: UnreadQuery) -> Result<UnreadList, ApiError> {
    let call = ctx.request(ss::ListUnreadRequest {
        member: Some(caller_member(ctx)?.pb()),
        message_limit: query.message_limit.unwrap_or(0),
    });
    let response = peers.session.list_unread(call).await?.into_inner();
    let groups = response
        .groups
        .into_iter()
        .map(|unread| {
            Ok(UnreadGroup {
                group: unread.group.ok_or_else(|| missing("group"))?.into(),
                read_seq: unread.read_seq,
                unread_count: unread.unread_count,
                messages: unread
                    .messages
                    .into_iter()
                    .map(GroupMessage::new)
                    .collect::<Result<_, _>>()?,
            })
        })
        .collect::<Result<_, ApiError>>()?;
    Ok(UnreadList { groups })
}

/// Follows a group's events: each message posted (`group_message`) and the
/// events of every member agent's turns, live after `after_cursor`. With
/// `history`, the stored messages after that seq come first, as
/// `group_message` events without a cursor; a message both hold shows once.
pub async fn events(
    peers: &Peers,
    ctx: &RequestContext,
    group_id: String,
    after_cursor: Option<String>,
    history: Option<u64>,
) -> Result<EventStream, ApiError> {
    let request = ctx.request(rt::SubscribeGroupEventsRequest {
        group_id: group_id.clone(),
        after_cursor,
    });
    // Subscribed before the history is read: nothing posted between is missed.
    let live = peers.runtime.subscribe_group_events(request).await?.into_inner();
    let live = futures::StreamExt::filter_map(live, |item| {
        futures::future::ready(match item {
            Ok(response) => response.event.map(Ok),
            Err(status) => Some(Err(ApiError::from_status(&status))),
        })
    });
    let group = get(peers, ctx, group_id.clone()).await?;
    let order = InOrder {
        peers: peers.clone(),
        ctx: ctx.clone(),
        container_id: group.container_id.clone(),
        group_id: group_id.clone(),
    };
    let Some(after_seq) = history else {
        return Ok(order.apply(live, None));
    };
    let stored = order.stored(after_seq, 1000).await?;
    let shown = stored.last().map_or(after_seq, |message| message.seq);
    let stored: Vec<Result<rt::Event, ApiError>> = stored.iter().map(|message| Ok(order.event(message))).collect();
    Ok(Box::pin(futures::StreamExt::chain(
        futures::stream::iter(stored),
        order.apply(live, Some(shown)),
    )))
}

/// Passes each group message once and in seq order. With replicas, each
/// runtime publishes the messages it knows of in order, but two runtimes'
/// publications may cross (one's seq 3 before the other's seq 2): a message
/// past the next one expected is preceded by those it skipped, read from
/// the group's history, and a message already passed is dropped.
struct InOrder {
    peers: Peers,
    ctx: RequestContext,
    container_id: String,
    group_id: String,
}

impl InOrder {
    /// Orders `live`'s messages after `shown` (after the first one seen when `None`).
    fn apply(
        self,
        live: impl futures::Stream<Item = Result<rt::Event, ApiError>> + Send + 'static,
        shown: Option<u64>,
    ) -> EventStream {
        let this = std::sync::Arc::new(self);
        let shown = std::sync::Arc::new(std::sync::Mutex::new(shown));
        let ordered = futures::StreamExt::then(live, move |item| {
            let (this, shown) = (std::sync::Arc::clone(&this), std::sync::Arc::clone(&shown));
            async move {
                // Ordered by seq; an event without one (of a runtime older
                // than the field) goes as it came.
                let event = match item {
                    Ok(event) if frames::kind(&event) == Some(EventKind::GroupMessage) && event.group_seq > 0 => event,
                    other => return vec![other],
                };
                let seq = event.group_seq;
                let last = *shown.lock().unwrap_or_else(|poison| poison.into_inner());
                let mut out = Vec::new();
                match last {
                    Some(last) if seq <= last => return out,
                    Some(last) if seq > last + 1 => out.extend(this.skipped(last, seq).await),
                    _ => {}
                }
                *shown.lock().unwrap_or_else(|poison| poison.into_inner()) = Some(seq);
                out.push(Ok(event));
                out
            }
        });
        Box::pin(futures::StreamExt::flat_map(ordered, futures::stream::iter))
    }

    /// The messages after `last` and before `seq`, from the group's history.
    async fn skipped(&self, last: u64, seq: u64) -> Vec<Result<rt::Event, ApiError>> {
        let limit = u32::try_from(seq - last - 1).unwrap_or(u32::MAX).min(1000);
        match self.stored(last, limit).await {
            Ok(stored) => stored
                .iter()
                .filter(|message| message.seq < seq)
                .map(|message| Ok(self.event(message)))
                .collect(),
            Err(err) => vec![Err(err)],
        }
    }

    /// Up to `limit` stored messages after `after_seq`, oldest first.
    async fn stored(&self, after_seq: u64, limit: u32) -> Result<Vec<ss::GroupMessage>, ApiError> {
        let call = self.ctx.request(ss::ListGroupMessagesRequest {
            group_id: self.group_id.clone(),
            after_seq,
            limit,
        });
        Ok(self
            .peers
            .session
            .list_group_messages(call)
            .await?
            .into_inner()
            .messages)
    }

    /// A stored message as the `group_message` event the runtime publishes
    /// for it (without a cursor).
    fn event(&self, message: &ss::GroupMessage) -> rt::Event {
        let event = Event::GroupMessage(data::GroupMessage::from(message));
        rt::Event {
            r#type: event.kind().name().to_owned(),
            cursor: String::new(),
            timestamp_ms: message.created_at_ms,
            context: Some(rt::EventContext {
                container_id: self.container_id.clone(),
                image_id: match message.sender.as_ref() {
                    Some(sender) if sender.kind() == ss::GroupMemberKind::Agent => sender.member_id.clone(),
                    _ => String::new(),
                },
                agent_id: String::new(),
                session_id: self.group_id.clone(),
            }),
            group_seq: message.seq,
            data_json: event.data_json(),
            request_id: String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_kinds_are_named_as_events_and_prompts_name_them() {
        for kind in [ss::GroupMemberKind::Agent, ss::GroupMemberKind::User] {
            let public = serde_json::to_value(MemberKind::from_pb(kind as i32)).unwrap();
            assert_eq!(public, avm_common::event::member_kind_name(kind));
            assert_eq!(MemberKind::from_pb(kind as i32).pb(), kind);
        }
    }
}
