-- One secret per consumer name, shared by its replicas: idempo seals the
-- message id it writes on its own retry and dead-letter copies with an
-- HMAC under this key, so that a header forged by another publisher cannot
-- make a new message pass for a copy of an old one.
CREATE TABLE IF NOT EXISTS idempo_consumer_keys (
    consumer   text        PRIMARY KEY,
    secret     bytea       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
