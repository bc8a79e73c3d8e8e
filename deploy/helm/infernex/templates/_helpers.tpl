{{/* Names, labels, images and the shared environment of the InferNex components. */}}

{{- define "infernex.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "infernex.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Namespace of every component but the Gateway. */}}
{{- define "infernex.namespace" -}}
{{- default .Release.Namespace .Values.global.namespace -}}
{{- end -}}

{{/* Labels of every object; baseLabels leaves out those that selectors carry. */}}
{{- define "infernex.baseLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: infernex
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "infernex.labels" -}}
{{ include "infernex.baseLabels" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "router") */}}
{{- define "infernex.selectorLabels" -}}
app.kubernetes.io/name: {{ include "infernex.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "infernex.componentLabels" -}}
{{ include "infernex.baseLabels" .ctx }}
{{ include "infernex.selectorLabels" . }}
{{- end -}}

{{/* Image of a control-plane component: (dict "ctx" $ "image" .Values.x.image) */}}
{{- define "infernex.image" -}}
{{- $g := .ctx.Values.global.infernexImage -}}
{{- $i := .image | default dict -}}
{{- $repo := $i.repository | default $g.repository -}}
{{- $tag := $i.tag | default $g.tag | default .ctx.Chart.AppVersion -}}
image: {{ printf "%s:%s" $repo $tag | quote }}
imagePullPolicy: {{ $i.pullPolicy | default $g.pullPolicy }}
{{- end -}}

{{- define "infernex.natsUrl" -}}
{{- if .Values.nats.enabled -}}
{{- printf "nats://%s-nats.%s.svc:%d" (include "infernex.fullname" .) (include "infernex.namespace" .) (int .Values.nats.port) -}}
{{- else -}}
{{- required "nats.externalUrl is required when nats.enabled is false" .Values.nats.externalUrl -}}
{{- end -}}
{{- end -}}

{{/* Stream replicas follow the NATS cluster size (R3 on a 3-node cluster). */}}
{{- define "infernex.streamReplicas" -}}
{{- if and .Values.nats.enabled (ge (int .Values.nats.replicas) 3) -}}3{{- else -}}1{{- end -}}
{{- end -}}

{{/* Environment every control-plane container gets. */}}
{{- define "infernex.env" -}}
- name: INFERNEX_CONFIG
  value: /etc/infernex/settings/config.yaml
- name: INFERNEX_NATS__SERVERS
  value: {{ include "infernex.natsUrl" . | quote }}
- name: INFERNEX_TOPOLOGY__REPLICAS
  value: {{ include "infernex.streamReplicas" . | quote }}
- name: INFERNEX_LOG_LEVEL
  value: {{ .Values.global.logLevel | quote }}
- name: INFERNEX_DATA_DIR
  value: /var/lib/infernex
{{- with .Values.global.subjectPrefix }}
- name: INFERNEX_NATS__SUBJECT_PREFIX
  value: {{ . | quote }}
{{- end }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: NODE_IP
  valueFrom:
    fieldRef:
      fieldPath: status.hostIP
{{- end -}}

{{- define "infernex.configVolume" -}}
- name: infernex-config
  configMap:
    name: {{ include "infernex.fullname" . }}-config
- name: tmp
  emptyDir: {}
{{- end -}}

{{- define "infernex.configMount" -}}
- name: infernex-config
  mountPath: /etc/infernex/settings
  readOnly: true
- name: infernex-data
  mountPath: /var/lib/infernex
- name: tmp
  mountPath: /tmp
{{- end -}}

{{- define "infernex.podSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{- define "infernex.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end -}}

{{- define "infernex.imagePullSecrets" -}}
{{- with .Values.global.imagePullSecrets }}
imagePullSecrets:
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "infernex.routerName" -}}
{{- printf "%s-router" (include "infernex.fullname" .) -}}
{{- end -}}

{{- define "infernex.poolName" -}}
{{- $pool := (index .Values "hermes-router").inferencePool -}}
{{- $pool.name | default .Values.global.name -}}
{{- end -}}

{{/* Labels an engine pod carries: (dict "ctx" $ "svc" $svc "role" "prefill") */}}
{{- define "infernex.engineLabels" -}}
inference-backend: "true"
app.kubernetes.io/name: {{ include "infernex.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: engine
infernex.io/service: {{ .svc.name }}
openfuyao.com/model: {{ dig "openfuyao" "model" "" .svc | quote }}
openfuyao.com/engine: {{ dig "openfuyao" "engine" "vllm" .svc | quote }}
openfuyao.com/pdRole: {{ .role | quote }}
{{- with dig "openfuyao" "pdGroupID" "" .svc }}
openfuyao.com/pdGroupID: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The NATS users, one per component (nats.auth). */}}
{{- define "infernex.natsUsers" -}}
["router","indexer","sla-sink","planner","diagnosis","collector","bridge","streams"]
{{- end -}}

{{/* A component's NATS credentials and CA (nats.auth / nats.tls):
(dict "ctx" $ "user" "indexer"). With an external NATS, credentials come only from nats.auth.existingSecret. */}}
{{- define "infernex.natsClientEnv" -}}
{{- $v := .ctx.Values.nats -}}
{{- $fn := include "infernex.fullname" .ctx -}}
{{- if and $v.auth.enabled (or $v.enabled $v.auth.existingSecret) }}
- name: INFERNEX_NATS__USER
  value: {{ .user | quote }}
- name: INFERNEX_NATS__PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $v.auth.existingSecret | default (printf "%s-nats-auth" $fn) }}
      key: {{ .user }}
{{- end }}
{{- if and $v.tls.enabled (or $v.enabled $v.tls.existingSecret $v.tls.caPem) }}
- name: INFERNEX_NATS__TLS__CA_PEM
  {{- if $v.tls.caPem }}
  value: {{ $v.tls.caPem | quote }}
  {{- else }}
  valueFrom:
    secretKeyRef:
      name: {{ $v.tls.existingSecret | default (printf "%s-nats-tls" $fn) }}
      key: ca.crt
  {{- end }}
{{- end }}
{{- end -}}
