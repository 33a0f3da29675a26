//! Agents in groups. A group message wakes the agent members it concerns
//! (every agent, or those it mentions); a woken agent reads what it has not
//! read, one turn per group, posts its reply into the group, moves its read
//! cursor and sleeps. A sleeping agent has no task: a wake starts one, and
//! it ends when nothing is left to read. Messages that arrive during a turn
//! wake it again, so they are read by the next turn, never by the running one.

use std::sync::Arc;

use avm_common::auth::Scopes;
use avm_common::event::data;
use avm_common::{ApiError, Code, RequestContext};
use futures::StreamExt;
use futures::future::BoxFuture;

use super::AgentPool;
use crate::agent::Agent;
use crate::error::RuntimeError;
use crate::event::{Detail, EventContext};
use crate::hub::Subscription;
use crate::message::{Content, Part};
use crate::peers::groups::{agent_member, is_agent, sender};
use crate::peers::{AgentPost, Group, GroupMessage, Member, UnreadGroup};

/// Unread messages of a group read by one turn.
const READ_LIMIT: u32 = 100;

/// Agents one group message wakes at once.
const WAKES_AT_ONCE: usize = 16;

/// Whom a posted group message woke.
#[derive(Debug, Default)]
struct Woken {
    /// The agent members woken (with replicas: whose wakes were queued), in
    /// the order they joined.
    image_ids: Vec<String>,
    /// The group reached its limit of consecutive agent messages.
    runaway_stopped: bool,
}

impl AgentPool {
    /// The session service announced a new group message (posted by a user
    /// over any surface, by an agent, or straight over gRPC): unless a
    /// runtime claimed it first (the one whose agent posted it does before
    /// posting), its watchers see it and the agent members it concerns wake.
    #[tracing::instrument(name = "runtime.group_message_posted", skip_all, fields(tenant_id = %tenant_id, group_id = %group_id, seq = seq))]
    pub(super) async fn group_message_posted(&self, tenant_id: &str, group_id: &str, seq: u64, message_id: &str) {
        let posted = async {
            if !self
                .inner
                .placement
                .claim_post(tenant_id, group_id, message_id, false)
                .await?
            {
                return Ok(None);
            }
            let ctx = self.inner.ports.identity.tenant_context(tenant_id).await?;
            let group = self.sessions().get_group(&ctx, group_id).await?;
            let message = self
                .sessions()
                .group_message(&ctx, group_id, seq)
                .await?
                .ok_or_else(|| {
                    RuntimeError::Api(ApiError::new(
                        Code::NotFound,
                        "GROUP_MESSAGE_NOT_FOUND",
                        format!("group {group_id} has no message {seq}"),
                    ))
                })?;
            self.fan_out(&ctx, &group, &message).await.map(Some)
        };
        match posted.await {
            Ok(Some(woken)) => {
                tracing::debug!(
                    woken = woken.image_ids.len(),
                    runaway_stopped = woken.runaway_stopped,
                    "group message woke its agents"
                );
            }
            Ok(None) => {}
            // Stored is stored: an agent not woken now reads it on its next wake.
            Err(err) => tracing::warn!(error = %err, "the group's agents were not woken"),
        }
    }

