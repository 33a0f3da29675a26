//! Groups: validation, ids, timestamps and logs around the `GroupStore`.
//!
//! A group belongs to a container and is seen by whoever sees the container;
//! its agent members are images of that container, its user members users of
//! the tenant. Waking agents is the runtime's business: this part stores,
//! orders and answers "what is unread".

use avm_common::auth::{Role, Scopes};
use avm_common::ids::new_id;
use avm_common::{ApiError, Code, RequestContext, now_ms};
use tracing::instrument;

use super::{
    MAX_MESSAGE_BYTES, MAX_NAME_CHARS, allow, check_user_message_id, is_valid_client_id, scope, validate_container_id,
};
use crate::error::SessionError;
use crate::record::{
    GroupCursor, GroupMemberRecord, GroupMessageRecord, GroupPage, GroupRecord, GroupUpdate, MemberKind, MemberRef,
    NewGroup, NewGroupMessage, PostedGroupMessage, SessionChange, ShareRole, UnreadGroup,
};
use crate::service::SessionService;

/// Groups on a page of ListGroups when the caller names no size.
pub const DEFAULT_GROUP_PAGE_SIZE: u32 = 50;
/// Most groups on a page of ListGroups; larger requests get this many.
pub const MAX_GROUP_PAGE_SIZE: u32 = 500;
/// Group messages returned when the caller names no limit.
pub const DEFAULT_GROUP_MESSAGE_LIMIT: u32 = 100;
/// Most group messages one call returns (per group, for unread ones).
pub const MAX_GROUP_MESSAGE_LIMIT: u32 = 1000;
/// Most members one message may mention.
pub const MAX_MENTIONS: usize = 64;
/// Most members a group may be created with in one call.
pub const MAX_INITIAL_MEMBERS: usize = 64;

impl SessionService {
    /// Creates a group in an existing container, with its first members.
    #[instrument(
        name = "session.create_group",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn create_group(&self, ctx: &RequestContext, new: NewGroup) -> Result<GroupRecord, SessionError> {
        allow(ctx, Scopes::WRITE)?;
        validate_container_id(&new.container_id)?;
        let name = validate_group_name(new.name)?;
        if new.members.len() > MAX_INITIAL_MEMBERS {
            return Err(SessionError::invalid(
                "TOO_MANY_GROUP_MEMBERS",
                format!("a group may be created with at most {MAX_INITIAL_MEMBERS} members; add more later"),
            ));
        }
        for (n, member) in new.members.iter().enumerate() {
            validate_member_id(&member.member_id)?;
            if new.members[..n]
                .iter()
                .any(|earlier| earlier.member_id == member.member_id)
            {
                return Err(SessionError::invalid(
                    "DUPLICATE_GROUP_MEMBER",
                    format!("{} is named twice among the group's members", member.member_id),
                ));
            }
            if member.kind == MemberKind::Agent {
                self.check_agent_container(ctx, &member.member_id, &new.container_id)
                    .await?;
            }
        }
        self.require_role(ctx, &new.container_id, ShareRole::Use).await?;
        let now = now_ms();
        let group = GroupRecord {
            group_id: new_id("grp"),
            container_id: new.container_id,
            name,
            wake_mode: new.wake_mode.unwrap_or_default(),
            last_seq: 0,
            consecutive_agent_messages: 0,
            created_at_ms: now,
            updated_at_ms: now,
        };
        self.store.create_group(&scope(ctx), &group, &new.members).await?;
        tracing::info!(
            group_id = %group.group_id,
            container_id = %group.container_id,
            members = new.members.len(),
            "group created"
        );
        Ok(group)
    }

    /// Returns a group of the caller's containers.
    #[instrument(
        name = "session.get_group",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn get_group(&self, ctx: &RequestContext, group_id: &str) -> Result<GroupRecord, SessionError> {
        allow(ctx, Scopes::READ)?;
        self.store.get_group(&scope(ctx), group_id).await
    }

    /// Returns a page of a container's groups, newest first (none when the
    /// container does not exist). `page_size` 0 means the default; a token
    /// comes from the previous page.
    #[instrument(
        name = "session.list_groups",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn list_groups(
        &self,
        ctx: &RequestContext,
        container_id: &str,
        page_size: u32,
        page_token: &str,
    ) -> Result<GroupPage, SessionError> {
        allow(ctx, Scopes::READ)?;
        validate_container_id(container_id)?;
        let size = match page_size {
            0 => DEFAULT_GROUP_PAGE_SIZE,
            size => size.min(MAX_GROUP_PAGE_SIZE),
        };
        let after = parse_page_token(page_token)?;
        // One more than asked says whether another page follows.
        let mut groups = self
            .store
            .list_groups(&scope(ctx), container_id, after.as_ref(), size + 1)
            .await?;
        let next_page_token = if groups.len() > size as usize {
            groups.truncate(size as usize);
            groups.last().map(page_token_after)
        } else {
            None
        };
        Ok(GroupPage {
            groups,
            next_page_token,
        })
    }

