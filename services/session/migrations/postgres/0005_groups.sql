-- Multi-agent groups: a group belongs to a container; its members are agents
-- (images of that container) and users; its messages are stored once, in a
-- per-group seq without gaps; each member keeps a read cursor, so a member's
-- unread count is `last_seq - read_seq`, read from two rows, never counted.
--
-- The table is `chat_groups` because GROUPS is a keyword (window frames) in
-- both dialects.

CREATE TABLE chat_groups (
    group_id      TEXT    NOT NULL PRIMARY KEY,
    tenant_id     TEXT    NOT NULL,
    container_id  TEXT    NOT NULL,
    name          TEXT    NOT NULL,
    -- Which agent members a message wakes: every one, or the mentioned ones.
    wake_mode     TEXT    NOT NULL CHECK (wake_mode IN ('all', 'mentions')),
    created_at_ms BIGINT  NOT NULL,
    updated_at_ms BIGINT  NOT NULL,
    -- The seq of the newest message; bumping it first locks the row, which
    -- serializes posts per group.
    last_seq      BIGINT  NOT NULL DEFAULT 0,
    -- Messages since the last one a user sent, moved in the same statement.
    agent_streak  BIGINT  NOT NULL DEFAULT 0,
    FOREIGN KEY (tenant_id, container_id)
        REFERENCES containers (tenant_id, container_id) ON DELETE CASCADE
);

-- Serves the container cascade and ListGroups (newest first, keyset pages).
CREATE INDEX chat_groups_by_container ON chat_groups (tenant_id, container_id, created_at_ms DESC, group_id DESC);

CREATE TABLE group_members (
    group_id      TEXT    NOT NULL REFERENCES chat_groups (group_id) ON DELETE CASCADE,
    -- One id per member of a group, whatever its kind, so mentions are plain ids.
    member_id     TEXT    NOT NULL,
    member_kind   TEXT    NOT NULL CHECK (member_kind IN ('agent', 'user')),
    tenant_id     TEXT    NOT NULL,
    -- An agent's image (its member id again), so deleting the image removes
    -- its memberships; NULL for users.
    image_id      TEXT    REFERENCES images (image_id) ON DELETE CASCADE,
    joined_at_ms  BIGINT  NOT NULL,
    -- The seq of the last message the member read.
    read_seq      BIGINT  NOT NULL DEFAULT 0,
    PRIMARY KEY (group_id, member_id),
    CHECK ((member_kind = 'agent' AND image_id = member_id) OR (member_kind = 'user' AND image_id IS NULL))
);

-- Serves "every group this member belongs to" (ListUnread).
CREATE INDEX group_members_by_member ON group_members (tenant_id, member_kind, member_id, group_id);
-- Serves the image cascade.
CREATE INDEX group_members_by_image ON group_members (image_id) WHERE image_id IS NOT NULL;

CREATE TABLE group_messages (
    group_id      TEXT    NOT NULL REFERENCES chat_groups (group_id) ON DELETE CASCADE,
    seq           BIGINT  NOT NULL,
    -- Chosen by the client (its idempotency key) or by the server.
    message_id    TEXT    NOT NULL,
    sender_kind   TEXT    NOT NULL CHECK (sender_kind IN ('agent', 'user')),
    -- No foreign key: a message outlives its sender's membership.
    sender_id     TEXT    NOT NULL,
    content       TEXT    NOT NULL,
    -- The mentioned member ids, a JSON array of strings.
    mentions_json TEXT    NOT NULL,
    -- The group's agent streak with this message, so a re-post answers the same.
    agent_streak  BIGINT  NOT NULL,
    created_at_ms BIGINT  NOT NULL,
    -- Serves "messages of a group after seq N" (unread, history pages).
    PRIMARY KEY (group_id, seq),
    UNIQUE (group_id, message_id)
);
