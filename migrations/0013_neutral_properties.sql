-- A message's properties and typed headers at rest in idempo's own encoding
-- (src/properties.rs), whichever transport carried it: every AMQP field type
-- without loss, and JetStream's headers (any name, any length, repeated
-- names) alike. `properties` keeps AMQP's encoding for rows written before,
-- which are still read; new rows write `envelope`.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS envelope bytea;
ALTER TABLE dead_letters ADD COLUMN IF NOT EXISTS envelope bytea;
ALTER TABLE dead_letters ALTER COLUMN properties DROP NOT NULL;