    /// Changes a group's name or wake mode.
    #[instrument(
        name = "session.update_group",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn update_group(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        update: GroupUpdate,
    ) -> Result<GroupRecord, SessionError> {
        allow(ctx, Scopes::WRITE)?;
        let update = GroupUpdate {
            name: update.name.map(validate_group_name).transpose()?,
            wake_mode: update.wake_mode,
        };
        self.require_group_role(ctx, group_id, ShareRole::Manage).await?;
        let group = self
            .store
            .update_group(&scope(ctx), group_id, &update, now_ms())
            .await?;
        tracing::info!(group_id, wake_mode = group.wake_mode.as_str(), "group updated");
        Ok(group)
    }

    /// Deletes a group with its members and messages.
    #[instrument(
        name = "session.delete_group",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn delete_group(&self, ctx: &RequestContext, group_id: &str) -> Result<(), SessionError> {
        allow(ctx, Scopes::WRITE)?;
        self.require_group_role(ctx, group_id, ShareRole::Manage).await?;
        self.store.delete_group(&scope(ctx), group_id).await?;
        tracing::info!(group_id, "group deleted");
        Ok(())
    }

    /// Adds an agent (an image of the group's container) or a user to a
    /// group, with nothing read yet.
    #[instrument(
        name = "session.add_group_member",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn add_group_member(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        member: MemberRef,
    ) -> Result<GroupMemberRecord, SessionError> {
        allow(ctx, Scopes::WRITE)?;
        validate_member_id(&member.member_id)?;
        self.require_group_role(ctx, group_id, ShareRole::Manage).await?;
        if member.kind == MemberKind::Agent {
            let group = self.store.get_group(&scope(ctx), group_id).await?;
            self.check_agent_container(ctx, &member.member_id, &group.container_id)
                .await?;
        }
        let added = self
            .store
            .add_group_member(&scope(ctx), group_id, &member, now_ms())
            .await?;
        tracing::info!(
            group_id,
            member_id = %member.member_id,
            kind = member.kind.as_str(),
            "group member added"
        );
        Ok(added)
    }

    /// Removes a member from a group; what it posted stays.
    #[instrument(
        name = "session.remove_group_member",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn remove_group_member(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        member: MemberRef,
    ) -> Result<(), SessionError> {
        allow(ctx, Scopes::WRITE)?;
        validate_member_id(&member.member_id)?;
        self.require_group_role(ctx, group_id, ShareRole::Manage).await?;
        self.store.remove_group_member(&scope(ctx), group_id, &member).await?;
        tracing::info!(group_id, member_id = %member.member_id, "group member removed");
        Ok(())
    }

    /// Returns a group's members in the order they joined, with their read cursors.
    #[instrument(
        name = "session.list_group_members",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn list_group_members(
        &self,
        ctx: &RequestContext,
        group_id: &str,
    ) -> Result<Vec<GroupMemberRecord>, SessionError> {
        allow(ctx, Scopes::READ)?;
        self.store.list_group_members(&scope(ctx), group_id).await
    }

