{{/*
Names and labels. Every helper here reads only .Values, .Chart and .Release, so the sidecar
snippets work both in this chart and from a parent chart through .Subcharts.<alias>.
*/}}
{{- define "tool-proxy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tool-proxy.fullname" -}}
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

{{- define "tool-proxy.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tool-proxy.labels" -}}
helm.sh/chart: {{ include "tool-proxy.chart" . }}
{{ include "tool-proxy.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tool-proxy
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "tool-proxy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tool-proxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tool-proxy.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tool-proxy.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tool-proxy.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end }}

{{/* The ConfigMap holding config.yaml: the chart's own, or an existing one. */}}
{{- define "tool-proxy.configMapName" -}}
{{- .Values.existingConfigMap.name | default (printf "%s-config" (include "tool-proxy.fullname" .)) }}
{{- end }}

{{- define "tool-proxy.configKey" -}}
{{- if .Values.existingConfigMap.name }}{{ .Values.existingConfigMap.key | default "config.yaml" }}{{ else }}config.yaml{{ end }}
{{- end }}

{{/*
config.yaml as the proxy reads it (docs/configuration.md). The store is not in it: the chart
passes it in TOOL_PROXY_STORE_URL (see tool-proxy.env), from store.* in the values.
*/}}
{{- define "tool-proxy.configYaml" -}}
{{- $config := deepCopy (.Values.config | default dict) -}}
{{- with .Values.store.durability }}
{{- $_ := set $config "store" (dict "durability" .) -}}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* Whether the store is shared by every pod (Redis, PostgreSQL), not kept inside one. */}}
{{- define "tool-proxy.sharedStore" -}}
{{- if has .Values.store.type (list "redis" "postgresql") }}true{{ end -}}
{{- end }}

{{/* The sha256 of config.yaml: a pod annotation, so a change of routes rolls the pods. */}}
{{- define "tool-proxy.configChecksum" -}}
{{- include "tool-proxy.configYaml" . | sha256sum }}
{{- end }}

{{/* Seconds from a duration of the config file: 30, 0.5, "250ms", "5s", "2m", "24h", "7d". */}}
{{- define "tool-proxy.seconds" -}}
{{- $text := toString . | trim -}}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $text -}}
{{- $unit := trimPrefix $number $text | trim -}}
{{- $scale := dict "" 1.0 "s" 1.0 "ms" 0.001 "m" 60.0 "h" 3600.0 "d" 86400.0 -}}
{{- if or (not $number) (not (hasKey $scale $unit)) -}}
{{- fail (printf "config.routes: timeout %q is not a duration (use 30, 5s, 2m, 24h)" $text) -}}
{{- end -}}
{{- ceil (mulf (float64 $number) (get $scale $unit)) | int -}}
{{- end }}

{{/*
The longest route timeout in seconds: the proxy waits that long (plus 5 s) for calls in flight
when it stops. With an existing ConfigMap the chart cannot read the routes, and
maxRouteTimeoutSeconds says it.
*/}}
{{- define "tool-proxy.maxRouteTimeout" -}}
{{- if .Values.existingConfigMap.name -}}
{{- .Values.maxRouteTimeoutSeconds | int -}}
{{- else -}}
{{- $max := 0 -}}
{{- range .Values.config.routes -}}
{{- $seconds := include "tool-proxy.seconds" (.timeout | default "30s") | int -}}
{{- if gt $seconds $max }}{{ $max = $seconds }}{{ end -}}
{{- end -}}
{{- $max -}}
{{- end -}}
{{- end }}

{{/*
terminationGracePeriodSeconds: the value if set, else the preStop delay + the longest route
timeout + 30 s (the claim and the recording, the proxy's own margin, the conclusions of
calls it cancels, the journal's last flush, and the exit).
*/}}
{{- define "tool-proxy.terminationGracePeriodSeconds" -}}
{{- if not (kindIs "invalid" .Values.terminationGracePeriodSeconds) -}}
{{- .Values.terminationGracePeriodSeconds | int -}}
{{- else -}}
{{- add (.Values.shutdownDelaySeconds | int) (include "tool-proxy.maxRouteTimeout" . | int) 30 -}}
{{- end -}}
{{- end }}

{{/*
serve --graceful-timeout: how long the proxy waits for requests before it cancels them (and
records their calls FAILED): the grace period less the preStop delay and 15 s to conclude,
flush the journal and exit, so it is done before the kubelet's SIGKILL.
*/}}
{{- define "tool-proxy.gracefulTimeout" -}}
{{- $left := sub (include "tool-proxy.terminationGracePeriodSeconds" . | int) (.Values.shutdownDelaySeconds | int) -}}
{{- max 1 (sub $left 15) -}}
{{- end }}

