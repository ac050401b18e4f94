{{/* Names ------------------------------------------------------------------------------ */}}
{{- define "mooncake-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "mooncake-operator.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The gateway's Service (<fullname>-gateway, at most 63 characters). */}}
{{- define "mooncake-operator.gatewayService" -}}
{{- printf "%s-gateway" (include "mooncake-operator.fullname" . | trunc 55 | trimSuffix "-") -}}
{{- end -}}

{{- define "mooncake-operator.metricsService" -}}
{{- printf "%s-metrics" (include "mooncake-operator.fullname" . | trunc 55 | trimSuffix "-") -}}
{{- end -}}

{{- define "mooncake-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "mooncake-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels ----------------------------------------------------------------------------- */}}
{{- define "mooncake-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mooncake-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "mooncake-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "mooncake-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: mooncake-operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Images: repository:tag, the tag defaulting to the chart's appVersion. -------------- */}}
{{- define "mooncake-operator.image" -}}
{{- printf "%s:%s" .repository (default .appVersion .tag) -}}
{{- end -}}

{{- define "mooncake-operator.operatorImage" -}}
{{- include "mooncake-operator.image" (dict "repository" .Values.operator.image.repository "tag" .Values.operator.image.tag "appVersion" .Chart.AppVersion) -}}
{{- end -}}

{{- define "mooncake-operator.workerImage" -}}
{{- include "mooncake-operator.image" (dict "repository" .Values.worker.image.repository "tag" .Values.worker.image.tag "appVersion" .Chart.AppVersion) -}}
{{- end -}}

{{/* URLs ------------------------------------------------------------------------------- */}}
{{/* Where the operator reads the gateway beside it: loopback when it listens everywhere. */}}
{{- define "mooncake-operator.gatewayLocalURL" -}}
{{- $host := .Values.gateway.bindAddress -}}
{{- if or (eq $host "0.0.0.0") (eq $host "::") -}}{{- $host = "127.0.0.1" -}}{{- end -}}
{{- printf "http://%s:%d" $host (int .Values.gateway.port) -}}
{{- end -}}

{{/* Where users (in the cluster) reach the gateway: its Service. */}}
{{- define "mooncake-operator.gatewayPublicURL" -}}
{{- printf "http://%s.%s.svc:%d" (include "mooncake-operator.gatewayService" .) .Release.Namespace (int .Values.gateway.service.port) -}}
{{- end -}}

{{- define "mooncake-operator.livenessURL" -}}
{{- printf "http://%s:%d/healthz" .Values.operator.bindAddress (int .Values.operator.healthPort) -}}
{{- end -}}
