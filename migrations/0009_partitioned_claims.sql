-- The partitioned inbox (opt-in; `idempo::inbox::partitioned`). Nothing here
-- changes `processed_messages`: `idempo partitions switch` turns it into a
-- table partitioned by `processed_at`, retired by DETACH/DROP PARTITION.
--
-- A partition's primary key only covers that partition, so across partitions
-- the lock is a transaction-scoped advisory lock on (consumer, message id),
-- and the claim probes every partition before it inserts. This function is
-- the one claim of that mode: one statement, one round trip.
--
-- p_ids must be distinct; they are locked in sorted order (two claims sharing
-- ids cannot deadlock). Each statement of a VOLATILE function takes a new
-- snapshot at READ COMMITTED, so the probe, run after the locks are held, sees
-- the claim of a copy whose transaction committed while this one waited. At
-- REPEATABLE READ or SERIALIZABLE the snapshot may predate that commit: the
-- claim is refused (SQLSTATE IDP01) rather than risk a second Fresh.
--
-- The ids already claimed come back with their stored hash; the others are
-- inserted. With p_raise, any id already claimed raises IDP02 instead and
-- nothing is inserted (the caller's implicit transaction ends, as a unique
-- violation ends the plain claim's).
CREATE OR REPLACE FUNCTION idempo_claim_partitioned(
    p_consumer text, p_ids text[], p_hashes bytea[], p_raise boolean
) RETURNS TABLE (claimed_id text, stored_sha256 bytea)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_id     text;
    v_found  text[];
    v_stored bytea[];
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'the partitioned claim needs READ COMMITTED, not %',
            current_setting('transaction_isolation') USING ERRCODE = 'IDP01';
    END IF;
    FOR v_id IN SELECT i FROM unnest(p_ids) AS i ORDER BY i LOOP
        PERFORM pg_advisory_xact_lock(hashtextextended(p_consumer || E'\x1f' || v_id, 28));
    END LOOP;
    -- A new statement: a snapshot taken after the locks were granted.
    SELECT coalesce(array_agg(p.message_id), '{}'), coalesce(array_agg(p.payload_sha256), '{}')
    INTO v_found, v_stored
    FROM unnest(p_ids) AS t(id)
    JOIN processed_messages p ON p.consumer = p_consumer AND p.message_id = t.id;
    IF cardinality(v_found) > 0 THEN
        IF p_raise THEN
            RAISE EXCEPTION 'message ids already claimed' USING ERRCODE = 'IDP02';
        END IF;
        RETURN QUERY SELECT * FROM unnest(v_found, v_stored);
    END IF;
    INSERT INTO processed_messages (consumer, message_id, payload_sha256, claimed_under_lock)
    SELECT p_consumer, t.id, t.hash, true FROM unnest(p_ids, p_hashes) AS t(id, hash)
    WHERE t.id <> ALL (v_found);
END
$$;

-- The retention each consumer in partitioned mode asked for: partitions go
-- only when older than the longest of them (consumers share the table).
CREATE TABLE IF NOT EXISTS processed_messages_retention (
    consumer       text        PRIMARY KEY,
    retention_secs float8      NOT NULL CHECK (retention_secs > 0),
    seen_at        timestamptz NOT NULL DEFAULT now()
);
