//! Groups as the runtime reads and writes them: who is in a group, what its
//! agents have not read, their replies and read cursors.

use avm_common::RequestContext;
use avm_common::event::{GroupSender, data};
use avm_proto::session::v1 as pb;

use super::Sessions;
use crate::error::RuntimeError;

/// A group member or a message's sender: an agent (its image id) or a user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub agent: bool,
    pub member_id: String,
}

impl Member {
    /// The agent member of an image.
    pub fn agent(image_id: &str) -> Self {
        Self {
            agent: true,
            member_id: image_id.to_owned(),
        }
    }

    fn kind(&self) -> &'static str {
        if self.agent { "agent" } else { "user" }
    }

    fn pb(&self) -> pb::GroupMemberRef {
        pb::GroupMemberRef {
            kind: if self.agent {
                pb::GroupMemberKind::Agent
            } else {
                pb::GroupMemberKind::User
            } as i32,
            member_id: self.member_id.clone(),
        }
    }

    fn of(member: Option<pb::GroupMemberRef>) -> Self {
        let member = member.unwrap_or_default();
        Self {
            agent: member.kind != pb::GroupMemberKind::User as i32,
            member_id: member.member_id,
        }
    }
}

/// What the runtime needs of a group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupInfo {
    pub group_id: String,
    pub container_id: String,
    pub name: String,
    /// Whether a message wakes only the agents it mentions (else every agent).
    pub wake_on_mention: bool,
}

impl GroupInfo {
    fn of(group: pb::Group) -> Self {
        Self {
            wake_on_mention: group.wake_mode == pb::GroupWakeMode::Mentions as i32,
            group_id: group.group_id,
            container_id: group.container_id,
            name: group.name,
        }
    }
}

/// A message an agent posts into a group.
pub struct AgentPost<'a> {
    /// Named after what it answers, so a redelivered wake posts nothing twice.
    pub message_id: String,
    pub sender: &'a Member,
    pub content: &'a str,
    pub mentions: Vec<String>,
    /// The last message the agent read before writing this one.
    pub read_seq: u64,
}

/// One message of a group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupPost {
    pub group_id: String,
    pub message_id: String,
    pub seq: u64,
    pub sender: Member,
    pub content: String,
    pub mentions: Vec<String>,
    /// The group's run of agent messages including this one; 0 for a user's.
    pub consecutive_agent_messages: u64,
    pub created_at_ms: i64,
}

impl GroupPost {
    fn of(message: pb::GroupMessage) -> Self {
        Self {
            sender: Member::of(message.sender),
            group_id: message.group_id,
            message_id: message.message_id,
            seq: message.seq,
            content: message.content,
            mentions: message.mentions,
            consecutive_agent_messages: message.consecutive_agent_messages,
            created_at_ms: message.created_at_ms,
        }
    }

    /// The `group_message` event that shows the message.
    pub fn event(&self) -> data::GroupMessage {
        data::GroupMessage {
            group_id: self.group_id.clone(),
            message_id: self.message_id.clone(),
            seq: self.seq,
            sender: GroupSender {
                kind: self.sender.kind().to_owned(),
                member_id: self.sender.member_id.clone(),
            },
            content: self.content.clone(),
            mentions: self.mentions.clone(),
            created_at: self.created_at_ms,
        }
    }
}

/// A group in which a member has unread messages.
#[derive(Clone, Debug)]
pub struct UnreadGroup {
    pub group: GroupInfo,
    pub read_seq: u64,
    pub unread_count: u64,
    /// The first unread messages, oldest first.
    pub messages: Vec<GroupPost>,
}

impl Sessions {
    /// Returns a group the caller may see.
    pub async fn get_group(&self, ctx: &RequestContext, group_id: &str) -> Result<GroupInfo, RuntimeError> {
        let request = ctx.request(pb::GetGroupRequest {
            group_id: group_id.to_owned(),
        });
        let group = self.service.get_group(request).await?.into_inner().group;
        Ok(GroupInfo::of(group.unwrap_or_default()))
    }

