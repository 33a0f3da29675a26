-- Containers, images, sessions and messages of every tenant. The tenant is part
-- of every lookup; ids made by the server (img_, sess_) are globally unique.

CREATE TABLE containers (
    tenant_id     TEXT    NOT NULL,
    container_id  TEXT    NOT NULL,
    created_at_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, container_id)
) STRICT;

CREATE TABLE images (
    image_id         TEXT    NOT NULL PRIMARY KEY,
    tenant_id        TEXT    NOT NULL,
    container_id     TEXT    NOT NULL,
    name             TEXT    NOT NULL,
    description      TEXT,
    system_prompt    TEXT,
    mcp_servers_json TEXT    NOT NULL,
    created_at_ms    INTEGER NOT NULL,
    updated_at_ms    INTEGER NOT NULL,
    FOREIGN KEY (tenant_id, container_id)
        REFERENCES containers (tenant_id, container_id) ON DELETE CASCADE
) STRICT;

-- Serves the container cascade and both orders of ListImages (newest first).
CREATE INDEX images_by_container ON images (tenant_id, container_id, created_at_ms DESC, image_id DESC);
CREATE INDEX images_by_tenant ON images (tenant_id, created_at_ms DESC, image_id DESC);

CREATE TABLE sessions (
    session_id    TEXT    NOT NULL PRIMARY KEY,
    tenant_id     TEXT    NOT NULL,
    image_id      TEXT    NOT NULL UNIQUE REFERENCES images (image_id) ON DELETE CASCADE,
    created_at_ms INTEGER NOT NULL,
    -- The seq of the newest message; bumping it first serializes appends per session.
    last_seq      INTEGER NOT NULL DEFAULT 0
) STRICT;

CREATE TABLE messages (
    session_id    TEXT    NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    seq           INTEGER NOT NULL,
    message_id    TEXT    NOT NULL,
    kind          TEXT    NOT NULL CHECK (kind IN ('user', 'assistant', 'tool_call', 'tool_result', 'error')),
    -- The body as JSON text, kept byte for byte.
    body          TEXT    NOT NULL,
    created_at_ms INTEGER NOT NULL,
    PRIMARY KEY (session_id, seq),
    UNIQUE (session_id, message_id)
) STRICT;
