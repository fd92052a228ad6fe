#!/usr/bin/env bash
# test-all.sh: the tests `make test` runs on the rig (OUTBOX_RIG_ENV set by with-rig.sh):
# every target of the crate, as `cargo test --all-targets --no-fail-fast` would run
# them, in two passes. The binaries whose tests mostly wait on servers — the
# controller's, the relay's and the end-to-end ones — run four tests at a time: with
# cargo's default of one per core, the two cores of CI sat idle two thirds of the run.
# The fault matrix and the memory test keep the default: they stop and kill servers and
# load the WAL, which would slow their neighbours. Exits non-zero if either pass failed.
#
# The operator's image on the rig's node carries the release binary, as the Dockerfile
# builds it (`cargo build --release --locked`). It is built during the first pass, in a
# target folder of its own (cargo locks a target folder while its tests run), and
# handed to the second pass, whose end-to-end tests build the image from it
# (OUTBOX_IMAGE_BINARY; without it, the image carries the debug binary under test).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
CARGO=${CARGO:-cargo}
RELEASE_TARGET="$CACHE/target-release"
release_log="$RIG_DIR/logs/release-build.log"
(cd "$REPO" && CARGO_TARGET_DIR="$RELEASE_TARGET" "$CARGO" build --release --locked \
  --bin outbox-operator >"$release_log" 2>&1) &
release_pid=$!
WIDE=(controller e2e relay)
narrow=() wide=()
for main in "$REPO"/tests/*/main.rs; do
  name=$(basename "$(dirname "$main")")
  if [[ " ${WIDE[*]} " == *" $name "* ]]; then wide+=(--test "$name"); else narrow+=(--test "$name"); fi
done
status=0
(cd "$REPO" && "$CARGO" test --locked --no-fail-fast --lib --bins --examples --benches "${narrow[@]}") || status=$?
if wait "$release_pid"; then
  export OUTBOX_IMAGE_BINARY="$RELEASE_TARGET/release/outbox-operator"
  log "release binary built for the operator's image: $OUTBOX_IMAGE_BINARY"
else
  status=1
  log "the release build failed (the image carries the debug binary):"
  tail -n 30 "$release_log" >&2
fi
(cd "$REPO" && "$CARGO" test --locked --no-fail-fast "${wide[@]}" -- --test-threads 4) || status=$?
exit "$status"
