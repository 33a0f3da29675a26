-- An image runs one agent; the runtime keeps a sleeping agent in rows only,
-- so whether it may run is stored here: `active` agents are woken by what
-- reaches them, `paused` ones are not, `terminated` ones never run again.
-- An agent may start child agents: a child is an image of the same tenant
-- and container (the service checks both) whose `depth` is its parent's
-- plus one; deleting the parent deletes its children.

ALTER TABLE images ADD COLUMN agent_state TEXT NOT NULL DEFAULT 'active'
    CHECK (agent_state IN ('active', 'paused', 'terminated'));
ALTER TABLE images ADD COLUMN parent_image_id TEXT
    CONSTRAINT images_parent_image_id_fkey REFERENCES images (image_id) ON DELETE CASCADE;
-- BIGINT like every other count of this schema, so both dialects decode it as i64.
ALTER TABLE images ADD COLUMN depth BIGINT NOT NULL DEFAULT 0;

-- Serves the children of a parent (ListImages by parent, newest first), the
-- walk down a family when it is terminated, and the parent cascade.
CREATE INDEX images_by_parent ON images (parent_image_id, created_at_ms DESC, image_id DESC)
    WHERE parent_image_id IS NOT NULL;
