{{/*
Names and labels.
*/}}
{{- define "engram.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "engram.fullname" -}}
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

{{/* Labels every object gets besides its selector labels. */}}
{{- define "engram.commonLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* An object's labels; pass (dict "root" $ "component" "proxy"). */}}
{{- define "engram.labels" -}}
{{ include "engram.selectorLabels" . }}
{{ include "engram.commonLabels" .root }}
{{- end }}

{{/* Selector labels; pass (dict "root" $ "component" "proxy"). */}}
{{- define "engram.selectorLabels" -}}
app.kubernetes.io/name: {{ include "engram.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "engram.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
Secrets and Redis.
*/}}
{{- define "engram.upstreamKeyConfigured" -}}
{{- if or .Values.upstream.apiKey.existingSecret .Values.upstream.apiKey.value }}true{{ end }}
{{- end }}

{{- define "engram.adminTokenConfigured" -}}
{{- if or .Values.adminToken.existingSecret .Values.adminToken.value }}true{{ end }}
{{- end }}

{{/* The chart creates its Secret only for values given inline. */}}
{{- define "engram.createSecret" -}}
{{- if or (and .Values.upstream.apiKey.value (not .Values.upstream.apiKey.existingSecret)) (and .Values.adminToken.value (not .Values.adminToken.existingSecret)) }}true{{ end }}
{{- end }}

{{/* identity.trust: the value, else headers for a sidecar and client_keys standalone. */}}
{{- define "engram.trust" -}}
{{- .Values.identity.trust | default (ternary "client_keys" "headers" (eq .Values.mode "standalone")) }}
{{- end }}

{{/* Where the client keys file is mounted (identity.trust: client_keys). */}}
{{- define "engram.clientKeysDir" -}}
/etc/engram-client-keys
{{- end }}

{{/* The container port of probes and scraping: the ops listener of a sidecar, else the proxy. */}}
{{- define "engram.probePort" -}}
{{- ternary .Values.opsPort .Values.port (eq .Values.mode "sidecar") }}
{{- end }}

{{/* The bundled Redis runs when the Redis backend has no external server. */}}
{{- define "engram.bundledRedis" -}}
{{- if and (eq .Values.store.backend "redis") (not .Values.redis.url) (not .Values.redis.existingSecret) }}true{{ end }}
{{- end }}

{{- define "engram.redisFullname" -}}
{{- printf "%s-redis" (include "engram.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The config.yaml engram reads: what the values say, with .Values.config merged over it. Keys are
config.yaml's own (snake_case); env overrides (ENGRAM_SECTION__KEY) win over the file.
*/}}
{{- define "engram.configYaml" -}}
{{- $upstream := dict "base_url" .Values.upstream.baseUrl }}
{{- if include "engram.upstreamKeyConfigured" . }}
{{- $_ := set $upstream "api_key_env" "UPSTREAM_API_KEY" }}
{{- end }}
{{- $store := dict "backend" .Values.store.backend "data_dir" "/var/lib/engram" }}
{{- if include "engram.bundledRedis" . }}
{{- $_ := set $store "redis_url" (printf "redis://%s:6379" (include "engram.redisFullname" .)) }}
{{- else if .Values.redis.url }}
{{- $_ := set $store "redis_url" .Values.redis.url }}
{{- end }}
{{- /* A sidecar's proxy is for its app alone: loopback, with probes and metrics on 0.0.0.0. */}}
{{- $server := dict "listen" (printf "0.0.0.0:%d" (int .Values.port)) }}
{{- if eq .Values.mode "sidecar" }}
{{- $server = dict "listen" (printf "127.0.0.1:%d" (int .Values.port)) "ops_listen" (printf "0.0.0.0:%d" (int .Values.opsPort)) }}
{{- end }}
{{- $generated := dict
  "server" $server
  "identity" (dict "trust" (include "engram.trust" .))
  "upstream" $upstream
  "store" $store
  "memory" (deepCopy (default (dict) .Values.memory))
  "logging" (dict "format" "json") }}
{{- toYaml (mustMergeOverwrite $generated (deepCopy (default (dict) .Values.config))) }}
{{- end }}

{{/*
Seconds from SIGTERM to SIGKILL: engram drains in-flight streams and background work for
server.drain_timeout_ms; a native sidecar is stopped only after the app has exited.
*/}}
{{- define "engram.drainSeconds" -}}
{{- $drainMs := 30000 }}
{{- with .Values.config.server }}{{ with .drain_timeout_ms }}{{ $drainMs = . }}{{ end }}{{ end }}
{{- add (div (int64 $drainMs) 1000) 15 }}
{{- end }}

{{- define "engram.terminationGracePeriodSeconds" -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- $seconds := int64 (include "engram.drainSeconds" .) }}
{{- if and (eq .Values.mode "sidecar") .Values.sidecar.native }}
{{- $seconds = add $seconds .Values.sidecar.appShutdownSeconds }}
{{- else if eq .Values.mode "sidecar" }}
{{- $seconds = add $seconds .Values.sidecar.preStopSleepSeconds }}
{{- end }}
{{- $seconds }}
{{- else }}
{{- .Values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* The engram container's environment: its secrets and .Values.extraEnv. */}}
{{- define "engram.env" -}}
{{- if include "engram.upstreamKeyConfigured" . }}
- name: UPSTREAM_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.upstream.apiKey.existingSecret | default (include "engram.fullname" .) }}
      key: {{ ternary .Values.upstream.apiKey.existingSecretKey "upstream-api-key" (not (empty .Values.upstream.apiKey.existingSecret)) }}
{{- end }}
{{- if include "engram.adminTokenConfigured" . }}
- name: ENGRAM_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.adminToken.existingSecret | default (include "engram.fullname" .) }}
      key: {{ ternary .Values.adminToken.existingSecretKey "admin-token" (not (empty .Values.adminToken.existingSecret)) }}
{{- end }}
{{- if eq (include "engram.trust" .) "client_keys" }}
- name: ENGRAM_CLIENT_KEYS_FILE
  value: {{ include "engram.clientKeysDir" . }}/client-keys
{{- end }}
{{- if eq (include "engram.trust" .) "signed" }}
- name: ENGRAM_IDENTITY_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ .Values.identity.signingSecret.existingSecret }}
      key: {{ .Values.identity.signingSecret.existingSecretKey }}
{{- end }}
{{- if and (eq .Values.store.backend "redis") .Values.redis.existingSecret }}
- name: ENGRAM_STORE__REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.existingSecretKey }}
{{- end }}
{{- with .Values.extraEnv }}
{{- toYaml . | nindent 0 }}
{{- end }}
{{- end }}

