//! Groups as the runtime reads and writes them: who is in a group, what its
//! agents have not read, their replies and read cursors.

use avm_common::RequestContext;
use avm_proto::session::v1 as pb;

use super::Sessions;
use crate::error::RuntimeError;

/// The session service's group types are the runtime's: it adds nothing to them.
pub use pb::{Group, GroupMemberRef as Member, GroupMessage, UnreadGroup};

/// The agent member of an image.
pub fn agent_member(image_id: &str) -> Member {
    Member {
        kind: pb::GroupMemberKind::Agent.into(),
        member_id: image_id.to_owned(),
    }
}

/// The user member `user_id`.
pub fn user_member(user_id: &str) -> Member {
    Member {
        kind: pb::GroupMemberKind::User.into(),
        member_id: user_id.to_owned(),
    }
}

/// Whether a member is an agent (else a user).
pub fn is_agent(member: &Member) -> bool {
    member.kind() == pb::GroupMemberKind::Agent
}

/// Who sent a message (the session service always says).
pub fn sender(message: &GroupMessage) -> &Member {
    static NOBODY: Member = Member {
        kind: 0,
        member_id: String::new(),
    };
    message.sender.as_ref().unwrap_or(&NOBODY)
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

impl Sessions {
    /// Returns a group the caller may see.
    pub async fn get_group(&self, ctx: &RequestContext, group_id: &str) -> Result<Group, RuntimeError> {
        let request = ctx.request(pb::GetGroupRequest {
            group_id: group_id.to_owned(),
        });
        let group = self.service.get_group(request).await?.into_inner().group;
        Ok(group.unwrap_or_default())
    }

    /// Returns a group's members in the order they joined.
    pub async fn group_members(&self, ctx: &RequestContext, group_id: &str) -> Result<Vec<Member>, RuntimeError> {
        let request = ctx.request(pb::ListGroupMembersRequest {
            group_id: group_id.to_owned(),
        });
        let members = self.service.list_group_members(request).await?.into_inner().members;
        Ok(members.into_iter().filter_map(|member| member.member).collect())
    }

    /// Returns one message of a group, by seq.
    pub async fn group_message(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        seq: u64,
    ) -> Result<Option<GroupMessage>, RuntimeError> {
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
    ) -> Result<Vec<GroupMessage>, RuntimeError> {
        let request = ctx.request(pb::ListGroupMessagesRequest {
            group_id: group_id.to_owned(),
            after_seq,
            limit,
        });
        Ok(self.service.list_group_messages(request).await?.into_inner().messages)
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
            member: Some(member.clone()),
            message_limit: limit,
        });
        Ok(self.service.list_unread(request).await?.into_inner().groups)
    }

    /// Posts an agent's message; idempotent on its id. The sender's cursor
    /// moves to what it read (and past its message when nothing lies
    /// between), and the session service announces the message to the
    /// runtimes. Returns the stored message, whether this call stored it,
    /// and the sender's cursor as the session moved it.
    pub async fn post_group_message(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        post: AgentPost<'_>,
    ) -> Result<pb::PostGroupMessageResponse, RuntimeError> {
        let request = ctx.request(pb::PostGroupMessageRequest {
            group_id: group_id.to_owned(),
            message_id: post.message_id,
            sender: Some(post.sender.clone()),
            content: post.content.to_owned(),
            mentions: post.mentions,
            read_seq: Some(post.read_seq),
        });
        Ok(self.service.post_group_message(request).await?.into_inner())
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
            members: members.to_vec(),
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
            member: Some(member.clone()),
        });
        self.service.add_group_member(request).await?;
        Ok(())
    }

    /// Moves a member's read cursor up to `seq`; returns where it is now.
    pub async fn advance_read_cursor(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        member: &Member,
        seq: u64,
    ) -> Result<u64, RuntimeError> {
        let request = ctx.request(pb::AdvanceReadCursorRequest {
            group_id: group_id.to_owned(),
            member: Some(member.clone()),
            seq,
        });
        let moved = self.service.advance_read_cursor(request).await?.into_inner();
        Ok(moved.member.map_or(seq, |member| member.read_seq))
    }
}
