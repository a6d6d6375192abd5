#!/usr/bin/env bash
# A 3-node NATS cluster with JetStream on this machine, beside the standard
# server, for the JetStream failover test (and for trying failover by hand).
#
#   scripts/nats-cluster.sh start            # start every node (idempotent), wait for JetStream
#   scripts/nats-cluster.sh stop             # stop every node, keep the data
#   scripts/nats-cluster.sh stop-node N      # stop node N (1..3) (SIGTERM: a clean exit)
#   scripts/nats-cluster.sh kill-node N      # kill node N (SIGKILL)
#   scripts/nats-cluster.sh start-node N     # start node N again
#   scripts/nats-cluster.sh status           # which nodes run
#   scripts/nats-cluster.sh urls             # the client URLs, comma-separated
#
# Nodes n1..n3: clients on 127.0.0.1:14221..14223, routes on 16221..16223,
# monitoring on 18221..18223. Everything (configs, JetStream stores, logs,
# pid files) lives under target/nats-cluster/. Needs nats-server (Debian's
# nats-server package) on the PATH.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BASE="${IDEMPO_NATS_CLUSTER_DIR:-$ROOT/target/nats-cluster}"
NODES=(1 2 3)

client_port() { echo $((14220 + $1)); }
route_port() { echo $((16220 + $1)); }
monitor_port() { echo $((18220 + $1)); }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

config() { # n
  local n=$1 dir="$BASE/n$1"
  mkdir -p "$dir/store"
  cat >"$dir/nats.conf" <<CONF
server_name: n$n
listen: 127.0.0.1:$(client_port "$n")
http: 127.0.0.1:$(monitor_port "$n")
jetstream {
  store_dir: "$dir/store"
}
cluster {
  name: idempo-test
  listen: 127.0.0.1:$(route_port "$n")
  routes: [
    nats-route://127.0.0.1:$(route_port 1)
    nats-route://127.0.0.1:$(route_port 2)
    nats-route://127.0.0.1:$(route_port 3)
  ]
}
CONF
}

running() { # n
  local pid_file="$BASE/n$1/pid"
  [[ -f $pid_file ]] && kill -0 "$(cat "$pid_file")" 2>/dev/null
}

start_node() { # n
  local n=$1 dir="$BASE/n$1"
  command -v nats-server >/dev/null || {
    echo "nats-server is not installed (apt-get install nats-server)" >&2
    exit 1
  }
  running "$n" && return 0
  # A node this script lost track of (its pid file gone) would pass for
  # this one: stopping "it" would then stop nothing.
  if port_open "$(client_port "$n")"; then
    echo "port $(client_port "$n") is taken by a process this script did not start; stop it first (pkill -f $BASE/n$n)" >&2
    exit 1
  fi
  config "$n"
  # Detached from the caller's pipes: a test waits for them to close.
  nats-server -c "$dir/nats.conf" -l "$dir/nats.log" -P "$dir/pid" </dev/null >/dev/null 2>&1 &
  disown
  for _ in $(seq 1 50); do
    port_open "$(client_port "$n")" && return 0
    sleep 0.1
  done
  echo "node n$n did not start: see $dir/nats.log" >&2
  exit 1
}

stop_node() { # n signal
  local n=$1 sig=$2 pid_file="$BASE/n$1/pid"
  running "$n" || return 0
  local pid
  pid=$(cat "$pid_file")
  kill "-$sig" "$pid"
  for _ in $(seq 1 100); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  rm -f "$pid_file"
}

# JetStream is ready when the cluster has elected its meta leader: the
# monitoring endpoint of each node then answers healthz with JetStream on.
wait_ready() {
  for _ in $(seq 1 150); do
    local ready=0
    for n in "${NODES[@]}"; do
      if curl -fs "http://127.0.0.1:$(monitor_port "$n")/healthz?js-enabled-only=true" >/dev/null 2>&1 &&
        curl -fs "http://127.0.0.1:$(monitor_port "$n")/jsz" 2>/dev/null | grep -q '"meta_cluster"'; then
        ready=$((ready + 1))
      fi
    done
    if ((ready == ${#NODES[@]})) && curl -fs "http://127.0.0.1:$(monitor_port 1)/jsz" | grep -q '"leader"'; then
      return 0
    fi
    sleep 0.2
  done
  echo "the cluster's JetStream did not elect a leader: see $BASE/n*/nats.log" >&2
  exit 1
}

case "${1:-}" in
start)
  for n in "${NODES[@]}"; do start_node "$n"; done
  wait_ready
  ;;
stop) for n in "${NODES[@]}"; do stop_node "$n" TERM; done ;;
stop-node) stop_node "$2" TERM ;;
kill-node) stop_node "$2" KILL ;;
start-node) start_node "$2" ;;
status)
  for n in "${NODES[@]}"; do
    if running "$n"; then echo "n$n running on $(client_port "$n")"; else echo "n$n stopped"; fi
  done
  ;;
urls)
  echo "nats://127.0.0.1:$(client_port 1),nats://127.0.0.1:$(client_port 2),nats://127.0.0.1:$(client_port 3)"
  ;;
*)
  sed -n '2,16p' "$0" >&2
  exit 2
  ;;
esac
