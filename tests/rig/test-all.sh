#!/usr/bin/env bash
# test-all.sh: the tests `make test` runs on the rig (OUTBOX_RIG_ENV set by with-rig.sh):
# every target of the crate, as `cargo test --all-targets --no-fail-fast` would run
# them, in two passes. The binaries whose tests mostly wait on servers — the
# controller's, the relay's and the end-to-end ones — run four tests at a time: with
# cargo's default of one per core, the two cores of CI sat idle two thirds of the run.
# The fault matrix and the memory test keep the default: they stop and kill servers and
# load the WAL, which would slow their neighbours. Exits non-zero if either pass failed.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
CARGO=${CARGO:-cargo}
WIDE=(controller e2e relay)
narrow=() wide=()
for main in "$REPO"/tests/*/main.rs; do
  name=$(basename "$(dirname "$main")")
  if [[ " ${WIDE[*]} " == *" $name "* ]]; then wide+=(--test "$name"); else narrow+=(--test "$name"); fi
done
status=0
(cd "$REPO" && "$CARGO" test --locked --no-fail-fast --lib --bins --examples --benches "${narrow[@]}") || status=$?
(cd "$REPO" && "$CARGO" test --locked --no-fail-fast "${wide[@]}" -- --test-threads 4) || status=$?
exit "$status"
