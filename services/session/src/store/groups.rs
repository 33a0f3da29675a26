//! The statements and the `GroupStore` implementation shared by SQLite and
//! Postgres, in the manner of `store/sql.rs` (one text for both dialects, a
//! macro expanded once per pool type).
//!
//! A group's `last_seq` is claimed by an `UPDATE` that starts the post's
//! transaction: it locks the group row (Postgres) or takes the write lock
//! (SQLite), so posts of one group are serialized and their seqs have no
//! gaps. Messages are never deleted one by one, so a member's unread count is
//! `last_seq - read_seq`, read from two rows.

use sqlx::{ColumnIndex, Decode, Row, Type};

use super::sql::visible;
use crate::error::SessionError;
use crate::record::{GroupMemberRecord, GroupMessageRecord, GroupRecord, MemberKind, MemberRef, WakeMode};

macro_rules! select_group {
    () => {
        "SELECT g.group_id, g.container_id, g.name, g.wake_mode, g.last_seq, g.agent_streak, \
                g.created_at_ms, g.updated_at_ms \
         FROM chat_groups g JOIN containers c ON c.tenant_id = g.tenant_id AND c.container_id = g.container_id "
    };
}

/// The condition that the `chat_groups` row being changed is visible to `$u`.
macro_rules! group_visible {
    ($u:literal) => {
        concat!(
            "EXISTS (SELECT 1 FROM containers c WHERE c.tenant_id = chat_groups.tenant_id \
             AND c.container_id = chat_groups.container_id AND ",
            visible!("c", $u),
            ")"
        )
    };
}

/// Inserts nothing when the container is missing or not visible.
pub(super) const INSERT_GROUP: &str = concat!(
    "INSERT INTO chat_groups (group_id, tenant_id, container_id, name, wake_mode, created_at_ms, updated_at_ms) \
     SELECT $1, $2, $3, $4, $5, $6, $7 FROM containers c \
     WHERE c.tenant_id = $2 AND c.container_id = $3 AND ",
    visible!("c", "$8")
);
pub(super) const SELECT_GROUP: &str = concat!(
    select_group!(),
    "WHERE g.tenant_id = $1 AND g.group_id = $2 AND ",
    visible!("c", "$3")
);
pub(super) const LIST_GROUPS: &str = concat!(
    select_group!(),
    "WHERE g.tenant_id = $1 AND g.container_id = $2 AND ",
    visible!("c", "$3"),
    " ORDER BY g.created_at_ms DESC, g.group_id DESC LIMIT $4"
);
/// The pages after the first: a keyset on the order of `LIST_GROUPS`.
pub(super) const LIST_GROUPS_AFTER: &str = concat!(
    select_group!(),
    "WHERE g.tenant_id = $1 AND g.container_id = $2 AND ",
    visible!("c", "$3"),
    " AND (g.created_at_ms < $5 OR (g.created_at_ms = $5 AND g.group_id < $6)) \
     ORDER BY g.created_at_ms DESC, g.group_id DESC LIMIT $4"
);
/// `$3` is the new name or NULL, `$4` the new wake mode or NULL.
pub(super) const UPDATE_GROUP: &str = concat!(
    "UPDATE chat_groups SET name = COALESCE($3, name), wake_mode = COALESCE($4, wake_mode), updated_at_ms = $5 \
     WHERE tenant_id = $1 AND group_id = $2 AND ",
    group_visible!("$6")
);
pub(super) const DELETE_GROUP: &str = concat!(
    "DELETE FROM chat_groups WHERE tenant_id = $1 AND group_id = $2 AND ",
    group_visible!("$3")
);

