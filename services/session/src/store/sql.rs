//! The statements and the `SessionStore` implementation shared by SQLite and Postgres.
//!
//! Both dialects accept `$N` placeholders, `RETURNING` and `ON CONFLICT … DO NOTHING`,
//! so one text serves both. The implementation is a macro expanded once per
//! concrete pool type: code generic over `sqlx::Database` needs higher-ranked
//! `Executor` bounds that the `Send` futures of `async_trait` do not satisfy.
//!
//! Every transaction starts with a write, and on SQLite with `BEGIN
//! IMMEDIATE` (each store's `BEGIN`): it takes its write lock up front, where
//! `busy_timeout` applies, instead of upgrading a read snapshot, which fails
//! at once with `SQLITE_BUSY` when another writer got in between.

use sqlx::{ColumnIndex, Decode, Row, Type};

use crate::error::SessionError;
use crate::record::{
    AgentState, Compaction, ContainerRecord, ImageRecord, MessageBody, MessageRecord, ShareRecord, ShareRole,
};
use crate::retention::{RetentionCandidate, RetentionPolicy, StoredPolicy};
use crate::search::SearchRow;

/// The condition that container `c` is visible to user `$u`: always when `$u`
/// is NULL (the whole tenant), else when the user owns it or it is shared
/// with them.
macro_rules! visible {
    ($c:literal, $u:literal) => {
        concat!(
            "(",
            $u,
            " IS NULL OR ",
            $c,
            ".owner_id = ",
            $u,
            " OR EXISTS (SELECT 1 FROM container_shares sh WHERE sh.tenant_id = ",
            $c,
            ".tenant_id",
            " AND sh.container_id = ",
            $c,
            ".container_id AND sh.user_id = ",
            $u,
            "))"
        )
    };
}

pub(super) use visible;

pub(super) const INSERT_CONTAINER: &str = "\
    INSERT INTO containers (tenant_id, container_id, owner_id, created_at_ms) VALUES ($1, $2, $3, $4) \
    ON CONFLICT (tenant_id, container_id) DO NOTHING";
pub(super) const SELECT_CONTAINER: &str = concat!(
    "SELECT c.container_id, c.owner_id, c.created_at_ms FROM containers c \
     WHERE c.tenant_id = $1 AND c.container_id = $2 AND ",
    visible!("c", "$3")
);
pub(super) const LIST_CONTAINERS: &str = concat!(
    "SELECT c.container_id, c.owner_id, c.created_at_ms FROM containers c WHERE c.tenant_id = $1 AND ",
    visible!("c", "$2"),
    " ORDER BY c.created_at_ms, c.container_id"
);
/// Locks a container's images without changing them and returns their ids.
///
/// Not a `DELETE … RETURNING`: SQLite runs `ON DELETE CASCADE` row by row, so
/// a child deleted with its parent before the statement reached it would be
/// missing from what the statement returns.
pub(super) const LOCK_CONTAINER_IMAGES: &str = "\
    UPDATE images SET agent_state = agent_state WHERE tenant_id = $1 AND container_id = $2 RETURNING image_id";
pub(super) const DELETE_CONTAINER: &str = "\
    DELETE FROM containers WHERE tenant_id = $1 AND container_id = $2";

/// Sharing again changes the role and keeps the first time.
pub(super) const INSERT_SHARE: &str = "\
    INSERT INTO container_shares (tenant_id, container_id, user_id, created_at_ms, role) VALUES ($1, $2, $3, $4, $5) \
    ON CONFLICT (tenant_id, container_id, user_id) DO UPDATE SET role = excluded.role";
/// The role of user `$3` on a container, when it is shared with them.
pub(super) const SELECT_SHARE_ROLE: &str = "\
    SELECT role FROM container_shares WHERE tenant_id = $1 AND container_id = $2 AND user_id = $3";
pub(super) const DELETE_SHARE: &str = "\
    DELETE FROM container_shares WHERE tenant_id = $1 AND container_id = $2 AND user_id = $3";
pub(super) const LIST_SHARES: &str = "\
    SELECT user_id, created_at_ms, role FROM container_shares \
    WHERE tenant_id = $1 AND container_id = $2 ORDER BY created_at_ms, user_id";

/// Inserts nothing when the container is missing or not visible, which is how
/// the caller learns it is.
pub(super) const INSERT_IMAGE: &str = concat!(
    "INSERT INTO images (image_id, tenant_id, container_id, name, description, system_prompt, \
                         mcp_servers_json, created_at_ms, updated_at_ms, agent, variables_json, tools_json, \
                         agent_state, parent_image_id, depth, metadata_json) \
     SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $11, $12, $13, $14, $15, $16, $17 FROM containers c \
     WHERE c.tenant_id = $2 AND c.container_id = $3 AND ",
    visible!("c", "$10")
);
/// `$5` is the seq of its newest message (0, or an import's last) and `$6`
/// the time of its last activity.
pub(super) const INSERT_SESSION: &str = "\
    INSERT INTO sessions (session_id, tenant_id, image_id, created_at_ms, last_seq, last_active_at_ms) \
    VALUES ($1, $2, $3, $4, $5, $6)";
/// Locks a visible container for the rest of the transaction without
/// changing it: imports into it run one after another.
pub(super) const LOCK_CONTAINER: &str = concat!(
    "UPDATE containers AS c SET created_at_ms = c.created_at_ms \
     WHERE c.tenant_id = $1 AND c.container_id = $2 AND ",
    visible!("c", "$3"),
    " RETURNING container_id"
);
pub(super) const INSERT_IMPORT: &str = "\
    INSERT INTO imports (tenant_id, container_id, document_id, image_id, created_at_ms) VALUES ($1, $2, $3, $4, $5)";

macro_rules! select_image {
    () => {
        "SELECT i.image_id, i.container_id, s.session_id, i.name, i.description, i.system_prompt, \
                i.mcp_servers_json, i.created_at_ms, i.updated_at_ms, i.agent, i.variables_json, i.tools_json, \
                i.agent_state, i.agent_error, i.parent_image_id, i.depth, i.metadata_json \
         FROM images i JOIN sessions s ON s.image_id = i.image_id \
         JOIN containers c ON c.tenant_id = i.tenant_id AND c.container_id = i.container_id "
    };
}
pub(super) const SELECT_IMAGE: &str = concat!(
    select_image!(),
    "WHERE i.tenant_id = $1 AND i.image_id = $2 AND ",
    visible!("c", "$3")
);
pub(super) const SELECT_SESSION_IMAGE: &str = concat!(
    select_image!(),
    "WHERE s.tenant_id = $1 AND s.session_id = $2 AND ",
    visible!("c", "$3")
);
/// The image an earlier import of document `$3` into container `$2` made.
pub(super) const SELECT_IMPORTED: &str = concat!(
    select_image!(),
    "JOIN imports x ON x.image_id = i.image_id \
     WHERE x.tenant_id = $1 AND x.container_id = $2 AND x.document_id = $3"
);
pub(super) const LIST_IMAGES: &str = concat!(
    select_image!(),
    "WHERE i.tenant_id = $1 AND ",
    visible!("c", "$2"),
    " ORDER BY i.created_at_ms DESC, i.image_id DESC"
);
pub(super) const LIST_CONTAINER_IMAGES: &str = concat!(
    select_image!(),
    "WHERE i.tenant_id = $1 AND i.container_id = $2 AND ",
    visible!("c", "$3"),
    " ORDER BY i.created_at_ms DESC, i.image_id DESC"
);

/// The condition that the `images` row being changed is visible to `$u`.
macro_rules! image_visible {
    ($u:literal) => {
        concat!(
            "EXISTS (SELECT 1 FROM containers c WHERE c.tenant_id = images.tenant_id \
             AND c.container_id = images.container_id AND ",
            visible!("c", $u),
            ")"
        )
    };
}
/// `$3` is the new name or NULL; `$4` says whether the description changes to `$5`.
pub(super) const UPDATE_IMAGE: &str = concat!(
    "UPDATE images SET name = COALESCE($3, name), \
                       description = CASE WHEN $4 THEN $5 ELSE description END, \
                       updated_at_ms = $6, \
                       tools_json = COALESCE($8, tools_json), \
                       metadata_json = COALESCE($9, metadata_json) \
     WHERE tenant_id = $1 AND image_id = $2 AND ",
    image_visible!("$7")
);
/// The direct children of a parent, newest first, through `images_by_parent`.
pub(super) const LIST_CHILD_IMAGES: &str = concat!(
    select_image!(),
    "WHERE i.tenant_id = $1 AND i.parent_image_id = $2 AND ",
    visible!("c", "$3"),
    " ORDER BY i.created_at_ms DESC, i.image_id DESC"
);

/// Locks a visible image for the rest of the transaction without changing
/// it and returns its state: a write, so the transaction starts with one,
/// that holds off a concurrent change of state, new child or deletion.
pub(super) const LOCK_IMAGE: &str = concat!(
    "UPDATE images SET agent_state = agent_state \
     WHERE tenant_id = $1 AND image_id = $2 AND ",
    image_visible!("$3"),
    " RETURNING agent_state, agent_error"
);
/// Sets the stored state `$3` and error `$5` (see [`stored_state`]).
pub(super) const SET_AGENT_STATE: &str = "\
    UPDATE images SET agent_state = $3, agent_error = $5, updated_at_ms = $4 \
    WHERE tenant_id = $1 AND image_id = $2";