    /// Returns a group's members in the order they joined.
    pub async fn group_members(&self, ctx: &RequestContext, group_id: &str) -> Result<Vec<Member>, RuntimeError> {
        let request = ctx.request(pb::ListGroupMembersRequest {
            group_id: group_id.to_owned(),
        });
        let members = self.service.list_group_members(request).await?.into_inner().members;
        Ok(members.into_iter().map(|member| Member::of(member.member)).collect())
    }

    /// Returns one message of a group, by seq.
    pub async fn group_message(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        seq: u64,
    ) -> Result<Option<GroupPost>, RuntimeError> {
        let messages = self.group_messages(ctx, group_id, seq.saturating_sub(1), 1).await?;
        Ok(messages.into_iter().find(|message| message.seq == seq))
    }

    /// Returns up to `limit` messages of a group after `after_seq`, oldest first.
    pub async fn group_messages(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<GroupPost>, RuntimeError> {
        let request = ctx.request(pb::ListGroupMessagesRequest {
            group_id: group_id.to_owned(),
            after_seq,
            limit,
        });
        let messages = self.service.list_group_messages(request).await?.into_inner().messages;
        Ok(messages.into_iter().map(GroupPost::of).collect())
    }

    /// Returns the groups in which `member` has unread messages, with up to
    /// `limit` of them each, oldest first.
    pub async fn unread(
        &self,
        ctx: &RequestContext,
        member: &Member,
        limit: u32,
    ) -> Result<Vec<UnreadGroup>, RuntimeError> {
        let request = ctx.request(pb::ListUnreadRequest {
            member: Some(member.pb()),
            message_limit: limit,
        });
        let groups = self.service.list_unread(request).await?.into_inner().groups;
        Ok(groups
            .into_iter()
            .map(|unread| UnreadGroup {
                group: GroupInfo::of(unread.group.unwrap_or_default()),
                read_seq: unread.read_seq,
                unread_count: unread.unread_count,
                messages: unread.messages.into_iter().map(GroupPost::of).collect(),
            })
            .collect())
    }

    /// Posts an agent's message; idempotent on its id. The sender's cursor
    /// moves to what it read (and past its message when nothing lies
    /// between), and the session service announces the message to the
    /// runtimes. Returns the stored message and whether this call stored it.
    pub async fn post_group_message(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        post: AgentPost<'_>,
    ) -> Result<(GroupPost, bool), RuntimeError> {
        let request = ctx.request(pb::PostGroupMessageRequest {
            group_id: group_id.to_owned(),
            message_id: post.message_id,
            sender: Some(post.sender.pb()),
            content: post.content.to_owned(),
            mentions: post.mentions,
            read_seq: Some(post.read_seq),
        });
        let posted = self.service.post_group_message(request).await?.into_inner();
        Ok((GroupPost::of(posted.message.unwrap_or_default()), posted.created))
    }

    /// Makes a group in a container with `members`; returns its id.
    pub async fn create_group(
        &self,
        ctx: &RequestContext,
        container_id: &str,
        name: &str,
        members: &[Member],
    ) -> Result<String, RuntimeError> {
        let request = ctx.request(pb::CreateGroupRequest {
            container_id: container_id.to_owned(),
            name: name.to_owned(),
            wake_mode: pb::GroupWakeMode::Unspecified as i32,
            members: members.iter().map(Member::pb).collect(),
        });
        let group = self.service.create_group(request).await?.into_inner().group;
        Ok(group.unwrap_or_default().group_id)
    }

    /// Adds a member to a group.
    pub async fn add_group_member(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        member: &Member,
    ) -> Result<(), RuntimeError> {
        let request = ctx.request(pb::AddGroupMemberRequest {
            group_id: group_id.to_owned(),
            member: Some(member.pb()),
        });
        self.service.add_group_member(request).await?;
        Ok(())
    }

    /// Moves a member's read cursor up to `seq`.
    pub async fn advance_read_cursor(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        member: &Member,
        seq: u64,
    ) -> Result<(), RuntimeError> {
        let request = ctx.request(pb::AdvanceReadCursorRequest {
            group_id: group_id.to_owned(),
            member: Some(member.pb()),
            seq,
        });
        self.service.advance_read_cursor(request).await?;
        Ok(())
    }
}
