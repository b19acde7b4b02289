{{/*
The node mode this release installs: "dra" or "device-plugin". auto follows `fracgpu mode` at
install: DRA where the API server serves resource.k8s.io/v1 DeviceClasses and is Kubernetes 1.36
or newer (DRA's consumable capacity, which many shares of one card need). On an upgrade auto keeps
the mode the release runs (its node agent's DaemonSet, looked up in the cluster): a cluster
upgraded to 1.36 must not switch node agents under running shares, which the other agent does
not know. Setting mode switches. (`helm template` has no cluster to look in: capabilities only.)
*/}}
{{- define "fracgpu.mode" -}}
{{- if eq .Values.mode "auto" -}}
{{- $dra := lookup "apps/v1" "DaemonSet" .Release.Namespace "fracgpu-dra-plugin" -}}
{{- $dp := lookup "apps/v1" "DaemonSet" .Release.Namespace "fracgpu-device-plugin" -}}
{{- if and .Release.IsUpgrade $dra -}}
dra
{{- else if and .Release.IsUpgrade $dp -}}
device-plugin
{{- else if and (.Capabilities.APIVersions.Has "resource.k8s.io/v1/DeviceClass") (semverCompare ">=1.36.0-0" .Capabilities.KubeVersion.Version) -}}
dra
{{- else -}}
device-plugin
{{- end -}}
{{- else -}}
{{ .Values.mode }}
{{- end -}}
{{- end -}}

{{/* Labels on every object: kustomize's part-of, and Helm's own. */}}
{{- define "fracgpu.labels" -}}
app.kubernetes.io/part-of: fracgpu
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "fracgpu.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The resource names of the dialects in .Values.dialects (webhook/dialects.py). */}}
{{- define "fracgpu.dialectResources" -}}
{{- $names := list -}}
{{- if has "hami" .Values.dialects -}}
{{- $names = concat $names (list "nvidia.com/gpu" "nvidia.com/gpucores" "nvidia.com/gpumem" "nvidia.com/gpumem-percentage" "nvidia.com/priority") -}}
{{- end -}}
{{- if has "tkestack" .Values.dialects -}}
{{- $names = concat $names (list "tencent.com/vcuda-core" "tencent.com/vcuda-memory") -}}
{{- end -}}
{{- join "," $names -}}
{{- end -}}

{{/*
"true" when GPU pods are placed by fracgpu serve's scheduler extender, else empty. placement
auto (the default) is the extender in device-plugin mode and nothing in DRA mode, whose claims
the stock scheduler places; placement node is the device plugin's choice at kubelet admission
(the fallback). The extender is called by the fracgpu-scheduler profile, so it needs
scheduler.enabled. The scheduler's client certificate for the extender's port comes from serve
(certs.mode self) or from cert-manager (certs.mode cert-manager, templates/certificate.yaml).
*/}}
{{- define "fracgpu.extender" -}}
{{- $dra := eq (include "fracgpu.mode" .) "dra" -}}
{{- if and (eq .Values.placement "extender") $dra -}}
{{- fail "placement extender is for device-plugin mode; in DRA mode the stock scheduler places each claim: set mode: device-plugin, or placement: node" -}}
{{- end -}}
{{- if and (ne .Values.placement "node") (not $dra) -}}
{{- if not .Values.scheduler.enabled -}}
{{- fail "device-plugin mode places GPU pods with the scheduler extender, which the fracgpu-scheduler calls: set scheduler.enabled: true, or placement: node to let the device plugin pick each card at kubelet admission (on nodes with several cards kubelet may then refuse a bound pod; docs/install.md)" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* `fracgpu serve`'s config.yaml: what the chart's values decide, then .Values.config over it. */}}
{{- define "fracgpu.serveConfig" -}}
{{- $certs := dict "service" "fracgpu-webhook" "namespace" .Release.Namespace -}}
{{- if eq .Values.certs.mode "cert-manager" -}}
{{- $_ := set $certs "mode" "files" -}}
{{- $_ := set $certs "cert_file" "/etc/fracgpu/tls/tls.crt" -}}
{{- $_ := set $certs "key_file" "/etc/fracgpu/tls/tls.key" -}}
{{- $_ := set $certs "ca_file" "/etc/fracgpu/tls/ca.crt" -}}
{{- else -}}
{{- $_ := set $certs "mode" "secret" -}}
{{- $_ := set $certs "secret_name" "fracgpu-webhook-tls" -}}
{{- $_ := set $certs "mutating_webhook_configurations" (list "fracgpu-mutate") -}}
{{- $_ := set $certs "validating_webhook_configurations" (list "fracgpu-validate") -}}
{{- end -}}
{{- $toleration := dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule" -}}
{{- $admission := dict "scheduler_name" "" "override_scheduler" false "tolerations" (list $toleration) "inventory" (dict "watch_nodes" true) -}}
{{- if eq (include "fracgpu.mode" .) "dra" -}}
{{- $_ := set $admission "allocation" "dra" -}}
{{- end -}}
{{- if .Values.dialects -}}
{{- $_ := set $admission "dialects" .Values.dialects -}}
{{- end -}}
{{- $config := dict "server" (dict "host" "0.0.0.0" "port" 8443) "admission" $admission "certs" $certs "quota" (dict "timeout_s" (sub .Values.webhook.timeoutSeconds 1)) "shutdown_delay_seconds" 5 -}}
{{- if include "fracgpu.extender" . -}}
{{- $_ := set $admission "scheduler_name" "fracgpu-scheduler" -}}
{{- $_ := set $config "extender" (dict "enabled" true "policy" "pack" "port" 8444 "client_secret_name" "fracgpu-scheduler-client-tls") -}}
{{- end -}}
{{- toYaml (mustMergeOverwrite $config (deepCopy .Values.config)) -}}
{{- end -}}
