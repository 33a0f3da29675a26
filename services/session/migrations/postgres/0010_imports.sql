-- Which conversation each imported document became, so importing the same
-- document into the same container again finds it rather than copying it
-- twice. Deleting the image forgets the import: the document may come back.

CREATE TABLE imports (
    tenant_id     TEXT   NOT NULL,
    container_id  TEXT   NOT NULL,
    document_id   TEXT   NOT NULL,
    image_id      TEXT   NOT NULL REFERENCES images (image_id) ON DELETE CASCADE,
    created_at_ms BIGINT NOT NULL,
    PRIMARY KEY (tenant_id, container_id, document_id)
);

-- Serves the cascade from images.
CREATE INDEX imports_by_image ON imports (image_id);
