{{/* "true" when the scrape monitors render: asked for, and the cluster serves the Prometheus
Operator's API (a plain cluster would refuse the objects). */}}
{{- define "specdecode-operator.monitors" -}}
{{- if and .Values.metrics.serviceMonitor.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") -}}
true
{{- end -}}
{{- end -}}

{{/* "true" when the PrometheusRule renders, on the same terms. */}}
{{- define "specdecode-operator.alerts" -}}
{{- if and .Values.metrics.prometheusRule.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") -}}
true
{{- end -}}
{{- end -}}

{{/* Labels of a monitoring object: the chart's, plus those Prometheus selects by. */}}
{{- define "specdecode-operator.monitoringLabels" -}}
{{ include "specdecode-operator.labels" .root }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end -}}