/// The descendants of `$2` (children, grandchildren…), found through
/// `images_by_parent`; children live in their parent's tenant and container.
macro_rules! descendants {
    () => {
        "WITH RECURSIVE family (image_id) AS ( \
             SELECT image_id FROM images WHERE tenant_id = $1 AND parent_image_id = $2 \
             UNION ALL \
             SELECT i.image_id FROM images i JOIN family f ON i.parent_image_id = f.image_id) "
    };
}
/// Terminates the descendants of `$2` not yet terminated and returns them.
pub(super) const TERMINATE_DESCENDANTS: &str = concat!(
    descendants!(),
    "UPDATE images SET agent_state = 'terminated', updated_at_ms = $3 \
     WHERE image_id IN (SELECT image_id FROM family) AND agent_state <> 'terminated' \
     RETURNING image_id, depth"
);
/// The descendants of `$2`, by depth: what deleting it takes with it.
pub(super) const LIST_DESCENDANTS: &str = concat!(
    descendants!(),
    "SELECT i.image_id FROM images i JOIN family f ON f.image_id = i.image_id ORDER BY i.depth, i.image_id"
);
/// Locks a visible image as [`LOCK_IMAGE`] does, only while its session's
/// last activity is still `$4` and it has no children: what retention
/// chose is deleted only if nothing happened to it since.
pub(super) const LOCK_UNCHANGED_IMAGE: &str = concat!(
    "UPDATE images SET agent_state = agent_state \
     WHERE tenant_id = $1 AND image_id = $2 AND ",
    image_visible!("$3"),
    " AND EXISTS (SELECT 1 FROM sessions s WHERE s.image_id = images.image_id AND s.last_active_at_ms = $4) \
      AND NOT EXISTS (SELECT 1 FROM images c WHERE c.parent_image_id = images.image_id) \
     RETURNING agent_state, agent_error"
);
pub(super) const DELETE_IMAGE: &str = "DELETE FROM images WHERE tenant_id = $1 AND image_id = $2";

/// The condition that the `sessions` row is visible to `$u`.
macro_rules! session_visible {
    ($u:literal) => {
        concat!(
            "EXISTS (SELECT 1 FROM images i JOIN containers c \
             ON c.tenant_id = i.tenant_id AND c.container_id = i.container_id \
             WHERE i.image_id = sessions.image_id AND ",
            visible!("c", $u),
            ")"
        )
    };
}
/// Locks the session row for the rest of the transaction and claims the next seq.
pub(super) const BUMP_SEQ: &str = concat!(
    "UPDATE sessions SET last_seq = last_seq + 1, \
         last_active_at_ms = CASE WHEN $4 > last_active_at_ms THEN $4 ELSE last_active_at_ms END \
     WHERE tenant_id = $1 AND session_id = $2 AND ",
    session_visible!("$3"),
    " RETURNING last_seq"
);
pub(super) const INSERT_MESSAGE: &str = "\
    INSERT INTO messages (session_id, seq, message_id, kind, body, created_at_ms) \
    VALUES ($1, $2, $3, $4, $5, $6) \
    ON CONFLICT (session_id, message_id) DO NOTHING";
pub(super) const SELECT_MESSAGE: &str = "\
    SELECT message_id, session_id, seq, created_at_ms, body FROM messages \
    WHERE session_id = $1 AND message_id = $2";
pub(super) const SESSION_EXISTS: &str = concat!(
    "SELECT 1 FROM sessions WHERE tenant_id = $1 AND session_id = $2 AND ",
    session_visible!("$3")
);
pub(super) const LIST_MESSAGES: &str = "\
    SELECT message_id, session_id, seq, created_at_ms, body FROM messages \
    WHERE session_id = $1 ORDER BY seq";
/// Locks a visible session for the rest of the transaction without changing
/// it (a write, so the transaction starts with one); returns its image.
pub(super) const LOCK_SESSION: &str = concat!(
    "UPDATE sessions SET last_seq = last_seq WHERE tenant_id = $1 AND session_id = $2 AND ",
    session_visible!("$3"),
    " RETURNING image_id"
);
pub(super) const SELECT_MESSAGE_KIND: &str = "\
    SELECT seq, kind FROM messages WHERE session_id = $1 AND message_id = $2";
/// Deletes the messages after seq `$2`; the search index follows by trigger.
pub(super) const DELETE_MESSAGES_AFTER: &str = "DELETE FROM messages WHERE session_id = $1 AND seq > $2";
/// Sets the last seq back to `$2`, so the next message follows the kept ones.
pub(super) const REWIND_SEQ: &str = "UPDATE sessions SET last_seq = $2 WHERE session_id = $1";
/// Moves read markers past seq `$2` of image `$1` back to it: messages
/// written after a rewind reuse those seqs and are unread.
pub(super) const REWIND_READS: &str = "UPDATE image_reads SET read_seq = $2 WHERE image_id = $1 AND read_seq > $2";
/// Forgets the compactions whose first message a truncation after seq `$2` deleted.
pub(super) const DELETE_COMPACTIONS_AFTER: &str =
    "DELETE FROM context_compactions WHERE session_id = $1 AND from_seq > $2";
/// The latest compaction of a session.
pub(super) const SELECT_COMPACTION: &str = "\
    SELECT from_seq, from_message_id, method, summary, compacted_messages, tokens_before, tokens_after, created_at_ms \
    FROM context_compactions WHERE session_id = $1 ORDER BY from_seq DESC LIMIT 1";
/// Records a compaction; the same first message compacted again replaces it.
pub(super) const UPSERT_COMPACTION: &str = "\
    INSERT INTO context_compactions (session_id, from_seq, from_message_id, method, summary, compacted_messages, \
        tokens_before, tokens_after, created_at_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
    ON CONFLICT (session_id, from_seq) DO UPDATE SET from_message_id = excluded.from_message_id, \
        method = excluded.method, summary = excluded.summary, compacted_messages = excluded.compacted_messages, \
        tokens_before = excluded.tokens_before, tokens_after = excluded.tokens_after, \
        created_at_ms = excluded.created_at_ms";
/// A session's messages from seq `$2` on.
pub(super) const LIST_MESSAGES_FROM: &str = "\
    SELECT message_id, session_id, seq, created_at_ms, body FROM messages \
    WHERE session_id = $1 AND seq >= $2 ORDER BY seq";
/// The conversations of the scope (`$2` the visibility), most recently active
/// first, after the page ending at activity `$4` and session `$5` (NULL for
/// the first page), at most `$6`; each with its last message and reader
/// `$3`'s read marker. It walks `sessions_by_activity`.
pub(super) const LIST_RECENT: &str = concat!(
    "SELECT i.image_id, i.container_id, s.session_id, i.name, i.agent_state, i.agent_error, \
            i.created_at_ms AS image_created_at_ms, s.last_seq, s.last_active_at_ms, \
            COALESCE(r.read_seq, 0) AS read_seq, \
            m.message_id, m.seq, m.created_at_ms, m.body \
     FROM sessions s JOIN images i ON i.image_id = s.image_id \
     JOIN containers c ON c.tenant_id = i.tenant_id AND c.container_id = i.container_id \
     LEFT JOIN image_reads r ON r.image_id = i.image_id AND r.user_id = $3 \
     LEFT JOIN messages m ON m.session_id = s.session_id AND m.seq = s.last_seq \
     WHERE s.tenant_id = $1 AND ",
    visible!("c", "$2"),
    " AND ($4 IS NULL OR s.last_active_at_ms < $4 OR (s.last_active_at_ms = $4 AND s.session_id < $5)) \
     ORDER BY s.last_active_at_ms DESC, s.session_id DESC LIMIT $6"
);
/// Moves reader `$3`'s marker of a visible image (`$2`; `$5` the visibility)
/// to seq `$4` (NULL: its last message), never past its last message nor
/// backwards; returns the marker.
pub(super) const MARK_READ: &str = concat!(
    "INSERT INTO image_reads (tenant_id, image_id, user_id, read_seq, updated_at_ms) \
     SELECT i.tenant_id, i.image_id, $3, \
            CASE WHEN $4 IS NULL OR $4 > s.last_seq THEN s.last_seq ELSE $4 END, $6 \
     FROM images i JOIN sessions s ON s.image_id = i.image_id \
     JOIN containers c ON c.tenant_id = i.tenant_id AND c.container_id = i.container_id \
     WHERE i.tenant_id = $1 AND i.image_id = $2 AND ",
    visible!("c", "$5"),
    " ON CONFLICT (image_id, user_id) DO UPDATE SET \
         read_seq = CASE WHEN excluded.read_seq > image_reads.read_seq THEN excluded.read_seq \
                         ELSE image_reads.read_seq END, \
         updated_at_ms = excluded.updated_at_ms \
     RETURNING read_seq"
);
/// At most `$3` messages of a session after seq `$2`.
pub(super) const LIST_MESSAGES_PAGE: &str = "\
    SELECT message_id, session_id, seq, created_at_ms, body FROM messages \
    WHERE session_id = $1 AND seq > $2 ORDER BY seq LIMIT $3";

