-- The tools an image's agent may call: built-in names and `resource://tools/…`
-- URIs, as a JSON array of strings.

ALTER TABLE images ADD COLUMN tools_json TEXT NOT NULL DEFAULT '[]';
