{{/*
Sidecar mode: named templates to add tool-proxy to a pod spec you write yourself.

With tool-proxy as a dependency of your chart (alias: toolProxy), inside your pod template:

  metadata:
    annotations:
      {{- include "tool-proxy.sidecar.podAnnotations" .Subcharts.toolProxy | nindent 8 }}
  spec:
    terminationGracePeriodSeconds: {{ include "tool-proxy.sidecar.gracePeriodSeconds" .Subcharts.toolProxy }}
    containers:
      - name: my-tool
        ...
      {{- include "tool-proxy.sidecar.container" .Subcharts.toolProxy | nindent 6 }}
    volumes:
      {{- include "tool-proxy.sidecar.volumes" .Subcharts.toolProxy | nindent 6 }}

The context must be the tool-proxy chart's own scope (.Subcharts.<alias>, Helm >= 3.13):
the snippets read its values, release and chart metadata.
*/}}

{{- define "tool-proxy.sidecar.check" -}}
{{- include "tool-proxy.validate" . -}}
{{- if ne .Values.mode "sidecar" -}}
{{- fail "the tool-proxy.sidecar.* templates need mode=sidecar in the tool-proxy values" -}}
{{- end -}}
{{- end }}

{{/* One container list item: the proxy. */}}
{{- define "tool-proxy.sidecar.container" -}}
{{- include "tool-proxy.sidecar.check" . -}}
{{- include "tool-proxy.container" . }}
{{- end }}

{{/* Volume list items the container mounts: config, /tmp, SQLite state, secret files. */}}
{{- define "tool-proxy.sidecar.volumes" -}}
{{- include "tool-proxy.sidecar.check" . -}}
{{- include "tool-proxy.volumes" . }}
{{- end }}

{{/* Pod annotations: the config checksum, so a change of routes rolls your pods. */}}
{{- define "tool-proxy.sidecar.podAnnotations" -}}
{{- include "tool-proxy.sidecar.check" . -}}
{{- include "tool-proxy.podAnnotations" . }}
{{- end }}

{{/* The grace period the proxy needs; your tool may need more (take the larger). */}}
{{- define "tool-proxy.sidecar.gracePeriodSeconds" -}}
{{- include "tool-proxy.sidecar.check" . -}}
{{- include "tool-proxy.terminationGracePeriodSeconds" . }}
{{- end }}
