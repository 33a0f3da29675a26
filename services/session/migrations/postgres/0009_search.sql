-- Full-text search over messages and conversation (image) names, kept on
-- every write by Postgres itself (a stored column and expression indexes),
-- so no search ever scans and nothing indexes later. The `simple`
-- configuration splits and lowercases words without stemming or folding
-- diacritics, as the SQLite store's unicode61 tokenizer does.

-- The words a message is found by: what a user wrote (a string, or the text
-- parts of a list), an assistant's or an error's text, a tool's name with its
-- input or output. A body no JSON function can read (a `\u0000` escape,
-- which Postgres refuses to decode) is searched as it is stored.
CREATE FUNCTION message_search_text(kind TEXT, body TEXT) RETURNS TEXT
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    doc JSONB;
    content JSONB;
BEGIN
    doc := body::jsonb;
    CASE kind
        WHEN 'user' THEN
            content := (doc ->> 'content_json')::jsonb;
            IF jsonb_typeof(content) = 'string' THEN
                RETURN content #>> '{}';
            ELSIF jsonb_typeof(content) = 'array' THEN
                RETURN (SELECT string_agg(part ->> 'text', ' ') FROM jsonb_array_elements(content) part
                        WHERE part ->> 'type' = 'text');
            END IF;
            RETURN '';
        WHEN 'tool_call' THEN
            RETURN concat_ws(' ', doc ->> 'tool_name', doc ->> 'input_json');
        WHEN 'tool_result' THEN
            RETURN concat_ws(' ', doc ->> 'tool_name', doc ->> 'output');
        ELSE
            RETURN doc ->> 'text';
    END CASE;
EXCEPTION WHEN OTHERS THEN
    RETURN body;
END
$$;

-- Adding the column computes it for every stored message: the migration
-- indexes what exists.
ALTER TABLE messages ADD COLUMN search TSVECTOR
    GENERATED ALWAYS AS (to_tsvector('simple', message_search_text(kind, body))) STORED;
CREATE INDEX messages_search ON messages USING GIN (search);

CREATE INDEX images_name_search ON images USING GIN (to_tsvector('simple', name));
