{{/* Name prefix of every object: the release name, or fullnameOverride. */}}
{{- define "kvpick.fullname" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvpick.picker" -}}
{{- printf "%s-picker" (include "kvpick.fullname" .) -}}
{{- end -}}

{{/* Labels on every object. */}}
{{- define "kvpick.labels" -}}
app.kubernetes.io/name: kvpick
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: include "kvpick.selector" (list . "picker") */}}
{{- define "kvpick.selector" -}}
app.kubernetes.io/name: kvpick
app.kubernetes.io/instance: {{ (index . 0).Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* The pool's matchLabels as a label selector (kubectl -l, --endpoint-selector): k1=v1,k2=v2 */}}
{{- define "kvpick.poolSelector" -}}
{{- $terms := list -}}
{{- range $k, $v := .Values.inferencePool.matchLabels -}}
{{- $terms = append $terms (printf "%s=%s" $k $v) -}}
{{- end -}}
{{- join "," $terms -}}
{{- end -}}

{{/* The pool's targetPorts as a comma-separated list (--endpoint-target-ports): 8000,8001 */}}
{{- define "kvpick.targetPorts" -}}
{{- $ports := list -}}
{{- range .Values.inferencePool.targetPorts -}}
{{- $ports = append $ports (toString .number) -}}
{{- end -}}
{{- join "," $ports -}}
{{- end -}}
