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
infernex.io/pool: {{ include "infernex.servicePool" (dict "ctx" .ctx "svc" .svc) }}
openfuyao.com/model: {{ dig "openfuyao" "model" "" .svc | quote }}
openfuyao.com/engine: {{ dig "openfuyao" "engine" "vllm" .svc | quote }}
openfuyao.com/pdRole: {{ .role | quote }}
{{- with dig "openfuyao" "pdGroupID" "" .svc }}
openfuyao.com/pdGroupID: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The pool an engine service belongs to: (dict "ctx" $ "svc" $svc). A service with its own
`router` block has its own pool (<pool>-<service>); the others share global.name's. */}}
{{- define "infernex.servicePool" -}}
{{- if .svc.router -}}
{{- printf "%s-%s" (include "infernex.poolName" .ctx) .svc.name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- include "infernex.poolName" .ctx -}}
{{- end -}}
{{- end -}}

{{/* The routers of this release as a JSON list: the shared router (services without a `router`
block; always there when no service has one) and one per service with a `router` block. Each:
name, pool, strategy, replicas, shared, model (served model name, for the route's header match),
services. */}}
{{- define "infernex.routerUnits" -}}
{{- $r := index .Values "hermes-router" -}}
{{- $ie := $r.inferenceExtension -}}
{{- $base := include "infernex.routerName" . -}}
{{- $pool := include "infernex.poolName" . -}}
{{- $custom := $ie.pluginsCustomConfig | default dict -}}
{{- $units := list -}}
{{- $shared := list -}}
{{- range $svc := (index .Values "inference-backend").services -}}
{{- if dig "enabled" true $svc -}}
{{- if $svc.router -}}
{{- $rt := $svc.router -}}
{{- $strategy := $rt.strategy | default (eq ($svc.mode | default "aggregated") "pd" | ternary "pd-kv-aware" "kv-aware") -}}
{{- if $rt.pluginsConfigFile -}}
{{- if not (hasKey $custom $rt.pluginsConfigFile) -}}
{{- fail (printf "inference-backend service %q: router.pluginsConfigFile %q is not a key of hermes-router.inferenceExtension.pluginsCustomConfig" $svc.name $rt.pluginsConfigFile) -}}
{{- end -}}
{{- $strategy = printf "/etc/infernex/profiles/%s" $rt.pluginsConfigFile -}}
{{- end -}}
{{- $served := dig "model" "servedModelName" "" $svc | default (dig "model" "name" "" $svc) -}}
{{- $units = append $units (dict "name" (printf "%s-%s" $base $svc.name | trunc 63 | trimSuffix "-")
      "pool" (include "infernex.servicePool" (dict "ctx" $ "svc" $svc)) "strategy" $strategy
      "replicas" ($rt.replicas | default $r.replicas) "shared" false
      "model" ($rt.modelHeader | default $served) "services" (list $svc.name)) -}}
{{- else -}}
{{- $shared = append $shared $svc.name -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if or $shared (not $units) -}}
{{- $strategy := $ie.strategy -}}
{{- if $ie.pluginsConfigFile }}{{ $strategy = printf "/etc/infernex/profiles/%s" $ie.pluginsConfigFile }}{{ end -}}
{{- $units = prepend $units (dict "name" $base "pool" $pool "strategy" $strategy "replicas" $r.replicas
      "shared" true "model" "" "services" $shared) -}}
{{- end -}}
{{- toJson $units -}}
{{- end -}}

{{/* proxy (Gateway -> router Service -> engine) or epp (Gateway -> InferencePool, the router
picks the pod over ext_proc). */}}
{{- define "infernex.routerMode" -}}
{{- $r := index .Values "hermes-router" -}}
{{- if $r.mode -}}{{- $r.mode -}}
{{- else if eq (dig "httpRoute" "backend" "kind" "Service" $r) "InferencePool" -}}epp
{{- else -}}proxy{{- end -}}
{{- end -}}

{{/* The router image. Seed 000 keys: inferenceExtension.image.hub/name and hermes-router.image
.tag/pullPolicy; inferenceExtension.image.repository/tag/pullPolicy win; else global.infernexImage. */}}
{{- define "infernex.routerImage" -}}
{{- $r := index .Values "hermes-router" -}}
{{- $i := $r.inferenceExtension.image | default dict -}}
{{- $top := $r.image | default dict -}}
{{- $repo := $i.repository | default $top.repository -}}
{{- if and (not $repo) $i.name -}}
{{- $repo = $i.name -}}
{{- if $i.hub }}{{ $repo = printf "%s/%s" (trimSuffix "/" $i.hub) $i.name }}{{ end -}}
{{- end -}}
{{- $img := dict "repository" $repo "tag" ($i.tag | default $top.tag) "pullPolicy" ($i.pullPolicy | default $top.pullPolicy) -}}
{{- include "infernex.image" (dict "ctx" . "image" $img) -}}
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
