-- Which transport a heartbeating consumer reads (`amqp`, `nats`): where the
-- operations tools find its queue's depth, and whether a replay's target is
-- a RabbitMQ queue to check or a JetStream stream.
ALTER TABLE idempo_heartbeats ADD COLUMN IF NOT EXISTS transport text NOT NULL DEFAULT 'amqp';
