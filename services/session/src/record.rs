//! The domain types of the session service: what the store keeps and the
//! service hands out. Proto types stay in `grpc.rs`; rows stay in `store`.

use serde::{Deserialize, Serialize};

/// A tenant's isolation unit; its id is chosen by the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerRecord {
    pub container_id: String,
    /// The user who created it; empty for containers older than ownership.
    pub owner_id: String,
    pub created_at_ms: i64,
}

/// A user a container is shared with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareRecord {
    pub user_id: String,
    pub created_at_ms: i64,
    /// What the user may do in the container.
    pub role: ShareRole,
}

/// What a user a container is shared with may do in it, weakest first: the
/// container's owner and the tenant's admins may do everything.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ShareRole {
    /// See the container and everything in it.
    Read,
    /// Also talk: send messages, interrupt, create images and groups, post.
    /// The default: a share made without a role, or before roles existed.
    #[default]
    Use,
    /// Also change and destroy: edit and delete images and groups, pause,
    /// resume, terminate and stop agents.
    Manage,
}

impl ShareRole {
    /// Returns the stable name of this role, as stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            ShareRole::Read => "read",
            ShareRole::Use => "use",
            ShareRole::Manage => "manage",
        }
    }

    /// Parses a role name.
    pub fn parse(name: &str) -> Option<ShareRole> {
        match name {
            "read" => Some(ShareRole::Read),
            "use" => Some(ShareRole::Use),
            "manage" => Some(ShareRole::Manage),
            _ => None,
        }
    }
}

/// What the caller may do in a container it sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContainerAccess {
    /// Everything: the owner, an admin or a service.
    Full,
    /// What the share's role allows.
    Shared(ShareRole),
}

impl ContainerAccess {
    /// Returns whether this access allows what `need` allows.
    pub fn allows(self, need: ShareRole) -> bool {
        match self {
            ContainerAccess::Full => true,
            ContainerAccess::Shared(role) => role >= need,
        }
    }
}

/// A persisted conversation definition with exactly one session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageRecord {
    pub image_id: String,
    pub container_id: String,
    pub session_id: String,
    pub name: String,
    pub description: Option<String>,
    pub system_prompt: Option<String>,
    /// MCP server definitions as a JSON object; `"{}"` when none.
    pub mcp_servers_json: String,
    /// The agent definition it runs, a `resource://agents/…` URI.
    pub agent: Option<String>,
    /// Values of the prompt's variables, a JSON object of strings; `"{}"` when none.
    pub variables_json: String,
    /// The tools its agent may call: built-in names and `resource://tools/…` URIs.
    pub tools: Vec<String>,
    /// A JSON object its clients own; `"{}"` when none.
    pub metadata_json: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
    /// Whether its agent may run.
    pub agent_state: AgentState,
    /// Why its agent is in the `Error` state; `None` in any other.
    pub agent_error: Option<String>,
    /// The image whose agent started this one, in the same container.
    pub parent_image_id: Option<String>,
    /// How many parents it has: 0 for an image without one.
    pub depth: u32,
}

/// Whether an image's agent may run; the runtime reads it before waking one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AgentState {
    /// Woken by what reaches it.
    #[default]
    Active,
    /// Not woken until it is made active again.
    Paused,
    /// Never runs again; final.
    Terminated,
    /// Stopped by a failure retrying would not fix; not woken until it is
    /// made active again. Stored as an active state with its error.
    Error,
}

impl AgentState {
    /// Returns the stable name of this state, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            AgentState::Active => "active",
            AgentState::Paused => "paused",
            AgentState::Terminated => "terminated",
            AgentState::Error => "error",
        }
    }

    /// Parses a stored state.
    pub fn parse(name: &str) -> Option<AgentState> {
        match name {
            "active" => Some(AgentState::Active),
            "paused" => Some(AgentState::Paused),
            "terminated" => Some(AgentState::Terminated),
            _ => None,
        }
    }
}

