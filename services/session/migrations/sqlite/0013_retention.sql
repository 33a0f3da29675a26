-- Retention: each tenant's policy, which the sweeper applies a bounded batch
-- at a time. A NULL field sets no limit. Only the session service's own rows
-- (messages, and conversations with their sessions, messages and read
-- markers) are ever deleted; usage records live in other services' databases
-- (observability's ledger, auth's quota counters) and are kept for billing.

CREATE TABLE retention_policies (
    tenant_id                        TEXT    NOT NULL PRIMARY KEY,
    -- Messages older than this many days are deleted.
    message_days                     INTEGER CHECK (message_days BETWEEN 1 AND 36500),
    -- Conversations whose last activity is older than this many days are deleted.
    idle_conversation_days           INTEGER CHECK (idle_conversation_days BETWEEN 1 AND 36500),
    -- Each container keeps this many of its most recently active conversations.
    max_conversations_per_container  INTEGER CHECK (max_conversations_per_container BETWEEN 1 AND 100000),
    updated_at_ms                    INTEGER NOT NULL,
    updated_by                       TEXT    NOT NULL
) STRICT;

-- Finds a session's messages older than a cutoff without reading the newer ones.
CREATE INDEX messages_by_age ON messages (session_id, created_at_ms);
