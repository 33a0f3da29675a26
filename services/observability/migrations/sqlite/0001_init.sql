-- The usage ledger: one row per LLM call, written once (idempotent on call_id).
-- `day` and `month` are the UTC date of the call's start, computed at insert
-- so grouping is the same on SQLite and Postgres.

CREATE TABLE usage_records (
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
    -- completed | interrupted | failed
    status             TEXT    NOT NULL,
    error_code         TEXT    NOT NULL,
    started_at_ms      INTEGER NOT NULL,
    ended_at_ms        INTEGER NOT NULL,
    first_token_ms     INTEGER NOT NULL,
    cost_pico_usd      INTEGER NOT NULL,
    billed_pico_usd    INTEGER NOT NULL,
    priced             INTEGER NOT NULL,
    own_key            INTEGER NOT NULL,
    -- YYYY-MM-DD and YYYY-MM (UTC) of started_at_ms.
    day                TEXT    NOT NULL,
    month              TEXT    NOT NULL,
    recorded_at_ms     INTEGER NOT NULL
) STRICT;

CREATE INDEX usage_records_by_tenant ON usage_records (tenant_id, started_at_ms, call_id);
CREATE INDEX usage_records_by_time ON usage_records (started_at_ms, call_id);
-- What a budget has spent this month.
CREATE INDEX usage_records_by_month ON usage_records (tenant_id, month, key_id);

-- Monthly spend caps: key_id '' caps the whole tenant.
CREATE TABLE usage_budgets (
    tenant_id              TEXT    NOT NULL,
    key_id                 TEXT    NOT NULL,
    monthly_limit_pico_usd INTEGER NOT NULL,
    updated_at_ms          INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, key_id)
) STRICT;

-- Tenants' recent log events; the pruner keeps them few and young.
CREATE TABLE log_events (
    id          INTEGER NOT NULL PRIMARY KEY AUTOINCREMENT,
    tenant_id   TEXT    NOT NULL,
    at_ms       INTEGER NOT NULL,
    -- 1 trace, 2 debug, 3 info, 4 warn, 5 error
    level       INTEGER NOT NULL,
    component   TEXT    NOT NULL,
    target      TEXT    NOT NULL,
    message     TEXT    NOT NULL,
    fields_json TEXT    NOT NULL,
    request_id  TEXT    NOT NULL,
    trace_id    TEXT    NOT NULL
) STRICT;

CREATE INDEX log_events_by_tenant ON log_events (tenant_id, at_ms, id);
CREATE INDEX log_events_by_time ON log_events (at_ms);