/// Inserts nothing when the group is not visible or the image is not one of its container.
pub(super) const INSERT_AGENT_MEMBER: &str = concat!(
    "INSERT INTO group_members (group_id, member_id, member_kind, tenant_id, image_id, joined_at_ms) \
     SELECT g.group_id, i.image_id, 'agent', g.tenant_id, i.image_id, $4 \
     FROM chat_groups g JOIN containers c ON c.tenant_id = g.tenant_id AND c.container_id = g.container_id \
     JOIN images i ON i.tenant_id = g.tenant_id AND i.container_id = g.container_id \
     WHERE g.tenant_id = $1 AND g.group_id = $2 AND i.image_id = $3 AND ",
    visible!("c", "$5")
);
/// Inserts nothing when the group is not visible.
pub(super) const INSERT_USER_MEMBER: &str = concat!(
    "INSERT INTO group_members (group_id, member_id, member_kind, tenant_id, joined_at_ms) \
     SELECT g.group_id, $3, 'user', g.tenant_id, $4 \
     FROM chat_groups g JOIN containers c ON c.tenant_id = g.tenant_id AND c.container_id = g.container_id \
     WHERE g.tenant_id = $1 AND g.group_id = $2 AND ",
    visible!("c", "$5")
);
/// The condition that the `group_members` row is in a group visible to `$u`.
macro_rules! member_visible {
    ($u:literal) => {
        concat!(
            "EXISTS (SELECT 1 FROM chat_groups g JOIN containers c \
             ON c.tenant_id = g.tenant_id AND c.container_id = g.container_id \
             WHERE g.group_id = group_members.group_id AND ",
            visible!("c", $u),
            ")"
        )
    };
}
pub(super) const DELETE_MEMBER: &str = concat!(
    "DELETE FROM group_members \
     WHERE tenant_id = $1 AND group_id = $2 AND member_id = $3 AND member_kind = $4 AND ",
    member_visible!("$5")
);
pub(super) const LIST_MEMBERS: &str = "\
    SELECT group_id, member_id, member_kind, joined_at_ms, read_seq FROM group_members \
    WHERE group_id = $1 ORDER BY joined_at_ms, member_id";
pub(super) const SELECT_MEMBER_KIND: &str = "\
    SELECT member_kind FROM group_members WHERE group_id = $1 AND member_id = $2";
pub(super) const SELECT_VISIBLE_MEMBER: &str = concat!(
    "SELECT group_id, member_id, member_kind, joined_at_ms, read_seq FROM group_members \
     WHERE tenant_id = $1 AND group_id = $2 AND member_id = $3 AND member_kind = $4 AND ",
    member_visible!("$5")
);
/// Moves the cursor forward only, and never past the group's newest message.
pub(super) const ADVANCE_CURSOR: &str = "\
    UPDATE group_members SET read_seq = \
        (SELECT CASE WHEN $5 < g.last_seq THEN $5 ELSE g.last_seq END \
         FROM chat_groups g WHERE g.group_id = group_members.group_id) \
    WHERE tenant_id = $1 AND group_id = $2 AND member_id = $3 AND member_kind = $4 AND read_seq < $5";

/// Locks the group row for the rest of the transaction, claims the next seq
/// and moves the agent streak (`$4`: the sender is a user).
pub(super) const BUMP_GROUP_SEQ: &str = concat!(
    "UPDATE chat_groups SET last_seq = last_seq + 1, \
                            agent_streak = CASE WHEN $4 THEN 0 ELSE agent_streak + 1 END \
     WHERE tenant_id = $1 AND group_id = $2 AND ",
    group_visible!("$3"),
    " RETURNING last_seq, agent_streak"
);
pub(super) const INSERT_GROUP_MESSAGE: &str = "\
    INSERT INTO group_messages (group_id, seq, message_id, sender_kind, sender_id, content, mentions_json, \
                                agent_streak, created_at_ms) \
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
    ON CONFLICT (group_id, message_id) DO NOTHING";
macro_rules! select_group_message {
    () => {
        "SELECT group_id, seq, message_id, sender_kind, sender_id, content, mentions_json, agent_streak, \
                created_at_ms FROM group_messages "
    };
}
pub(super) const SELECT_GROUP_MESSAGE: &str =
    concat!(select_group_message!(), "WHERE group_id = $1 AND message_id = $2");
/// A range of the primary key `(group_id, seq)`: `$2 < seq <= $3`.
pub(super) const LIST_GROUP_MESSAGES: &str = concat!(
    select_group_message!(),
    "WHERE group_id = $1 AND seq > $2 AND seq <= $3 ORDER BY seq LIMIT $4"
);

