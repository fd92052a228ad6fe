{{/* Name of the chart, for labels. */}}
{{- define "outbox-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every namespaced object name: "<release>-<chart>", or the release name
when it already contains the chart name. */}}
{{- define "outbox-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of cluster-scoped objects (ClusterRoles, bindings): carries the release
namespace, so the same release name in two namespaces never collides. */}}
{{- define "outbox-operator.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "outbox-operator.fullname" .) }}
{{- end }}

{{- define "outbox-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels the operator's pods are selected by; never change them (Deployment
selectors are immutable). */}}
{{- define "outbox-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "outbox-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "outbox-operator.labels" -}}
helm.sh/chart: {{ include "outbox-operator.chart" . }}
{{ include "outbox-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: outbox-operator
{{- end }}

{{- define "outbox-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "outbox-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image: a digest wins over a tag; the tag defaults to appVersion. */}}
{{- define "outbox-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "outbox-operator.relayImage" -}}
{{- default (include "outbox-operator.image" .) .Values.relayImage }}
{{- end }}

{{- define "outbox-operator.leaseName" -}}
{{- default (include "outbox-operator.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/* What the controller does in the namespaces it watches. Shared by the ClusterRole
(all namespaces) and the Role (watchNamespace). */}}
{{- define "outbox-operator.watchRules" -}}
# The OutboxRelays themselves: read, add/remove the finalizer, write status.
- apiGroups: ["outbox.dev"]
  resources: ["outboxrelays"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["outbox.dev"]
  resources: ["outboxrelays/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["outbox.dev"]
  resources: ["outboxrelays/finalizers"]
  verbs: ["update"]
# OutboxReplays: read them, write their status; each runs as one Job the controller
# creates (shaped like the relay's pods) and reads back (its pod's termination message).
- apiGroups: ["outbox.dev"]
  resources: ["outboxreplays"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["outbox.dev"]
  resources: ["outboxreplays/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create"]
# The objects the controller builds for each relay (server-side apply, pruning).
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors", "prometheusrules"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
# Relay pods, read only: the finalizer waits until a log-tailing relay's pods are gone
# before it drops the replication slot (a running relay would hold it).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# Get by name only: the controller checks that a referenced Secret and key exist; the
# relay pods mount the Secret themselves. No list/watch: that would let the operator
# read every Secret in a watched namespace (in cluster-wide mode, in the cluster).
# Patch: only to add and remove its finalizer outbox.dev/slot-of-<relay> on the
# Secrets that reach a log-tailing relay's database, so they outlive the relay until
# its replication slot is dropped. Never create, update or delete.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
# CloudNativePG Clusters that relays name in spec.database.databaseRef: read by name
# only (their Secrets are read as any referenced Secret is).
- apiGroups: ["postgresql.cnpg.io"]
  resources: ["clusters"]
  verbs: ["get"]
# Strimzi Kafka clusters and KafkaUsers that relays name in spec.broker.kafka.kafkaRef:
# read by name only (the cluster CA and user Secrets are read as any referenced Secret).
- apiGroups: ["kafka.strimzi.io"]
  resources: ["kafkas", "kafkausers"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}
