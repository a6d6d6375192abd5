-- The transactional inbox: one row per (consumer, message id) whose effects committed.
-- The primary key is the lock: a concurrent claim of the same id blocks on the
-- in-flight insert and then sees the committed row (or proceeds if it rolled back).
CREATE TABLE IF NOT EXISTS processed_messages (
    consumer       text        NOT NULL,
    message_id     text        NOT NULL,
    payload_sha256 bytea,
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);

-- Retention deletes by age.
CREATE INDEX IF NOT EXISTS processed_messages_processed_at_idx
    ON processed_messages (processed_at);
