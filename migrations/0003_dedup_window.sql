-- The dedup window (feature `window`): ids seen within their window, and
-- reservations of ids whose work (a publish, a handler) is under way.
CREATE TABLE IF NOT EXISTS dedup_window (
    key        text        PRIMARY KEY,
    state      text        NOT NULL CHECK (state IN ('pending', 'seen')),
    -- The reservation's owner while pending.
    token      bigint,
    -- What was recorded with a seen id (a publisher: the first message id).
    value      text,
    -- The window's end for a seen id, the lease's end for a pending one; an
    -- entry past it counts as absent.
    expires_at timestamptz NOT NULL
);

CREATE INDEX IF NOT EXISTS dedup_window_expires_at_idx ON dedup_window (expires_at);
