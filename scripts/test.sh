#!/usr/bin/env bash
# The test suite with everything it needs, on Debian (what .ci/run runs, and
# the README's test command):
#
#   scripts/test.sh                        # everything: the docs check and every test
#   scripts/test.sh --test inbox           # arguments go to cargo test, after
#   scripts/test.sh --test nats -- replay  #   `--all-features --no-fail-fast`
#
# 1. Installs with apt-get what is missing (sudo when not root): the servers,
#    openssl, curl, python3-venv (the foreign-publisher tests), chromium and
#    chromium-driver (the dashboard's browser test).
# 2. Starts PostgreSQL, RabbitMQ (with its management plugin), Redis and NATS
#    with JetStream when they are down; a service whose URL (DATABASE_URL,
#    AMQP_URL, REDIS_URL, NATS_URL) names another host is left to you.
# 3. Starts the local RabbitMQ cluster with its TLS Redis
#    (scripts/rabbitmq-cluster.sh) and the NATS cluster
#    (scripts/nats-cluster.sh) when the selected tests use them.
# 4. On a run of every target: the docs, with warnings as errors; and each
#    feature alone, and the default set, checked with warnings as errors
#    (cargo hack, installed with cargo when missing).
# 5. cargo test --all-features --no-fail-fast "$@": every test binary runs,
#    and the script exits non-zero if anything failed.
# 6. Prints the chaos tests' figures (cargo hides a passing test's output).
#
# On exit, passed, failed or interrupted: stops what this run started of the
# RabbitMQ cluster (ports 5681-5683, amqps 5691), the TLS Redis (6390) and
# the NATS cluster (14221-14223), and drops the PostgreSQL schemas the tests
# left (idempo_test_db_*, idempo_harness_*). A cluster that ran before is
# left running (start it yourself to keep it across runs); so are
# PostgreSQL, RabbitMQ, Redis and NATS, whoever started them.
set -euo pipefail
cd "$(dirname "$0")/.."
# The servers' commands are in /usr/sbin, which a user's PATH may lack.
export PATH="$PATH:/usr/sbin:/sbin"

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() { # name port seconds
  for _ in $(seq 1 "$3"); do port_open "$2" && return 0; sleep 1; done
  echo "$1 did not come up on 127.0.0.1:$2" >&2
  return 1
}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# Whether a service's URL (unset: the local default) is this machine's.
local_url() {
  local host
  host=$(sed -E 's#^[a-z+]+://([^@/]*@)?\[?([^]:/?,]*).*#\2#' <<<"${1:-127.0.0.1}")
  [ "$host" = 127.0.0.1 ] || [ "$host" = localhost ] || [ "$host" = "::1" ]
}

# --- which targets this run selects --------------------------------------------
# Every target, unless the arguments (before `--`) pick some with --test,
# --lib, --doc, ...; `selected NAME...` says whether any of those test
# binaries runs.
all_targets=1
named=()
expect_name=0
for arg in "$@"; do
  [ "$arg" = -- ] && break
  if [ "$expect_name" = 1 ]; then named+=("$arg"); expect_name=0; continue; fi
  case "$arg" in
    --tests | --all-targets) all_targets=1; break ;;
    --test) all_targets=0; expect_name=1 ;;
    --test=*) all_targets=0; named+=("${arg#--test=}") ;;
    --lib | --doc | --bins | --bin | --bin=* | --examples | --example | --example=* | --benches | --bench | --bench=*)
      all_targets=0 ;;
  esac
done
selected() {
  [ "$all_targets" = 1 ] && return 0
  local want have
  for want in "$@"; do
    for have in ${named[@]+"${named[@]}"}; do [ "$want" = "$have" ] && return 0; done
  done
  return 1
}

# --- teardown: what this run started --------------------------------------------
RABBIT_CLUSTER_PORTS=(5681 5682 5683 5691)
NATS_CLUSTER_PORTS=(14221 14222 14223)
any_open() { local p; for p in "$@"; do port_open "$p" && return 0; done; return 1; }
any_open "${RABBIT_CLUSTER_PORTS[@]}" && rabbit_cluster_before=1 || rabbit_cluster_before=0
port_open 6390 && redis_tls_before=1 || redis_tls_before=0
any_open "${NATS_CLUSTER_PORTS[@]}" && nats_cluster_before=1 || nats_cluster_before=0
started_at=$(date +%s)
TARGET_DIR=${CARGO_TARGET_DIR:-target}
mkdir -p "$TARGET_DIR/tmp"
run_marker=$(mktemp "$TARGET_DIR/tmp/test-run.XXXXXX")

