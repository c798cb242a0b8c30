{{/* Labels Helm adds to every object besides those of the kustomize base. */}}
{{- define "kvfleet.labels" -}}
app.kubernetes.io/part-of: kvfleet
app.kubernetes.io/managed-by: Helm
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "kvfleet.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}
