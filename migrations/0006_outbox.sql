-- The transactional outbox: a message staged in the caller's transaction is
-- a row here, committed or rolled back with the caller's writes; the relay
-- publishes committed rows and deletes (or marks) them after the broker's
-- confirm.
CREATE TABLE IF NOT EXISTS outbox (
    id              bigserial   PRIMARY KEY,
    exchange        text        NOT NULL,
    routing_key     text        NOT NULL,
    message_id      text        NOT NULL,
    body            bytea       NOT NULL,
    content_type    text,
    correlation_id  text,
    persistent      boolean     NOT NULL DEFAULT true,
    headers         jsonb       NOT NULL DEFAULT '{}',
    -- Rows with the same key are published in id order, which staging makes
    -- the commit order (an advisory lock per key until commit).
    ordering_key    text,
    -- pending: to publish; failed: gave up after max attempts (kept, visible,
    -- re-triable); done: published, kept for an audit period.
    state           text        NOT NULL DEFAULT 'pending'
                                CHECK (state IN ('pending', 'failed', 'done')),
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    created_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    -- Several unkeyed messages staged by one call, in idempo's encoding
    -- (src/outbox/packed.rs); the message columns above are then empty.
    packed          bytea,
    messages        integer     NOT NULL DEFAULT 1
);

CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (id) WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS outbox_pending_by_key ON outbox (ordering_key, id)
    WHERE state = 'pending' AND ordering_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS outbox_done ON outbox (published_at) WHERE state = 'done';

-- One notification per staging transaction (PostgreSQL folds identical
-- ones), delivered to LISTENing relays only when it commits. A consumer whose
-- own relay runs wakes it in-process after the commit instead, and turns the
-- notification off for its transaction: a notifying commit holds a
-- database-wide lock until it is flushed, which serialises commits.
CREATE OR REPLACE FUNCTION idempo_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(current_setting('idempo.outbox_notify', true), '') <> 'off' THEN
        PERFORM pg_notify('idempo_outbox', '');
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS outbox_notify ON outbox;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION idempo_outbox_notify();
