{{/*
The proxy container, its volumes and its pod annotations. The standalone Deployment uses them,
and so do the sidecar snippets (_sidecar.tpl) that users add to their own pod spec.
*/}}

{{- define "tool-proxy.portName" -}}
{{- if eq .Values.mode "sidecar" }}{{ .Values.sidecar.portName }}{{ else }}http{{ end }}
{{- end }}

{{- define "tool-proxy.container" -}}
- name: {{ if eq .Values.mode "sidecar" }}{{ .Values.sidecar.containerName }}{{ else }}{{ include "tool-proxy.name" . }}{{ end }}
  image: {{ include "tool-proxy.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args:
    - --host
    - "0.0.0.0"
    - --port
    - {{ .Values.containerPort | quote }}
    - --workers
    - {{ .Values.workers | quote }}
    - --log-level
    - {{ .Values.logLevel | quote }}
    - --graceful-timeout
    - {{ include "tool-proxy.gracefulTimeout" . | quote }}
  ports:
    - name: {{ include "tool-proxy.portName" . }}
      containerPort: {{ .Values.containerPort }}
      protocol: TCP
  env:
    - name: TOOL_PROXY_CONFIG
      value: /etc/tool-proxy/config.yaml
    - name: TOOL_PROXY_STORE_URL
      {{- if and (eq .Values.store.type "redis") .Values.store.redis.existingSecret }}
      valueFrom:
        secretKeyRef:
          name: {{ .Values.store.redis.existingSecret }}
          key: {{ .Values.store.redis.existingSecretKey }}
      {{- else if eq .Values.store.type "postgresql" }}
      valueFrom:
        secretKeyRef:
          name: {{ .Values.store.postgresql.existingSecret }}
          key: {{ .Values.store.postgresql.existingSecretKey }}
      {{- else }}
      value: {{ include "tool-proxy.storeUrl" . | quote }}
      {{- end }}
    {{- range .Values.secrets.envKeys }}
    - name: {{ .name }}
      valueFrom:
        secretKeyRef:
          name: {{ .secretName }}
          key: {{ .key }}
          {{- if .optional }}
          optional: true
          {{- end }}
    {{- end }}
    {{- with .Values.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.secrets.env }}
  envFrom:
    {{- range . }}
    - secretRef:
        name: {{ .secretName }}
        {{- if .optional }}
        optional: true
        {{- end }}
      {{- with .prefix }}
      prefix: {{ . }}
      {{- end }}
    {{- end }}
  {{- end }}
  {{- if .Values.livenessProbe.enabled }}
  livenessProbe:
    httpGet:
      path: /_proxy/healthz
      port: {{ .Values.containerPort }}
    {{- toYaml (omit .Values.livenessProbe "enabled") | nindent 4 }}
  {{- end }}
  {{- if .Values.readinessProbe.enabled }}
  readinessProbe:
    httpGet:
      path: /_proxy/readyz
      port: {{ .Values.containerPort }}
    {{- toYaml (omit .Values.readinessProbe "enabled") | nindent 4 }}
  {{- end }}
  {{- if gt (.Values.shutdownDelaySeconds | int) 0 }}
  lifecycle:
    preStop:
      exec:
        command: ["sleep", {{ .Values.shutdownDelaySeconds | quote }}]
  {{- end }}
  {{- with .Values.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.containerSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: tool-proxy-config
      mountPath: /etc/tool-proxy
      readOnly: true
    - name: tool-proxy-tmp
      mountPath: /tmp
    - name: tool-proxy-state
      {{- if eq .Values.store.type "sqlite" }}
      mountPath: {{ dir .Values.store.sqlite.path }}
      {{- else }}
      # the journal of outcomes the store could not take yet (state_dir)
      mountPath: /var/lib/tool-proxy
      {{- end }}
    {{- range $i, $secret := .Values.secrets.files }}
    - name: tool-proxy-secret-{{ $i }}
      mountPath: {{ $secret.mountPath }}
      readOnly: true
    {{- end }}
{{- end }}

{{- define "tool-proxy.volumes" -}}
- name: tool-proxy-config
  configMap:
    name: {{ include "tool-proxy.configMapName" . }}
    items:
      - key: {{ include "tool-proxy.configKey" . }}
        path: config.yaml
- name: tool-proxy-tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
- name: tool-proxy-state
  {{- if and (eq .Values.store.type "sqlite") (eq .Values.mode "standalone") .Values.persistence.enabled }}
  persistentVolumeClaim:
    claimName: {{ .Values.persistence.existingClaim | default (printf "%s-state" (include "tool-proxy.fullname" .)) }}
  {{- else }}
  emptyDir:
    sizeLimit: {{ .Values.store.sqlite.sizeLimit }}
  {{- end }}
{{- range $i, $secret := .Values.secrets.files }}
- name: tool-proxy-secret-{{ $i }}
  secret:
    secretName: {{ $secret.secretName }}
    {{- with $secret.items }}
    items:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    {{- if not (kindIs "invalid" $secret.defaultMode) }}
    defaultMode: {{ $secret.defaultMode }}
    {{- end }}
{{- end }}
{{- end }}

{{/* Pod annotations: the config checksum (absent with an existing ConfigMap). */}}
{{- define "tool-proxy.podAnnotations" -}}
{{- if not .Values.existingConfigMap.name -}}
checksum/tool-proxy-config: {{ include "tool-proxy.configChecksum" . }}
{{- end -}}
{{- end }}
