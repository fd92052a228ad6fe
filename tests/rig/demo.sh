#!/usr/bin/env bash
# demo.sh [DEMO ARGS...]: `make demo`. Builds the operator and the demo program
# (tests/demo/demo.rs), starts a rig of its own, installs the chart's CRDs, and runs the
# demo until Ctrl-C (or --duration); then stops the demo and every server it started.
#
# The demo's rig has its own run folder (/tmp/outbox-operator-demo-<hash>), ports,
# RabbitMQ node and epmd, and leaves the checkout's .rig link alone, so it runs beside a
# rig that `make test` or `make rig-up` starts from the same checkout. (It takes the
# machine's one node only when no other rig has it.) A second demo from the same
# checkout is refused.
set -euo pipefail
RIG_SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CHECKOUT=$(cd "$RIG_SCRIPTS/../.." && pwd)
DEMO_DIR=/tmp/outbox-operator-demo-$(printf %s "$CHECKOUT" | md5sum | cut -c1-10)
# The node, when no other rig (make test's) runs it; else relay pods run on the pod runner.
export OUTBOX_RIG_DIR="$DEMO_DIR" OUTBOX_RIG_LINK=0 OUTBOX_RIG_NODE=auto
source "$RIG_SCRIPTS/lib.sh"

# One demo per checkout: the lock is held for as long as this script runs (servers are
# started with the descriptor closed, so a crashed script never leaves it held).
exec 9>"$DEMO_DIR.lock"
flock -n 9 || die "a demo from this checkout is already running (rig folder $DEMO_DIR): stop it with Ctrl-C first"

CARGO=${CARGO:-cargo}
TARGET=${CARGO_TARGET_DIR:-$REPO/target}
log "building the operator and the demo"
(cd "$REPO" && "$CARGO" build --locked --bin outbox-operator --example demo)

demo_pid=""
stop_demo() { [ -z "$demo_pid" ] || kill -TERM "$demo_pid" 2>/dev/null || true; }
trap 'rc=$?; stop_demo; wait 2>/dev/null; "$RIG_ROOT/down.sh" 9>&-; exit "$rc"' EXIT
trap 'stop_demo' INT TERM

log "starting the demo's own rig in $RIG_DIR"
"$RIG_ROOT/up.sh" 9>&-
KUBECTL=$(sed -n 's/^OUTBOX_RIG_KUBECTL=//p' "$RIG_ENV")
KUBECONFIG_FILE=$(sed -n 's/^OUTBOX_RIG_KUBECONFIG=//p' "$RIG_ENV")
log "installing the chart's CRDs (charts/outbox-operator/crds)"
"$KUBECTL" --kubeconfig "$KUBECONFIG_FILE" apply --server-side -f "$REPO/charts/outbox-operator/crds"
"$KUBECTL" --kubeconfig "$KUBECONFIG_FILE" wait --for condition=Established --timeout 60s \
  crd/outboxrelays.outbox.dev

# In the background and waited for, so a signal to this script is passed on at once;
# the demo stops its relays and the operator before it exits, then down.sh runs.
OUTBOX_RIG_ENV="$RIG_ENV" "$TARGET/debug/examples/demo" "$@" 9>&- &
demo_pid=$!
rc=0
while :; do
  # A trapped signal interrupts wait (status > 128) while the demo is still stopping.
  if wait "$demo_pid"; then rc=0; else rc=$?; fi
  kill -0 "$demo_pid" 2>/dev/null || break
done
demo_pid=""
exit "$rc"
