-- Versioned resources of every tenant. A resource is unique per tenant, kind
-- and name; ids made by the server (res_) are globally unique. Versions are
-- immutable: rows of resource_versions are inserted and deleted, never updated.

CREATE TABLE resources (
    resource_id    TEXT    NOT NULL PRIMARY KEY,
    tenant_id      TEXT    NOT NULL,
    kind           TEXT    NOT NULL CHECK (kind IN ('prompt', 'tool', 'sandbox', 'agent', 'knowledge')),
    name           TEXT    NOT NULL,
    visibility     TEXT    NOT NULL CHECK (visibility IN ('private', 'public')),
    description    TEXT    NOT NULL,
    -- A JSON array of tags. Tags cannot hold quotes, so `LIKE '%"<tag>"%'` finds one exactly.
    tags_json      TEXT    NOT NULL,
    -- Kept by every publish and delete: SQL cannot order semantic versions.
    latest_version TEXT    NOT NULL,
    created_at_ms  INTEGER NOT NULL,
    updated_at_ms  INTEGER NOT NULL,
    UNIQUE (tenant_id, kind, name)
) STRICT;

-- One public resource per kind and name, so a name means one thing to every tenant.
CREATE UNIQUE INDEX resources_public_name ON resources (kind, name) WHERE visibility = 'public';
-- Serves listings in their order (kind, name, resource_id) within a tenant.
CREATE INDEX resources_by_tenant ON resources (tenant_id, kind, name, resource_id);

CREATE TABLE resource_versions (
    resource_id   TEXT    NOT NULL REFERENCES resources (resource_id) ON DELETE CASCADE,
    -- A semantic version without build metadata, as semver prints it.
    version       TEXT    NOT NULL,
    -- The content as sent, kept byte for byte.
    content_json  TEXT    NOT NULL,
    created_at_ms INTEGER NOT NULL,
    created_by    TEXT    NOT NULL,
    PRIMARY KEY (resource_id, version)
) STRICT;

-- The requirements each version declared, as written, with the kind and name
-- they point at so a delete finds its dependents by index.
CREATE TABLE resource_dependencies (
    resource_id TEXT    NOT NULL,
    version     TEXT    NOT NULL,
    position    INTEGER NOT NULL,
    uri         TEXT    NOT NULL,
    dep_kind    TEXT    NOT NULL,
    dep_name    TEXT    NOT NULL,
    PRIMARY KEY (resource_id, version, position),
    FOREIGN KEY (resource_id, version)
        REFERENCES resource_versions (resource_id, version) ON DELETE CASCADE
) STRICT;

CREATE INDEX resource_dependencies_by_target ON resource_dependencies (dep_kind, dep_name);
