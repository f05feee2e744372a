{{- define "raypaged.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "raypaged.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "raypaged.apiKeySecret" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecret -}}
{{- else if .Values.apiKey.value -}}
{{- printf "%s-api-key" (include "raypaged.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Environment every Ray container gets: the API key, when there is one. */}}
{{- define "raypaged.env" -}}
{{- with include "raypaged.apiKeySecret" . }}
- name: RAYPAGED_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: api-key
{{- end }}
{{- end -}}
