{{- define "pagedmodel.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagedmodel.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pagedmodel.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "pagedmodel.serviceAccountName" -}}
{{- default (include "pagedmodel.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* The operator's permissions, shared by the ClusterRole and the per-namespace Roles. */}}
{{- define "pagedmodel.namespacedRules" -}}
# PagedModels: watched, annotated by kopf (progress, diff-base), status written.
- apiGroups: ["pagedmodel.io"]
  resources: ["pagedmodels"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["pagedmodel.io"]
  resources: ["pagedmodels/status"]
  verbs: ["get", "patch"]
# Events on PagedModels (kopf posts core/v1 Events).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# Children, applied by name: read, then server-side apply (patch; create when absent). Deletion is the garbage collector's (owner references).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["services", "serviceaccounts"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch"]
# Engine pods for status; pods, endpoints and endpointslices are also what the router Role grants,
# which Kubernetes only lets the operator create if it holds those permissions itself.
- apiGroups: [""]
  resources: ["pods", "endpoints"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
# An external HorizontalPodAutoscaler targeting a PagedModel turns the built-in autoscaler off.
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["list"]
# Existence checks of what a spec names (a PVC, image pull secrets): get only, never list.
- apiGroups: [""]
  resources: ["persistentvolumeclaims", "secrets"]
  verbs: ["get"]
{{- end -}}
