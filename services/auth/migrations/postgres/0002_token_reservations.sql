-- Token estimates of LLM calls in flight, held against their tenant's and
-- API key's monthly quotas until each call's usage report settles them (or
-- they expire). Postgres twin of migrations/sqlite/0002_token_reservations.sql:
-- keep the two in step.

CREATE TABLE token_reservations (
    tenant_id      TEXT    NOT NULL REFERENCES tenants (tenant_id) ON DELETE CASCADE,
    reservation_id TEXT    NOT NULL,
    -- '' when the call was made without an API key.
    key_id         TEXT    NOT NULL,
    tokens         BIGINT  NOT NULL,
    expires_at_ms  BIGINT  NOT NULL,
    PRIMARY KEY (tenant_id, reservation_id)
);
