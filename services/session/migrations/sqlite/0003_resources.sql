-- Images may run a versioned agent definition (`resource://agents/…`) and
-- fill the variables of a `resource://prompts/…` system prompt; the exact
-- versions a turn ran with are kept on its assistant message (in its body).

ALTER TABLE images ADD COLUMN agent TEXT;
ALTER TABLE images ADD COLUMN variables_json TEXT NOT NULL DEFAULT '{}';
