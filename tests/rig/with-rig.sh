#!/usr/bin/env bash
# with-rig.sh CMD...: starts the rig, runs CMD with OUTBOX_RIG_ENV pointing at it, and
# stops the rig afterwards whatever CMD did (also on Ctrl-C). Exits with CMD's status.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

trap '"$RIG_ROOT/down.sh"' EXIT
trap 'exit 130' INT TERM
"$RIG_ROOT/up.sh"
export OUTBOX_RIG_ENV="$RIG_ENV"
"$@"