    /// Posts a message into a group; returns it as stored, whether it is
    /// new, and its sender's read cursor.
    ///
    /// Idempotent on the message id: posting an id the group already holds
    /// returns the stored message. The sender and every mention must be
    /// members; a user may post only as themself, a service principal (the
    /// runtime) as anyone, agents included.
    #[instrument(
        name = "session.post_group_message",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn post_group_message(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        message: NewGroupMessage,
    ) -> Result<PostedGroupMessage, SessionError> {
        allow(ctx, Scopes::WRITE)?;
        let message_id = match message.message_id.as_deref() {
            Some(id) if !id.is_empty() => {
                if !is_valid_client_id(id) {
                    return Err(SessionError::invalid(
                        "INVALID_MESSAGE_ID",
                        "message id must be 1 to 128 characters of letters, digits and . _ : @ -",
                    ));
                }
                if ctx.principal.role != Role::Service {
                    check_user_message_id(id)?;
                }
                id.to_owned()
            }
            _ => new_id("gmsg"),
        };
        validate_member_id(&message.sender.member_id)?;
        if !speaks_for(ctx, &message.sender) {
            return Err(SessionError::Denied(ApiError::new(
                Code::PermissionDenied,
                "SENDER_NOT_CALLER",
                "a user may post only as themself; only the runtime posts as an agent",
            )));
        }
        if message.content.trim().is_empty() {
            return Err(SessionError::invalid(
                "EMPTY_GROUP_MESSAGE",
                "group message content must not be blank",
            ));
        }
        if message.content.len() > MAX_MESSAGE_BYTES {
            return Err(SessionError::invalid(
                "MESSAGE_TOO_LARGE",
                format!("message must be at most {} MiB", MAX_MESSAGE_BYTES / (1024 * 1024)),
            ));
        }
        let mut mentions: Vec<String> = Vec::with_capacity(message.mentions.len());
        for mention in message.mentions {
            validate_member_id(&mention)?;
            if !mentions.contains(&mention) {
                mentions.push(mention);
            }
        }
        if mentions.len() > MAX_MENTIONS {
            return Err(SessionError::invalid(
                "TOO_MANY_MENTIONS",
                format!("a message may mention at most {MAX_MENTIONS} members"),
            ));
        }
        self.require_group_role(ctx, group_id, ShareRole::Use).await?;
        let read_seq = message.read_seq;
        let message = NewGroupMessage {
            message_id: Some(message_id.clone()),
            mentions,
            created_at_ms: if message.created_at_ms > 0 {
                message.created_at_ms
            } else {
                now_ms()
            },
            ..message
        };
        let (stored, created) = self
            .store
            .post_group_message(&scope(ctx), group_id, &message_id, &message)
            .await?;
        tracing::debug!(
            group_id,
            message_id = %stored.message_id,
            seq = stored.seq,
            sender_kind = stored.sender.kind.as_str(),
            consecutive_agent_messages = stored.consecutive_agent_messages,
            created,
            "group message posted"
        );
        if created {
            self.events
                .emit(SessionChange::Posted {
                    tenant_id: ctx.tenant_id.clone(),
                    group_id: group_id.to_owned(),
                    seq: stored.seq,
                    message_id: stored.message_id.clone(),
                })
                .await;
        }
        // The sender read what it answers (or what it says it read): its own
        // message is unread to it only when something it did not read lies
        // before. The message is stored whatever happens here: a cursor left
        // behind only shows it as unread, and failing the post would invite
        // a duplicate.
        let read = match read_seq {
            Some(read) if stored.seq != read.saturating_add(1) => read,
            _ => stored.seq,
        };
        let sender_read_seq = match self
            .store
            .advance_read_cursor(&scope(ctx), group_id, &stored.sender, read)
            .await
        {
            Ok(member) => Some(member.read_seq),
            Err(err) => {
                tracing::warn!(group_id, error = %err, "the sender's read cursor was not moved past its message");
                None
            }
        };
        Ok(PostedGroupMessage {
            message: stored,
            created,
            sender_read_seq,
        })
    }

    /// Returns a group's messages after `after_seq`, oldest first, at most
    /// `limit` of them (0: the default).
    #[instrument(
        name = "session.list_group_messages",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn list_group_messages(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        after_seq: u64,
        limit: u32,
    ) -> Result<Vec<GroupMessageRecord>, SessionError> {
        allow(ctx, Scopes::READ)?;
        let limit = match limit {
            0 => DEFAULT_GROUP_MESSAGE_LIMIT,
            limit => limit.min(MAX_GROUP_MESSAGE_LIMIT),
        };
        self.store
            .list_group_messages(&scope(ctx), group_id, after_seq, limit)
            .await
    }

    /// Returns the groups in which `member` has unread messages, with their
    /// counts and up to `message_limit` unread messages each (0: counts only).
    #[instrument(
        name = "session.list_unread",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn list_unread(
        &self,
        ctx: &RequestContext,
        member: MemberRef,
        message_limit: u32,
    ) -> Result<Vec<UnreadGroup>, SessionError> {
        allow(ctx, Scopes::READ)?;
        validate_member_id(&member.member_id)?;
        self.store
            .list_unread(&scope(ctx), &member, message_limit.min(MAX_GROUP_MESSAGE_LIMIT))
            .await
    }

