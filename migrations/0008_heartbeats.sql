-- One row per running consumer process, written every few seconds by the
-- runtime: what `idempo dashboard` shows of consumers it cannot ask
-- directly (their counters, state and relay), on any host.
CREATE TABLE IF NOT EXISTS idempo_heartbeats (
    -- host:pid:random, new at every start (counters start at zero with it).
    instance    text        PRIMARY KEY,
    consumer    text        NOT NULL,
    queue       text        NOT NULL,
    host        text        NOT NULL,
    pid         int4        NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT now(),
    seen_at     timestamptz NOT NULL DEFAULT now(),
    -- The runtime's state (consuming, reconnecting, stopped, ...).
    state       text        NOT NULL,
    -- The state of the outbox relay it runs, NULL without one.
    relay       text,
    -- The runtime's counters (deliveries, processed, duplicates, ...).
    counters    jsonb       NOT NULL DEFAULT '{}'
);

CREATE INDEX IF NOT EXISTS idempo_heartbeats_seen_at_idx ON idempo_heartbeats (seen_at);
