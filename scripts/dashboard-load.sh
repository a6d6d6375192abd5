#!/usr/bin/env bash
# The dashboard's pages under load (BENCHMARKS.md): a schema with 1,000,000
# claims (5 consumers) and 100,000 live dead letters in 50 causes, the
# release binary's dashboard against it, and N requests per page timed by
# curl: min, median, p95 and max in milliseconds.
#
#   bash scripts/dashboard-load.sh            # N=200
#   N=500 bash scripts/dashboard-load.sh
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-200}
PORT=${PORT:-8799}
BASE=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
SCHEMA=dash_load
AMQP_URL=${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672/%2f}

psql -q -v ON_ERROR_STOP=1 "$BASE" <<SQL
DROP SCHEMA IF EXISTS $SCHEMA CASCADE;
CREATE SCHEMA $SCHEMA;
SQL
URL="$BASE?options=-csearch_path%3D$SCHEMA"
cargo build --release --features cli --bin idempo >/dev/null
DATABASE_URL="$URL" AMQP_URL="$AMQP_URL" target/release/idempo migrate >/dev/null
psql -q -v ON_ERROR_STOP=1 "$BASE" <<SQL
SET search_path = $SCHEMA;
INSERT INTO processed_messages (consumer, message_id, payload_sha256)
  SELECT 'consumer-' || (i % 5), 'm-' || i, sha256(i::text::bytea) FROM generate_series(1, 1000000) i;
INSERT INTO dead_letters (consumer, queue, message_id, payload_sha256, exchange, routing_key,
    properties, headers, body, reason, error, fingerprint, attempts, first_failed_at, last_failed_at)
  SELECT 'consumer-' || (i % 5), 'queue-' || (i % 5), 'd-' || i, sha256(i::text::bytea), '',
         'queue-' || (i % 5), '\x0000', '{}', '{}', 'permanent handler error',
         'cause ' || (i % 50) || ': refused', 'cause-' || (i % 50), 1, now(), now()
    FROM generate_series(1, 100000) i;
ANALYZE;
SQL
DATABASE_URL="$URL" AMQP_URL="$AMQP_URL" target/release/idempo dashboard --listen "127.0.0.1:$PORT" >/dev/null 2>&1 &
BOARD=$!
trap 'kill $BOARD 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$PORT/login" && break; sleep 0.1; done
# The first sample (taken in the background) before the timing starts.
for _ in $(seq 100); do curl -s "http://127.0.0.1:$PORT/" | grep -q 'sampled' && break; sleep 0.2; done

measure() {
  local path=$1
  for _ in $(seq "$N"); do
    curl -s -o /dev/null -w '%{time_total}\n' "http://127.0.0.1:$PORT$path"
  done | sort -n | awk -v path="$path" '
    { t[NR] = $1 * 1000 }
    END {
      p50 = t[int((NR + 1) * 0.50)]; p95 = t[int(NR * 0.95 + 0.999)];
      printf "%-16s n=%d  min %.1f ms  median %.1f ms  p95 %.1f ms  max %.1f ms\n", path, NR, t[1], p50, p95, t[NR]
    }'
}
measure /
measure /dead-letters