/// The sessions whose last message, stored before `$1`, leaves a turn open,
/// after session `$2`, at most `$3`: one index lookup per session.
pub(super) const LIST_OPEN_TURNS: &str = "\
    SELECT s.tenant_id, i.container_id, s.image_id, s.session_id, \
      (SELECT u.message_id FROM messages u WHERE u.session_id = s.session_id AND u.kind = 'user' \
       ORDER BY u.seq DESC LIMIT 1) AS user_message_id \
    FROM sessions s \
    JOIN messages m ON m.session_id = s.session_id AND m.seq = s.last_seq \
    JOIN images i ON i.image_id = s.image_id \
    WHERE m.kind IN ('user', 'tool_call') AND m.created_at_ms < $1 AND s.session_id > $2 \
    ORDER BY s.session_id LIMIT $3";

/// Reads a compaction row.
pub(super) fn compaction_from_row<'r, R>(row: &'r R) -> Result<Compaction, SessionError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    String: Decode<'r, R::Database> + Type<R::Database>,
{
    let count = |name: &'r str| -> Result<u64, SessionError> {
        let value: i64 = row.try_get(name)?;
        u64::try_from(value).map_err(|_| SessionError::corrupt(format!("compaction {name} {value}")))
    };
    Ok(Compaction {
        from_seq: count("from_seq")?,
        from_message_id: row.try_get("from_message_id")?,
        method: row.try_get("method")?,
        summary: row.try_get("summary")?,
        compacted_messages: count("compacted_messages")?,
        tokens_before: count("tokens_before")?,
        tokens_after: count("tokens_after")?,
        created_at_ms: row.try_get("created_at_ms")?,
    })
}

/// A tenant's retention policy.
pub(super) const SELECT_RETENTION: &str = "\
    SELECT message_days, idle_conversation_days, max_conversations_per_container, updated_at_ms \
    FROM retention_policies WHERE tenant_id = $1";
/// Sets a tenant's retention policy, all of it.
pub(super) const UPSERT_RETENTION: &str = "\
    INSERT INTO retention_policies (tenant_id, message_days, idle_conversation_days, \
                                    max_conversations_per_container, updated_at_ms, updated_by) \
    VALUES ($1, $2, $3, $4, $5, $6) \
    ON CONFLICT (tenant_id) DO UPDATE SET message_days = excluded.message_days, \
        idle_conversation_days = excluded.idle_conversation_days, \
        max_conversations_per_container = excluded.max_conversations_per_container, \
        updated_at_ms = excluded.updated_at_ms, updated_by = excluded.updated_by";
/// The policies that delete something, by tenant id after `$1`, at most `$2`.
pub(super) const LIST_RETENTION: &str = "\
    SELECT tenant_id, message_days, idle_conversation_days, max_conversations_per_container, updated_at_ms \
    FROM retention_policies \
    WHERE tenant_id > $1 AND (message_days IS NOT NULL OR idle_conversation_days IS NOT NULL \
                              OR max_conversations_per_container IS NOT NULL) \
    ORDER BY tenant_id LIMIT $2";

/// At most `$3` messages of tenant `$1` written before `$2`: each of the
/// tenant's sessions (`sessions_by_activity`), then its old messages alone
/// (`messages_by_age`).
macro_rules! old_messages {
    () => {
        "SELECT m.session_id, m.seq FROM sessions s JOIN messages m ON m.session_id = s.session_id \
         WHERE s.tenant_id = $1 AND m.created_at_ms < $2 LIMIT $3"
    };
}
pub(super) const COUNT_OLD_MESSAGES: &str = concat!("SELECT COUNT(*) FROM (", old_messages!(), ") old");
pub(super) const DELETE_OLD_MESSAGES: &str = concat!(
    "DELETE FROM messages WHERE (session_id, seq) IN (",
    old_messages!(),
    ")"
);
/// The conversations of tenant `$1` last active before `$2`, least recently
/// active first, at most `$3`. Only images without children: deleting one
/// never takes a child still in use with it (its parent's turn comes once
/// the children are gone).
pub(super) const LIST_IDLE_IMAGES: &str = "\
    SELECT i.image_id, i.container_id, s.session_id, s.last_active_at_ms \
    FROM sessions s JOIN images i ON i.image_id = s.image_id \
    WHERE s.tenant_id = $1 AND s.last_active_at_ms < $2 \
      AND NOT EXISTS (SELECT 1 FROM images c WHERE c.parent_image_id = i.image_id) \
    ORDER BY s.last_active_at_ms, s.session_id LIMIT $3";
/// The conversations of tenant `$1` beyond the `$2` most recently active of
/// their container, least recently active first, at most `$3`; images
/// without children only, as for idle ones.
pub(super) const LIST_EXCESS_IMAGES: &str = "\
    SELECT r.image_id, r.container_id, r.session_id, r.last_active_at_ms FROM ( \
        SELECT i.image_id, i.container_id, s.session_id, s.last_active_at_ms, \
               ROW_NUMBER() OVER (PARTITION BY i.container_id \
                                  ORDER BY s.last_active_at_ms DESC, s.session_id DESC) AS place \
        FROM sessions s JOIN images i ON i.image_id = s.image_id WHERE s.tenant_id = $1) r \
    WHERE r.place > $2 AND NOT EXISTS (SELECT 1 FROM images c WHERE c.parent_image_id = r.image_id) \
    ORDER BY r.last_active_at_ms, r.session_id LIMIT $3";

/// Reads a container row.
pub(super) fn container_from_row<'r, R>(row: &'r R) -> Result<ContainerRecord, SessionError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(ContainerRecord {
        container_id: row.try_get("container_id")?,
        owner_id: row.try_get("owner_id")?,
        created_at_ms: row.try_get("created_at_ms")?,
    })
}

/// Reads a share row.
pub(super) fn share_from_row<'r, R>(row: &'r R) -> Result<ShareRecord, SessionError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let role: String = row.try_get("role")?;
    Ok(ShareRecord {
        user_id: row.try_get("user_id")?,
        created_at_ms: row.try_get("created_at_ms")?,
        role: share_role_from(&role)?,
    })
}

/// Reads a row of `select_image!`.
pub(super) fn image_from_row<'r, R>(row: &'r R) -> Result<ImageRecord, SessionError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Option<String>: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let agent_state: String = row.try_get("agent_state")?;
    let agent_error: Option<String> = row.try_get("agent_error")?;
    let agent_state = agent_state_of(&agent_state, agent_error.as_deref())?;
    let depth: i64 = row.try_get("depth")?;
    Ok(ImageRecord {
        image_id: row.try_get("image_id")?,
        container_id: row.try_get("container_id")?,
        session_id: row.try_get("session_id")?,
        name: row.try_get("name")?,
        description: row.try_get("description")?,
        system_prompt: row.try_get("system_prompt")?,
        mcp_servers_json: row.try_get("mcp_servers_json")?,
        agent: row.try_get("agent")?,
        variables_json: row.try_get("variables_json")?,
        metadata_json: row.try_get("metadata_json")?,
        tools: serde_json::from_str(&row.try_get::<String, _>("tools_json")?)
            .map_err(|_| SessionError::corrupt("images.tools_json"))?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
        agent_error: agent_error.filter(|_| agent_state == AgentState::Error),
        agent_state,
        parent_image_id: row.try_get("parent_image_id")?,
        depth: u32::try_from(depth).map_err(|_| SessionError::corrupt(format!("images.depth is {depth}")))?,
    })
}

/// Parses a stored share role.
pub(super) fn share_role_from(name: &str) -> Result<ShareRole, SessionError> {
    ShareRole::parse(name).ok_or_else(|| SessionError::corrupt(format!("share role {name:?}")))
}

/// Parses a stored agent state.
pub(super) fn agent_state_from(name: &str) -> Result<AgentState, SessionError> {
    AgentState::parse(name).ok_or_else(|| SessionError::corrupt(format!("agent state {name:?}")))
}

/// Returns the state a stored state and error make: an active agent with an
/// error is in the `Error` state.
pub(super) fn agent_state_of(name: &str, error: Option<&str>) -> Result<AgentState, SessionError> {
    Ok(match (agent_state_from(name)?, error) {
        (AgentState::Active, Some(_)) => AgentState::Error,
        (state, _) => state,
    })
}

/// Returns how a state is stored: its `agent_state` and `agent_error`.
pub(super) fn stored_state(state: AgentState, error: Option<&str>) -> (&'static str, Option<&str>) {
    match state {
        AgentState::Error => ("active", Some(error.unwrap_or("failed"))),
        state => (state.as_str(), None),
    }
}

