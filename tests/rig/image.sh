#!/usr/bin/env bash
# image.sh BINARY TAG: assembles the operator's image from BINARY as the Dockerfile's
# runtime stage makes it — the binary at /outbox-operator, the shared libraries it links
# (only those distroless/cc has: the Dockerfile's ldd check), user 65532, entrypoint
# /outbox-operator, port 8080, the same title label — with buildah from scratch (nothing
# pulled), and imports it into the rig node's containerd as outbox.test/outbox-operator:TAG.
# Prints the image reference. tests/e2e/e2e_node.rs checks it agrees with the Dockerfile.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

binary=$1 tag=$2
[ -x "$binary" ] || die "image.sh: $binary is not an executable"
[ -S "$RIG_DIR/node/containerd.sock" ] || die "image.sh: the rig's node is not running (tests/rig/up.sh)"
ref="outbox.test/outbox-operator:$tag"
# The Dockerfile's allowlist: what distroless/cc-debian12 provides.
libs=$(ldd "$binary" | awk '/=>/ {print $1, $3} /ld-linux/ {print $1, $1}')
extra=$(echo "$libs" | awk '{print $1}' | grep -Ev '^(linux-vdso\.so\.1|/lib64/ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libgcc_s\.so\.1|libstdc\+\+\.so\.6|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1)$' || true)
[ -z "$extra" ] || die "image.sh: $binary links libraries distroless/cc lacks: $extra"
store=$(mktemp -d)
trap 'buildah --root "$store/root" --runroot "$store/run" --storage-driver vfs rm --all >/dev/null 2>&1; rm -rf "$store"' EXIT
b=(buildah --root "$store/root" --runroot "$store/run" --storage-driver vfs)
c=$("${b[@]}" from scratch)
"${b[@]}" copy "$c" "$binary" /outbox-operator >/dev/null
echo "$libs" | awk '$2 ~ /^\// {print $2}' | sort -u | while read -r lib; do
  "${b[@]}" copy "$c" "$lib" "$lib" >/dev/null
done
"${b[@]}" config --user 65532:65532 --entrypoint '["/outbox-operator"]' --cmd '--help' \
  --port 8080/tcp --label org.opencontainers.image.title=outbox-operator "$c"
"${b[@]}" commit --quiet "$c" "$ref" >/dev/null
"${b[@]}" push --quiet "$ref" "oci-archive:$store/image.tar:$ref" >/dev/null 2>&1
"$BIN/ctr-$CONTAINERD_VERSION" --address "$RIG_DIR/node/containerd.sock" -n k8s.io \
  images import "$store/image.tar" >/dev/null 2>&1 || die "image.sh: containerd refused $ref"
"${b[@]}" inspect --type image "$ref" >"$store/inspect.json"
cp "$store/inspect.json" "$RIG_DIR/node/image-$tag.json"
echo "$ref"
