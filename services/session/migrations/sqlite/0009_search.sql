-- Full-text search over messages and conversation (image) names, kept by
-- triggers on every write, so no search ever scans and nothing indexes
-- later. Words are split and case-folded by FTS5's unicode61 tokenizer
-- without folding diacritics, as Postgres' `simple` configuration does, so
-- both stores find the same words.
--
-- The index links to a message by an integer key, and an implicit rowid is
-- not one that lasts: VACUUM may renumber it. So `messages` gets an
-- `INTEGER PRIMARY KEY`, copied over in stored order.

CREATE TABLE messages_keyed (
    id            INTEGER PRIMARY KEY,
    session_id    TEXT    NOT NULL REFERENCES sessions (session_id) ON DELETE CASCADE,
    seq           INTEGER NOT NULL,
    message_id    TEXT    NOT NULL,
    kind          TEXT    NOT NULL CHECK (kind IN ('user', 'assistant', 'tool_call', 'tool_result', 'error')),
    body          TEXT    NOT NULL,
    created_at_ms INTEGER NOT NULL,
    UNIQUE (session_id, seq),
    UNIQUE (session_id, message_id)
) STRICT;
INSERT INTO messages_keyed (session_id, seq, message_id, kind, body, created_at_ms)
    SELECT session_id, seq, message_id, kind, body, created_at_ms FROM messages ORDER BY session_id, seq;
DROP TABLE messages;
ALTER TABLE messages_keyed RENAME TO messages;

-- The words a message is found by: what a user wrote (a string, or the text
-- parts of a list), an assistant's or an error's text, a tool's name with its
-- input or output. Content that is not JSON (none is stored so) counts as text.
CREATE VIEW message_search_texts (id, text) AS
SELECT id, CASE kind
    WHEN 'user' THEN CASE
        WHEN NOT json_valid(json_extract(body, '$.content_json')) THEN json_extract(body, '$.content_json')
        WHEN json_type(json_extract(body, '$.content_json')) = 'text'
            THEN json_extract(json_extract(body, '$.content_json'), '$')
        WHEN json_type(json_extract(body, '$.content_json')) = 'array' THEN (
            SELECT group_concat(json_extract(part.value, '$.text'), ' ')
            FROM json_each(json_extract(body, '$.content_json')) part
            WHERE json_extract(part.value, '$.type') = 'text')
        ELSE '' END
    WHEN 'tool_call' THEN json_extract(body, '$.tool_name') || ' ' || json_extract(body, '$.input_json')
    WHEN 'tool_result' THEN json_extract(body, '$.tool_name') || ' ' || json_extract(body, '$.output')
    ELSE json_extract(body, '$.text') END
FROM messages;

-- The index holds no copy of the text: it reads it through the view.
CREATE VIRTUAL TABLE message_search USING fts5 (
    text, content = 'message_search_texts', content_rowid = 'id',
    tokenize = 'unicode61 remove_diacritics 0'
);
INSERT INTO message_search (rowid, text) SELECT id, text FROM message_search_texts;

CREATE TRIGGER message_search_insert AFTER INSERT ON messages BEGIN
    INSERT INTO message_search (rowid, text) SELECT id, text FROM message_search_texts WHERE id = new.id;
END;
-- Before, while the view still reads the row: the index must be told the
-- words it removes. Deletions by cascade (an image, a container) fire it too.
CREATE TRIGGER message_search_delete BEFORE DELETE ON messages BEGIN
    INSERT INTO message_search (message_search, rowid, text)
        SELECT 'delete', id, text FROM message_search_texts WHERE id = old.id;
END;

-- Names: the same kind of index, keyed through a table of its own, since
-- images have no integer key either; it holds its own copy of each name.
CREATE TABLE image_search_keys (
    id       INTEGER PRIMARY KEY,
    image_id TEXT NOT NULL UNIQUE REFERENCES images (image_id) ON DELETE CASCADE
) STRICT;
CREATE VIRTUAL TABLE image_search USING fts5 (name, tokenize = 'unicode61 remove_diacritics 0');
INSERT INTO image_search_keys (image_id) SELECT image_id FROM images ORDER BY created_at_ms, image_id;
INSERT INTO image_search (rowid, name)
    SELECT k.id, i.name FROM image_search_keys k JOIN images i ON i.image_id = k.image_id;

CREATE TRIGGER image_search_insert AFTER INSERT ON images BEGIN
    INSERT INTO image_search_keys (image_id) VALUES (new.image_id);
    INSERT INTO image_search (rowid, name) SELECT id, new.name FROM image_search_keys WHERE image_id = new.image_id;
END;
CREATE TRIGGER image_search_rename AFTER UPDATE OF name ON images WHEN new.name IS NOT old.name BEGIN
    UPDATE image_search SET name = new.name
        WHERE rowid = (SELECT id FROM image_search_keys WHERE image_id = new.image_id);
END;
CREATE TRIGGER image_search_delete AFTER DELETE ON image_search_keys BEGIN
    DELETE FROM image_search WHERE rowid = old.id;
END;
