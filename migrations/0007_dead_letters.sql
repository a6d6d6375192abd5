-- Dead letters kept in PostgreSQL (a consumer configured with
-- `dead_letters(DeadLetters::Table)`): queryable, grouped by cause, and
-- replayed exactly once through the outbox.
CREATE TABLE IF NOT EXISTS dead_letters (
    id              bigserial   PRIMARY KEY,
    consumer        text        NOT NULL,
    queue           text        NOT NULL,
    -- NULL when the delivery had no usable id.
    message_id      text,
    payload_sha256  bytea       NOT NULL,
    exchange        text        NOT NULL DEFAULT '',
    routing_key     text        NOT NULL DEFAULT '',
    -- The dead letter's AMQP properties in AMQP's own encoding (lossless),
    -- with idempo's failure headers; `headers` is a JSON rendering for queries.
    properties      bytea       NOT NULL,
    headers         jsonb       NOT NULL DEFAULT '{}',
    body            bytea       NOT NULL,
    -- The body as JSON when it is JSON (for JSON path filters), else NULL.
    body_json       jsonb,
    reason          text        NOT NULL,
    error           text        NOT NULL,
    -- The cause: reason + the error with ids, numbers and quoted values masked.
    fingerprint     text        NOT NULL,
    attempts        integer     NOT NULL DEFAULT 0,
    -- How many times this letter arrived (a lost ack brings it back).
    deliveries      integer     NOT NULL DEFAULT 1,
    first_failed_at timestamptz NOT NULL,
    last_failed_at  timestamptz NOT NULL,
    -- live: waiting; replayed: staged in the outbox; discarded: kept for audit.
    state           text        NOT NULL DEFAULT 'live'
                                CHECK (state IN ('live', 'replayed', 'discarded')),
    replay_count    integer     NOT NULL DEFAULT 0,
    replayed_at     timestamptz,
    replayed_by     text,
    replayed_to     text,
    discarded_at    timestamptz,
    discarded_by    text,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- One live letter per message (same id, same body): a redelivered dead
-- letter updates it instead of adding a second.
CREATE UNIQUE INDEX IF NOT EXISTS dead_letters_live_message
    ON dead_letters (consumer, queue, message_id, payload_sha256) WHERE state = 'live';
CREATE INDEX IF NOT EXISTS dead_letters_queue ON dead_letters (queue, state, id);
CREATE INDEX IF NOT EXISTS dead_letters_fingerprint ON dead_letters (queue, fingerprint, state);
CREATE INDEX IF NOT EXISTS dead_letters_message_id ON dead_letters (message_id);
-- The reaper's scan: letters that left the live state.
CREATE INDEX IF NOT EXISTS dead_letters_settled
    ON dead_letters (coalesce(replayed_at, discarded_at)) WHERE state <> 'live';