/// The member's groups with messages after its cursor: `group_members_by_member`
/// finds its memberships in group order, each group is one primary-key lookup.
pub(super) const LIST_UNREAD: &str = concat!(
    "SELECT g.group_id, g.container_id, g.name, g.wake_mode, g.last_seq, g.agent_streak, \
            g.created_at_ms, g.updated_at_ms, m.read_seq \
     FROM group_members m JOIN chat_groups g ON g.group_id = m.group_id \
     JOIN containers c ON c.tenant_id = g.tenant_id AND c.container_id = g.container_id \
     WHERE m.tenant_id = $1 AND m.member_kind = $2 AND m.member_id = $3 AND g.last_seq > m.read_seq AND ",
    visible!("c", "$4"),
    " ORDER BY m.group_id"
);

/// Returns a count column as `u64`.
fn unsigned<'r, R>(row: &'r R, column: &'static str) -> Result<u64, SessionError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let value: i64 = row.try_get(column)?;
    u64::try_from(value).map_err(|_| SessionError::corrupt(format!("{column} is {value}")))
}

fn member_kind(name: &str) -> Result<MemberKind, SessionError> {
    MemberKind::parse(name).ok_or_else(|| SessionError::corrupt(format!("member kind {name:?}")))
}

/// Reads a row of `select_group!` (or of `LIST_UNREAD`).
pub(super) fn group_from_row<'r, R>(row: &'r R) -> Result<GroupRecord, SessionError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let wake_mode: String = row.try_get("wake_mode")?;
    Ok(GroupRecord {
        group_id: row.try_get("group_id")?,
        container_id: row.try_get("container_id")?,
        name: row.try_get("name")?,
        wake_mode: WakeMode::parse(&wake_mode)
            .ok_or_else(|| SessionError::corrupt(format!("wake mode {wake_mode:?}")))?,
        last_seq: unsigned(row, "last_seq")?,
        consecutive_agent_messages: unsigned(row, "agent_streak")?,
        created_at_ms: row.try_get("created_at_ms")?,
        updated_at_ms: row.try_get("updated_at_ms")?,
    })
}

/// Reads a `group_members` row.
pub(super) fn member_from_row<'r, R>(row: &'r R) -> Result<GroupMemberRecord, SessionError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let kind: String = row.try_get("member_kind")?;
    Ok(GroupMemberRecord {
        group_id: row.try_get("group_id")?,
        member: MemberRef {
            kind: member_kind(&kind)?,
            member_id: row.try_get("member_id")?,
        },
        joined_at_ms: row.try_get("joined_at_ms")?,
        read_seq: unsigned(row, "read_seq")?,
    })
}

/// Reads a row of `select_group_message!`, decoding its mentions.
pub(super) fn group_message_from_row<'r, R>(row: &'r R) -> Result<GroupMessageRecord, SessionError>
where
    R: Row,
    &'r str: ColumnIndex<R>,
    String: Decode<'r, R::Database> + Type<R::Database>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let message_id: String = row.try_get("message_id")?;
    let kind: String = row.try_get("sender_kind")?;
    let mentions: String = row.try_get("mentions_json")?;
    let mentions = serde_json::from_str(&mentions)
        .map_err(|_| SessionError::corrupt(format!("group message {message_id}: mentions")))?;
    Ok(GroupMessageRecord {
        group_id: row.try_get("group_id")?,
        seq: unsigned(row, "seq")?,
        sender: MemberRef {
            kind: member_kind(&kind)?,
            member_id: row.try_get("sender_id")?,
        },
        content: row.try_get("content")?,
        mentions,
        consecutive_agent_messages: unsigned(row, "agent_streak")?,
        created_at_ms: row.try_get("created_at_ms")?,
        message_id,
    })
}

/// Returns a seq as the stores keep it; beyond `i64::MAX` means "everything".
pub(super) fn stored_seq(seq: u64) -> i64 {
    i64::try_from(seq).unwrap_or(i64::MAX)
}

/// Maps the failure of a member insert: a second member with one id is
/// `GroupMemberExists`; a group or image deleted while the insert ran (a
/// foreign key) is the same outcome as never finding it.
pub(super) fn member_insert_error(err: sqlx::Error, group_id: &str, member: &MemberRef) -> SessionError {
    match &err {
        sqlx::Error::Database(db) if db.is_unique_violation() => SessionError::GroupMemberExists {
            group_id: group_id.to_owned(),
            member_id: member.member_id.clone(),
        },
        sqlx::Error::Database(db) if db.is_foreign_key_violation() => match member.kind {
            MemberKind::Agent => SessionError::ImageNotFound(member.member_id.clone()),
            MemberKind::User => SessionError::GroupNotFound(group_id.to_owned()),
        },
        _ => SessionError::from(err),
    }
}

