{{/*
A worker pod's spec, at column 0 (include it with nindent). Arguments: root, group (the worker kind: key, service,
role, short, offset), member: "group" (every rank of the worker group in this pod, rank 0 starting the others,
a GPU each), "leader" or "follower" (a LeaderWorkerSet's pods across hosts: rank 0 in the leader pod, the
others one a pod, each with one GPU, meeting at the leader's store).
*/}}
{{- define "aflex.workerPod" -}}
{{- $ := .root }}
{{- $group := .group }}
{{- $member := .member }}
{{- $v := get $.Values $group.key }}
{{- $gpu := $.Values.gpu }}
{{- $image := $gpu.enabled | ternary $gpu.image $.Values.image }}
{{- $ranks := include "aflex.workerRanks" (dict "root" $ "group" $group) | int }}
{{- $gpus := eq $member "group" | ternary $ranks 1 }}
{{- $resources := deepCopy ($v.resources | default dict) }}
{{- if $gpu.enabled }}{{/* exactly one GPU a rank, whatever resources say */}}
{{- range $kind := list "limits" "requests" }}
{{- $asked := get $resources $kind | default dict }}
{{- $_ := set $asked $gpu.resource $gpus }}
{{- $_ := set $resources $kind $asked }}
{{- end }}
{{- end }}
{{- $env := include "aflex.userEnv" (dict "root" $ "own" $v.env "worker" true) | fromJson }}
{{- $nvml := and $gpu.enabled (eq $gpu.control "nvml") }}
{{- $nodeSelector := merge (deepCopy ($v.nodeSelector | default dict)) ($gpu.enabled | ternary $gpu.nodeSelector dict) }}
{{- $tolerations := concat ($v.tolerations | default list) ($gpu.enabled | ternary $gpu.tolerations list) }}
terminationGracePeriodSeconds: {{ include "aflex.gracePeriod" $ }}
{{- if and $gpu.enabled $gpu.runtimeClassName }}
runtimeClassName: {{ $gpu.runtimeClassName }}
{{- end }}
securityContext:
  {{- if $nvml }}
  runAsUser: 0        # setting GPU clocks needs root with CAP_SYS_ADMIN (docs/gpu.md)
  runAsNonRoot: false
  seccompProfile:
    type: RuntimeDefault
  {{- else }}
  {{- include "aflex.podSecurityContext" $ | nindent 2 }}
  {{- end }}
{{- with $.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  - name: {{ $group.service }}
    image: "{{ $image.repository }}:{{ $image.tag }}"
    imagePullPolicy: {{ $image.pullPolicy }}
    args: [{{ $group.service | quote }}]
    env:
      {{- include "aflex.env" (dict "root" $ "role" $group.role "offset" $group.offset "env" $env
            "reserved" (list "AFLEX_WORKER_ID" "AFLEX_SEAM_HOST" "AFLEX_DEVICE" "AFLEX_GPU_BACKEND"
                             "AFLEX_COLOCATE" "AFLEX_ATTENTION_TP" "AFLEX_FFN_TP" "AFLEX_FFN_EP"
                             "AFLEX_GROUP_SPAWN" "AFLEX_GROUP_PORT" "AFLEX_GROUP_RANK" "AFLEX_GROUP_ADDRESS")) | nindent 6 }}
      - name: AFLEX_WORKER_ID
        valueFrom:
          fieldRef:
            fieldPath: metadata.name
      - name: AFLEX_SEAM_HOST       # where the other workers reach this one's torch seam
        valueFrom:
          fieldRef:
            fieldPath: status.podIP
      - name: AFLEX_DEVICE
        value: {{ $gpu.enabled | ternary "cuda" "cpu" | quote }}
      - name: AFLEX_GPU_BACKEND
        value: {{ $gpu.enabled | ternary $gpu.control "emulated" | quote }}
      {{- if not (hasKey $env "AFLEX_TORCH_THREADS") }}
      - name: AFLEX_TORCH_THREADS   # the container's CPU limit (the node's cores without one)
        valueFrom:
          resourceFieldRef:
            resource: limits.cpu
            divisor: "1"
      {{- end }}
      {{- if eq $group.key "attention" }}
      - name: AFLEX_COLOCATE
        value: {{ $v.colocate | quote }}
      - name: AFLEX_ATTENTION_TP    # the pod's worker group: rank 0 starts the other ranks, one a GPU
        value: {{ $v.tp | default 1 | quote }}
      {{- else }}
      - name: AFLEX_FFN_TP
        value: {{ $v.tp | default 1 | quote }}
      - name: AFLEX_FFN_EP
        value: {{ $v.ep | default 1 | quote }}
      {{- end }}
      {{- if ne $member "group" }}
      - name: AFLEX_GROUP_SPAWN     # the other ranks are pods of their own (the LeaderWorkerSet's)
        value: "false"
      - name: AFLEX_GROUP_PORT      # rank 0's store, where they meet
        value: {{ $.Values.groupPort | quote }}
      {{- end }}
      {{- if eq $member "follower" }}
      - name: AFLEX_GROUP_RANK      # LWS_* come first in the env (the LeaderWorkerSet's webhook puts them there)
        value: "$(LWS_WORKER_INDEX)"
      - name: AFLEX_GROUP_ADDRESS
        value: "gloo://$(LWS_LEADER_ADDRESS):{{ $.Values.groupPort }}"
      {{- end }}
      {{- include "aflex.probeEnv" $ | nindent 6 }}
    {{- if ne $member "follower" }}{{/* a follower has no presence on NATS: its group's rank 0 answers for it */}}
    {{- include "aflex.execProbes" (dict "root" $ "service" $group.service) | nindent 4 }}
    {{- end }}
    securityContext:
      {{- if $nvml }}
      capabilities:
        add: ["SYS_ADMIN"]
      {{- else }}
      {{- include "aflex.containerSecurityContext" $ | nindent 6 }}
      {{- end }}
    volumeMounts:
      {{- include "aflex.volumeMounts" (dict "root" $) | nindent 6 }}
      - name: shm
        mountPath: /dev/shm
    {{- with $resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
volumes:
  {{- include "aflex.volumes" (dict "root" $) | nindent 2 }}
  - name: shm
    emptyDir:
      medium: Memory
      sizeLimit: {{ $v.shmSize }}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The ranks of a worker kind's group: tp (attention), tp x ep (FFN). */}}
{{- define "aflex.workerRanks" -}}
{{- $v := get .root.Values .group.key -}}
{{- eq .group.key "ffn" | ternary (mul ($v.tp | default 1) ($v.ep | default 1)) ($v.tp | default 1) -}}
{{- end }}
