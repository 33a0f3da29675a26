-- LLM calls noted as they were made and not yet in the ledger, each as the
-- record it would be if the process making it died now (estimated tokens and
-- price). A call's record deletes its row; the runtime's next start bills
-- those left behind at their estimate (status 'cut').

CREATE TABLE open_calls (
    call_id            TEXT    NOT NULL PRIMARY KEY,
    tenant_id          TEXT    NOT NULL,
    user_id            TEXT    NOT NULL,
    key_id             TEXT    NOT NULL,
    container_id       TEXT    NOT NULL,
    image_id           TEXT    NOT NULL,
    agent_id           TEXT    NOT NULL,
    provider           TEXT    NOT NULL,
    model              TEXT    NOT NULL,
    input_tokens       INTEGER NOT NULL,
    output_tokens      INTEGER NOT NULL,
    cache_read_tokens  INTEGER NOT NULL,
    cache_write_tokens INTEGER NOT NULL,
    estimated          INTEGER NOT NULL,
    status             TEXT    NOT NULL,
    error_code         TEXT    NOT NULL,
    started_at_ms      INTEGER NOT NULL,
    ended_at_ms        INTEGER NOT NULL,
    first_token_ms     INTEGER NOT NULL,
    cost_pico_usd      INTEGER NOT NULL,
    billed_pico_usd    INTEGER NOT NULL,
    priced             INTEGER NOT NULL,
    own_key            INTEGER NOT NULL
) STRICT;

CREATE INDEX open_calls_by_start ON open_calls (started_at_ms);