{{/* The number of pods that may run the proxy at once (for the SQLite check). */}}
{{- define "tool-proxy.maxPods" -}}
{{- if and (eq .Values.mode "standalone") .Values.autoscaling.enabled -}}
{{- .Values.autoscaling.maxReplicas | int -}}
{{- else -}}
{{- .Values.replicaCount | int -}}
{{- end -}}
{{- end }}

{{- define "tool-proxy.redisName" -}}
{{- printf "%s-redis" (include "tool-proxy.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Checks that fail the render with a message saying what to change. Included by every template
that renders a resource, and by templates/validate.yaml.
*/}}
{{- define "tool-proxy.validate" -}}
{{- if not (has .Values.mode (list "standalone" "sidecar")) -}}
{{- fail (printf "mode: %q is not one of standalone, sidecar" .Values.mode) -}}
{{- end -}}
{{- if not (has .Values.store.type (list "sqlite" "redis" "postgresql" "memory")) -}}
{{- fail (printf "store.type: %q is not one of sqlite, redis, postgresql, memory" .Values.store.type) -}}
{{- end -}}
{{- $pods := include "tool-proxy.maxPods" . | int -}}
{{- if and (not (include "tool-proxy.sharedStore" .)) (gt $pods 1) -}}
{{- fail (printf "store.type=%s keeps state inside one pod, but up to %d pods would run the proxy (replicaCount or autoscaling.maxReplicas): each would have its own records and a duplicate call could execute twice. Use store.type=redis with store.redis.existingSecret (or redis.enabled=true to try it out), store.type=postgresql with store.postgresql.existingSecret, or run one replica." .Values.store.type $pods) -}}
{{- end -}}
{{- if and (eq .Values.store.type "postgresql") (not .Values.store.postgresql.existingSecret) -}}
{{- fail "store.type=postgresql: set store.postgresql.existingSecret (a Secret holding the postgresql:// URL)" -}}
{{- end -}}
{{- if and .Values.store.durability (ne .Values.store.type "redis") -}}
{{- fail (printf "store.durability: only for store.type=redis (WAIT for Redis replicas), not %s%s" .Values.store.type (ternary "; PostgreSQL has synchronous_commit and synchronous_standby_names" "" (eq .Values.store.type "postgresql"))) -}}
{{- end -}}
{{- if and .Values.store.durability .Values.redis.enabled -}}
{{- fail "store.durability: the in-chart Redis has no replicas to wait for; use an external Redis with replicas (store.redis.existingSecret)" -}}
{{- end -}}
{{- if and (eq .Values.store.type "redis") (not .Values.store.redis.existingSecret) (not .Values.redis.enabled) -}}
{{- fail "store.type=redis: set store.redis.existingSecret (a Secret holding the Redis URL) or redis.enabled=true (a single in-chart Redis for trying it out)" -}}
{{- end -}}
{{- if and .Values.redis.enabled (ne .Values.store.type "redis") -}}
{{- fail "redis.enabled=true: set store.type=redis as well, or the proxy would not use it" -}}
{{- end -}}
{{- if and .Values.redis.enabled .Values.store.redis.existingSecret -}}
{{- fail "store.redis.existingSecret and redis.enabled are both set: pick the external Redis or the in-chart one" -}}
{{- end -}}
{{- if and (not .Values.existingConfigMap.name) (not .Values.config.routes) -}}
{{- fail "config.routes: at least one route is required (or set existingConfigMap.name)" -}}
{{- end -}}
{{- if and (not .Values.existingConfigMap.name) (hasKey (.Values.config | default dict) "store") -}}
{{- fail "config.store: set the store with store.type and store.* in the values, not in config" -}}
{{- end -}}
{{- if and .Values.persistence.enabled (ne .Values.store.type "sqlite") -}}
{{- fail "persistence.enabled=true only makes sense with store.type=sqlite" -}}
{{- end -}}
{{- if and .Values.persistence.enabled (eq .Values.mode "sidecar") -}}
{{- fail "persistence.enabled=true is for mode=standalone; in sidecar mode mount a volume at store.sqlite.path in your pod, or use Redis" -}}
{{- end -}}
{{- if not (hasPrefix "/" .Values.store.sqlite.path) -}}
{{- fail "store.sqlite.path: must be an absolute path" -}}
{{- end -}}
{{- end }}

{{/* The store URL for the literal cases (an external Redis's or PostgreSQL's comes from its Secret). */}}
{{- define "tool-proxy.storeUrl" -}}
{{- if eq .Values.store.type "sqlite" -}}
sqlite://{{ .Values.store.sqlite.path }}
{{- else if eq .Values.store.type "memory" -}}
memory://
{{- else -}}
redis://{{ include "tool-proxy.redisName" . }}:{{ .Values.redis.service.port }}/0
{{- end -}}
{{- end }}

{{/* The in-chart Redis has a name of its own, so the proxy's selectors never match it. */}}
{{- define "tool-proxy.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-redis" (include "tool-proxy.name" .) | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}
