#!/usr/bin/env bash
# A 3-node RabbitMQ cluster on this machine, beside the standard broker, for
# the cluster and TLS tests (and for trying failover by hand), plus a Redis
# that speaks only TLS.
#
#   scripts/rabbitmq-cluster.sh start            # start (idempotent), join, wait
#   scripts/rabbitmq-cluster.sh stop             # stop everything, keep the data
#   scripts/rabbitmq-cluster.sh stop-node N      # stop node N (1..3) cleanly
#   scripts/rabbitmq-cluster.sh kill-node N      # kill node N's VM (SIGKILL)
#   scripts/rabbitmq-cluster.sh start-node N     # start node N again
#   scripts/rabbitmq-cluster.sh status           # which nodes run
#   scripts/rabbitmq-cluster.sh ctl N ARGS...    # rabbitmqctl against node N
#   scripts/rabbitmq-cluster.sh certs            # only make the certificates
#
# With IDEMPO_CLUSTER_COMPOSE=1 the same commands drive the cluster of
# docker-compose.cluster.yml instead (node N is the service rabbit-N).
#
# Nodes idempo-1..3@localhost: AMQP on 127.0.0.1:5681..5683, distribution on
# 25681..25683; node 1 also serves amqps on 5691 (certificates of a CA made
# here with openssl). Redis with TLS on 6390. Everything lives under
# target/rabbitmq-cluster/. Needs Debian's rabbitmq-server package (the
# scripts in /usr/lib/rabbitmq/bin run as the caller), openssl, redis-server.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BASE="${IDEMPO_CLUSTER_DIR:-$ROOT/target/rabbitmq-cluster}"
BIN="${RABBITMQ_BIN:-/usr/lib/rabbitmq/bin}"
CERTS="$BASE/certs"
NODES=(1 2 3)

node_name() { echo "idempo-$1@localhost"; }

# The environment one node's server and CLI run with: its own HOME (and so
# its own Erlang cookie, the same for all three), its own files and ports.
node_env() {
  local n=$1 dir="$BASE/node$1"
  echo "HOME=$dir/home"
  echo "RABBITMQ_CONF_ENV_FILE=$BASE/empty-env.conf"
  echo "RABBITMQ_NODENAME=$(node_name "$n")"
  echo "RABBITMQ_NODE_PORT=$((5680 + n))"
  echo "RABBITMQ_DIST_PORT=$((25680 + n))"
  echo "RABBITMQ_CONFIG_FILE=$dir/rabbitmq.conf"
  echo "RABBITMQ_MNESIA_BASE=$dir/mnesia"
  echo "RABBITMQ_LOG_BASE=$dir/log"
  echo "RABBITMQ_ENABLED_PLUGINS_FILE=$dir/enabled_plugins"
  echo "RABBITMQ_PID_FILE=$dir/pid"
  echo "ERL_EPMD_ADDRESS=127.0.0.1"
}

on_node() { # N command...
  local n=$1
  shift
  env $(node_env "$n") "$@"
}

ctl() { # N args...
  local n=$1
  shift
  on_node "$n" "$BIN/rabbitmqctl" -n "$(node_name "$n")" "$@"
}

