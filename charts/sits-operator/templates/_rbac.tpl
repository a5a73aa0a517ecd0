{{/* The rules of rbac.yaml, by scope. */}}

{{- define "sits-operator.namespacedRules" -}}
# SitsDeployments: kopf lists and watches them and keeps its progress in annotations; the
# reconciler reads one at a time and writes status
- apiGroups: [sits.ai]
  resources: [sitsdeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [sits.ai]
  resources: [sitsdeployments/status]
  verbs: [patch]
# what one SitsDeployment owns: created, then server-side applied
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch]
# the router of spec.router (Deployment, Service, ServiceAccount, Role, RoleBinding x-router) is
# also listed and deleted when the spec turns it off
- apiGroups: [""]
  resources: [services, serviceaccounts]
  verbs: [get, list, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, create, patch, delete]
# what the router's Role grants: Kubernetes lets the operator grant only permissions it holds
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch]
# optional owned objects: also listed and deleted when the spec stops asking for them
- apiGroups: [gateway.networking.k8s.io]
  resources: [httproutes]
  verbs: [get, list, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors, prometheusrules]
  verbs: [get, list, create, patch, delete]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [get, list, create, patch, delete]
# tenants' API keys (only their SHA-256 leaves the operator)
- apiGroups: [""]
  resources: [secrets]
  verbs: [get]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
{{- define "sits-operator.crdRules" -}}
# kopf follows CRDs to learn when the SitsDeployment resource appears or changes
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
{{- end }}