/// Reads a message row, decoding its JSON body.
pub(super) fn message_from_row<'r, R>(row: &'r R) -> Result<MessageRecord, SessionError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    &'r str: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let message_id: String = row.try_get("message_id")?;
    let seq: i64 = row.try_get("seq")?;
    let seq = u64::try_from(seq).map_err(|_| SessionError::corrupt(format!("message {message_id} has seq {seq}")))?;
    let body: &str = row.try_get("body")?;
    let body = decode_body(body).map_err(|err| SessionError::corrupt(format!("message {message_id}: {err}")))?;
    Ok(MessageRecord {
        message_id,
        session_id: row.try_get("session_id")?,
        seq,
        created_at_ms: row.try_get("created_at_ms")?,
        body,
    })
}

/// Reads a row of `LIST_RECENT`.
pub(super) fn recent_from_row<'r, R>(row: &'r R) -> Result<crate::recent::RecentRow, SessionError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Option<String>: Decode<'r, R::Database> + Type<R::Database>,
    &'r str: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let count =
        |name: &str, value: i64| u64::try_from(value).map_err(|_| SessionError::corrupt(format!("{name} is {value}")));
    let agent_state: String = row.try_get("agent_state")?;
    let agent_error: Option<String> = row.try_get("agent_error")?;
    let message_id: Option<String> = row.try_get("message_id")?;
    Ok(crate::recent::RecentRow {
        image_id: row.try_get("image_id")?,
        container_id: row.try_get("container_id")?,
        session_id: row.try_get("session_id")?,
        name: row.try_get("name")?,
        agent_state: agent_state_of(&agent_state, agent_error.as_deref())?,
        created_at_ms: row.try_get("image_created_at_ms")?,
        last_seq: count("sessions.last_seq", row.try_get("last_seq")?)?,
        last_active_at_ms: row.try_get("last_active_at_ms")?,
        read_seq: count("image_reads.read_seq", row.try_get("read_seq")?)?,
        last_message: message_id.map(|_| message_from_row(row)).transpose()?,
    })
}

/// Reads a row of `SELECT_RETENTION` or `LIST_RETENTION`.
pub(super) fn policy_from_row<'r, R>(row: &'r R) -> Result<StoredPolicy, SessionError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    Option<i64>: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let bound = |name: &'r str| -> Result<Option<u32>, SessionError> {
        let value: Option<i64> = row.try_get(name)?;
        value
            .map(|value| u32::try_from(value).map_err(|_| SessionError::corrupt(format!("{name} is {value}"))))
            .transpose()
    };
    Ok(StoredPolicy {
        policy: RetentionPolicy {
            message_days: bound("message_days")?,
            idle_conversation_days: bound("idle_conversation_days")?,
            max_conversations_per_container: bound("max_conversations_per_container")?,
        },
        updated_at_ms: row.try_get("updated_at_ms")?,
    })
}

/// Reads a row of `LIST_IDLE_IMAGES` or `LIST_EXCESS_IMAGES`.
pub(super) fn candidate_from_row<'r, R>(row: &'r R) -> Result<RetentionCandidate, SessionError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(RetentionCandidate {
        image_id: row.try_get("image_id")?,
        container_id: row.try_get("container_id")?,
        session_id: row.try_get("session_id")?,
        last_active_at_ms: row.try_get("last_active_at_ms")?,
    })
}

/// Reads a row of a store's `SEARCH` statement.
pub(super) fn search_row_from_row<'r, R>(row: &'r R) -> Result<SearchRow, SessionError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    Option<String>: Decode<'r, R::Database> + Type<R::Database>,
    &'r str: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    f64: Decode<'r, R::Database> + Type<R::Database>,
{
    let message_id: Option<String> = row.try_get("message_id")?;
    Ok(SearchRow {
        container_id: row.try_get("container_id")?,
        image_id: row.try_get("image_id")?,
        session_id: row.try_get("session_id")?,
        image_name: row.try_get("image_name")?,
        score: row.try_get("score")?,
        at_ms: row.try_get("at_ms")?,
        message: message_id.map(|_| message_from_row(row)).transpose()?,
    })
}

/// The filters of a `SEARCH` statement, `$4`… of it, for one arm: `$4` the
/// container, `$5` the image, `$6` the kind, `$7`/`$8` the time range (each
/// NULL for any), on the arm's images `i` and time column.
macro_rules! search_filters {
    ($at:literal) => {
        concat!(
            " AND i.tenant_id = $2 AND ",
            visible!("c", "$3"),
            " AND ($4 IS NULL OR i.container_id = $4) AND ($5 IS NULL OR i.image_id = $5)",
            " AND ($7 IS NULL OR ",
            $at,
            " >= $7) AND ($8 IS NULL OR ",
            $at,
            " < $8)"
        )
    };
}

pub(super) use search_filters;

/// Maps the foreign-key failure of an image insert to `ContainerNotFound`.
///
/// On Postgres the container can be deleted after the insert saw it and before
/// its foreign-key check ran; that is the same outcome as never finding it.
pub(super) fn missing_container(err: sqlx::Error, container_id: &str) -> SessionError {
    match &err {
        sqlx::Error::Database(db) if db.is_foreign_key_violation() => {
            SessionError::ContainerNotFound(container_id.to_owned())
        }
        _ => SessionError::from(err),
    }
}

/// Returns the stored form of a message body: its kind and its JSON text.
pub(super) fn encode_body(body: &MessageBody) -> Result<(&'static str, String), SessionError> {
    let json =
        serde_json::to_string(body).map_err(|err| SessionError::corrupt(format!("cannot encode body: {err}")))?;
    Ok((body.kind(), json))
}

fn decode_body(json: &str) -> Result<MessageBody, serde_json::Error> {
    serde_json::from_str(json)
}

