-- A conversation's metadata: a JSON object its clients own (a pinned flag, a
-- colour, a folder), stored and returned as given, at most 16 KiB.

ALTER TABLE images ADD COLUMN metadata_json TEXT NOT NULL DEFAULT '{}';
