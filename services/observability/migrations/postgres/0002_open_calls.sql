-- LLM calls noted as they were made and not yet in the ledger, each as the
-- record it would be if the process making it died now (estimated tokens and
-- price). A call's record deletes its row; the runtime's next start bills
-- those left behind at their estimate (status 'cut').

CREATE TABLE open_calls (
    call_id            TEXT COLLATE "C" NOT NULL PRIMARY KEY,
    tenant_id          TEXT    NOT NULL,
    user_id            TEXT    NOT NULL,
    key_id             TEXT    NOT NULL,
    container_id       TEXT    NOT NULL,
    image_id           TEXT    NOT NULL,
    agent_id           TEXT    NOT NULL,
    provider           TEXT    NOT NULL,
    model              TEXT    NOT NULL,
    input_tokens       BIGINT  NOT NULL,
    output_tokens      BIGINT  NOT NULL,
    cache_read_tokens  BIGINT  NOT NULL,
    cache_write_tokens BIGINT  NOT NULL,
    estimated          BOOLEAN NOT NULL,
    status             TEXT    NOT NULL,
    error_code         TEXT    NOT NULL,
    started_at_ms      BIGINT  NOT NULL,
    ended_at_ms        BIGINT  NOT NULL,
    first_token_ms     BIGINT  NOT NULL,
    cost_pico_usd      BIGINT  NOT NULL,
    billed_pico_usd    BIGINT  NOT NULL,
    priced             BOOLEAN NOT NULL,
    own_key            BOOLEAN NOT NULL
);

CREATE INDEX open_calls_by_start ON open_calls (started_at_ms);
