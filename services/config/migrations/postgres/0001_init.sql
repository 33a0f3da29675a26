-- Stored overrides of the configuration tree: the system's (scope '') and
-- each tenant's (scope = tenant id). Secret values are sealed (encrypted).

CREATE TABLE config_overrides (
    scope         TEXT    NOT NULL,
    key           TEXT    NOT NULL,
    -- The value as JSON, or for secrets the sealed JSON.
    value         TEXT    NOT NULL,
    encrypted     BOOLEAN NOT NULL,
    updated_at_ms BIGINT  NOT NULL,
    updated_by    TEXT    NOT NULL,
    PRIMARY KEY (scope, key)
);

-- One row: grows with every change, so watchers can tell old news.
CREATE TABLE config_revision (
    id       INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
    revision BIGINT  NOT NULL
);

INSERT INTO config_revision (id, revision) VALUES (1, 0);