# The schemas the tests leave: a test's `idempo_test_db_<secs>_<pid>_<n>`
# (tests/support), a unit test's `idempo_test_db_<secs>_unit_<token>`, an
# unclosed harness's `idempo_harness_<secs>_<token>` (src/testing/schema.rs).
# Dropped when created during this run, or over an hour ago (the age at which
# the tests reap them themselves), unless the test process in the name still
# runs (another run's).
drop_test_schemas() {
  command -v psql >/dev/null || { echo "psql is missing: test schemas not dropped" >&2; return 0; }
  local db=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres} now name secs pid sql=""
  now=$(date +%s)
  local names
  names=$(psql "$db" -XAtq -c "SELECT nspname FROM pg_namespace
      WHERE nspname ~ '^(idempo_test_db|idempo_harness)_[0-9]+_[a-z0-9_]+\$'" 2>/dev/null) || {
    echo "cannot list the test schemas at $db" >&2
    return 0
  }
  for name in $names; do
    secs=$(sed -E 's/^(idempo_test_db|idempo_harness)_([0-9]+)_.*/\2/' <<<"$name")
    if [ "$secs" -lt "$started_at" ] && [ "$secs" -ge $((now - 3600)) ]; then continue; fi
    pid=$(sed -nE 's/^idempo_test_db_[0-9]+_([0-9]+)_[0-9]+$/\1/p' <<<"$name")
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then continue; fi
    sql+="DROP SCHEMA IF EXISTS $name CASCADE;"$'\n'
  done
  [ -n "$sql" ] || return 0
  # One statement (one transaction) per schema; a schema still locked is skipped.
  printf 'SET lock_timeout = %s;\n%s' "'5s'" "$sql" |
    psql "$db" -Xq -v ON_ERROR_STOP=0 >/dev/null 2>&1 || true
  echo "dropped $(grep -c . <<<"$sql") test schemas"
}

stop_rabbit_cluster_nodes() {
  local n
  for n in 1 2 3; do scripts/rabbitmq-cluster.sh stop-node "$n" >/dev/null 2>&1 || true; done
  for _ in $(seq 1 30); do any_open "${RABBIT_CLUSTER_PORTS[@]}" || return 0; sleep 1; done
  for n in 1 2 3; do scripts/rabbitmq-cluster.sh kill-node "$n" >/dev/null 2>&1 || true; done
}

stop_redis_tls() {
  # Where scripts/rabbitmq-cluster.sh keeps it (under target/ whatever CARGO_TARGET_DIR says).
  local pidfile=${IDEMPO_CLUSTER_DIR:-target/rabbitmq-cluster}/redis-tls.pid
  if [ -f "$pidfile" ]; then kill "$(cat "$pidfile")" 2>/dev/null || true; fi
  rm -f "$pidfile"
  for _ in $(seq 1 20); do port_open 6390 || return 0; sleep 0.5; done
}

teardown() {
  local status=$?
  trap - EXIT INT TERM
  echo "tearing down what this run started"
  if [ "$rabbit_cluster_before" = 0 ] && any_open "${RABBIT_CLUSTER_PORTS[@]}"; then
    echo "stopping the local RabbitMQ cluster"
    stop_rabbit_cluster_nodes
  fi
  if [ "$redis_tls_before" = 0 ] && port_open 6390; then
    echo "stopping the TLS Redis"
    stop_redis_tls
  fi
  if [ "$nats_cluster_before" = 0 ] && any_open "${NATS_CLUSTER_PORTS[@]}"; then
    echo "stopping the NATS cluster"
    scripts/nats-cluster.sh stop || true
  fi
  drop_test_schemas
  rm -f "$run_marker"
  exit "$status"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- 1. packages ------------------------------------------------------------------
missing=()
need() { command -v "$1" >/dev/null || missing+=("$2"); }
local_url "${DATABASE_URL:-}" && { need pg_ctlcluster postgresql; need psql postgresql-client; }
local_url "${AMQP_URL:-}" && need rabbitmq-server rabbitmq-server
need redis-server redis-server # the TLS Redis of the cluster script too
need nats-server nats-server   # the JetStream tests start servers of their own
need openssl openssl
need curl curl
need python3 python3
dpkg-query -W -f '${Status}' python3-venv 2>/dev/null | grep -q 'ok installed' || missing+=(python3-venv)
if selected dashboard_browser; then need chromium chromium; need chromedriver chromium-driver; fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  if [[ " ${missing[*]} " == *" postgresql "* ]]; then
    # A cluster installed just now: the tests connect over TCP as `postgres`
    # without a password.
    version=$(ls /etc/postgresql | head -n 1)
    as_root sed -i -e '1i host all all 127.0.0.1/32 trust' -e '1i host all all ::1/128 trust' \
      "/etc/postgresql/$version/main/pg_hba.conf"
    if port_open 5432; then as_root pg_ctlcluster --skip-systemctl-redirect "$version" main reload; fi
  fi
fi

# --- 2. services ------------------------------------------------------------------
if local_url "${DATABASE_URL:-}" && ! port_open 5432; then
  echo "starting PostgreSQL"
  as_root pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n 1)" main start
  wait_port PostgreSQL 5432 60
