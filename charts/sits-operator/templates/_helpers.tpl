{{/* Names, labels and small pieces shared by the templates. */}}

{{- define "sits-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name; objects add suffixes (-webhook, -redis), so it stays within 52 characters. */}}
{{- define "sits-operator.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "sits-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sits-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sits-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sits-operator.labels" -}}
helm.sh/chart: {{ include "sits-operator.chart" . }}
{{ include "sits-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sits
{{- end -}}

{{- define "sits-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "sits-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "sits-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The Secret holding the webhook's bearer token: the user's existingSecret, or the chart's own. */}}
{{- define "sits-operator.webhookTokenSecret" -}}
{{- .Values.webhook.token.existingSecret | default (printf "%s-webhook-token" (include "sits-operator.fullname" .)) -}}
{{- end -}}

{{/* The Redis URL SitsDeployments should name in spec.tenancy.redis.url ("" when there is none). */}}
{{- define "sits-operator.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis.%s.svc:%d/0" (include "sits-operator.fullname" .) .Release.Namespace (int .Values.redis.port) -}}
{{- else -}}
{{- .Values.redis.existingUrl -}}
{{- end -}}
{{- end -}}

{{/*
One track's latency quantile per SitsDeployment: the same PromQL as sits.operator.queries.quantile_expr,
across every namespace and SitsDeployment instead of one (tests/packaging checks they agree).
Arguments: a dict with quantile, track and window.
*/}}
{{- define "sits-operator.quantileExpr" -}}
histogram_quantile({{ .quantile }}, sum by (namespace, sitsdeployment, le) (rate(sits_request_latency_seconds_bucket{sitsdeployment!="",track="{{ .track }}"}[{{ .window }}])))
{{- end -}}

{{/* Fail early on values that render but cannot work. */}}
{{- define "sits-operator.validate" -}}
{{- if and (gt (int .Values.operator.replicas) 1) (not .Values.operator.peering) -}}
{{- fail "operator.replicas > 1 needs operator.peering: standalone replicas would all act on every resource" -}}
{{- end -}}
{{- if and .Values.redis.enabled .Values.redis.existingUrl -}}
{{- fail "set either redis.enabled or redis.existingUrl, not both" -}}
{{- end -}}
{{- if eq (int .Values.operator.healthPort) (int .Values.operator.webhookPort) -}}
{{- fail "operator.healthPort and operator.webhookPort must differ" -}}
{{- end -}}
{{- end -}}