    /// Marks a member as having read up to `seq` (at most the newest
    /// message); a cursor already past `seq` stays where it is. A user moves
    /// only their own cursor; a service principal (the runtime) any.
    #[instrument(
        name = "session.advance_read_cursor",
        skip_all,
        fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id)
    )]
    pub async fn advance_read_cursor(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        member: MemberRef,
        seq: u64,
    ) -> Result<GroupMemberRecord, SessionError> {
        allow(ctx, Scopes::WRITE)?;
        validate_member_id(&member.member_id)?;
        if !speaks_for(ctx, &member) {
            return Err(SessionError::Denied(ApiError::new(
                Code::PermissionDenied,
                "CURSOR_NOT_CALLER",
                "a user may move only their own read cursor; only the runtime moves an agent's",
            )));
        }
        let advanced = self
            .store
            .advance_read_cursor(&scope(ctx), group_id, &member, seq)
            .await?;
        tracing::debug!(
            group_id,
            member_id = %member.member_id,
            read_seq = advanced.read_seq,
            "read cursor advanced"
        );
        Ok(advanced)
    }

    /// Does what [`SessionService::require_role`] does for the container of a group.
    async fn require_group_role(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        need: ShareRole,
    ) -> Result<(), SessionError> {
        if ctx.owner_filter().is_none() {
            return Ok(());
        }
        let group = self.store.get_group(&scope(ctx), group_id).await?;
        self.require_role(ctx, &group.container_id, need).await
    }

    /// Fails unless `image_id` is an image the caller sees in `container_id`.
    async fn check_agent_container(
        &self,
        ctx: &RequestContext,
        image_id: &str,
        container_id: &str,
    ) -> Result<(), SessionError> {
        let image = self.store.get_image(&scope(ctx), image_id).await?;
        if image.container_id != container_id {
            return Err(SessionError::invalid(
                "IMAGE_NOT_IN_GROUP_CONTAINER",
                format!(
                    "image {image_id} is in container {}, not in the group's {container_id}",
                    image.container_id
                ),
            ));
        }
        Ok(())
    }
}

/// Returns whether the caller may act as `member`: a service principal (the
/// runtime, for its agents) as anyone, a user only as themself.
fn speaks_for(ctx: &RequestContext, member: &MemberRef) -> bool {
    ctx.principal.role == Role::Service
        || (member.kind == MemberKind::User && member.member_id == ctx.principal.user_id)
}

fn validate_group_name(name: String) -> Result<String, SessionError> {
    if name.trim().is_empty() {
        return Err(SessionError::invalid(
            "INVALID_GROUP_NAME",
            "group name must not be blank",
        ));
    }
    if name.chars().count() > MAX_NAME_CHARS {
        return Err(SessionError::invalid(
            "INVALID_GROUP_NAME",
            format!("group name must be at most {MAX_NAME_CHARS} characters"),
        ));
    }
    Ok(name)
}

fn validate_member_id(member_id: &str) -> Result<(), SessionError> {
    if is_valid_client_id(member_id) {
        Ok(())
    } else {
        Err(SessionError::invalid(
            "INVALID_MEMBER_ID",
            "member id must be 1 to 128 characters of letters, digits and . _ : @ -",
        ))
    }
}

/// Returns the token of the page after `last`: its sort key, opaque to callers.
fn page_token_after(last: &GroupRecord) -> String {
    format!("{}.{}", last.created_at_ms, last.group_id)
}

fn parse_page_token(token: &str) -> Result<Option<GroupCursor>, SessionError> {
    if token.is_empty() {
        return Ok(None);
    }
    let invalid = || SessionError::invalid("INVALID_PAGE_TOKEN", "page token is not one this service made");
    let (created_at_ms, group_id) = token.split_once('.').ok_or_else(invalid)?;
    let created_at_ms = created_at_ms.parse().map_err(|_| invalid())?;
    if !is_valid_client_id(group_id) {
        return Err(invalid());
    }
    Ok(Some(GroupCursor {
        created_at_ms,
        group_id: group_id.to_owned(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::WakeMode;

    #[test]
    fn page_tokens_round_trip_and_refuse_forgeries() {
        let group = GroupRecord {
            group_id: "grp_0123".into(),
            container_id: "default".into(),
            name: "g".into(),
            wake_mode: WakeMode::All,
            last_seq: 0,
            consecutive_agent_messages: 0,
            created_at_ms: 1_700_000_000_000,
            updated_at_ms: 1_700_000_000_000,
        };
        let cursor = parse_page_token(&page_token_after(&group)).ok().flatten();
        assert_eq!(
            cursor,
            Some(GroupCursor {
                created_at_ms: 1_700_000_000_000,
                group_id: "grp_0123".into()
            })
        );
        assert_eq!(parse_page_token("").ok(), Some(None));
        for bad in ["x", "abc.grp_1", "1.", "1.a b"] {
            assert!(
                matches!(
                    parse_page_token(bad),
                    Err(SessionError::Invalid {
                        reason: "INVALID_PAGE_TOKEN",
                        ..
                    })
                ),
                "{bad}"
            );
        }
    }
}
