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

{{/* The Gateway the chart serves: its name and namespace (httpRoute's, else the chart's own). */}}
{{- define "kvpick.gatewayName" -}}
{{- .Values.httpRoute.gatewayName | default (printf "%s-gateway" (include "kvpick.fullname" .)) -}}
{{- end -}}
{{- define "kvpick.gatewayNamespace" -}}
{{- .Values.httpRoute.gatewayNamespace | default .Release.Namespace -}}
{{- end -}}

{{/* The gateway's proxies as NetworkPolicy peers (a YAML list): its pods, by the selectors in
`gateway` or those its provider's labels give (values.yaml, gateway.podSelector), and `gateway.ipBlocks`
(with GKE's health-check ranges under provider gke, whose proxies are outside the cluster). */}}
{{- define "kvpick.gatewayPeers" -}}
{{- $gw := .Values.gateway -}}
{{- $name := include "kvpick.gatewayName" . -}}
{{- $ns := include "kvpick.gatewayNamespace" . -}}
{{- $podSel := $gw.podSelector -}}
{{- $nsSel := $gw.namespaceSelector -}}
{{- if eq .Values.provider "envoy-gateway" -}}
{{- $podSel = $podSel | default (dict "matchLabels" (dict "gateway.envoyproxy.io/owning-gateway-name" $name "gateway.envoyproxy.io/owning-gateway-namespace" $ns)) -}}
{{- $nsSel = $nsSel | default (dict "matchLabels" (dict "kubernetes.io/metadata.name" "envoy-gateway-system")) -}}
{{- else if ne .Values.provider "gke" -}}
{{- $podSel = $podSel | default (dict "matchLabels" (dict "gateway.networking.k8s.io/gateway-name" $name)) -}}
{{- end -}}
{{- $nsSel = $nsSel | default (dict "matchLabels" (dict "kubernetes.io/metadata.name" $ns)) -}}
{{- $peers := list -}}
{{- if $podSel -}}
{{- $peers = append $peers (dict "namespaceSelector" $nsSel "podSelector" $podSel) -}}
{{- end -}}
{{- $cidrs := $gw.ipBlocks -}}
{{- if eq .Values.provider "gke" -}}
{{- $cidrs = concat $cidrs (list "35.191.0.0/16" "130.211.0.0/22") -}}
{{- end -}}
{{- range $cidrs -}}
{{- $peers = append $peers (dict "ipBlock" (dict "cidr" .)) -}}
{{- end -}}
{{- toYaml $peers -}}
{{- end -}}

{{/* `monitoring` as one NetworkPolicy peer. */}}
{{- define "kvpick.monitoringPeer" -}}
namespaceSelector:
  {{- toYaml .Values.monitoring.namespaceSelector | nindent 2 }}
podSelector:
  {{- toYaml .Values.monitoring.podSelector | nindent 2 }}
{{- end -}}

{{/* "true" when the pickers require the gateway's client certificate on ext_proc (mTLS):
tls.clientAuth true, or auto with provider none (values.yaml, tls). */}}
{{- define "kvpick.mtls" -}}
{{- $c := toString .Values.tls.clientAuth -}}
{{- if and (eq $c "true") (not .Values.picker.secureServing) -}}
{{- fail "tls.clientAuth=true needs picker.secureServing=true (mTLS is TLS with a client certificate)" -}}
{{- end -}}
{{- if and .Values.picker.secureServing (or (eq $c "true") (and (eq $c "auto") (eq .Values.provider "none"))) -}}
true
{{- end -}}
{{- end -}}

{{/* The pickers' Secret (tls.crt, tls.key: their server certificate; ca.crt: the CA a client's
certificate must chain to) and the gateway's (tls.crt, tls.key: the client certificate it
presents; ca.crt: the CA the pickers' certificate chains to). */}}
{{- define "kvpick.pickerTlsSecret" -}}
{{- printf "%s-tls" (include "kvpick.picker" .) -}}
{{- end -}}
{{- define "kvpick.clientTlsSecret" -}}
{{- printf "%s-gateway-client-tls" (include "kvpick.fullname" .) -}}
{{- end -}}

{{/* The names the pickers' certificate is valid for: their Service and headless peers Service. */}}
{{- define "kvpick.pickerDnsNames" -}}
{{- $p := include "kvpick.picker" . -}}
{{- $ns := .Release.Namespace -}}
{{- toYaml (list $p (printf "%s.%s" $p $ns) (printf "%s.%s.svc" $p $ns) (printf "%s.%s.svc.cluster.local" $p $ns) (printf "%s-peers.%s.svc" $p $ns) (printf "%s-peers.%s.svc.cluster.local" $p $ns)) -}}
{{- end -}}

{{/* A probe whose httpGet/tcpSocket port "http" is replaced by the named port: include
"kvpick.probePort" (list probe "vllm"). On a P/D decode pod the sidecar owns "http". */}}
{{- define "kvpick.probePort" -}}
{{- $probe := deepCopy (index . 0) -}}
{{- $port := index . 1 -}}
{{- range $k := list "httpGet" "tcpSocket" -}}
{{- $h := index $probe $k -}}
{{- if and $h (eq (toString (index $h "port")) "http") -}}
{{- $_ := set $h "port" $port -}}
{{- end -}}
{{- end -}}
{{- toYaml $probe -}}
{{- end -}}