/// Implements `SessionStore` for a struct with a `pool: sqlx::Pool<$db>` field.
macro_rules! impl_session_store {
    ($store:ty, $db:ty) => {
        /// Inserts an image and its session whose newest message is
        /// `last_seq`; false when the image's container is not visible.
        async fn insert_image_rows(
            tx: &mut sqlx::Transaction<'_, $db>,
            scope: &$crate::store::Scope<'_>,
            image: &$crate::record::ImageRecord,
            last_seq: i64,
            last_active_at_ms: i64,
        ) -> Result<bool, $crate::error::SessionError> {
            use $crate::store::sql;
            let inserted = sqlx::query(sql::INSERT_IMAGE)
                .bind(&image.image_id)
                .bind(scope.tenant_id)
                .bind(&image.container_id)
                .bind(&image.name)
                .bind(&image.description)
                .bind(&image.system_prompt)
                .bind(&image.mcp_servers_json)
                .bind(image.created_at_ms)
                .bind(image.updated_at_ms)
                .bind(scope.user_id)
                .bind(&image.agent)
                .bind(&image.variables_json)
                .bind(serde_json::Value::from(image.tools.clone()).to_string())
                .bind(image.agent_state.as_str())
                .bind(&image.parent_image_id)
                .bind(i64::from(image.depth))
                .bind(&image.metadata_json)
                .execute(&mut **tx)
                .await
                .map_err(|err| sql::missing_container(err, &image.container_id))?
                .rows_affected();
            if inserted == 0 {
                return Ok(false);
            }
            sqlx::query(sql::INSERT_SESSION)
                .bind(&image.session_id)
                .bind(scope.tenant_id)
                .bind(&image.image_id)
                .bind(image.created_at_ms)
                .bind(last_seq)
                .bind(last_active_at_ms)
                .execute(&mut **tx)
                .await?;
            Ok(true)
        }

        /// Deletes a visible image with its descendants, their sessions and
        /// messages, in one transaction; with `unchanged`, only while its
        /// session's last activity is that and it has no children. Returns
        /// the deleted image ids, the image first; `ImageNotFound` when
        /// nothing was deleted.
        async fn delete_image_rows(
            pool: &sqlx::Pool<$db>,
            scope: &$crate::store::Scope<'_>,
            image_id: &str,
            unchanged: Option<i64>,
        ) -> Result<Vec<String>, $crate::error::SessionError> {
            use $crate::store::sql;
            let mut tx = pool.begin_with(<$store>::BEGIN).await?;
            let lock = match unchanged {
                None => sqlx::query(sql::LOCK_IMAGE)
                    .bind(scope.tenant_id)
                    .bind(image_id)
                    .bind(scope.user_id),
                Some(last_active_at_ms) => sqlx::query(sql::LOCK_UNCHANGED_IMAGE)
                    .bind(scope.tenant_id)
                    .bind(image_id)
                    .bind(scope.user_id)
                    .bind(last_active_at_ms),
            };
            if lock.fetch_optional(&mut *tx).await?.is_none() {
                tx.rollback().await?;
                return Err($crate::error::SessionError::ImageNotFound(image_id.to_owned()));
            }
            // The cascade takes the descendants with the image, and the
            // sessions and messages of all of them; their ids are read
            // first so the runtimes hear of every agent that is gone.
            let mut image_ids = vec![image_id.to_owned()];
            image_ids.extend(
                sqlx::query_scalar::<$db, String>(sql::LIST_DESCENDANTS)
                    .bind(scope.tenant_id)
                    .bind(image_id)
                    .fetch_all(&mut *tx)
                    .await?,
            );
            sqlx::query(sql::DELETE_IMAGE)
                .bind(scope.tenant_id)
                .bind(image_id)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(image_ids)
        }

        #[async_trait::async_trait]
        impl $crate::store::SessionStore for $store {
            async fn create_container(
                &self,
                scope: &$crate::store::Scope<'_>,
                container_id: &str,
                owner_id: &str,
                now_ms: i64,
            ) -> Result<($crate::record::ContainerRecord, bool), $crate::error::SessionError> {
                use $crate::store::sql;
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                let inserted = sqlx::query(sql::INSERT_CONTAINER)
                    .bind(scope.tenant_id)
                    .bind(container_id)
                    .bind(owner_id)
                    .bind(now_ms)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                let row = sqlx::query(sql::SELECT_CONTAINER)
                    .bind(scope.tenant_id)
                    .bind(container_id)
                    .bind(scope.user_id)
                    .fetch_optional(&mut *tx)
                    .await?;
                let Some(row) = row else {
                    tx.rollback().await?;
                    return Err($crate::error::SessionError::ContainerIdTaken(
                        container_id.to_owned(),
                    ));
                };
                let container = sql::container_from_row(&row)?;
                tx.commit().await?;
                Ok((container, inserted == 1))
            }

            async fn get_container(
                &self,
                scope: &$crate::store::Scope<'_>,
                container_id: &str,
            ) -> Result<$crate::record::ContainerRecord, $crate::error::SessionError> {
                use $crate::store::sql;
                let row = sqlx::query(sql::SELECT_CONTAINER)
                    .bind(scope.tenant_id)
                    .bind(container_id)
                    .bind(scope.user_id)
                    .fetch_optional(&self.pool)
                    .await?
                    .ok_or_else(|| $crate::error::SessionError::ContainerNotFound(container_id.to_owned()))?;
                sql::container_from_row(&row)
            }

            async fn list_containers(
                &self,
                scope: &$crate::store::Scope<'_>,
            ) -> Result<Vec<$crate::record::ContainerRecord>, $crate::error::SessionError> {
                use $crate::store::sql;
                let rows = sqlx::query(sql::LIST_CONTAINERS)
                    .bind(scope.tenant_id)
                    .bind(scope.user_id)
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| sql::container_from_row(row)).collect()
            }

            async fn delete_container(
                &self,
                scope: &$crate::store::Scope<'_>,
                container_id: &str,
            ) -> Result<Vec<String>, $crate::error::SessionError> {
                use $crate::store::sql;
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                // The images' ids are read first, by a write so the
                // transaction starts with one; the cascade takes the images
                // with their sessions and messages. Ownership is checked
                // before commit.
                let image_ids: Vec<String> = sqlx::query_scalar(sql::LOCK_CONTAINER_IMAGES)
                    .bind(scope.tenant_id)
                    .bind(container_id)
                    .fetch_all(&mut *tx)
                    .await?;
                let row = sqlx::query(sql::SELECT_CONTAINER)
                    .bind(scope.tenant_id)
                    .bind(container_id)
                    .bind(scope.user_id)
                    .fetch_optional(&mut *tx)
                    .await?;
                let Some(row) = row else {
                    tx.rollback().await?;
                    return Err($crate::error::SessionError::ContainerNotFound(
                        container_id.to_owned(),
                    ));
                };
                let container = sql::container_from_row(&row)?;
                if scope.user_id.is_some_and(|user| user != container.owner_id) {
                    tx.rollback().await?;
                    return Err($crate::error::SessionError::NotContainerOwner(
                        container_id.to_owned(),
                    ));
                }
                sqlx::query(sql::DELETE_CONTAINER)
                    .bind(scope.tenant_id)
                    .bind(container_id)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(image_ids)
            }

            async fn share_container(
                &self,
                scope: &$crate::store::Scope<'_>,
                container_id: &str,
                user_id: &str,
                role: $crate::record::ShareRole,
                now_ms: i64,
            ) -> Result<(), $crate::error::SessionError> {
                use $crate::store::sql;
                let container = self.get_container(scope, container_id).await?;
                if scope.user_id.is_some_and(|user| user != container.owner_id) {
                    return Err($crate::error::SessionError::NotContainerOwner(
                        container_id.to_owned(),
                    ));
                }
                // The foreign key makes a share of a container deleted meanwhile fail.
                sqlx::query(sql::INSERT_SHARE)
                    .bind(scope.tenant_id)
                    .bind(container_id)
                    .bind(user_id)
                    .bind(now_ms)
                    .bind(role.as_str())
                    .execute(&self.pool)
                    .await
                    .map_err(|err| sql::missing_container(err, container_id))?;
                Ok(())
            }

            async fn container_access(
                &self,
                scope: &$crate::store::Scope<'_>,
                container_id: &str,
            ) -> Result<$crate::record::ContainerAccess, $crate::error::SessionError> {
                use $crate::record::ContainerAccess;
                use $crate::store::sql;
                let container = self.get_container(scope, container_id).await?;
                let Some(user) = scope.user_id.filter(|user| *user != container.owner_id) else {
                    return Ok(ContainerAccess::Full);
                };
                let role: Option<String> = sqlx::query_scalar(sql::SELECT_SHARE_ROLE)
                    .bind(scope.tenant_id)
                    .bind(container_id)
                    .bind(user)
                    .fetch_optional(&self.pool)
                    .await?;
                // Unshared between the two statements: as if never seen.
                let role =
                    role.ok_or_else(|| $crate::error::SessionError::ContainerNotFound(container_id.to_owned()))?;
                Ok(ContainerAccess::Shared(sql::share_role_from(&role)?))
            }

            async fn unshare_container(
                &self,
                scope: &$crate::store::Scope<'_>,
                container_id: &str,
                user_id: &str,
            ) -> Result<(), $crate::error::SessionError> {
                use $crate::store::sql;
                let container = self.get_container(scope, container_id).await?;
                if scope.user_id.is_some_and(|user| user != container.owner_id) {
                    return Err($crate::error::SessionError::NotContainerOwner(
                        container_id.to_owned(),
                    ));
                }
                sqlx::query(sql::DELETE_SHARE)
                    .bind(scope.tenant_id)
                    .bind(container_id)
                    .bind(user_id)
                    .execute(&self.pool)
                    .await?;
                Ok(())
            }

            async fn list_shares(
                &self,
                scope: &$crate::store::Scope<'_>,
                container_id: &str,
            ) -> Result<Vec<$crate::record::ShareRecord>, $crate::error::SessionError> {
                use $crate::store::sql;
                self.get_container(scope, container_id).await?;
                let rows = sqlx::query(sql::LIST_SHARES)
                    .bind(scope.tenant_id)
                    .bind(container_id)
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| sql::share_from_row(row)).collect()
            }

            async fn create_image(
                &self,
                scope: &$crate::store::Scope<'_>,
                image: &$crate::record::ImageRecord,
            ) -> Result<(), $crate::error::SessionError> {
                use $crate::store::sql;
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                if let Some(parent_id) = &image.parent_image_id {
                    // The service checked the parent; holding it until commit
                    // keeps it from being terminated or deleted meanwhile.
                    let state = sqlx::query_scalar::<$db, String>(sql::LOCK_IMAGE)
                        .bind(scope.tenant_id)
                        .bind(parent_id)
                        .bind(scope.user_id)
                        .fetch_optional(&mut *tx)
                        .await?;
                    let failure = match state.as_deref().map(sql::agent_state_from).transpose()? {
                        None => Some($crate::error::SessionError::ImageNotFound(parent_id.clone())),
                        Some($crate::record::AgentState::Terminated) => {
                            Some($crate::error::SessionError::AgentTerminated(parent_id.clone()))
                        }
                        Some(_) => None,
                    };
                    if let Some(failure) = failure {
                        tx.rollback().await?;
                        return Err(failure);
                    }
                }
                if !insert_image_rows(&mut tx, scope, image, 0, image.created_at_ms).await? {
                    tx.rollback().await?;
                    return Err($crate::error::SessionError::ContainerNotFound(
                        image.container_id.clone(),
                    ));
                }
                tx.commit().await?;
                Ok(())
            }

            async fn get_image(
                &self,
                scope: &$crate::store::Scope<'_>,
                image_id: &str,
            ) -> Result<$crate::record::ImageRecord, $crate::error::SessionError> {
                use $crate::store::sql;
                let row = sqlx::query(sql::SELECT_IMAGE)
                    .bind(scope.tenant_id)
                    .bind(image_id)
                    .bind(scope.user_id)
                    .fetch_optional(&self.pool)
                    .await?
                    .ok_or_else(|| $crate::error::SessionError::ImageNotFound(image_id.to_owned()))?;
                sql::image_from_row(&row)
            }

            async fn get_session_image(
                &self,
                scope: &$crate::store::Scope<'_>,
                session_id: &str,
            ) -> Result<$crate::record::ImageRecord, $crate::error::SessionError> {
                use $crate::store::sql;
                let row = sqlx::query(sql::SELECT_SESSION_IMAGE)
                    .bind(scope.tenant_id)
                    .bind(session_id)
                    .bind(scope.user_id)
                    .fetch_optional(&self.pool)
                    .await?
                    .ok_or_else(|| $crate::error::SessionError::SessionNotFound(session_id.to_owned()))?;
                sql::image_from_row(&row)
            }

            async fn list_images(
                &self,
                scope: &$crate::store::Scope<'_>,
                container_id: Option<&str>,
            ) -> Result<Vec<$crate::record::ImageRecord>, $crate::error::SessionError> {
                use $crate::store::sql;
                let rows = match container_id {
                    Some(container_id) => {
                        sqlx::query(sql::LIST_CONTAINER_IMAGES)
                            .bind(scope.tenant_id)
                            .bind(container_id)
                            .bind(scope.user_id)
                            .fetch_all(&self.pool)
                            .await?
                    }
                    None => {
                        sqlx::query(sql::LIST_IMAGES)
                            .bind(scope.tenant_id)
                            .bind(scope.user_id)
                            .fetch_all(&self.pool)
                            .await?
                    }
                };
                rows.iter().map(|row| sql::image_from_row(row)).collect()
            }

            async fn list_child_images(
                &self,
                scope: &$crate::store::Scope<'_>,
                parent_image_id: &str,
            ) -> Result<Vec<$crate::record::ImageRecord>, $crate::error::SessionError> {
                use $crate::store::sql;
                let rows = sqlx::query(sql::LIST_CHILD_IMAGES)
                    .bind(scope.tenant_id)
                    .bind(parent_image_id)
                    .bind(scope.user_id)
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| sql::image_from_row(row)).collect()
            }

            async fn set_agent_state(
                &self,
                scope: &$crate::store::Scope<'_>,
                image_id: &str,
                state: $crate::record::AgentState,
                error: Option<&str>,
                now_ms: i64,
            ) -> Result<$crate::record::AgentStateChange, $crate::error::SessionError> {
                use $crate::record::AgentState;
                use $crate::store::sql;
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                let Some((current, current_error)) = sqlx::query_as::<$db, (String, Option<String>)>(sql::LOCK_IMAGE)
                    .bind(scope.tenant_id)
                    .bind(image_id)
                    .bind(scope.user_id)
                    .fetch_optional(&mut *tx)
                    .await?
                else {
                    tx.rollback().await?;
                    return Err($crate::error::SessionError::ImageNotFound(image_id.to_owned()));
                };
                let current = sql::agent_state_of(&current, current_error.as_deref())?;
                let mut terminated_image_ids = Vec::new();
                match (current, state) {
                    (AgentState::Terminated, AgentState::Terminated) => {}
                    (AgentState::Terminated, _) => {
                        tx.rollback().await?;
                        return Err($crate::error::SessionError::AgentTerminated(image_id.to_owned()));
                    }
                    // A failure of a turn cut by the pause: paused it stays.
                    (AgentState::Paused, AgentState::Error) => {}
                    (current, state) if current == state && state != AgentState::Error => {}
                    (_, state) => {
                        let (stored, error) = sql::stored_state(state, error);
                        sqlx::query(sql::SET_AGENT_STATE)
                            .bind(scope.tenant_id)
                            .bind(image_id)
                            .bind(stored)
                            .bind(now_ms)
                            .bind(error)
                            .execute(&mut *tx)
                            .await?;
                    }
                }
                if current != AgentState::Terminated && state == AgentState::Terminated {
                    terminated_image_ids.push(image_id.to_owned());
                    // Each pass sees what committed before it started: a child
                    // created under a descendant while the previous pass waited
                    // for that descendant's lock is taken by the next one.
                    let mut descendants: Vec<(i64, String)> = Vec::new();
                    loop {
                        let rows = sqlx::query(sql::TERMINATE_DESCENDANTS)
                            .bind(scope.tenant_id)
                            .bind(image_id)
                            .bind(now_ms)
                            .fetch_all(&mut *tx)
                            .await?;
                        if rows.is_empty() {
                            break;
                        }
                        for row in &rows {
                            use sqlx::Row as _;
                            descendants.push((row.try_get("depth")?, row.try_get("image_id")?));
                        }
                    }
                    descendants.sort();
                    terminated_image_ids.extend(descendants.into_iter().map(|(_, id)| id));
                }
                let row = sqlx::query(sql::SELECT_IMAGE)
                    .bind(scope.tenant_id)
                    .bind(image_id)
                    .bind(scope.user_id)
                    .fetch_one(&mut *tx)
                    .await?;
                let image = sql::image_from_row(&row)?;
                tx.commit().await?;
                Ok($crate::record::AgentStateChange {
                    image,
                    terminated_image_ids,
                })
            }

            async fn update_image(
                &self,
                scope: &$crate::store::Scope<'_>,
                image_id: &str,
                update: &$crate::record::ImageUpdate,
                now_ms: i64,
            ) -> Result<$crate::record::ImageRecord, $crate::error::SessionError> {
                use $crate::store::sql;
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                let description = update.description.as_deref().filter(|d| !d.is_empty());
                let tools_json = update
                    .tools
                    .as_ref()
                    .map(|tools| serde_json::to_string(tools).unwrap_or_else(|_| "[]".to_owned()));
                let updated = sqlx::query(sql::UPDATE_IMAGE)
                    .bind(scope.tenant_id)
                    .bind(image_id)
                    .bind(update.name.as_deref())
                    .bind(update.description.is_some())
                    .bind(description)
                    .bind(now_ms)
                    .bind(scope.user_id)
                    .bind(tools_json)
                    .bind(update.metadata_json.as_deref())
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if updated == 0 {
                    tx.rollback().await?;
                    return Err($crate::error::SessionError::ImageNotFound(image_id.to_owned()));
                }
                let row = sqlx::query(sql::SELECT_IMAGE)
                    .bind(scope.tenant_id)
                    .bind(image_id)
                    .bind(scope.user_id)
                    .fetch_one(&mut *tx)
                    .await?;
                let image = sql::image_from_row(&row)?;
                tx.commit().await?;
                Ok(image)
            }

            async fn delete_image(
                &self,
                scope: &$crate::store::Scope<'_>,
                image_id: &str,
            ) -> Result<Vec<String>, $crate::error::SessionError> {
                delete_image_rows(&self.pool, scope, image_id, None).await
            }

            async fn delete_unchanged_image(
                &self,
                scope: &$crate::store::Scope<'_>,
                image_id: &str,
                last_active_at_ms: i64,
            ) -> Result<Vec<String>, $crate::error::SessionError> {
                delete_image_rows(&self.pool, scope, image_id, Some(last_active_at_ms)).await
            }

            async fn get_retention_policy(
                &self,
                tenant_id: &str,
            ) -> Result<Option<$crate::retention::StoredPolicy>, $crate::error::SessionError> {
                let row = sqlx::query($crate::store::sql::SELECT_RETENTION)
                    .bind(tenant_id)
                    .fetch_optional(&self.pool)
                    .await?;
                row.map(|row| $crate::store::sql::policy_from_row(&row))
                    .transpose()
            }

            async fn set_retention_policy(
                &self,
                tenant_id: &str,
                policy: &$crate::retention::RetentionPolicy,
                updated_by: &str,
                now_ms: i64,
            ) -> Result<(), $crate::error::SessionError> {
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                sqlx::query($crate::store::sql::UPSERT_RETENTION)
                    .bind(tenant_id)
                    .bind(policy.message_days.map(i64::from))
                    .bind(policy.idle_conversation_days.map(i64::from))
                    .bind(policy.max_conversations_per_container.map(i64::from))
                    .bind(now_ms)
                    .bind(updated_by)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(())
            }

            async fn list_retention_policies(
                &self,
                after_tenant_id: &str,
                limit: u32,
            ) -> Result<Vec<(String, $crate::retention::RetentionPolicy)>, $crate::error::SessionError> {
                let rows = sqlx::query($crate::store::sql::LIST_RETENTION)
                    .bind(after_tenant_id)
                    .bind(i64::from(limit))
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter()
                    .map(|row| {
                        let tenant_id: String = sqlx::Row::try_get(row, "tenant_id")?;
                        Ok((tenant_id, $crate::store::sql::policy_from_row(row)?.policy))
                    })
                    .collect()
            }

            async fn count_old_messages(
                &self,
                tenant_id: &str,
                before_ms: i64,
                limit: u32,
            ) -> Result<u64, $crate::error::SessionError> {
                let count = sqlx::query_scalar::<$db, i64>($crate::store::sql::COUNT_OLD_MESSAGES)
                    .bind(tenant_id)
                    .bind(before_ms)
                    .bind(i64::from(limit))
                    .fetch_one(&self.pool)
                    .await?;
                Ok(u64::try_from(count).unwrap_or_default())
            }

            async fn delete_old_messages(
                &self,
                tenant_id: &str,
                before_ms: i64,
                limit: u32,
            ) -> Result<u64, $crate::error::SessionError> {
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                let deleted = sqlx::query($crate::store::sql::DELETE_OLD_MESSAGES)
                    .bind(tenant_id)
                    .bind(before_ms)
                    .bind(i64::from(limit))
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                tx.commit().await?;
                Ok(deleted)
            }

            async fn list_retention_candidates(
                &self,
                tenant_id: &str,
                idle_before_ms: Option<i64>,
                keep_per_container: Option<u32>,
                limit: u32,
            ) -> Result<Vec<$crate::retention::RetentionCandidate>, $crate::error::SessionError> {
                use $crate::store::sql;
                let mut rows = Vec::new();
                if let Some(before) = idle_before_ms {
                    rows.extend(
                        sqlx::query(sql::LIST_IDLE_IMAGES)
                            .bind(tenant_id)
                            .bind(before)
                            .bind(i64::from(limit))
                            .fetch_all(&self.pool)
                            .await?,
                    );
                }
                if let Some(keep) = keep_per_container {
                    rows.extend(
                        sqlx::query(sql::LIST_EXCESS_IMAGES)
                            .bind(tenant_id)
                            .bind(i64::from(keep))
                            .bind(i64::from(limit))
                            .fetch_all(&self.pool)
                            .await?,
                    );
                }
                let mut candidates = rows
                    .iter()
                    .map(|row| sql::candidate_from_row(row))
                    .collect::<Result<Vec<_>, _>>()?;
                // Each list holds its own least recently active; together,
                // once sorted and rid of what both hold, so does their head.
                candidates
                    .sort_by(|a, b| (a.last_active_at_ms, &a.session_id).cmp(&(b.last_active_at_ms, &b.session_id)));
                candidates.dedup_by(|a, b| a.image_id == b.image_id);
                candidates.truncate(limit as usize);
                Ok(candidates)
            }

            async fn lock_sweep(&self) -> Result<Option<$crate::store::SweepLock>, $crate::error::SessionError> {
                self.lock_sweep_impl().await
            }

            async fn append_message(
                &self,
                scope: &$crate::store::Scope<'_>,
                session_id: &str,
                message: &$crate::record::NewMessage,
            ) -> Result<$crate::record::MessageRecord, $crate::error::SessionError> {
                use $crate::store::sql;
                let (kind, body) = sql::encode_body(&message.body)?;
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                // Claiming the seq locks the session, so the rest of the transaction
                // sees every earlier append of it; each step is an index lookup.
                let Some(seq) = sqlx::query_scalar::<$db, i64>(sql::BUMP_SEQ)
                    .bind(scope.tenant_id)
                    .bind(session_id)
                    .bind(scope.user_id)
                    .bind(message.created_at_ms)
                    .fetch_optional(&mut *tx)
                    .await?
                else {
                    tx.rollback().await?;
                    return Err($crate::error::SessionError::SessionNotFound(
                        session_id.to_owned(),
                    ));
                };
                let inserted = sqlx::query(sql::INSERT_MESSAGE)
                    .bind(session_id)
                    .bind(seq)
                    .bind(&message.message_id)
                    .bind(kind)
                    .bind(&body)
                    .bind(message.created_at_ms)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if inserted == 1 {
                    tx.commit().await?;
                    return Ok($crate::record::MessageRecord {
                        message_id: message.message_id.clone(),
                        session_id: session_id.to_owned(),
                        seq: u64::try_from(seq).map_err(|_| {
                            $crate::error::SessionError::corrupt(format!("session {session_id} seq {seq}"))
                        })?,
                        created_at_ms: message.created_at_ms,
                        body: message.body.clone(),
                    });
                }
                // A retried append: return what is stored and give the seq back.
                let row = sqlx::query(sql::SELECT_MESSAGE)
                    .bind(session_id)
                    .bind(&message.message_id)
                    .fetch_one(&mut *tx)
                    .await?;
                tx.rollback().await?;
                sql::message_from_row(&row)
            }

            async fn list_messages(
                &self,
                scope: &$crate::store::Scope<'_>,
                session_id: &str,
            ) -> Result<Vec<$crate::record::MessageRecord>, $crate::error::SessionError> {
                use $crate::store::sql;
                let exists = sqlx::query(sql::SESSION_EXISTS)
                    .bind(scope.tenant_id)
                    .bind(session_id)
                    .bind(scope.user_id)
                    .fetch_optional(&self.pool)
                    .await?;
                if exists.is_none() {
                    return Err($crate::error::SessionError::SessionNotFound(
                        session_id.to_owned(),
                    ));
                }
                let rows = sqlx::query(sql::LIST_MESSAGES)
                    .bind(session_id)
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| sql::message_from_row(row)).collect()
            }

            async fn list_context(
                &self,
                scope: &$crate::store::Scope<'_>,
                session_id: &str,
            ) -> Result<(Option<$crate::record::Compaction>, Vec<$crate::record::MessageRecord>), $crate::error::SessionError> {
                use $crate::store::sql;
                let exists = sqlx::query(sql::SESSION_EXISTS)
                    .bind(scope.tenant_id)
                    .bind(session_id)
                    .bind(scope.user_id)
                    .fetch_optional(&self.pool)
                    .await?;
                if exists.is_none() {
                    return Err($crate::error::SessionError::SessionNotFound(session_id.to_owned()));
                }
                let compaction = sqlx::query(sql::SELECT_COMPACTION)
                    .bind(session_id)
                    .fetch_optional(&self.pool)
                    .await?
                    .map(|row| sql::compaction_from_row(&row))
                    .transpose()?;
                let from = compaction.as_ref().map_or(0, |compaction| compaction.from_seq);
                let rows = sqlx::query(sql::LIST_MESSAGES_FROM)
                    .bind(session_id)
                    .bind(i64::try_from(from).unwrap_or(i64::MAX))
                    .fetch_all(&self.pool)
                    .await?;
                let messages = rows.iter().map(|row| sql::message_from_row(row)).collect::<Result<_, _>>()?;
                Ok((compaction, messages))
            }

            async fn record_compaction(
                &self,
                scope: &$crate::store::Scope<'_>,
                session_id: &str,
                compaction: &$crate::record::Compaction,
            ) -> Result<u64, $crate::error::SessionError> {
                use $crate::store::sql;
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                let locked = sqlx::query_scalar::<$db, String>(sql::LOCK_SESSION)
                    .bind(scope.tenant_id)
                    .bind(session_id)
                    .bind(scope.user_id)
                    .fetch_optional(&mut *tx)
                    .await?;
                if locked.is_none() {
                    tx.rollback().await?;
                    return Err($crate::error::SessionError::SessionNotFound(session_id.to_owned()));
                }
                let row = sqlx::query(sql::SELECT_MESSAGE_KIND)
                    .bind(session_id)
                    .bind(&compaction.from_message_id)
                    .fetch_optional(&mut *tx)
                    .await?;
                let Some(row) = row else {
                    tx.rollback().await?;
                    return Err($crate::error::SessionError::MessageNotFound(
                        compaction.from_message_id.clone(),
                    ));
                };
                let from_seq: i64 = sqlx::Row::try_get(&row, "seq")?;
                let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
                sqlx::query(sql::UPSERT_COMPACTION)
                    .bind(session_id)
                    .bind(from_seq)
                    .bind(&compaction.from_message_id)
                    .bind(&compaction.method)
                    .bind(&compaction.summary)
                    .bind(count(compaction.compacted_messages))
                    .bind(count(compaction.tokens_before))
                    .bind(count(compaction.tokens_after))
                    .bind(compaction.created_at_ms)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok(u64::try_from(from_seq).unwrap_or_default())
            }

            async fn truncate_messages(
                &self,
                scope: &$crate::store::Scope<'_>,
                session_id: &str,
                after_message_id: Option<&str>,
            ) -> Result<$crate::record::Truncated, $crate::error::SessionError> {
                use $crate::store::sql;
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                let locked = sqlx::query_scalar::<$db, String>(sql::LOCK_SESSION)
                    .bind(scope.tenant_id)
                    .bind(session_id)
                    .bind(scope.user_id)
                    .fetch_optional(&mut *tx)
                    .await?;
                let Some(image_id) = locked else {
                    tx.rollback().await?;
                    return Err($crate::error::SessionError::SessionNotFound(session_id.to_owned()));
                };
                let keep = match after_message_id {
                    None => 0,
                    Some(message_id) => {
                        let row = sqlx::query(sql::SELECT_MESSAGE_KIND)
                            .bind(session_id)
                            .bind(message_id)
                            .fetch_optional(&mut *tx)
                            .await?;
                        let Some(row) = row else {
                            tx.rollback().await?;
                            return Err($crate::error::SessionError::MessageNotFound(message_id.to_owned()));
                        };
                        let kind: String = sqlx::Row::try_get(&row, "kind")?;
                        if matches!(kind.as_str(), "user" | "tool_call") {
                            tx.rollback().await?;
                            return Err($crate::error::SessionError::precondition(
                                "REWIND_POINT_OPENS_TURN",
                                format!(
                                    "message {message_id} is a {kind} message: the conversation would end inside a turn; \
                                     rewind after a reply, an error or a tool result"
                                ),
                            ));
                        }
                        sqlx::Row::try_get::<i64, _>(&row, "seq")?
                    }
                };
                let removed = sqlx::query(sql::DELETE_MESSAGES_AFTER)
                    .bind(session_id)
                    .bind(keep)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                sqlx::query(sql::REWIND_SEQ)
                    .bind(session_id)
                    .bind(keep)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(sql::DELETE_COMPACTIONS_AFTER)
                    .bind(session_id)
                    .bind(keep)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(sql::REWIND_READS)
                    .bind(&image_id)
                    .bind(keep)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok($crate::record::Truncated {
                    removed_messages: removed,
                    last_seq: u64::try_from(keep).unwrap_or_default(),
                })
            }

            async fn list_open_turns(
                &self,
                before_ms: i64,
                after_session_id: &str,
                limit: u32,
            ) -> Result<Vec<$crate::record::OpenTurn>, $crate::error::SessionError> {
                let rows = sqlx::query($crate::store::sql::LIST_OPEN_TURNS)
                    .bind(before_ms)
                    .bind(after_session_id)
                    .bind(i64::from(limit))
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter()
                    .map(|row| {
                        Ok($crate::record::OpenTurn {
                            tenant_id: sqlx::Row::try_get(row, "tenant_id")?,
                            container_id: sqlx::Row::try_get(row, "container_id")?,
                            image_id: sqlx::Row::try_get(row, "image_id")?,
                            session_id: sqlx::Row::try_get(row, "session_id")?,
                            user_message_id: sqlx::Row::try_get::<Option<String>, _>(row, "user_message_id")?
                                .unwrap_or_default(),
                        })
                    })
                    .collect()
            }

            async fn list_recent(
                &self,
                scope: &$crate::store::Scope<'_>,
                reader: &str,
                after: Option<(i64, &str)>,
                limit: u32,
            ) -> Result<Vec<$crate::recent::RecentRow>, $crate::error::SessionError> {
                use $crate::store::sql;
                let rows = sqlx::query(sql::LIST_RECENT)
                    .bind(scope.tenant_id)
                    .bind(scope.user_id)
                    .bind(reader)
                    .bind(after.map(|(at, _)| at))
                    .bind(after.map(|(_, session)| session))
                    .bind(i64::from(limit))
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| sql::recent_from_row(row)).collect()
            }

            async fn mark_read(
                &self,
                scope: &$crate::store::Scope<'_>,
                image_id: &str,
                reader: &str,
                seq: Option<u64>,
                now_ms: i64,
            ) -> Result<u64, $crate::error::SessionError> {
                use $crate::store::sql;
                let seq = seq.map(|seq| i64::try_from(seq).unwrap_or(i64::MAX));
                let marker = sqlx::query_scalar::<$db, i64>(sql::MARK_READ)
                    .bind(scope.tenant_id)
                    .bind(image_id)
                    .bind(reader)
                    .bind(seq)
                    .bind(scope.user_id)
                    .bind(now_ms)
                    .fetch_optional(&self.pool)
                    .await?;
                let marker = marker.ok_or_else(|| $crate::error::SessionError::ImageNotFound(image_id.to_owned()))?;
                u64::try_from(marker).map_err(|_| $crate::error::SessionError::corrupt(format!("read marker {marker}")))
            }

            async fn list_messages_page(
                &self,
                session_id: &str,
                after_seq: u64,
                limit: u32,
            ) -> Result<Vec<$crate::record::MessageRecord>, $crate::error::SessionError> {
                use $crate::store::sql;
                let rows = sqlx::query(sql::LIST_MESSAGES_PAGE)
                    .bind(session_id)
                    .bind(i64::try_from(after_seq).unwrap_or(i64::MAX))
                    .bind(i64::from(limit))
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| sql::message_from_row(row)).collect()
            }

            async fn import_conversations(
                &self,
                scope: &$crate::store::Scope<'_>,
                container_id: &str,
                items: &[$crate::transfer::ImportWrite],
                now_ms: i64,
            ) -> Result<Vec<$crate::transfer::Imported>, $crate::error::SessionError> {
                use $crate::store::sql;
                let not_found = || $crate::error::SessionError::ContainerNotFound(container_id.to_owned());
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                let locked = sqlx::query(sql::LOCK_CONTAINER)
                    .bind(scope.tenant_id)
                    .bind(container_id)
                    .bind(scope.user_id)
                    .fetch_optional(&mut *tx)
                    .await?;
                if locked.is_none() {
                    tx.rollback().await?;
                    return Err(not_found());
                }
                let mut imported = Vec::with_capacity(items.len());
                for item in items {
                    let earlier = sqlx::query(sql::SELECT_IMPORTED)
                        .bind(scope.tenant_id)
                        .bind(container_id)
                        .bind(&item.document_id)
                        .fetch_optional(&mut *tx)
                        .await?;
                    if let Some(row) = earlier {
                        imported.push($crate::transfer::Imported {
                            document_id: item.document_id.clone(),
                            image: sql::image_from_row(&row)?,
                            created: false,
                        });
                        continue;
                    }
                    let last_seq = item.messages.last().map_or(0, |(seq, _)| *seq);
                    let last_seq = i64::try_from(last_seq).unwrap_or(i64::MAX);
                    let active = item
                        .messages
                        .iter()
                        .map(|(_, message)| message.created_at_ms)
                        .max();
                    let active = active.unwrap_or(item.image.created_at_ms);
                    if !insert_image_rows(&mut tx, scope, &item.image, last_seq, active).await? {
                        tx.rollback().await?;
                        return Err(not_found());
                    }
                    for (seq, message) in &item.messages {
                        let (kind, body) = sql::encode_body(&message.body)?;
                        sqlx::query(sql::INSERT_MESSAGE)
                            .bind(&item.image.session_id)
                            .bind(i64::try_from(*seq).unwrap_or(i64::MAX))
                            .bind(&message.message_id)
                            .bind(kind)
                            .bind(&body)
                            .bind(message.created_at_ms)
                            .execute(&mut *tx)
                            .await?;
                    }
                    sqlx::query(sql::INSERT_IMPORT)
                        .bind(scope.tenant_id)
                        .bind(container_id)
                        .bind(&item.document_id)
                        .bind(&item.image.image_id)
                        .bind(now_ms)
                        .execute(&mut *tx)
                        .await?;
                    imported.push($crate::transfer::Imported {
                        document_id: item.document_id.clone(),
                        image: item.image.clone(),
                        created: true,
                    });
                }
                tx.commit().await?;
                Ok(imported)
            }

            async fn search(
                &self,
                scope: &$crate::store::Scope<'_>,
                terms: &$crate::search::Terms,
                filter: &$crate::search::SearchRequest,
                limit: u32,
                offset: u64,
            ) -> Result<Vec<$crate::search::SearchRow>, $crate::error::SessionError> {
                let rows = sqlx::query(Self::SEARCH)
                    .bind(terms.expression())
                    .bind(scope.tenant_id)
                    .bind(scope.user_id)
                    .bind(filter.container_id.as_deref())
                    .bind(filter.image_id.as_deref())
                    .bind(filter.role.as_deref())
                    .bind(filter.from_ms)
                    .bind(filter.to_ms)
                    .bind(i64::from(limit))
                    .bind(i64::try_from(offset).unwrap_or(i64::MAX))
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter()
                    .map(|row| $crate::store::sql::search_row_from_row(row))
                    .collect()
            }

            fn event_transport(&self) -> avm_store::events::EventTransport {
                self.event_transport_impl()
            }
        }
    };
}