/// What a change of agent state did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentStateChange {
    /// The image after the change.
    pub image: ImageRecord,
    /// Every image this change terminated: the image itself first, then its
    /// descendants by depth; empty when nothing became terminated.
    pub terminated_image_ids: Vec<String>,
}

/// What a caller asks for when creating an image; validated by the service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NewImage {
    pub container_id: String,
    /// `None` or blank means the default name, "New Conversation".
    pub name: Option<String>,
    /// `None` or empty means no description.
    pub description: Option<String>,
    /// `None` or empty means no system prompt.
    pub system_prompt: Option<String>,
    /// A JSON object of MCP server definitions; empty means none.
    pub mcp_servers_json: String,
    /// `None` or empty means no agent definition.
    pub agent: Option<String>,
    /// A JSON object of strings; empty means none.
    pub variables_json: String,
    /// Built-in tool names and `resource://tools/…` URIs; empty means none.
    pub tools: Vec<String>,
    /// A JSON object its clients own; empty means none.
    pub metadata_json: String,
    /// The image whose agent starts this one; `None` or empty means none.
    pub parent_image_id: Option<String>,
}

/// The changes to an image; `None` leaves a field as it is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageUpdate {
    /// A new, non-blank name.
    pub name: Option<String>,
    /// A new description; an empty one clears it.
    pub description: Option<String>,
    /// New tools, replacing the image's (empty: none).
    pub tools: Option<Vec<String>>,
    /// New metadata, a JSON object replacing the image's.
    pub metadata_json: Option<String>,
}

/// A turn a session's history leaves open: its last message is the user's
/// (or a tool call without its result), where every turn that ended stored
/// a reply or an error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenTurn {
    pub tenant_id: String,
    pub container_id: String,
    pub image_id: String,
    pub session_id: String,
    /// The turn's user message.
    pub user_message_id: String,
}

/// Where the model's reading of a conversation starts, and what stands for
/// the messages before it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compaction {
    /// The seq of `from_message_id` (set by the store).
    pub from_seq: u64,
    /// The first message the model still reads: a user message.
    pub from_message_id: String,
    /// `summarized` or `dropped`.
    pub method: String,
    /// What the model reads in place of the earlier messages; empty when dropped.
    pub summary: String,
    pub compacted_messages: u64,
    pub tokens_before: u64,
    pub tokens_after: u64,
    pub created_at_ms: i64,
}

/// What a truncation removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Truncated {
    pub removed_messages: u64,
    /// The seq of the last message kept; 0 when none is.
    pub last_seq: u64,
}

/// One entry of a session's history as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageRecord {
    pub message_id: String,
    pub session_id: String,
    /// Position in the session, from 1, assigned by the store.
    pub seq: u64,
    pub created_at_ms: i64,
    pub body: MessageBody,
}

/// A message to append; its id is chosen by the caller, its `seq` by the store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewMessage {
    pub message_id: String,
    /// Zero (or negative) means "now".
    pub created_at_ms: i64,
    pub body: MessageBody,
}

/// The token count an LLM reported for one assistant message.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// What a message says, by kind.
///
/// The serde form is the stored form (the store's `body` column), so fields
/// and tags here are renamed only with a migration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum MessageBody {
    /// What a user sent: JSON, a string or a list of parts (PROTOCOL.md).
    User { content_json: String },
    /// A complete, or interrupted, assistant reply.
    Assistant {
        text: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        usage: Option<Usage>,
        #[serde(default)]
        interrupted: bool,
        #[serde(default)]
        model: String,
        #[serde(default)]
        stop_reason: String,
        /// The exact resources the turn ran with (`resource://…@<version>`).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        resources: Vec<String>,
    },
    /// A tool call the assistant made.
    ToolCall {
        tool_call_id: String,
        tool_name: String,
        input_json: String,
        parent_id: String,
    },
    /// The outcome of a tool call.
    ToolResult {
        tool_call_id: String,
        tool_name: String,
        output: String,
        is_error: bool,
    },
    /// A turn that failed.
    Error { text: String, error_code: String },
}

