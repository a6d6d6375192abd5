-- The exact AMQP properties of an outbox message (lapin's encoding of the
-- content header's property list: flags, then each field), for messages
-- staged with them (`OutboxMessage::amqp_properties`; every dead-letter
-- replay from the table store). The relay publishes them as they are: every
-- basic property and every header with its AMQP field type (decimals,
-- timestamps, byte arrays with NUL, nested tables, integers of each width)
-- that the JSON `headers` column cannot hold. `headers` keeps a readable
-- copy for queries and operators. NULL: the message is built from the
-- columns, as before.
ALTER TABLE outbox ADD COLUMN properties bytea;
