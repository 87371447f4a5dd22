{{/* Names: <release>-aflex unless the release's name holds "aflex" (Helm's usual rule). Kept short, so that a
StatefulSet's pods (name-attn-N) and their controller-revision-hash labels stay within 63 characters. */}}
{{- define "aflex.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default "aflex" .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "aflex.selectorLabels" -}}
app.kubernetes.io/name: {{ default "aflex" .root.Values.nameOverride | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of every object; call with (dict "root" $ "component" "gateway"). */}}
{{- define "aflex.labels" -}}
{{ include "aflex.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The Secret with the NATS users' passwords; the nats subchart's values name it the same way. */}}
{{- define "aflex.authSecret" -}}
{{- printf "%s-nats-auth" .Release.Name -}}
{{- end -}}

{{/* The nats subchart's full name (its own nats.fullname rule, on its values). */}}
{{- define "aflex.natsFullname" -}}
{{- $nats := .Values.nats | default dict -}}
{{- if $nats.fullnameOverride -}}
{{- $nats.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default "nats" $nats.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* AFLEX_NATS_URL; call with (dict "root" $ "offset" N). natsUrl as given, or the subchart's nodes: each by
its pod's name in the headless Service, listed from node N on (as compose/compose.cluster.yaml spreads the
services over the nodes: a service connects to the first and goes on down the list when its node dies). */}}
{{- define "aflex.natsUrl" -}}
{{- $root := .root -}}
{{- if $root.Values.natsUrl -}}
{{- $root.Values.natsUrl -}}
{{- else -}}
{{- if not $root.Values.nats.enabled -}}
{{- fail "nats.enabled is false: set natsUrl to your NATS cluster's URLs" -}}
{{- end -}}
{{- $name := include "aflex.natsFullname" $root -}}
{{- $port := dig "config" "nats" "port" 4222 $root.Values.nats -}}
{{- $cluster := dig "config" "cluster" "enabled" false $root.Values.nats -}}
{{- if $cluster -}}
{{- $n := int (dig "config" "cluster" "replicas" 3 $root.Values.nats) -}}
{{- $sts := dig "statefulSet" "name" "" $root.Values.nats | default $name -}}
{{- $headless := dig "headlessService" "name" "" $root.Values.nats | default (printf "%s-headless" $name) -}}
{{- $urls := list -}}
{{- range $i := until $n -}}
{{- $urls = append $urls (printf "nats://%s-%d.%s:%v" $sts (mod (add $i $.offset) $n) $headless $port) -}}
{{- end -}}
{{- join "," $urls -}}
{{- else -}}
{{- include "aflex.natsServiceUrl" $root -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* One URL for a reader (dashboards, `aflex top`): the first of natsUrl, or the subchart's client Service. */}}
{{- define "aflex.natsServiceUrl" -}}
{{- if .Values.natsUrl -}}
{{- .Values.natsUrl | splitList "," | first | trim -}}
{{- else -}}
{{- $svc := dig "service" "name" "" .Values.nats | default (include "aflex.natsFullname" .) -}}
{{- printf "nats://%s:%v" $svc (dig "config" "nats" "port" 4222 .Values.nats) -}}
{{- end -}}
{{- end -}}

{{/* Settings every AFlex service reads (shared/settings.py ServiceSettings), its role's NATS user, then the
user's env (the service's own over workerEnv over env). Call with (dict "root" $ "role" "gateway" "offset" N
"env" <merged env> "reserved" <names the service's template sets>). */}}
{{- define "aflex.env" -}}
{{- $root := .root -}}
- name: AFLEX_NATS_URL
  value: {{ include "aflex.natsUrl" (dict "root" $root "offset" .offset) | quote }}
- name: AFLEX_NATS_USER
  value: {{ .role | quote }}
- name: AFLEX_NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "aflex.authSecret" $root }}
      key: {{ printf "%s-password" .role }}
- name: AFLEX_MODEL
  value: {{ $root.Values.model | quote }}
- name: AFLEX_LOG_LEVEL
  value: {{ $root.Values.logLevel | quote }}
- name: AFLEX_DRAIN_TIMEOUT_S
  value: {{ $root.Values.drainTimeoutS | quote }}
{{- $reserved := concat (list "AFLEX_NATS_URL" "AFLEX_NATS_USER" "AFLEX_NATS_PASSWORD" "AFLEX_MODEL" "AFLEX_LOG_LEVEL"
      "AFLEX_DRAIN_TIMEOUT_S") (.reserved | default list) }}
{{- range $k, $v := .env }}
{{- if has $k $reserved }}
{{- fail (printf "%s is the chart's to set (natsUrl, model, logLevel, drainTimeoutS, gpu.*, gateway.port, gateway.apiKeySecret, attention.colocate), not env's" $k) }}
{{- end }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end -}}

{{/* The user's env for a service: its own over workerEnv (workers) over env. */}}
{{- define "aflex.userEnv" -}}
{{- $env := deepCopy (.own | default dict) -}}
{{- if .worker }}{{ $env = merge $env (deepCopy (.root.Values.workerEnv | default dict)) }}{{ end -}}
{{- toJson (merge $env (deepCopy (.root.Values.env | default dict))) -}}
{{- end -}}

{{/* What the liveness probe (`aflex liveness`, services/launcher/liveness.py) needs besides the service's own
settings: the read-only telemetry user's credentials (not AFLEX_* settings: no service reads them). */}}
{{- define "aflex.probeEnv" -}}
- name: PROBE_NATS_USER
  valueFrom:
    secretKeyRef:
      name: {{ include "aflex.authSecret" . }}
      key: telemetry-user
- name: PROBE_NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "aflex.authSecret" . }}
      key: telemetry-password
{{- end -}}

{{/* terminationGracePeriodSeconds: the drain timeout and a margin. */}}
{{- define "aflex.gracePeriod" -}}
{{- add (ceil .Values.drainTimeoutS | int) (int .Values.graceMarginS) -}}
{{- end -}}

{{/* Startup and liveness probes of a service without HTTP; call with (dict "root" $ "service" "scheduler"). */}}
{{- define "aflex.execProbes" -}}
{{- $p := .root.Values.probes -}}
{{- $command := list "aflex" "liveness" .service "--wait" (toString $p.liveness.waitS) -}}
startupProbe:
  exec:
    command: {{ toJson $command }}
  periodSeconds: 10
  timeoutSeconds: {{ add (int $p.liveness.waitS) 20 }}
  failureThreshold: {{ max 1 (div (int $p.startupTimeoutS) 10) }}
livenessProbe:
  exec:
    command: {{ toJson $command }}
  periodSeconds: {{ $p.liveness.periodS }}
  timeoutSeconds: {{ add (int $p.liveness.waitS) 20 }}
  failureThreshold: {{ $p.liveness.failureThreshold }}
{{- end -}}

{{/* The pod's /models; call with (dict "root" $). */}}
{{- define "aflex.volumes" -}}
- name: models
  {{- if .root.Values.modelVolume }}
  {{- toYaml .root.Values.modelVolume | nindent 2 }}
  {{- else }}
  emptyDir: {}
  {{- end }}
{{- end -}}

{{- define "aflex.volumeMounts" -}}
- name: models
  mountPath: /models
  readOnly: true
{{- end -}}

{{/* The image runs as its `aflex` user (uid 10001, compose/Dockerfile). */}}
{{- define "aflex.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "aflex.containerSecurityContext" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
{{- end -}}