{{/*
The engram container without its name: shared by the standalone Deployment and the sidecar.
*/}}
{{- define "engram.containerSpec" -}}
image: {{ include "engram.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args:
  - serve
  - --config
  - /etc/engram/config.yaml
ports:
  # Probes and scraping: the proxy's port standalone, the ops listener's in a sidecar (whose
  # proxy listens on loopback and needs no declared port).
  - name: engram
    containerPort: {{ include "engram.probePort" . }}
    protocol: TCP
{{- with include "engram.env" . | trim }}
env:
  {{- . | nindent 2 }}
{{- end }}
{{- with .Values.extraEnvFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.startupProbe }}
startupProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.livenessProbe }}
livenessProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.readinessProbe }}
readinessProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.resources }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.securityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumeMounts:
  - name: engram-config
    mountPath: /etc/engram
    readOnly: true
  - name: engram-data
    mountPath: /var/lib/engram
{{- if eq (include "engram.trust" .) "client_keys" }}
  - name: engram-client-keys
    mountPath: {{ include "engram.clientKeysDir" . }}
    readOnly: true
{{- end }}
{{- end }}

{{/*
The sidecar, for a pod template's initContainers (sidecar.native, the default) or containers
(sidecar.native=false). From an app chart that depends on this chart:
  initContainers:
    {{- include "engram.sidecar" .Subcharts.engram | nindent 8 }}
  volumes:
    {{- include "engram.volumes" .Subcharts.engram | nindent 8 }}
*/}}
{{- define "engram.sidecar" -}}
- name: engram
  {{- include "engram.containerSpec" . | nindent 2 }}
  {{- if .Values.sidecar.native }}
  restartPolicy: Always
  {{- else if .Values.sidecar.preStopSleepSeconds }}
  lifecycle:
    preStop:
      sleep:
        seconds: {{ .Values.sidecar.preStopSleepSeconds }}
  {{- end }}
{{- end }}

{{/* The engram container's volumes: its config and its data directory. */}}
{{- define "engram.volumes" -}}
- name: engram-config
  configMap:
    name: {{ include "engram.fullname" . }}
{{- if and (eq .Values.mode "standalone") .Values.store.persistence.enabled }}
- name: engram-data
  persistentVolumeClaim:
    claimName: {{ include "engram.fullname" . }}-data
{{- else }}
- name: engram-data
  emptyDir:
    sizeLimit: {{ .Values.store.dataSizeLimit }}
{{- end }}
{{- if eq (include "engram.trust" .) "client_keys" }}
- name: engram-client-keys
  secret:
    secretName: {{ .Values.identity.clientKeys.existingSecret }}
    items:
      - key: {{ .Values.identity.clientKeys.existingSecretKey }}
        path: client-keys
{{- end }}
{{- end }}

{{/* Labels a pod carrying the sidecar gets, so the PodMonitor finds it. */}}
{{- define "engram.sidecarPodLabels" -}}
engram-sidecar: "true"
{{- end }}

{{/* Pod annotations: restart on config changes, and annotation-based Prometheus scraping. */}}
{{- define "engram.podAnnotations" -}}
checksum/engram-config: {{ include "engram.configYaml" . | sha256sum }}
{{- if .Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ include "engram.probePort" . | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/* Checks of value combinations the schema cannot express. */}}
{{- define "engram.validate" -}}
{{- if and (eq .Values.mode "standalone") (eq .Values.store.backend "embedded") (gt (int .Values.replicaCount) 1) }}
{{- fail "store.backend=embedded keeps memory in one pod's volume: use store.backend=redis for replicaCount > 1" }}
{{- end }}
{{- $trust := include "engram.trust" . }}
{{- if and (eq .Values.mode "standalone") (eq $trust "headers") (not (dig "identity" "allow_headers_off_loopback" false (default (dict) .Values.config))) }}
{{- fail "identity.trust=headers in standalone mode lets any pod that reaches the Service read any user's memory: use client_keys (the default) or signed, or set config.identity.allow_headers_off_loopback=true if only trusted clients reach it" }}
{{- end }}
{{- if and (eq $trust "client_keys") (not .Values.identity.clientKeys.existingSecret) }}
{{- fail "identity.trust=client_keys (the standalone default) needs identity.clientKeys.existingSecret: a Secret of tenant=key lines" }}
{{- end }}
{{- if and (eq $trust "client_keys") (not (include "engram.upstreamKeyConfigured" .)) }}
{{- fail "identity.trust=client_keys needs upstream.apiKey: client keys are engram's own and are never sent upstream" }}
{{- end }}
{{- if and (eq $trust "signed") (not .Values.identity.signingSecret.existingSecret) }}
{{- fail "identity.trust=signed needs identity.signingSecret.existingSecret: the Secret holding the signing secret" }}
{{- end }}
{{- end }}
