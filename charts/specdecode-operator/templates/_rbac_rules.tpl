{{/*
Exactly what the operator does, derived from operator/specdecode_operator/.
Namespaced rules apply in the watched namespaces (Role) or everywhere (ClusterRole).
*/}}
{{- define "specdecode-operator.namespacedRules" -}}
# The SpecDecodeDeployments: watched by kopf, patched for its finalizer and progress annotations.
- apiGroups: ["specdecode.io"]
  resources: ["specdecodedeployments"]
  verbs: ["get", "list", "watch", "patch"]
# Status (phase, conditions, plan) is written through the status subresource.
- apiGroups: ["specdecode.io"]
  resources: ["specdecodedeployments/status"]
  verbs: ["get", "patch"]
# Planner pods are created, read for their termination message and cleaned up; worker pods are
# read to explain why a replica is not ready.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
# Children applied with server-side apply (patch) and owned by the SDD.
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "patch"]
# Events on every transition (kopf posts core/v1 events).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}

{{/* Cluster-wide only: kopf discovers the CRD and follows its changes. */}}
{{- define "specdecode-operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if .Values.rbac.readNodes }}
{{ include "specdecode-operator.nodeRules" . }}
{{- end }}
{{- end -}}

{{/* Node GPU capacity, to report PlanExceedsNodeGPUs. */}}
{{- define "specdecode-operator.nodeRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list"]
{{- end -}}