impl MessageBody {
    /// Returns the stable name of this kind, as stored in the `kind` column.
    pub fn kind(&self) -> &'static str {
        match self {
            MessageBody::User { .. } => "user",
            MessageBody::Assistant { .. } => "assistant",
            MessageBody::ToolCall { .. } => "tool_call",
            MessageBody::ToolResult { .. } => "tool_result",
            MessageBody::Error { .. } => "error",
        }
    }

    /// Returns the bytes of text the message carries, the measure of its size limit.
    pub fn text_bytes(&self) -> usize {
        match self {
            MessageBody::User { content_json } => content_json.len(),
            MessageBody::Assistant {
                text,
                model,
                stop_reason,
                resources,
                ..
            } => text.len() + model.len() + stop_reason.len() + resources.iter().map(String::len).sum::<usize>(),
            MessageBody::ToolCall {
                tool_call_id,
                tool_name,
                input_json,
                parent_id,
            } => tool_call_id.len() + tool_name.len() + input_json.len() + parent_id.len(),
            MessageBody::ToolResult {
                tool_call_id,
                tool_name,
                output,
                ..
            } => tool_call_id.len() + tool_name.len() + output.len(),
            MessageBody::Error { text, error_code } => text.len() + error_code.len(),
        }
    }
}

/// What the session service announces to the runtimes: images a deletion
/// removed (one, or all of a container's), so they stop their agents; a
/// message new in a group, so they wake the agents it concerns; an image's
/// new tools, so an agent started with others stops.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "change", rename_all = "snake_case")]
pub enum SessionChange {
    Deleted {
        tenant_id: String,
        image_ids: Vec<String>,
    },
    Posted {
        tenant_id: String,
        group_id: String,
        seq: u64,
        message_id: String,
    },
    Retooled {
        tenant_id: String,
        image_id: String,
        tools: Vec<String>,
    },
    /// A change a user's devices are told of (`WatchUserEvents`), for the
    /// users it concerns: who made it and who owns the container.
    Lifecycle {
        tenant_id: String,
        users: Vec<String>,
        /// The request that made the change: the connection that sent it
        /// has its answer and is not told again.
        origin: String,
        what: Lifecycle,
    },
}

/// What changed in a container, as its users' devices are told.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Lifecycle {
    ContainerCreated {
        container_id: String,
        created_at_ms: i64,
    },
    ImageCreated(ImageSummary),
    ImageUpdated(ImageSummary),
    ImageDeleted {
        container_id: String,
        image_id: String,
        session_id: String,
    },
}

/// What a conversation list shows of an image; small enough for any change
/// feed (a Postgres notification holds at most 8,000 bytes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageSummary {
    pub image_id: String,
    pub container_id: String,
    pub session_id: String,
    pub name: String,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

impl ImageSummary {
    pub fn of(image: &ImageRecord) -> ImageSummary {
        ImageSummary {
            image_id: image.image_id.clone(),
            container_id: image.container_id.clone(),
            session_id: image.session_id.clone(),
            name: image.name.clone(),
            created_at_ms: image.created_at_ms,
            updated_at_ms: image.updated_at_ms,
        }
    }
}

/// What a watcher of the session's changes receives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchItem {
    /// From here on every change reaches the watcher.
    Live,
    Changed(SessionChange),
}

/// Whether a group member is an agent (an image) or a user.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemberKind {
    /// An image of the group's container; its member id is the image id.
    Agent,
    /// A user of the tenant; its member id is the user id.
    User,
}

impl MemberKind {
    /// Returns the stable name of this kind, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            MemberKind::Agent => "agent",
            MemberKind::User => "user",
        }
    }

    /// Parses a stored kind.
    pub fn parse(name: &str) -> Option<MemberKind> {
        match name {
            "agent" => Some(MemberKind::Agent),
            "user" => Some(MemberKind::User),
            _ => None,
        }
    }
}

/// Which agent members a group message wakes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WakeMode {
    /// Every agent member.
    #[default]
    All,
    /// Only the agents the message mentions.
    Mentions,
}