    /// Tells the group's watchers of `message` and wakes whom it concerns.
    async fn fan_out(
        &self,
        ctx: &RequestContext,
        group: &Group,
        message: &GroupMessage,
    ) -> Result<Woken, RuntimeError> {
        let context = sender_context(group, message);
        let hub = self.inner.hubs.get_or_create(&group.group_id);
        self.publish_in_order(ctx, group, message, &context).await?;
        let members = self.sessions().group_members(ctx, &group.group_id).await?;
        let targets: Vec<Member> = members
            .into_iter()
            .filter(|member| is_agent(member) && wakes(group, message, &member.member_id))
            .collect();
        let limit = self.inner.config.group_runaway_limit;
        if !targets.is_empty() && limit > 0 && message.consecutive_agent_messages >= limit {
            tracing::warn!(
                group_id = %group.group_id,
                consecutive_agent_messages = message.consecutive_agent_messages,
                limit,
                "agents stopped: the group reached its limit of consecutive agent messages"
            );
            metrics::counter!("avm_runtime_group_runaways_stopped_total").increment(1);
            hub.publish(
                &context,
                data::GroupRunawayStopped {
                    group_id: group.group_id.clone(),
                    consecutive_agent_messages: message.consecutive_agent_messages,
                    limit,
                },
            );
            return Ok(Woken {
                image_ids: Vec::new(),
                runaway_stopped: true,
            });
        }
        // With replicas, through their bus: delivered to a replica, which
        // has the agent's holder read it, and taken over if that one dies.
        let image_ids: Vec<String> = targets.iter().map(|member| member.member_id.clone()).collect();
        if self
            .inner
            .placement
            .queue_wakes(&ctx.tenant_id, &group.group_id, message.seq, &image_ids)
            .await?
        {
            return Ok(Woken {
                image_ids,
                runaway_stopped: false,
            });
        }
        // Woken several at once: waking one may start it (its history read).
        let results: Vec<(Member, Result<bool, RuntimeError>)> = futures::stream::iter(targets)
            .map(|member| async move {
                let woken = self.wake_member(ctx, &member.member_id, false).await;
                (member, woken)
            })
            .buffered(WAKES_AT_ONCE)
            .collect()
            .await;
        let mut woken = Woken::default();
        for (member, result) in results {
            match result {
                Ok(true) => woken.image_ids.push(member.member_id),
                Ok(false) => {}
                Err(err) => {
                    tracing::warn!(group_id = %group.group_id, image_id = %member.member_id, error = %err, "cannot wake an agent member");
                }
            }
        }
        Ok(woken)
    }

    /// Publishes `group_message` events up to `message`, in seq order: a
    /// message posted meanwhile whose own publication is still to come goes
    /// out first (read from the group), and then not again.
    async fn publish_in_order(
        &self,
        ctx: &RequestContext,
        group: &Group,
        message: &GroupMessage,
        context: &Arc<EventContext>,
    ) -> Result<(), RuntimeError> {
        let feed = Arc::clone(
            self.inner
                .group_feeds
                .lock()
                .unwrap_or_else(|poison| poison.into_inner())
                .entry(group.group_id.clone())
                .or_default(),
        );
        let mut published = feed.lock().await;
        if *published == 0 {
            *published = message.seq.saturating_sub(1);
        }
        if message.seq <= *published {
            return Ok(());
        }
        let hub = self.inner.hubs.get_or_create(&group.group_id);
        let gap = message.seq - *published - 1;
        if gap > 0 {
            let earlier = self
                .sessions()
                .group_messages(ctx, &group.group_id, *published, u32::try_from(gap).unwrap_or(u32::MAX))
                .await?;
            for earlier in earlier.iter().filter(|earlier| earlier.seq < message.seq) {
                hub.publish(&sender_context(group, earlier), data::GroupMessage::from(earlier));
            }
        }
        hub.publish(context, data::GroupMessage::from(message));
        *published = message.seq;
        Ok(())
    }

    /// Subscribes to a group's events, replaying retained ones after `after_cursor`.
    #[tracing::instrument(name = "runtime.subscribe_group_events", skip_all, fields(tenant_id = %ctx.tenant_id, request_id = %ctx.request_id))]
    pub async fn subscribe_group(
        &self,
        ctx: &RequestContext,
        group_id: &str,
        after_cursor: Option<&str>,
    ) -> Result<Subscription, RuntimeError> {
        ctx.require(Scopes::READ)?;
        let after = super::parse_cursor(after_cursor)?;
        // Ownership: a group the caller may not see answers like a missing one.
        self.sessions().get_group(ctx, group_id).await?;
        Ok(self.inner.hubs.open(group_id).await.subscribe(after))
    }

