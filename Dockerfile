# syntax=docker/dockerfile:1.7
# The one image of outbox-operator: the operator (`outbox-operator controller`) and the
# relay pods (`outbox-operator relay`) both run it.
#
#   docker build -t ghcr.io/outbox-operator/outbox-operator:0.1.0 .
#
# The binary is built with exactly the command CI builds it with
# (`cargo build --release --locked`), so what CI proves is what the image contains.

# Keep in step with the toolchain CI uses (edition 2024 needs 1.85 or newer).
ARG RUST_VERSION=1.95

############################################################################ builder
FROM rust:${RUST_VERSION}-bookworm AS builder

# librdkafka is built from source and linked statically (rdkafka's cmake-build
# feature): it needs cmake and a C/C++ compiler, zlib, and the curl headers, which
# librdkafka 2.12 includes unconditionally even with curl turned off.
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake g++ zlib1g-dev libcurl4-openssl-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY . .

# Cache mounts keep the registry and the target folder between builds, so a source
# change recompiles the crate, not librdkafka and every dependency.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/usr/local/cargo/git \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked \
 && install -D -m 0755 target/release/outbox-operator /out/outbox-operator

# The runtime image has glibc, libgcc and libstdc++ and nothing else: fail the build
# here, not in a pod, if the binary wants any other shared library (zlib, libcurl).
RUN set -eu; \
    needed="$(ldd /out/outbox-operator | awk '{print $1}' | sort -u)"; \
    echo "shared libraries:"; echo "$needed"; \
    extra="$(echo "$needed" | grep -Ev '^(linux-vdso\.so\.1|/lib64/ld-linux-x86-64\.so\.2|/lib/ld-linux-aarch64\.so\.1|libc\.so\.6|libm\.so\.6|libgcc_s\.so\.1|libstdc\+\+\.so\.6|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1)$' || true)"; \
    if [ -n "$extra" ]; then echo "not in distroless/cc: $extra" >&2; exit 1; fi; \
    /out/outbox-operator --version

############################################################################ runtime
# glibc + libgcc + libstdc++ + CA certificates, no shell, no package manager; the
# :nonroot tag runs as uid/gid 65532.
FROM gcr.io/distroless/cc-debian12:nonroot

ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="outbox-operator" \
      org.opencontainers.image.description="Kubernetes operator running transactional-outbox relays from PostgreSQL to Kafka, NATS JetStream and RabbitMQ" \
      org.opencontainers.image.source="https://github.com/outbox-operator/outbox-operator" \
      org.opencontainers.image.url="https://github.com/outbox-operator/outbox-operator" \
      org.opencontainers.image.documentation="https://github.com/outbox-operator/outbox-operator#readme" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="outbox-operator" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="gcr.io/distroless/cc-debian12:nonroot"

COPY --from=builder /out/outbox-operator /outbox-operator

# Numeric, so Kubernetes' runAsNonRoot can verify it without an /etc/passwd lookup.
USER 65532:65532
# The operator's /metrics, /healthz and /readyz; relays use the same port.
EXPOSE 8080
ENTRYPOINT ["/outbox-operator"]
CMD ["--help"]
