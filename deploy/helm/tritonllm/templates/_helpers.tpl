{{- define "tritonllm.name" -}}{{ .Release.Name }}-tritonllm{{- end -}}

{{- define "tritonllm.labels" -}}
app.kubernetes.io/name: tritonllm
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
tritonllm/flavor: {{ .Values.flavor }}
{{- end -}}

{{- define "tritonllm.selector" -}}
app.kubernetes.io/name: tritonllm
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Dynamo's frontend (dynamo.enabled): pods of their own, which the servers' Service never selects. */}}
{{- define "tritonllm.frontendSelector" -}}
app.kubernetes.io/name: tritonllm-dynamo-frontend
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tritonllm.claim" -}}{{ .Values.storage.existingClaim | default (printf "%s-models" (include "tritonllm.name" .)) }}{{- end -}}

{{/* The TensorRT-LLM flavors: engines (trtllm) and the LLM API (trtllm-llmapi), both in NVIDIA's image. */}}
{{- define "tritonllm.trtllm" -}}{{ has .Values.flavor (list "trtllm" "trtllm-llmapi") }}{{- end -}}

{{/* GPUs per pod: TensorRT-LLM needs one per rank (tensor x pipeline parallel). */}}
{{- define "tritonllm.gpus" -}}
{{- if eq (include "tritonllm.trtllm" .) "true" -}}
{{- max (int .Values.resources.gpus) (mul (int .Values.build.tensorParallel) (int .Values.build.pipelineParallel)) -}}
{{- else -}}
{{- int .Values.resources.gpus -}}
{{- end -}}
{{- end -}}

{{- define "tritonllm.resources" -}}
requests:
  {{- toYaml .Values.resources.requests | nindent 2 }}
  {{- if gt (int (include "tritonllm.gpus" .)) 0 }}
  nvidia.com/gpu: {{ include "tritonllm.gpus" . }}
  {{- end }}
limits:
  {{- toYaml .Values.resources.limits | nindent 2 }}
  {{- if gt (int (include "tritonllm.gpus" .)) 0 }}
  nvidia.com/gpu: {{ include "tritonllm.gpus" . }}
  {{- end }}
{{- end -}}

{{/* build_engines.py arguments: the same arguments always give the same build folder. */}}
{{- define "tritonllm.buildArgs" -}}
- --engine
- {{ .Values.flavor }}
- --build-dir
- {{ .Values.storage.mountPath }}/build
{{- with .Values.build.model }}
- --model
- {{ . | quote }}
{{- end }}
{{- if gt (int .Values.build.maxBatchSize) 0 }}
- --max-batch-size
- {{ .Values.build.maxBatchSize | quote }}
{{- end }}
{{- if eq (include "tritonllm.trtllm" .) "true" }}
- --quant
- {{ .Values.build.quant }}
- --tp
- {{ .Values.build.tensorParallel | quote }}
- --pp
- {{ .Values.build.pipelineParallel | quote }}
{{- end }}
{{- if eq .Values.flavor "trtllm-llmapi" }}
- --llm-api-release
- {{ .Values.build.llmApiRelease | quote }}
{{- end }}
{{- range .Values.build.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}