certificates() {
  [ -f "$CERTS/server.pem" ] && return 0
  mkdir -p "$CERTS"
  (
    cd "$CERTS"
    local subj="/CN=idempo test CA"
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "$subj" \
      -keyout ca.key -out ca.pem 2>/dev/null
    openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=another CA" \
      -keyout wrong-ca.key -out wrong-ca.pem 2>/dev/null
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n' > server.ext
    openssl req -newkey rsa:2048 -nodes -subj "/CN=localhost" \
      -keyout server.key -out server.csr 2>/dev/null
    openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
      -days 3650 -extfile server.ext -out server.pem 2>/dev/null
    printf 'extendedKeyUsage=clientAuth\n' > client.ext
    openssl req -newkey rsa:2048 -nodes -subj "/CN=idempo client" \
      -keyout client.rsa.key -out client.csr 2>/dev/null
    openssl pkcs8 -topk8 -nocrypt -in client.rsa.key -out client.key
    openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
      -days 3650 -extfile client.ext -out client.pem 2>/dev/null
    chmod 644 ./*.pem ./*.key
  )
}

prepare() {
  mkdir -p "$BASE"
  : > "$BASE/empty-env.conf"
  [ -f "$BASE/cookie" ] || head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$BASE/cookie"
  certificates
  for n in "${NODES[@]}"; do
    local dir="$BASE/node$n"
    mkdir -p "$dir/home" "$dir/mnesia" "$dir/log"
    install -m 400 "$BASE/cookie" "$dir/home/.erlang.cookie.new"
    mv -f "$dir/home/.erlang.cookie.new" "$dir/home/.erlang.cookie"
    echo "[]." > "$dir/enabled_plugins"
    {
      echo "listeners.tcp.local = 127.0.0.1:$((5680 + n))"
      echo "loopback_users = none"
      echo "vm_memory_high_watermark.relative = 0.1"
      if [ "$n" = 1 ]; then
        echo "listeners.ssl.default = 127.0.0.1:5691"
        echo "ssl_options.cacertfile = $CERTS/ca.pem"
        echo "ssl_options.certfile = $CERTS/server.pem"
        echo "ssl_options.keyfile = $CERTS/server.key"
        echo "ssl_options.verify = verify_peer"
        echo "ssl_options.fail_if_no_peer_cert = false"
      fi
    } > "$dir/rabbitmq.conf"
  done
}

running() { ctl "$1" status >/dev/null 2>&1; }

launch_node() {
  running "$1" || on_node "$1" "$BIN/rabbitmq-server" -detached >/dev/null 2>&1
}

start_node() {
  local n=$1
  launch_node "$n"
  # -detached returns before the node is reachable; await_startup needs it to be.
  for _ in $(seq 1 120); do
    running "$n" && break
    sleep 0.5
  done
  ctl "$n" await_startup --timeout 120 >/dev/null
}

start_redis_tls() {
  local pidfile="$BASE/redis-tls.pid"
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then return 0; fi
  redis-server --port 0 --tls-port 6390 --bind 127.0.0.1 \
    --tls-cert-file "$CERTS/server.pem" --tls-key-file "$CERTS/server.key" \
    --tls-ca-cert-file "$CERTS/ca.pem" --tls-auth-clients yes \
    --save "" --appendonly no --dir "$BASE" --pidfile "$pidfile" \
    --logfile "$BASE/redis-tls.log" --daemonize yes
}

start() {
  prepare
  # All at once: a clustered node waits at boot for the peers that were
  # running when it stopped, so starting them one after another can stall.
  for n in "${NODES[@]}"; do launch_node "$n"; done
  for n in "${NODES[@]}"; do start_node "$n"; done
  for n in 2 3; do
    if ! ctl 1 cluster_status 2>/dev/null | grep -q "$(node_name "$n")"; then
      ctl "$n" stop_app >/dev/null 2>&1
      ctl "$n" reset >/dev/null 2>&1
      ctl "$n" join_cluster "$(node_name 1)" >/dev/null 2>&1
      ctl "$n" start_app >/dev/null 2>&1
    fi
  done
  for n in "${NODES[@]}"; do ctl "$n" await_startup --timeout 120 >/dev/null; done
  # Test queues go away when idle, like on the standard broker.
  ctl 1 set_policy idempo-test-expiry "^idempo_test_" '{"expires":300000}' --apply-to queues >/dev/null
  start_redis_tls
  echo "cluster up: amqp://guest:guest@127.0.0.1:5681,5682,5683 (amqps on 5691), rediss on 6390"
}

stop() {
  for n in "${NODES[@]}"; do ctl "$n" stop >/dev/null 2>&1 || true; done
  if [ -f "$BASE/redis-tls.pid" ]; then
    kill "$(cat "$BASE/redis-tls.pid")" 2>/dev/null || true
    rm -f "$BASE/redis-tls.pid"
  fi
}

kill_node() {
  local n=$1 pid
  pid="$(cat "$BASE/node$n/pid" 2>/dev/null || true)"
  [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true
}

status() {
  for n in "${NODES[@]}"; do
    if running "$n"; then echo "node $n ($(node_name "$n"), port $((5680 + n))): running"; else echo "node $n: stopped"; fi
  done
}

# The same commands for docker-compose.cluster.yml.
compose() { docker compose -f "$ROOT/docker-compose.cluster.yml" "$@"; }
if [ "${IDEMPO_CLUSTER_COMPOSE:-0}" = 1 ]; then
  case "${1:-}" in
    start) certificates; compose up -d --wait
      compose exec -T rabbit-1 rabbitmqctl set_policy idempo-test-expiry "^idempo_test_" '{"expires":300000}' --apply-to queues >/dev/null ;;
    stop) compose stop ;;
    stop-node) compose stop "rabbit-$2" ;;
    kill-node) compose kill "rabbit-$2" ;;
    start-node) compose start "rabbit-$2"; compose exec -T "rabbit-$2" rabbitmqctl await_startup --timeout 120 >/dev/null ;;
    status) compose ps ;;
    ctl) n=$2; shift 2; compose exec -T "rabbit-$n" rabbitmqctl "$@" ;;
    certs) certificates ;;
    *) sed -n '2,19p' "$0"; exit 2 ;;
  esac
  exit 0
fi

case "${1:-}" in
  start) start ;;
  certs) certificates ;;
  stop) stop ;;
  stop-node) ctl "$2" stop >/dev/null ;;
  kill-node) kill_node "$2" ;;
  start-node) prepare; start_node "$2" ;;
  status) status ;;
  ctl) n=$2; shift 2; ctl "$n" "$@" ;;
  *) sed -n '2,19p' "$0"; exit 2 ;;
esac
