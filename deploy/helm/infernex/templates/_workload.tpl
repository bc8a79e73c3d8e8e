{{/*
A control-plane Deployment and its metrics Service. The container serves /metrics, /readyz
(NATS connected, consumer lag ...) and /healthz (its loop and tasks alive) on PORT.
(dict "ctx" $ "component" "indexer" "name" NAME "replicas" N "image" IMG "args" LIST
      "port" PORT "resources" RES "serviceAccount" SA "kind" "Deployment"
      "data" VOLUME-SPEC-OR-NIL)
*/}}
{{- define "infernex.workload" -}}
{{- $ctx := .ctx -}}
{{- $sel := dict "ctx" $ctx "component" .component -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ .name }}
  namespace: {{ include "infernex.namespace" $ctx }}
  labels:
    {{- include "infernex.componentLabels" $sel | nindent 4 }}
    infernex.io/metrics: "true"
spec:
  type: ClusterIP
  selector:
    {{- include "infernex.selectorLabels" $sel | nindent 4 }}
  ports:
    - name: http
      port: {{ .port }}
      targetPort: http
      appProtocol: http
---
apiVersion: apps/v1
kind: {{ .kind | default "Deployment" }}
metadata:
  name: {{ .name }}
  namespace: {{ include "infernex.namespace" $ctx }}
  labels:
    {{- include "infernex.componentLabels" $sel | nindent 4 }}
spec:
  replicas: {{ .replicas }}
  {{- if eq (.kind | default "Deployment") "StatefulSet" }}
  serviceName: {{ .name }}
  {{- else if .singleWriter }}
  strategy:
    type: Recreate
  {{- end }}
  selector:
    matchLabels:
      {{- include "infernex.selectorLabels" $sel | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "infernex.componentLabels" $sel | nindent 8 }}
      annotations:
        checksum/config: {{ list (include (print $ctx.Template.BasePath "/configmap.yaml") $ctx) .args | toJson | sha256sum }}
    spec:
      {{- with .serviceAccount }}
      serviceAccountName: {{ . }}
      {{- end }}
      {{- include "infernex.imagePullSecrets" $ctx | nindent 6 }}
      {{- include "infernex.podSecurity" $ctx | nindent 6 }}
      terminationGracePeriodSeconds: 60
      containers:
        - name: {{ .component }}
          {{- include "infernex.image" (dict "ctx" $ctx "image" .image) | nindent 10 }}
          args:
            {{- range .args }}
            - {{ . | quote }}
            {{- end }}
          env:
            {{- include "infernex.env" $ctx | nindent 12 }}
            {{- include "infernex.natsClientEnv" (dict "ctx" $ctx "user" .component) | nindent 12 }}
            {{- with .env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: http
              containerPort: {{ .port }}
          readinessProbe:
            httpGet:
              path: /readyz
              port: http
            periodSeconds: 10
          # (liveness waits for the start: a component compiles or loads its numba kernels before it
          # serves, which a node without the image's compiled cache pays, up to a minute when busy)
          startupProbe:
            httpGet:
              path: /healthz
              port: http
            periodSeconds: 5
            failureThreshold: 60
          livenessProbe:
            httpGet:
              path: /healthz
              port: http
            periodSeconds: 20
            failureThreshold: 6
          resources:
            {{- toYaml .resources | nindent 12 }}
          {{- include "infernex.containerSecurity" $ctx | nindent 10 }}
          volumeMounts:
            {{- include "infernex.configMount" $ctx | nindent 12 }}
            {{- with .secretVolume }}
            - name: {{ .name }}
              mountPath: {{ .mountPath }}
              readOnly: true
            {{- end }}
      volumes:
        {{- include "infernex.configVolume" $ctx | nindent 8 }}
        {{- with .secretVolume }}
        - name: {{ .name }}
          secret:
            secretName: {{ .secretName }}
        {{- end }}
        {{- if not .claim }}
        - name: infernex-data
          emptyDir: {}
        {{- end }}
  {{- with .claim }}
  volumeClaimTemplates:
    - metadata:
        name: infernex-data
      spec:
        accessModes: ["ReadWriteOnce"]
        {{- with .storageClassName }}
        storageClassName: {{ . }}
        {{- end }}
        resources:
          requests:
            storage: {{ .size }}
  {{- end }}
{{- end -}}
