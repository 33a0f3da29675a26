-- An active agent stopped by a failure that retrying would not fix (its
-- provider refused the key, its request was invalid, its budget is spent):
-- it is in the `error` state, not woken until it is made active again,
-- which clears this. Its unread group messages wait, as a paused agent's.
-- The message is the turn's error as the runtime reported it (never a
-- secret). A column beside `agent_state` rather than a fourth value of it:
-- SQLite cannot change that column's CHECK without rebuilding the table.

ALTER TABLE images ADD COLUMN agent_error TEXT;
