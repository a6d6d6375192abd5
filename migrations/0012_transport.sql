-- Which transport an outbox row and a dead letter belong to (`amqp`,
-- `nats`, or another transport's name). Each relay takes only its own
-- transport's rows, and a replayed letter goes back to the transport it came
-- from: an AMQP service and a NATS service may share one database. Rows
-- written before this migration are RabbitMQ's, the only transport then.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS transport text NOT NULL DEFAULT 'amqp';
ALTER TABLE dead_letters ADD COLUMN IF NOT EXISTS transport text NOT NULL DEFAULT 'amqp';

-- The relays' scan: a transport's due rows in id order.
CREATE INDEX IF NOT EXISTS outbox_pending_by_transport ON outbox (transport, id)
    WHERE state = 'pending';
DROP INDEX IF EXISTS outbox_pending;
-- Ordering keys are per transport: one relay publishes a key's rows.
CREATE INDEX IF NOT EXISTS outbox_pending_by_transport_key
    ON outbox (transport, ordering_key, id) WHERE state = 'pending' AND ordering_key IS NOT NULL;
DROP INDEX IF EXISTS outbox_pending_by_key;

-- Letters a JetStream consumer stored before letters named their transport:
-- those of a consumer whose heartbeat says `nats`, or carrying JetStream's
-- id header.
UPDATE dead_letters SET transport = 'nats'
WHERE transport = 'amqp'
  AND (headers ? 'Nats-Msg-Id'
       OR (consumer, queue) IN (SELECT consumer, queue FROM idempo_heartbeats
                                WHERE transport = 'nats'));
