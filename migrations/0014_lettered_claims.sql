-- A dead letter holds its message's claim: stored in the letter's
-- transaction with `lettered = true`, so a later delivery of the message (a
-- JetStream durable set up anew sends it again as a first delivery) is a
-- duplicate of its letter and never also applied. A replay of the letter
-- deletes the held claim in the replay's transaction; retention reaps it like
-- any claim. On a partitioned table the column reaches every partition.
ALTER TABLE processed_messages ADD COLUMN IF NOT EXISTS lettered boolean NOT NULL DEFAULT false;

-- A letter's claim for every live letter written before this migration (a
-- partitioned table's claims are left as they are).
INSERT INTO processed_messages (consumer, message_id, payload_sha256, lettered)
SELECT DISTINCT ON (consumer, message_id) consumer, message_id, payload_sha256, true
FROM dead_letters
WHERE state = 'live' AND message_id IS NOT NULL AND message_id <> ''
  AND (SELECT relkind FROM pg_class WHERE oid = to_regclass('processed_messages')) = 'r'
ORDER BY consumer, message_id, id
ON CONFLICT DO NOTHING;
