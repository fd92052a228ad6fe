#!/usr/bin/env bash
# Stops every server up.sh started, by the PIDs it recorded, in an order that lets each
# shut down cleanly (the API server before etcd, or it hangs in shutdown). Safe to run
# twice, and on a rig that is half up.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

[ -d "$RIG_DIR/pids" ] || exit 0

# alive PID NAME: the process exists and is still the one we started (its command line
# names the run folder or the binary), so a recycled PID is never signalled.
alive() {
  local pid=$1 name=$2 cmd
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
  case "$cmd" in *"$RIG_DIR"* | *"$name"* | *beam*) return 0 ;; esac
  return 1
}

# stop NAME SIGNAL SECONDS: signal the recorded PID, wait for it to exit, SIGKILL after.
stop() {
  local name=$1 sig=$2 secs=$3 file="$RIG_DIR/pids/$1.pid" pid
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  if alive "$pid" "$name"; then
    kill -s "$sig" "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + secs))
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      log "$name ($pid) still running after ${secs}s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$file"
}

# The node first, while the API server still answers it: kubelet, then every container
# the runtime still runs, then containerd; then what they left in the kernel (mounts
# under the run folder, the pods' bridge).
stop kubelet TERM 15
if [ -f "$RIG_DIR/pids/containerd.pid" ] && [ -S "$RIG_DIR/node/containerd.sock" ]; then
  ctr=("$BIN/ctr-$CONTAINERD_VERSION" --address "$RIG_DIR/node/containerd.sock" -n k8s.io)
  for task in $("${ctr[@]}" tasks ls -q 2>/dev/null); do
    "${ctr[@]}" tasks kill -s SIGKILL "$task" >/dev/null 2>&1 || true
  done
  sleep 0.5
  for task in $("${ctr[@]}" tasks ls -q 2>/dev/null); do
    "${ctr[@]}" tasks delete -f "$task" >/dev/null 2>&1 || true
  done
fi
stop containerd TERM 15
if [ -d "$RIG_DIR/node" ]; then
  awk -v d="$RIG_DIR/node" 'index($2, d) == 1 {print $2}' /proc/self/mounts | sort -r |
    while read -r m; do umount -l "$m" 2>/dev/null || true; done
  # The pods' network, unless another rig has taken the node since (this one's kubelet
  # having died): it is that rig's now.
  owner=$(cat "$NODE_OWNER" 2>/dev/null || echo "$RIG_DIR")
  if [ "$owner" = "$RIG_DIR" ]; then
    ip link del obxrig0 2>/dev/null || true
    for _ in 1 2 3; do pod_nat_rules -D 2>/dev/null || break; done
    iptables -t nat -F OUTBOX-RIG 2>/dev/null && iptables -t nat -X OUTBOX-RIG 2>/dev/null || true
    rm -f "$NODE_OWNER"
  fi
fi

stop kube-scheduler TERM 10
stop kube-controller-manager TERM 10
stop kube-apiserver TERM 30
stop etcd TERM 10

# The node writes its PID file itself; a start that failed early never recorded it.
if [ ! -f "$RIG_DIR/pids/rabbitmq.pid" ] && [ -s "$RIG_DIR/rabbitmq/rabbitmq.pid" ] &&
  kill -0 "$(cat "$RIG_DIR/rabbitmq/rabbitmq.pid")" 2>/dev/null; then
  cp "$RIG_DIR/rabbitmq/rabbitmq.pid" "$RIG_DIR/pids/rabbitmq.pid"
fi
if [ -f "$RIG_DIR/pids/rabbitmq.pid" ] && [ -f "$RIG_DIR/rabbitmq.env" ]; then
  (source "$RIG_DIR/rabbitmq.env" &&
    timeout 30 setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups /usr/lib/rabbitmq/bin/rabbitmqctl -n "$RABBITMQ_NODENAME" stop >/dev/null 2>&1) || true
fi
stop rabbitmq TERM 20
rm -f "$RIG_DIR/rabbitmq/rabbitmq.pid"
stop rabbitmq-launcher TERM 5
stop epmd TERM 5

stop postgres INT 30 # SIGINT: PostgreSQL's fast shutdown
stop postgres18 INT 30
stop kafka TERM 30
stop nats TERM 10
stop prometheus TERM 10

# Anything recorded but not named above (a test may add its own).
for f in "$RIG_DIR"/pids/*.pid; do
  [ -e "$f" ] || continue
  stop "$(basename "$f" .pid)" TERM 10
done
log "rig down"