fi

if local_url "${AMQP_URL:-}"; then
  if ! port_open 5672; then
    echo "starting RabbitMQ"
    as_root rabbitmq-server -detached
    wait_port RabbitMQ 5672 120
  fi
  # The port opens before the broker accepts work; rabbitmqctl is also used by the crash test.
  if [ -z "${RABBITMQCTL:-}" ] && [ "$(id -u)" != 0 ]; then export RABBITMQCTL="sudo rabbitmqctl"; fi
  ${RABBITMQCTL:-rabbitmqctl} await_startup --timeout 120 >/dev/null
  # The dashboard reads the queues' unacked messages from the management API.
  if ! port_open 15672; then
    echo "enabling RabbitMQ's management plugin"
    as_root rabbitmq-plugins enable rabbitmq_management >/dev/null
    wait_port "RabbitMQ management" 15672 60
  fi
fi

if local_url "${REDIS_URL:-}" && ! port_open 6379; then
  echo "starting Redis"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
  wait_port Redis 6379 30
fi

if local_url "${NATS_URL:-}" && ! port_open 4222; then
  echo "starting NATS with JetStream"
  as_root mkdir -p /var/lib/nats-server
  as_root start-stop-daemon --start --oknodo --background --exec "$(command -v nats-server)" -- \
    -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
  wait_port NATS 4222 30
fi

# --- 3. the local clusters --------------------------------------------------------
# Three RabbitMQ nodes (amqps on node 1) and a TLS Redis, for the TLS and
# failover tests; about 30 s when not running yet.
if selected cluster tls startup_errors; then scripts/rabbitmq-cluster.sh start; fi
# Three NATS nodes for the JetStream failover test (which also starts them).
if selected nats_cluster; then scripts/nats-cluster.sh start; fi

# --- 4. the docs ------------------------------------------------------------------
# rustdoc with every feature (the guide, idempo::_guide, included), warnings as
# errors, so that a broken intra-doc link fails. Their code blocks run as
# doctests below.
failed=()
if [ "$all_targets" = 1 ] || [[ " $* " == *" --doc "* ]]; then
  RUSTDOCFLAGS="-D warnings" cargo doc --all-features --no-deps || failed+=("cargo doc")
fi

# Each feature on its own and the default set compile without a warning:
# what a feature turns on is all it needs, and nothing it leaves off is
# missed (`cargo hack check --each-feature`). In a target directory of its
# own: other RUSTFLAGS would rebuild the tests' dependencies otherwise.
if [ "$all_targets" = 1 ]; then
  if ! cargo hack --version >/dev/null 2>&1; then
    echo "installing cargo-hack"
    cargo install cargo-hack --locked
  fi
  CARGO_TARGET_DIR="$TARGET_DIR/features" RUSTFLAGS="-D warnings" \
    cargo hack check --each-feature || failed+=("cargo hack check --each-feature")
  # A transport pulls no other transport's client.
  if cargo tree -e normal --no-default-features --features nats | grep -q ' lapin '; then
    echo "--features nats pulls lapin" >&2; failed+=("features nats without lapin")
  fi
  if cargo tree -e normal --no-default-features --features amqp | grep -q ' async-nats '; then
    echo "--features amqp pulls async-nats" >&2; failed+=("features amqp without async-nats")
  fi
fi

# --- 5. the tests -----------------------------------------------------------------
cargo test --all-features --no-fail-fast "$@" || failed+=("cargo test")

# --- 6. the chaos tests' figures --------------------------------------------------
find "$TARGET_DIR/tmp" -name 'chaos-figures-*.txt' -newer "$run_marker" -exec cat {} + 2>/dev/null || true

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]} (see above)" >&2
  exit 1
fi
echo "all passed"