/// Implements `GroupStore` for a struct with a `pool: sqlx::Pool<$db>` field.
macro_rules! impl_group_store {
    ($store:ty, $db:ty) => {
        impl $store {
            /// Inserts one member inside `conn`; the number of rows says
            /// whether the group (and the agent's image) were found.
            async fn insert_group_member(
                conn: &mut <$db as sqlx::Database>::Connection,
                scope: &$crate::store::Scope<'_>,
                group_id: &str,
                member: &$crate::record::MemberRef,
                now_ms: i64,
            ) -> Result<u64, $crate::error::SessionError> {
                use $crate::store::groups as sql;
                let statement = match member.kind {
                    $crate::record::MemberKind::Agent => sql::INSERT_AGENT_MEMBER,
                    $crate::record::MemberKind::User => sql::INSERT_USER_MEMBER,
                };
                Ok(sqlx::query(statement)
                    .bind(scope.tenant_id)
                    .bind(group_id)
                    .bind(&member.member_id)
                    .bind(now_ms)
                    .bind(scope.user_id)
                    .execute(&mut *conn)
                    .await
                    .map_err(|err| sql::member_insert_error(err, group_id, member))?
                    .rows_affected())
            }

            /// Returns the error for a group, or a member of it, that a
            /// statement did not find: whichever of the two is missing.
            async fn missing_member(
                &self,
                scope: &$crate::store::Scope<'_>,
                group_id: &str,
                member_id: &str,
            ) -> $crate::error::SessionError {
                use $crate::store::GroupStore;
                match self.get_group(scope, group_id).await {
                    Ok(_) => $crate::error::SessionError::GroupMemberNotFound {
                        group_id: group_id.to_owned(),
                        member_id: member_id.to_owned(),
                    },
                    Err(err) => err,
                }
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::GroupStore for $store {
            async fn create_group(
                &self,
                scope: &$crate::store::Scope<'_>,
                group: &$crate::record::GroupRecord,
                members: &[$crate::record::MemberRef],
            ) -> Result<(), $crate::error::SessionError> {
                use $crate::store::groups as sql;
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                let inserted = sqlx::query(sql::INSERT_GROUP)
                    .bind(&group.group_id)
                    .bind(scope.tenant_id)
                    .bind(&group.container_id)
                    .bind(&group.name)
                    .bind(group.wake_mode.as_str())
                    .bind(group.created_at_ms)
                    .bind(group.updated_at_ms)
                    .bind(scope.user_id)
                    .execute(&mut *tx)
                    .await
                    .map_err(|err| $crate::store::sql::missing_container(err, &group.container_id))?
                    .rows_affected();
                if inserted == 0 {
                    tx.rollback().await?;
                    return Err($crate::error::SessionError::ContainerNotFound(
                        group.container_id.clone(),
                    ));
                }
                for member in members {
                    let inserted =
                        Self::insert_group_member(&mut *tx, scope, &group.group_id, member, group.created_at_ms)
                            .await?;
                    if inserted == 0 {
                        // The group was just inserted, so the image is what is missing.
                        tx.rollback().await?;
                        return Err($crate::error::SessionError::ImageNotFound(
                            member.member_id.clone(),
                        ));
                    }
                }
                tx.commit().await?;
                Ok(())
            }

            async fn get_group(
                &self,
                scope: &$crate::store::Scope<'_>,
                group_id: &str,
            ) -> Result<$crate::record::GroupRecord, $crate::error::SessionError> {
                use $crate::store::groups as sql;
                let row = sqlx::query(sql::SELECT_GROUP)
                    .bind(scope.tenant_id)
                    .bind(group_id)
                    .bind(scope.user_id)
                    .fetch_optional(&self.pool)
                    .await?
                    .ok_or_else(|| $crate::error::SessionError::GroupNotFound(group_id.to_owned()))?;
                sql::group_from_row(&row)
            }

            async fn list_groups(
                &self,
                scope: &$crate::store::Scope<'_>,
                container_id: &str,
                after: Option<&$crate::record::GroupCursor>,
                limit: u32,
            ) -> Result<Vec<$crate::record::GroupRecord>, $crate::error::SessionError> {
                use $crate::store::groups as sql;
                let query = match after {
                    None => sqlx::query(sql::LIST_GROUPS),
                    Some(_) => sqlx::query(sql::LIST_GROUPS_AFTER),
                }
                .bind(scope.tenant_id)
                .bind(container_id)
                .bind(scope.user_id)
                .bind(i64::from(limit));
                let query = match after {
                    None => query,
                    Some(cursor) => query.bind(cursor.created_at_ms).bind(&cursor.group_id),
                };
                let rows = query.fetch_all(&self.pool).await?;
                rows.iter().map(|row| sql::group_from_row(row)).collect()
            }

            async fn update_group(
                &self,
                scope: &$crate::store::Scope<'_>,
                group_id: &str,
                update: &$crate::record::GroupUpdate,
                now_ms: i64,
            ) -> Result<$crate::record::GroupRecord, $crate::error::SessionError> {
                use $crate::store::groups as sql;
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                let updated = sqlx::query(sql::UPDATE_GROUP)
                    .bind(scope.tenant_id)
                    .bind(group_id)
                    .bind(update.name.as_deref())
                    .bind(update.wake_mode.map($crate::record::WakeMode::as_str))
                    .bind(now_ms)
                    .bind(scope.user_id)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if updated == 0 {
                    tx.rollback().await?;
                    return Err($crate::error::SessionError::GroupNotFound(group_id.to_owned()));
                }
                let row = sqlx::query(sql::SELECT_GROUP)
                    .bind(scope.tenant_id)
                    .bind(group_id)
                    .bind(scope.user_id)
                    .fetch_one(&mut *tx)
                    .await?;
                let group = sql::group_from_row(&row)?;
                tx.commit().await?;
                Ok(group)
            }

            async fn delete_group(
                &self,
                scope: &$crate::store::Scope<'_>,
                group_id: &str,
            ) -> Result<(), $crate::error::SessionError> {
                use $crate::store::groups as sql;
                // One statement: the cascade takes the members and messages.
                let deleted = sqlx::query(sql::DELETE_GROUP)
                    .bind(scope.tenant_id)
                    .bind(group_id)
                    .bind(scope.user_id)
                    .execute(&self.pool)
                    .await?
                    .rows_affected();
                if deleted == 0 {
                    return Err($crate::error::SessionError::GroupNotFound(group_id.to_owned()));
                }
                Ok(())
            }

            async fn add_group_member(
                &self,
                scope: &$crate::store::Scope<'_>,
                group_id: &str,
                member: &$crate::record::MemberRef,
                now_ms: i64,
            ) -> Result<$crate::record::GroupMemberRecord, $crate::error::SessionError> {
                let mut conn = self.pool.acquire().await?;
                let inserted = Self::insert_group_member(&mut *conn, scope, group_id, member, now_ms).await?;
                drop(conn);
                if inserted == 0 {
                    // The group is missing, or else the agent's image is not in its container.
                    return Err(
                        match self.missing_member(scope, group_id, &member.member_id).await {
                            $crate::error::SessionError::GroupMemberNotFound { .. } => {
                                $crate::error::SessionError::ImageNotFound(member.member_id.clone())
                            }
                            err => err,
                        },
                    );
                }
                Ok($crate::record::GroupMemberRecord {
                    group_id: group_id.to_owned(),
                    member: member.clone(),
                    joined_at_ms: now_ms,
                    read_seq: 0,
                })
            }

            async fn remove_group_member(
                &self,
                scope: &$crate::store::Scope<'_>,
                group_id: &str,
                member: &$crate::record::MemberRef,
            ) -> Result<(), $crate::error::SessionError> {
                use $crate::store::groups as sql;
                let deleted = sqlx::query(sql::DELETE_MEMBER)
                    .bind(scope.tenant_id)
                    .bind(group_id)
                    .bind(&member.member_id)
                    .bind(member.kind.as_str())
                    .bind(scope.user_id)
                    .execute(&self.pool)
                    .await?
                    .rows_affected();
                if deleted == 0 {
                    return Err(self.missing_member(scope, group_id, &member.member_id).await);
                }
                Ok(())
            }

            async fn list_group_members(
                &self,
                scope: &$crate::store::Scope<'_>,
                group_id: &str,
            ) -> Result<Vec<$crate::record::GroupMemberRecord>, $crate::error::SessionError> {
                use $crate::store::groups as sql;
                self.get_group(scope, group_id).await?;
                let rows = sqlx::query(sql::LIST_MEMBERS)
                    .bind(group_id)
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| sql::member_from_row(row)).collect()
            }

            async fn post_group_message(
                &self,
                scope: &$crate::store::Scope<'_>,
                group_id: &str,
                message_id: &str,
                message: &$crate::record::NewGroupMessage,
            ) -> Result<($crate::record::GroupMessageRecord, bool), $crate::error::SessionError> {
                use $crate::error::SessionError;
                use $crate::store::groups as sql;
                let mentions_json = serde_json::to_string(&message.mentions)
                    .map_err(|err| SessionError::corrupt(format!("cannot encode mentions: {err}")))?;
                let from_user = message.sender.kind == $crate::record::MemberKind::User;
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                // Claiming the seq locks the group, so the rest of the
                // transaction sees every earlier post and membership change.
                let Some(row) = sqlx::query(sql::BUMP_GROUP_SEQ)
                    .bind(scope.tenant_id)
                    .bind(group_id)
                    .bind(scope.user_id)
                    .bind(from_user)
                    .fetch_optional(&mut *tx)
                    .await?
                else {
                    tx.rollback().await?;
                    return Err(SessionError::GroupNotFound(group_id.to_owned()));
                };
                let seq: i64 = sqlx::Row::try_get(&row, "last_seq")?;
                let streak: i64 = sqlx::Row::try_get(&row, "agent_streak")?;
                let inserted = sqlx::query(sql::INSERT_GROUP_MESSAGE)
                    .bind(group_id)
                    .bind(seq)
                    .bind(message_id)
                    .bind(message.sender.kind.as_str())
                    .bind(&message.sender.member_id)
                    .bind(&message.content)
                    .bind(&mentions_json)
                    .bind(streak)
                    .bind(message.created_at_ms)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                if inserted == 0 {
                    // A re-post: return what is stored and give the seq and streak back.
                    let row = sqlx::query(sql::SELECT_GROUP_MESSAGE)
                        .bind(group_id)
                        .bind(message_id)
                        .fetch_one(&mut *tx)
                        .await?;
                    tx.rollback().await?;
                    return Ok((sql::group_message_from_row(&row)?, false));
                }
                // Membership is checked under the group's lock, after the
                // re-post case: a stored message stays retrievable by its id
                // even once its sender has left.
                let sender_kind: Option<String> = sqlx::query_scalar(sql::SELECT_MEMBER_KIND)
                    .bind(group_id)
                    .bind(&message.sender.member_id)
                    .fetch_optional(&mut *tx)
                    .await?;
                if sender_kind.as_deref() != Some(message.sender.kind.as_str()) {
                    tx.rollback().await?;
                    return Err(SessionError::precondition(
                        "SENDER_NOT_GROUP_MEMBER",
                        format!(
                            "{} {} is not a member of group {group_id}",
                            message.sender.kind.as_str(),
                            message.sender.member_id
                        ),
                    ));
                }
                for mention in &message.mentions {
                    let kind: Option<String> = sqlx::query_scalar(sql::SELECT_MEMBER_KIND)
                        .bind(group_id)
                        .bind(mention)
                        .fetch_optional(&mut *tx)
                        .await?;
                    if kind.is_none() {
                        tx.rollback().await?;
                        return Err(SessionError::precondition(
                            "MENTION_NOT_GROUP_MEMBER",
                            format!("mentioned {mention} is not a member of group {group_id}"),
                        ));
                    }
                }
                tx.commit().await?;
                let unsigned = |value: i64| {
                    u64::try_from(value).map_err(|_| SessionError::corrupt(format!("group {group_id} counter {value}")))
                };
                let stored = $crate::record::GroupMessageRecord {
                    group_id: group_id.to_owned(),
                    message_id: message_id.to_owned(),
                    seq: unsigned(seq)?,
                    sender: message.sender.clone(),
                    content: message.content.clone(),
                    mentions: message.mentions.clone(),
                    consecutive_agent_messages: unsigned(streak)?,
                    created_at_ms: message.created_at_ms,
                };
                Ok((stored, true))
            }

            async fn list_group_messages(
                &self,
                scope: &$crate::store::Scope<'_>,
                group_id: &str,
                after_seq: u64,
                limit: u32,
            ) -> Result<Vec<$crate::record::GroupMessageRecord>, $crate::error::SessionError> {
                use $crate::store::groups as sql;
                self.get_group(scope, group_id).await?;
                let rows = sqlx::query(sql::LIST_GROUP_MESSAGES)
                    .bind(group_id)
                    .bind(sql::stored_seq(after_seq))
                    .bind(i64::MAX)
                    .bind(i64::from(limit))
                    .fetch_all(&self.pool)
                    .await?;
                rows.iter().map(|row| sql::group_message_from_row(row)).collect()
            }

            async fn list_unread(
                &self,
                scope: &$crate::store::Scope<'_>,
                member: &$crate::record::MemberRef,
                message_limit: u32,
            ) -> Result<Vec<$crate::record::UnreadGroup>, $crate::error::SessionError> {
                use $crate::store::groups as sql;
                let rows = sqlx::query(sql::LIST_UNREAD)
                    .bind(scope.tenant_id)
                    .bind(member.kind.as_str())
                    .bind(&member.member_id)
                    .bind(scope.user_id)
                    .fetch_all(&self.pool)
                    .await?;
                let mut unread = Vec::with_capacity(rows.len());
                for row in &rows {
                    let group = sql::group_from_row(row)?;
                    let read_seq: i64 = sqlx::Row::try_get(row, "read_seq")?;
                    let messages = if message_limit == 0 {
                        Vec::new()
                    } else {
                        // Bounded by the group's seq as read above, so the
                        // messages agree with the count.
                        sqlx::query(sql::LIST_GROUP_MESSAGES)
                            .bind(&group.group_id)
                            .bind(read_seq)
                            .bind(sql::stored_seq(group.last_seq))
                            .bind(i64::from(message_limit))
                            .fetch_all(&self.pool)
                            .await?
                            .iter()
                            .map(|row| sql::group_message_from_row(row))
                            .collect::<Result<Vec<_>, _>>()?
                    };
                    let read_seq = u64::try_from(read_seq).unwrap_or_default();
                    unread.push($crate::record::UnreadGroup {
                        unread_count: group.last_seq.saturating_sub(read_seq),
                        read_seq,
                        messages,
                        group,
                    });
                }
                Ok(unread)
            }

            async fn advance_read_cursor(
                &self,
                scope: &$crate::store::Scope<'_>,
                group_id: &str,
                member: &$crate::record::MemberRef,
                seq: u64,
            ) -> Result<$crate::record::GroupMemberRecord, $crate::error::SessionError> {
                use $crate::store::groups as sql;
                let mut tx = self.pool.begin_with(Self::BEGIN).await?;
                // The write first (see store/sql.rs); visibility is checked
                // before commit, and the move undone when it fails.
                sqlx::query(sql::ADVANCE_CURSOR)
                    .bind(scope.tenant_id)
                    .bind(group_id)
                    .bind(&member.member_id)
                    .bind(member.kind.as_str())
                    .bind(sql::stored_seq(seq))
                    .execute(&mut *tx)
                    .await?;
                let row = sqlx::query(sql::SELECT_VISIBLE_MEMBER)
                    .bind(scope.tenant_id)
                    .bind(group_id)
                    .bind(&member.member_id)
                    .bind(member.kind.as_str())
                    .bind(scope.user_id)
                    .fetch_optional(&mut *tx)
                    .await?;
                let Some(row) = row else {
                    tx.rollback().await?;
                    return Err(self.missing_member(scope, group_id, &member.member_id).await);
                };
                let record = sql::member_from_row(&row)?;
                tx.commit().await?;
                Ok(record)
            }
        }
    };
}

pub(super) use impl_group_store;