    /// Reads until nothing the agent was woken for is left unread. Boxed:
    /// a reply wakes other agents, whose reading may wake this one.
    pub(super) fn read_groups(self, agent: Arc<Agent>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            loop {
                // Paused, terminated or stopped meanwhile: it reads no more.
                if agent.is_retired() {
                    agent.read_done();
                    break;
                }
                let more = match self.read_unread(&agent).await {
                    Ok(more) => more,
                    Err(err) => {
                        tracing::warn!(image_id = %agent.image.image_id, error = %err, "cannot read the agent's group messages");
                        false
                    }
                };
                if !more && !agent.read_done() {
                    break;
                }
            }
        })
    }

    /// Answers each group with unread messages; `true` when a group had
    /// more than one turn reads.
    pub(super) async fn read_unread(&self, agent: &Arc<Agent>) -> Result<bool, RuntimeError> {
        let ctx = self.inner.ports.identity.tenant_context(&agent.tenant_id).await?;
        let me = agent_member(&agent.image.image_id);
        let mut more = false;
        for unread in self.sessions().unread(&ctx, &me, READ_LIMIT).await? {
            let group_id = unread
                .group
                .as_ref()
                .map(|group| group.group_id.clone())
                .unwrap_or_default();
            if agent.is_retired() {
                break;
            }
            match self.answer_group(&ctx, agent, &me, unread).await {
                Ok(read_all) => more |= !read_all,
                Err(err) => {
                    tracing::warn!(group_id, image_id = %me.member_id, error = %err, "cannot answer a group");
                }
            }
        }
        Ok(more)
    }

    /// Runs a turn on a group's unread messages and posts its reply; returns
    /// `false` when more messages wait than one turn reads.
    async fn answer_group(
        &self,
        ctx: &RequestContext,
        agent: &Agent,
        me: &Member,
        unread: UnreadGroup,
    ) -> Result<bool, RuntimeError> {
        let Some(last) = unread.messages.last().map(|message| message.seq) else {
            return Ok(true);
        };
        let Some(group) = unread.group.as_ref() else {
            return Ok(true);
        };
        let read_all = unread.unread_count <= unread.messages.len() as u64;
        let limit = self.inner.config.group_runaway_limit;
        let others: Vec<&GroupMessage> = unread.messages.iter().filter(|message| sender(message) != me).collect();
        // What would wake it, under the runaway limit; the rest is context
        // (read with what concerns it, or left for a user's next message).
        let concerned = others.iter().any(|message| {
            wakes(group, message, &me.member_id) && (limit == 0 || message.consecutive_agent_messages < limit)
        });
        if !concerned {
            // Only its own replies, or more than a turn reads with nothing
            // for it among the oldest: read past them, to what woke it.
            if others.is_empty() || !read_all {
                self.sessions()
                    .advance_read_cursor(ctx, &group.group_id, me, last)
                    .await?;
            }
            return Ok(read_all);
        }
        let members = self.sessions().group_members(ctx, &group.group_id).await?;
        let prompt = render(group, me, &others);
        // At most so many group turns at once, each tenant in turn.
        let permit = self.inner.gate.admit(&agent.tenant_id).await;
        let turn = self.group_turn(ctx, group, &me.member_id, prompt).await;
        drop(permit);
        let GroupTurn { reply, fatal } = match turn {
            Err(err) if !err.recoverable() => GroupTurn {
                reply: None,
                fatal: Some(err.to_string()),
            },
            turn => turn?,
        };
        if let Some(error) = fatal {
            // Retrying would fail alike: it stops, and what it read stays
            // unread until it is resumed.
            self.fail(ctx, group, &me.member_id, error).await?;
            return Ok(true);
        }
        if reply.is_none() && agent.is_retired() {
            // Cut by a pause or a stop: read again when it runs next.
            return Ok(true);
        }
        // Its reply moves its cursor (and the session announces it, to wake
        // whom it concerns); without one, the cursor moves here.
        let cursor = match reply.filter(|text| !text.trim().is_empty()) {
            Some(text) => {
                // Named after what it answers: a redelivered wake posts nothing twice.
                let message_id = format!("reply.{}.{last}", me.member_id);
                // Claimed before it is posted, so this runtime, not one
                // hearing the session announce it, tells the group's
                // watchers: they see the reply before the agent's read.
                self.inner
                    .placement
                    .claim_post(&ctx.tenant_id, &group.group_id, &message_id, true)
                    .await?;
                let post = AgentPost {
                    message_id,
                    sender: me,
                    content: &text,
                    mentions: mentioned(&text, me, &members),
                    read_seq: last,
                };
                let posted = self.sessions().post_group_message(ctx, &group.group_id, post).await?;
                if posted.created
                    && let Some(message) = &posted.message
                {
                    self.fan_out(ctx, group, message).await?;
                }
                posted.sender_read_seq
            }
            None => Some(
                self.sessions()
                    .advance_read_cursor(ctx, &group.group_id, me, last)
                    .await?,
            ),
        };
        // The session moved the cursor by its rule; its watchers hear where
        // to (nothing when it could not be moved: the post stands, unread).
        let Some(cursor) = cursor else {
            return Ok(read_all);
        };
        let context = Arc::new(EventContext {
            container_id: group.container_id.clone(),
            image_id: me.member_id.clone(),
            agent_id: String::new(),
            session_id: group.group_id.clone(),
        });
        self.inner.hubs.get_or_create(&group.group_id).publish(
            &context,
            data::GroupRead {
                group_id: group.group_id.clone(),
                member_id: me.member_id.clone(),
                read_seq: cursor,
            },
        );
        Ok(read_all)
    }

    /// Puts an agent whose group turn failed past retrying in the `error`
    /// state and takes it out of the pool; the group's watchers see
    /// `agent_error`.
    async fn fail(
        &self,
        ctx: &RequestContext,
        group: &Group,
        image_id: &str,
        error: String,
    ) -> Result<(), RuntimeError> {
        tracing::warn!(image_id, group_id = %group.group_id, error, "agent stopped in the error state; resume it once fixed");
        metrics::counter!("avm_runtime_agents_failed_total").increment(1);
        self.sessions().set_error(ctx, image_id, error.clone()).await?;
        self.leave(&ctx.tenant_id, image_id, "failed");
        let context = Arc::new(EventContext {
            container_id: group.container_id.clone(),
            image_id: image_id.to_owned(),
            agent_id: String::new(),
            session_id: group.group_id.clone(),
        });
        self.inner.hubs.get_or_create(&group.group_id).publish(
            &context,
            data::AgentError {
                group_id: group.group_id.clone(),
                image_id: image_id.to_owned(),
                agent_state: "error".to_owned(),
                error,
            },
        );
        Ok(())
    }

    /// Runs one turn of the agent on `prompt` (after any turn already
    /// running), relaying its events to the group's.
    async fn group_turn(
        &self,
        ctx: &RequestContext,
        group: &Group,
        image_id: &str,
        prompt: String,
    ) -> Result<GroupTurn, RuntimeError> {
        let content = Content {
            parts: vec![Part::Text(prompt)],
            plain_text: true,
        };
        let (accepted, turn) = loop {
            match self
                .start_turn(ctx, image_id, content.clone(), Some(&group.group_id))
                .await
            {
                Err(RuntimeError::AgentBusy) => {
                    if let Some(agent) =
                        self.lookup(&ctx.tenant_id, &crate::error::AgentTarget::Image(image_id.to_owned()))
                    {
                        agent.stopped().await;
                    }
                }
                started => break started?,
            }
        };
        let context = Arc::new(EventContext {
            container_id: group.container_id.clone(),
            image_id: image_id.to_owned(),
            agent_id: accepted.agent.agent_id.clone(),
            session_id: group.group_id.clone(),
        });
        let relay = async {
            let Subscription { replay, mut live, .. } = accepted.events;
            let hubs = &self.inner.hubs;
            for event in replay {
                hubs.get_or_create(&group.group_id).republish(&context, &event);
                if event.ends_turn() {
                    return fatal(&event);
                }
            }
            while let Some(event) = live.recv().await {
                hubs.get_or_create(&group.group_id).republish(&context, &event);
                if event.ends_turn() {
                    return fatal(&event);
                }
            }
            None
        };
        let (reply, fatal) = tokio::join!(turn, relay);
        Ok(GroupTurn {
            reply: reply.unwrap_or_default(),
            fatal,
        })
    }
}

