-- What a user a container is shared with may do in it: 'read' (look),
-- 'use' (also talk: send, interrupt, create images and groups, post) or
-- 'manage' (also change and destroy: edit and delete images and groups,
-- pause, resume, terminate and stop agents). Shares made before roles
-- existed become 'use': their users keep talking, and lose only the power
-- to destroy what the owner made.

ALTER TABLE container_shares ADD COLUMN role TEXT NOT NULL DEFAULT 'use';