pub(super) use impl_session_store;

#[cfg(test)]
mod tests {
    use super::*;

    /// Returns the tables a statement names after FROM, JOIN, INTO or UPDATE.
    fn tables(statement: &str) -> Vec<String> {
        let words: Vec<&str> = statement
            .split(|c: char| c.is_whitespace() || c == '(' || c == ')' || c == ',')
            .filter(|word| !word.is_empty())
            .collect();
        words
            .windows(2)
            .filter(|pair| ["FROM", "JOIN", "INTO", "UPDATE"].contains(&pair[0]))
            .map(|pair| pair[1].to_owned())
            .filter(|name| name.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            .collect()
    }

    #[test]
    fn retention_touches_only_the_session_tables() {
        // Usage records (observability's ledger, auth's quota counters) live
        // in other databases; a sweep's statements reach only these, and
        // deleting an image cascades within them alone.
        let allowed = [
            "retention_policies",
            "sessions",
            "messages",
            "images",
            "containers",
            "container_shares",
        ];
        let statements = [
            SELECT_RETENTION,
            UPSERT_RETENTION,
            LIST_RETENTION,
            COUNT_OLD_MESSAGES,
            DELETE_OLD_MESSAGES,
            LIST_IDLE_IMAGES,
            LIST_EXCESS_IMAGES,
            LOCK_UNCHANGED_IMAGE,
            LIST_DESCENDANTS,
            DELETE_IMAGE,
        ];
        for statement in statements {
            assert!(!statement.to_lowercase().contains("usage"), "{statement}");
            let named = tables(statement);
            assert!(!named.is_empty(), "{statement}");
            for table in named {
                assert!(
                    allowed.contains(&table.as_str()) || table == "family" || table == "old",
                    "{table} in {statement}"
                );
            }
        }
    }
}
