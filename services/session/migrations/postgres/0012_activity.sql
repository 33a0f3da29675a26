-- The recent list: when each conversation last changed, kept by the statement
-- that claims a message's seq (no write of its own), and each user's read
-- marker of each conversation, from which its unread count comes.

ALTER TABLE sessions ADD COLUMN last_active_at_ms BIGINT NOT NULL DEFAULT 0;
UPDATE sessions SET last_active_at_ms = COALESCE(
    (SELECT MAX(m.created_at_ms) FROM messages m WHERE m.session_id = sessions.session_id), created_at_ms);
-- Serves the recent list, newest first, a page at a time.
CREATE INDEX sessions_by_activity ON sessions (tenant_id, last_active_at_ms DESC, session_id DESC);

CREATE TABLE image_reads (
    tenant_id     TEXT   NOT NULL,
    image_id      TEXT   NOT NULL REFERENCES images (image_id) ON DELETE CASCADE,
    user_id       TEXT   NOT NULL,
    -- Every message up to this seq has been read.
    read_seq      BIGINT NOT NULL,
    updated_at_ms BIGINT NOT NULL,
    PRIMARY KEY (image_id, user_id)
);
