-- Tenants, their users and API keys, the keys that sign access tokens, token
-- usage per month, and tombstones of deleted users and tenants. Postgres twin of
-- migrations/sqlite/0001_init.sql: keep the two in step.

CREATE TABLE tenants (
    tenant_id           TEXT    NOT NULL PRIMARY KEY,
    name                TEXT    NOT NULL,
    operator            BOOLEAN NOT NULL,
    requests_per_minute BIGINT  NOT NULL,
    tokens_per_month    BIGINT  NOT NULL,
    created_at_ms       BIGINT  NOT NULL,
    updated_at_ms       BIGINT  NOT NULL
);

-- At most one operator tenant: two replicas bootstrapping at once cannot both win.
CREATE UNIQUE INDEX tenants_one_operator ON tenants (operator) WHERE operator;
CREATE INDEX tenants_by_age ON tenants (created_at_ms, tenant_id);
CREATE INDEX tenants_by_update ON tenants (updated_at_ms);

CREATE TABLE users (
    user_id          TEXT    NOT NULL PRIMARY KEY,
    tenant_id        TEXT    NOT NULL REFERENCES tenants (tenant_id) ON DELETE CASCADE,
    name             TEXT    NOT NULL,
    role             TEXT    NOT NULL CHECK (role IN ('admin', 'member')),
    -- The `sub` of an external OIDC issuer for users provisioned from its tokens.
    external_subject TEXT,
    created_at_ms    BIGINT  NOT NULL,
    UNIQUE (tenant_id, external_subject)
);

CREATE INDEX users_by_tenant ON users (tenant_id, created_at_ms, user_id);

CREATE TABLE api_keys (
    key_id              TEXT    NOT NULL PRIMARY KEY,
    tenant_id           TEXT    NOT NULL REFERENCES tenants (tenant_id) ON DELETE CASCADE,
    user_id             TEXT    NOT NULL REFERENCES users (user_id) ON DELETE CASCADE,
    name                TEXT    NOT NULL,
    prefix              TEXT    NOT NULL,
    -- Hex SHA-256 of the key's secret part; the key itself is never stored.
    secret_hash         TEXT    NOT NULL,
    -- Scope names separated by spaces.
    scopes              TEXT    NOT NULL,
    requests_per_minute BIGINT  NOT NULL,
    tokens_per_month    BIGINT  NOT NULL,
    created_at_ms       BIGINT  NOT NULL,
    expires_at_ms       BIGINT,
    revoked_at_ms       BIGINT
);

CREATE INDEX api_keys_by_tenant ON api_keys (tenant_id, created_at_ms DESC, key_id DESC);
CREATE INDEX api_keys_by_user ON api_keys (user_id);
CREATE INDEX api_keys_by_revocation ON api_keys (revoked_at_ms) WHERE revoked_at_ms IS NOT NULL;

CREATE TABLE signing_keys (
    kid           TEXT    NOT NULL PRIMARY KEY,
    -- PKCS#8 DER of the Ed25519 private key.
    private_key   BYTEA   NOT NULL,
    -- The public key as a JWK (JSON).
    public_jwk    TEXT    NOT NULL,
    created_at_ms BIGINT  NOT NULL,
    retired_at_ms BIGINT
);

-- Tokens used per tenant (key_id '') and per API key, per calendar month (UTC).
CREATE TABLE usage (
    tenant_id TEXT    NOT NULL REFERENCES tenants (tenant_id) ON DELETE CASCADE,
    key_id    TEXT    NOT NULL,
    month     TEXT    NOT NULL,
    tokens    BIGINT  NOT NULL,
    PRIMARY KEY (tenant_id, key_id, month)
);

-- Usage reports already counted, so a retried report counts once.
CREATE TABLE usage_reports (
    tenant_id      TEXT    NOT NULL REFERENCES tenants (tenant_id) ON DELETE CASCADE,
    report_id      TEXT    NOT NULL,
    recorded_at_ms BIGINT  NOT NULL,
    PRIMARY KEY (tenant_id, report_id)
);

-- Deleted users and tenants, so a watcher that connects later still refuses their tokens.
CREATE TABLE tombstones (
    kind  TEXT    NOT NULL CHECK (kind IN ('user', 'tenant')),
    id    TEXT    NOT NULL,
    at_ms BIGINT  NOT NULL,
    PRIMARY KEY (kind, id)
);

CREATE INDEX tombstones_by_time ON tombstones (at_ms);
