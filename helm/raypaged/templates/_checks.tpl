{{/* Combinations values.schema.json cannot express (it checks one value at a time), refused
     at `helm install/template/lint` with what to change: ones that would leave engine workers
     waiting forever, and ones that would leave the API or its key open. Included once, from
     rayservice.yaml. */}}
{{- define "raypaged.checks" -}}
{{- $w := .Values.workers -}}
{{- $a := .Values.raypaged -}}
{{- if or (gt (int $w.minReplicas) (int $w.replicas)) (gt (int $w.replicas) (int $w.maxReplicas)) -}}
{{- fail (printf "workers.replicas=%v must lie within workers.minReplicas=%v and workers.maxReplicas=%v (KubeRay would clamp it silently and engine workers would wait for pods that never come)" $w.replicas $w.minReplicas $w.maxReplicas) -}}
{{- end -}}
{{- $perPod := floor (divf $w.cpus $a.cpus_per_worker) -}}
{{- if gt (float64 $a.gpus_per_worker) 0.0 -}}
{{- $perPod = minf $perPod (floor (divf $w.gpus $a.gpus_per_worker)) -}}
{{- end -}}
{{- if gt (float64 $a.workers) (mulf $perPod $w.replicas) -}}
{{- fail (printf "raypaged.workers=%v engine workers need %v CPU and %v GPU each, but %v worker pods of %v CPU and %v GPU hold only %v: raise workers.replicas, workers.cpus or workers.gpus, or lower raypaged.workers" $a.workers $a.cpus_per_worker $a.gpus_per_worker $w.replicas $w.cpus $w.gpus (mulf $perPod $w.replicas)) -}}
{{- end -}}
{{- $maxWorkers := max (int $a.workers) (int (default 0 $a.min_workers)) -}}
{{- if $a.max_workers -}}{{- $maxWorkers = int $a.max_workers -}}{{- end -}}
{{- $pods := ternary $w.maxReplicas $w.replicas .Values.autoscaling.enabled -}}
{{- if gt (float64 $maxWorkers) (mulf $perPod $pods) -}}
{{- fail (printf "raypaged.max_workers=%v engine workers need %v CPU and %v GPU each, but %v worker pods (%s) of %v CPU and %v GPU hold only %v: raise workers.maxReplicas (with autoscaling.enabled=true) or workers.replicas, or lower raypaged.max_workers" $maxWorkers $a.cpus_per_worker $a.gpus_per_worker $pods (ternary "workers.maxReplicas" "workers.replicas: autoscaling.enabled=false adds no pods" .Values.autoscaling.enabled) $w.cpus $w.gpus (mulf $perPod $pods)) -}}
{{- end -}}
{{- if and (hasKey $a "kv_memory_fraction") (eq (float64 $a.gpus_per_worker) 0.0) -}}
{{- fail "raypaged.kv_memory_fraction sizes the KV cache from free GPU memory, but gpus_per_worker is 0: on CPU set raypaged.kv_memory_mb instead" -}}
{{- end -}}
{{- if hasKey $a "api_key" -}}
{{- fail "raypaged.api_key would be written in plaintext into the RayService (its serveConfigV2, readable by anyone who can read the RayService or the Ray dashboard): remove it and set apiKey.existingSecret (a Secret with key api-key) or apiKey.value (the chart creates the Secret); the key then reaches the router as $RAYPAGED_API_KEY" -}}
{{- end -}}
{{- if and (include "raypaged.exposed" .) (not (include "raypaged.apiKeySecret" .)) -}}
{{- fail (printf "service.type=%s%s publishes the API beyond the cluster, but no API key is set: anyone who reaches it could use the model. Set apiKey.existingSecret (a Secret with key api-key) or apiKey.value, or keep service.type=ClusterIP without an ingress and reach it with kubectl port-forward" .Values.service.type (ternary " with ingress.enabled=true" "" .Values.ingress.enabled)) -}}
{{- end -}}
{{- if and .Values.model.persistentVolumeClaim .Values.model.hostPath -}}
{{- fail "set one of model.persistentVolumeClaim and model.hostPath, not both" -}}
{{- end -}}
{{- end -}}