/// How an agent's group turn ended.
struct GroupTurn {
    /// The text of its last reply, when it completed.
    reply: Option<String>,
    /// Its failure, when retrying would fail alike (`code: message`).
    fatal: Option<String>,
}

/// The failure a turn's last event reports, when retrying would not fix it.
fn fatal(event: &crate::event::SessionEvent) -> Option<String> {
    match event.detail.as_deref() {
        Some(Detail::Unrecoverable(failure)) => Some(failure.to_string()),
        _ => None,
    }
}

/// Whether `message` wakes the agent member `image_id`: a user's message
/// wakes every agent (or, in a `mentions` group, those it mentions); an
/// agent's wakes only those it mentions, so agents do not chatter unasked.
fn wakes(group: &Group, message: &GroupMessage, image_id: &str) -> bool {
    let from = sender(message);
    let on_mention = group.wake_mode() == avm_proto::session::v1::GroupWakeMode::Mentions;
    from.member_id != image_id && (!(on_mention || is_agent(from)) || message.mentions.iter().any(|id| id == image_id))
}

/// The context of a group event about a message: the group, and the agent
/// that sent it, if one did.
fn sender_context(group: &Group, message: &GroupMessage) -> Arc<EventContext> {
    Arc::new(EventContext {
        container_id: group.container_id.clone(),
        image_id: if is_agent(sender(message)) {
            sender(message).member_id.clone()
        } else {
            String::new()
        },
        agent_id: String::new(),
        session_id: group.group_id.clone(),
    })
}

