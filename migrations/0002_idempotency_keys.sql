-- The HTTP Idempotency-Key records (feature `http`). One row per
-- (user, method, path, key); the primary key is a SHA-256 over the
-- length-prefixed parts, so no two distinct tuples can share a row.
--
-- Fencing tokens come from one sequence: unique across takeovers, releases and
-- re-creations, so a late completion by a worker whose lease expired can never
-- match the current owner's token.
CREATE SEQUENCE IF NOT EXISTS idempotency_fencing_tokens;

CREATE TABLE IF NOT EXISTS idempotency_keys (
    record_key       bytea       PRIMARY KEY,
    idempotency_key  text        NOT NULL,
    user_id          text        NOT NULL,
    method           text        NOT NULL,
    path             text        NOT NULL,
    -- SHA-256 of method, path (with query) and body.
    request_hash     bytea       NOT NULL,
    state            text        NOT NULL CHECK (state IN ('in_progress', 'complete')),
    fencing_token    bigint      NOT NULL,
    -- The in-progress lease: a record whose lease ran out may be taken over.
    locked_until     timestamptz,
    status_code      smallint,
    response_headers bytea,
    response_body    bytea,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    completed_at     timestamptz,
    -- A record past expires_at counts as absent and is deleted by the cleanup task.
    expires_at       timestamptz NOT NULL
);

CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at_idx ON idempotency_keys (expires_at);
