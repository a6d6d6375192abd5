-- Saga steps (feature `saga`): one row per (saga, step). `completed` holds the
-- step's result; `compensated` is final (a compensated step never runs again);
-- `failed` keeps the last error and the attempt count visible.
CREATE TABLE IF NOT EXISTS saga_steps (
    saga_id    text        NOT NULL,
    step       text        NOT NULL,
    state      text        NOT NULL CHECK (state IN ('pending', 'completed', 'failed', 'compensated')),
    result     jsonb,
    error      text,
    attempts   int         NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (saga_id, step)
);

-- One row per saga run by `Saga::run`: whether it is running forward or
-- compensating, and why. A rerun reads it to resume the right way.
CREATE TABLE IF NOT EXISTS sagas (
    saga_id     text        PRIMARY KEY,
    state       text        NOT NULL CHECK (state IN ('running', 'completed', 'compensating', 'compensated')),
    failed_step text,
    error       text,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