/// The unread messages of a group as the agent reads them: who said what.
fn render(group: &Group, me: &Member, messages: &[&GroupMessage]) -> String {
    let mut text = format!(
        "New messages in the group \"{}\" ({}). You are the member {}; your reply is posted into the group, and @<memberId> mentions a member.\n",
        group.name, group.group_id, me.member_id
    );
    for message in messages {
        let from = sender(message);
        let kind = avm_common::event::member_kind_name(from.kind());
        text.push_str(&format!("\n[{kind} {}] {}", from.member_id, message.content));
    }
    text
}

/// The members a reply mentions as `@<memberId>`, itself excepted.
fn mentioned(text: &str, me: &Member, members: &[Member]) -> Vec<String> {
    members
        .iter()
        .filter(|member| *member != me && text.contains(&format!("@{}", member.member_id)))
        .map(|member| member.member_id.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peers::groups::user_member;

    fn post(seq: u64, sender: Member, content: &str) -> GroupMessage {
        GroupMessage {
            group_id: "grp_1".to_owned(),
            message_id: format!("m{seq}"),
            seq,
            sender: Some(sender),
            content: content.to_owned(),
            ..GroupMessage::default()
        }
    }

    #[test]
    fn the_agent_reads_each_message_with_its_sender() {
        let group = Group {
            group_id: "grp_1".to_owned(),
            container_id: "ctr_1".to_owned(),
            name: "Planning".to_owned(),
            ..Group::default()
        };
        let user = user_member("usr_ann");
        let (first, second) = (
            post(1, user, "What should we build?"),
            post(2, agent_member("img_b"), "A bridge."),
        );
        let text = render(&group, &agent_member("img_a"), &[&first, &second]);
        assert!(text.contains("\"Planning\" (grp_1)"), "{text}");
        assert!(text.contains("You are the member img_a"), "{text}");
        let order: Vec<&str> = text.lines().skip(2).collect();
        assert_eq!(
            order,
            ["[user usr_ann] What should we build?", "[agent img_b] A bridge."]
        );
    }

    #[test]
    fn a_reply_mentions_only_members_and_never_its_author() {
        let me = agent_member("img_a");
        let members = [me.clone(), agent_member("img_b"), agent_member("img_c")];
        let mentions = mentioned("@img_a asks @img_c and @img_z", &me, &members);
        assert_eq!(mentions, ["img_c"]);
    }
}
