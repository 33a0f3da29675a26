-- Context compaction: where the model's reading of a conversation starts,
-- and the summary that stands for what came before. The stored history
-- stays whole; a turn loads the latest compaction and the messages from its
-- first kept one on, so what it loads is bounded by the model's window, not
-- by the conversation's length.

CREATE TABLE context_compactions (
    session_id         TEXT    NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    -- The first message the model still reads.
    from_seq           INTEGER NOT NULL,
    from_message_id    TEXT    NOT NULL,
    method             TEXT    NOT NULL CHECK (method IN ('summarized', 'dropped')),
    -- What the model reads in place of the messages before from_seq (empty when dropped).
    summary            TEXT    NOT NULL,
    compacted_messages INTEGER NOT NULL,
    tokens_before      INTEGER NOT NULL,
    tokens_after       INTEGER NOT NULL,
    created_at_ms      INTEGER NOT NULL,
    PRIMARY KEY (session_id, from_seq)
) STRICT;
