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

{{/* Selects the head pod only: the one place raypaged's /metrics is scraped. */}}
{{- define "raypaged.headSelector" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: ray-head
{{- end -}}

{{- define "raypaged.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
{{- end -}}

{{- define "raypaged.apiKeySecret" -}}
{{- if .Values.apiKey.existingSecret -}}
{{- .Values.apiKey.existingSecret -}}
{{- else if .Values.apiKey.value -}}
{{- printf "%s-api-key" (include "raypaged.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* Environment every Ray container gets: the API key, when there is one. Empty otherwise, and
     then the caller leaves `env:` out (an empty `env:` renders as null, which the CRD refuses). */}}
{{- define "raypaged.env" -}}
{{- with include "raypaged.apiKeySecret" . -}}
- name: RAYPAGED_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: api-key
{{- end }}
{{- end -}}

{{/* The parts of a Ray container that head and workers share: env, mounts, securityContext. */}}
{{- define "raypaged.containerCommon" -}}
volumeMounts:
  - {name: dshm, mountPath: /dev/shm}
  {{- if or .Values.model.persistentVolumeClaim .Values.model.hostPath }}
  - {name: models, mountPath: {{ .Values.model.mountPath | quote }}, readOnly: true}
  {{- end }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
{{- with include "raypaged.env" . }}
env:
  {{- . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The parts of a Ray pod that head and workers share: volumes and the pod securityContext. */}}
{{- define "raypaged.podCommon" -}}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
volumes:
  - name: dshm
    emptyDir: {medium: Memory, sizeLimit: {{ .Values.shm.sizeLimit | quote }}}
  {{- if .Values.model.persistentVolumeClaim }}
  - name: models
    persistentVolumeClaim: {claimName: {{ .Values.model.persistentVolumeClaim | quote }}, readOnly: true}
  {{- else if .Values.model.hostPath }}
  - name: models
    hostPath: {path: {{ .Values.model.hostPath | quote }}, type: Directory}
  {{- end }}
{{- end -}}
