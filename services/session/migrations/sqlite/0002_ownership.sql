-- Container ownership within a tenant: the user who created a container owns
-- it; admins see every container of their tenant, members those they own or
-- that are shared with them. Containers made before ownership existed have no
-- owner ('') and are visible to admins only.

ALTER TABLE containers ADD COLUMN owner_id TEXT NOT NULL DEFAULT '';

CREATE INDEX containers_by_owner ON containers (tenant_id, owner_id);

CREATE TABLE container_shares (
    tenant_id     TEXT    NOT NULL,
    container_id  TEXT    NOT NULL,
    user_id       TEXT    NOT NULL,
    created_at_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant_id, container_id, user_id),
    FOREIGN KEY (tenant_id, container_id)
        REFERENCES containers (tenant_id, container_id) ON DELETE CASCADE
) STRICT;

-- Serves "containers shared with this user".
CREATE INDEX container_shares_by_user ON container_shares (tenant_id, user_id);
