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

{{/* Environment every Ray container gets: Ray's token authentication, and the API key when there
     is one. RAY_AUTH_MODE is also what KubeRay's authOptions sets (KubeRay adds RAY_AUTH_TOKEN
     from the token's Secret); stating it here makes an operator that predates authOptions (and
     prunes the field) fail closed: `ray start` then finds no token and refuses to start. */}}
{{- define "raypaged.env" -}}
- name: RAY_AUTH_MODE
  value: token
{{- with include "raypaged.apiKeySecret" . }}
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
  {{- range .Values.writableDirs }}
  - {name: {{ .name }}, mountPath: {{ .mountPath | quote }}}
  {{- end }}
  {{- if or .Values.model.persistentVolumeClaim .Values.model.hostPath }}
  - {name: models, mountPath: {{ .Values.model.mountPath | quote }}, readOnly: true}
  {{- end }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
env:
  {{- include "raypaged.env" . | nindent 2 }}
{{- end -}}

{{/* The parts of a Ray pod that head and workers share: volumes and the pod securityContext.
     No service-account token: nothing in a Ray pod calls the Kubernetes API (the chart does not
     run KubeRay's autoscaler sidecar, the one Ray-side user of it). */}}
{{- define "raypaged.podCommon" -}}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
volumes:
  - name: dshm
    emptyDir: {medium: Memory, sizeLimit: {{ .Values.shm.sizeLimit | quote }}}
  {{- range .Values.writableDirs }}
  - name: {{ .name }}
    emptyDir: {sizeLimit: {{ .sizeLimit | quote }}}
  {{- end }}
  {{- if .Values.model.persistentVolumeClaim }}
  - name: models
    persistentVolumeClaim: {claimName: {{ .Values.model.persistentVolumeClaim | quote }}, readOnly: true}
  {{- else if .Values.model.hostPath }}
  - name: models
    hostPath: {path: {{ .Values.model.hostPath | quote }}, type: Directory}
  {{- end }}
{{- end -}}

{{/* The release's Ray pods (head and workers): the only peers allowed on Ray's own ports. */}}
{{- define "raypaged.rayPodSelector" -}}
matchLabels:
  app.kubernetes.io/instance: {{ .Release.Name }}
matchExpressions:
  - {key: app.kubernetes.io/component, operator: In, values: [ray-head, ray-worker]}
{{- end -}}

{{/* The API is published beyond the cluster: a LoadBalancer or NodePort Service, or an Ingress. */}}
{{- define "raypaged.exposed" -}}
{{- if or (ne .Values.service.type "ClusterIP") .Values.ingress.enabled -}}
exposed
{{- end -}}
{{- end -}}