impl WakeMode {
    /// Returns the stable name of this mode, as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            WakeMode::All => "all",
            WakeMode::Mentions => "mentions",
        }
    }

    /// Parses a stored mode.
    pub fn parse(name: &str) -> Option<WakeMode> {
        match name {
            "all" => Some(WakeMode::All),
            "mentions" => Some(WakeMode::Mentions),
            _ => None,
        }
    }
}

/// Who a member (or a message's sender) is.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MemberRef {
    pub kind: MemberKind,
    pub member_id: String,
}

impl MemberRef {
    /// Returns the agent member of image `image_id`.
    pub fn agent(image_id: impl Into<String>) -> Self {
        Self {
            kind: MemberKind::Agent,
            member_id: image_id.into(),
        }
    }

    /// Returns the user member `user_id`.
    pub fn user(user_id: impl Into<String>) -> Self {
        Self {
            kind: MemberKind::User,
            member_id: user_id.into(),
        }
    }
}

/// A conversation of several agents and users inside one container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupRecord {
    pub group_id: String,
    pub container_id: String,
    pub name: String,
    pub wake_mode: WakeMode,
    /// The seq of the newest message; 0 when there is none.
    pub last_seq: u64,
    /// Messages since the last one a user sent (all of them when none did).
    pub consecutive_agent_messages: u64,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// What a caller asks for when creating a group; validated by the service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NewGroup {
    pub container_id: String,
    pub name: String,
    /// `None` means [`WakeMode::All`].
    pub wake_mode: Option<WakeMode>,
    /// The members it starts with, joined in the same transaction.
    pub members: Vec<MemberRef>,
}

/// The changes to a group; `None` leaves a field as it is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupUpdate {
    pub name: Option<String>,
    pub wake_mode: Option<WakeMode>,
}

/// One page of a container's groups, newest first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupPage {
    pub groups: Vec<GroupRecord>,
    /// Passed back to get the next page; `None` after the last one.
    pub next_page_token: Option<String>,
}

/// Where a page of groups starts: after this group in newest-first order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupCursor {
    pub created_at_ms: i64,
    pub group_id: String,
}

/// A member of a group and how far it has read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupMemberRecord {
    pub group_id: String,
    pub member: MemberRef,
    pub joined_at_ms: i64,
    /// The seq of the last message it read; 0 when none.
    pub read_seq: u64,
}

/// A message to post; the service fills in the id when the caller gave none.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewGroupMessage {
    /// The caller's idempotency key; `None` lets the service choose one.
    pub message_id: Option<String>,
    pub sender: MemberRef,
    pub content: String,
    /// Member ids the message mentions.
    pub mentions: Vec<String>,
    /// Zero (or negative) means "now".
    pub created_at_ms: i64,
    /// The last message the sender read before writing this one; `None`:
    /// everything up to its own.
    pub read_seq: Option<u64>,
}

/// What a post did: the message as stored, whether this post stored it, and
/// where its sender's read cursor is now (`None` when it could not be moved).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PostedGroupMessage {
    pub message: GroupMessageRecord,
    pub created: bool,
    pub sender_read_seq: Option<u64>,
}

/// A group message as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupMessageRecord {
    pub group_id: String,
    pub message_id: String,
    /// Position in the group, from 1, without gaps, assigned by the store.
    pub seq: u64,
    pub sender: MemberRef,
    pub content: String,
    pub mentions: Vec<String>,
    /// The group's count of consecutive agent messages including this one
    /// (0 for a user's message).
    pub consecutive_agent_messages: u64,
    pub created_at_ms: i64,
}

/// A group in which a member has unread messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnreadGroup {
    pub group: GroupRecord,
    /// The member's read cursor.
    pub read_seq: u64,
    /// Messages after the cursor: `group.last_seq - read_seq`.
    pub unread_count: u64,
    /// The first unread messages, oldest first, as many as asked for.
    pub messages: Vec<GroupMessageRecord>,
}
