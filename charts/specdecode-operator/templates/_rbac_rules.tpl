{{/*
Exactly the API calls of operator/specdecode_operator/ (kube.py, reconcile.py and its drivers in
planner.py, modelcache.py and nodecapacity.py, handlers.py) and of
kopf as it is configured there (annotation progress storage, no finalizer, posting disabled).
Namespaced rules apply in the watched namespaces (Role) or everywhere (ClusterRole).
*/}}
{{- define "specdecode-operator.namespacedRules" -}}
# kopf lists and watches SDDs and patches its progress annotations; the reconciler reads each one.
- apiGroups: ["specdecode.io"]
  resources: ["specdecodedeployments"]
  verbs: ["get", "list", "watch", "patch"]
# Status is replaced (PUT) with the resourceVersion read, so a concurrent write is never clobbered.
- apiGroups: ["specdecode.io"]
  resources: ["specdecodedeployments/status"]
  verbs: ["update"]
# Planner pods: created, read for their termination message, old ones deleted. Worker pods:
# listed to tell crash loops, OOM kills and unschedulable pods apart. kopf watches both.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
# vllm and sglang workers: the readiness gate specdecode.io/kv-cache-verified is set on the pod's
# status once the engine's own report of its KV tokens was compared with the plan.
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
# The workload Deployment: server-side applied (patch; create when it does not exist yet), read
# for its rollout state and watched by kopf; deleted when a new plan spans nodes.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# A replica larger than one node: its LeaderWorkerSet, server-side applied, read for its groups'
# progress, watched by kopf (so readiness reaches status at once), deleted when a new plan fits
# one node again. Whether the CRD is installed is asked through discovery, which needs no rule.
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The plan ConfigMap and the Service: server-side applied only.
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["create", "patch"]
# A hub store with a cache: the cache PVC is read, and created when cache.create asks for it;
# one download Job per model is created, read for its completed parts, and deleted to retry
# once it failed for good. Its pods are read (above) for the hub's error message.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "create", "delete"]
{{- if .Values.workerNetworkPolicy.enabled }}
# With the worker NetworkPolicy: a replica spanning pods gets its rank policy, server-side
# applied, and deleted when a new plan fits one pod again.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "patch", "delete"]
{{- end }}
# One Event per condition transition.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}

{{/* Cluster scope only: kopf follows CRD changes (without it, it logs a warning and rescans only on restart). */}}
{{- define "specdecode-operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if .Values.rbac.readNodes }}
{{ include "specdecode-operator.nodeRules" . }}
{{- end }}
{{- end -}}

{{/* Node GPU capacity: GPUs per node for the planner, and PlanExceedsNodeGPUs before pods sit Pending. */}}
{{- define "specdecode-operator.nodeRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list"]
{{- end -}}
