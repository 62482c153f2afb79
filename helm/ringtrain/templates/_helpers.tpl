{{/*
The chart name, cut to 63 characters (a DNS label).
*/}}
{{- define "ringtrain.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The name of the release's resources. KubeRay appends 6 characters to a RayJob's name to name its
RayCluster and keeps RayCluster names to 53 characters, so names are cut to 47; both must be
DNS-1035 labels (lowercase, a letter first).
*/}}
{{- define "ringtrain.fullname" -}}
{{- $name := "" }}
{{- if .Values.fullnameOverride }}
{{- $name = .Values.fullnameOverride }}
{{- else }}
{{- $chart := default .Chart.Name .Values.nameOverride }}
{{- if contains $chart .Release.Name }}
{{- $name = .Release.Name }}
{{- else }}
{{- $name = printf "%s-%s" .Release.Name $chart }}
{{- end }}
{{- end }}
{{- $name = $name | trunc 47 | trimSuffix "-" }}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name) }}
{{- fail (printf "resource name %q must be lowercase letters, digits and '-', starting with a letter (KubeRay needs DNS-1035 names): pick another release name or set fullnameOverride" $name) }}
{{- end }}
{{- $name }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "ringtrain.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every resource.
*/}}
{{- define "ringtrain.labels" -}}
helm.sh/chart: {{ include "ringtrain.chart" . }}
{{ include "ringtrain.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ringtrain
{{- end }}

{{/*
Labels that select the release's pods (the PodMonitor uses them).
*/}}
{{- define "ringtrain.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ringtrain.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The ringtrain image reference.
*/}}
{{- define "ringtrain.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) }}
{{- end }}

{{/*
Name of the ConfigMap that holds the job config.
*/}}
{{- define "ringtrain.jobConfigMapName" -}}
{{- printf "%s-job" (include "ringtrain.fullname" .) }}
{{- end }}

{{/*
Where the job ConfigMap is mounted, and the path of the job config inside the Ray pods. A mount
path the chart already mounts a writable volume at would give the pod two volumes on one path.
*/}}
{{- define "ringtrain.jobConfigDir" -}}
{{- $dir := trimSuffix "/" .Values.job.mountPath }}
{{- if has $dir (list "/tmp" "/dev/shm" (trimSuffix "/" .Values.podSecurity.homeDir)) }}
{{- fail (printf "job.mountPath %q is where the chart mounts a writable volume; pick another folder, e.g. /etc/ringtrain" $dir) }}
{{- end }}
{{- $dir }}
{{- end }}

{{- define "ringtrain.jobConfigPath" -}}
{{- printf "%s/job.yaml" (include "ringtrain.jobConfigDir" .) }}
{{- end }}

{{/*
The job entrypoint: `python -m ringtrain run '<config>' 'key=value' ...`. The config path and each
override are passed single-quoted, so the shell hands them to ringtrain unchanged (the schema
refuses single quotes in both).
*/}}
{{- define "ringtrain.entrypoint" -}}
{{- $args := list "python" "-m" "ringtrain" "run" (include "ringtrain.jobConfigPath" . | squote) }}
{{- range .Values.job.overrides }}
{{- $args = append $args (squote .) }}
{{- end }}
{{- join " " $args }}
{{- end }}

{{/*
"true" when the Ray containers get S3 credentials from a Secret.
*/}}
{{- define "ringtrain.s3.enabled" -}}
{{- if or .Values.s3.existingSecret .Values.s3.accessKeyId }}true{{ end }}
{{- end }}

{{/*
"true" when the chart creates the S3 Secret itself.
*/}}
{{- define "ringtrain.s3.createSecret" -}}
{{- if and (not .Values.s3.existingSecret) .Values.s3.accessKeyId }}true{{ end }}
{{- end }}

{{/*
Name of the Secret with the S3 credentials.
*/}}
{{- define "ringtrain.s3.secretName" -}}
{{- .Values.s3.existingSecret | default (printf "%s-s3" (include "ringtrain.fullname" .)) }}
{{- end }}

{{/*
Name of the Secret holding the Ray auth token (key auth_token, KubeRay's convention).
*/}}
{{- define "ringtrain.auth.secretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-ray-auth" (include "ringtrain.fullname" .)) }}
{{- end }}

{{/*
Labels of the release's pods, with a component: the NetworkPolicy admits every pod carrying the
selector labels, so only the chart's own pods may carry them.
*/}}
{{- define "ringtrain.podLabels" -}}
{{- include "ringtrain.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- with .root.Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The restricted Pod Security profile: the pod's half (non-root, RuntimeDefault seccomp) ...
*/}}
{{- define "ringtrain.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsGroup }}
fsGroup: {{ .Values.podSecurity.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
... and every container's (no privilege escalation, no capabilities, a read-only root).
*/}}
{{- define "ringtrain.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop:
    - ALL
{{- end }}

{{/*
The writable folders of a read-only root: /tmp (Ray's session folders, logs, unpacked job
packages; Python's temporary files) and the home folder (caches, DeepSpeed's JIT builds, runs/).
*/}}
{{- define "ringtrain.writableMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: {{ .Values.podSecurity.homeDir }}
{{- end }}

{{- define "ringtrain.writableVolumes" -}}
- name: tmp
  emptyDir: {}
- name: home
  emptyDir: {}
{{- end }}

{{/*
What the kubelet would mount as the service account token, as a volume of its own: the pods set
automountServiceAccountToken false, and only the autoscaler sidecar (which talks to the API
server) mounts this, never the Ray container that runs user code.
*/}}
{{- define "ringtrain.autoscalerTokenVolume" -}}
- name: autoscaler-api-token
  projected:
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: 3600
      - configMap:
          name: kube-root-ca.crt
          items:
            - key: ca.crt
              path: ca.crt
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                apiVersion: v1
                fieldPath: metadata.namespace
{{- end }}

{{/*
Environment of every Ray container: the S3 credentials (endpoint and region are optional keys of
the Secret), then the user's env.
*/}}
{{- define "ringtrain.env" -}}
{{- if include "ringtrain.s3.enabled" . }}
{{- $secret := include "ringtrain.s3.secretName" . }}
{{- $keys := .Values.s3.secretKeys }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $keys.accessKeyId }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $keys.secretAccessKey }}
- name: AWS_ENDPOINT_URL
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $keys.endpointUrl }}
      optional: true
- name: AWS_DEFAULT_REGION
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $keys.region }}
      optional: true
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
`ray start` parameters of a group, as strings; metrics-export-port always comes from
metrics.port so that the PodMonitor and the container port agree with it.
Call with (dict "root" $ "params" $group.rayStartParams).
*/}}
{{- define "ringtrain.rayStartParams" -}}
{{- $params := dict }}
{{- range $key, $value := .params }}
{{- $_ := set $params $key (toString $value) }}
{{- end }}
{{- $_ := set $params "metrics-export-port" (toString .root.Values.metrics.port) }}
{{- toYaml $params }}
{{- end }}

{{/*
Container resources of a group, with `gpus` added to both requests and limits of the GPU resource
(Kubernetes needs them equal for extended resources).
Call with (dict "root" $ "group" $group).
*/}}
{{- define "ringtrain.resources" -}}
{{- $resources := deepCopy (.group.resources | default dict) }}
{{- if .group.gpus }}
{{- $gpuName := .root.Values.worker.gpuResourceName }}
{{- range $side := list "requests" "limits" }}
{{- $quantities := get $resources $side | default dict }}
{{- $_ := set $quantities $gpuName (int $.group.gpus) }}
{{- $_ := set $resources $side $quantities }}
{{- end }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/*
The pod template of a Ray group (head or workers).
Call with (dict "root" $ "group" $group "component" "head"|"worker").
*/}}
{{- define "ringtrain.podTemplate" -}}
{{- $root := .root }}
{{- $group := .group }}
{{- $values := $root.Values -}}
metadata:
  labels:
    {{- include "ringtrain.podLabels" (dict "root" $root "component" (printf "ray-%s" .component)) | nindent 4 }}
  {{- with $values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  automountServiceAccountToken: false
  securityContext:
    {{- include "ringtrain.podSecurityContext" $root | nindent 4 }}
  {{- with $values.serviceAccountName }}
  serviceAccountName: {{ . }}
  {{- end }}
  {{- with $values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    # KubeRay treats the first container as the Ray container and fills in `ray start`.
    - name: ray-{{ .component }}
      image: {{ include "ringtrain.image" $root }}
      imagePullPolicy: {{ $values.image.pullPolicy }}
      ports:
        {{- if eq .component "head" }}
        - name: gcs-server
          containerPort: 6379
        - name: dashboard
          containerPort: 8265
        - name: client
          containerPort: 10001
        {{- end }}
        - name: metrics
          containerPort: {{ $values.metrics.port }}
      {{- with include "ringtrain.env" $root | trim }}
      env:
        {{- . | nindent 8 }}
      {{- end }}
      {{- with $values.envFrom }}
      envFrom:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- include "ringtrain.containerSecurityContext" $root | nindent 8 }}
      resources:
        {{- include "ringtrain.resources" (dict "root" $root "group" $group) | nindent 8 }}
      volumeMounts:
        - name: job-config
          mountPath: {{ include "ringtrain.jobConfigDir" $root }}
          readOnly: true
        - name: dshm
          mountPath: /dev/shm
        {{- include "ringtrain.writableMounts" $root | nindent 8 }}
  volumes:
    {{- include "ringtrain.writableVolumes" $root | nindent 4 }}
    {{- if and (eq .component "head") $values.autoscaling.enabled }}
    {{- include "ringtrain.autoscalerTokenVolume" $root | nindent 4 }}
    {{- end }}
    - name: job-config
      configMap:
        name: {{ include "ringtrain.jobConfigMapName" $root }}
    # NCCL, PyTorch DataLoader workers and Ray's object store need a /dev/shm far above the
    # container runtime's 64 MiB default.
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $group.shmSizeLimit }}
{{- end }}

{{/*
The worker groups, each merged over the `worker` defaults; fails on duplicate names.
Returns YAML: a list of groups.
*/}}
{{- define "ringtrain.workerGroups" -}}
{{- $groups := list }}
{{- $names := dict }}
{{- range .Values.workerGroups }}
{{- if hasKey $names .name }}
{{- fail (printf "workerGroups: the name %q is used twice; group names must be unique" .name) }}
{{- end }}
{{- $_ := set $names .name true }}
{{- $groups = append $groups (mergeOverwrite (deepCopy $.Values.worker) (deepCopy .)) }}
{{- end }}
{{- toYaml $groups }}
{{- end }}

{{/*
The RayCluster spec, shared by the RayJob (spec.rayClusterSpec) and the RayCluster (spec).
*/}}
{{- define "ringtrain.rayClusterSpec" -}}
rayVersion: {{ .Values.rayVersion | quote }}
{{- if .Values.auth.enabled }}
# KubeRay sets RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from this Secret in every Ray container, the
# autoscaler and the job submitter.
authOptions:
  mode: token
  secretName: {{ include "ringtrain.auth.secretName" . }}
{{- end }}
enableInTreeAutoscaling: {{ .Values.autoscaling.enabled }}
{{- if .Values.autoscaling.enabled }}
autoscalerOptions:
  idleTimeoutSeconds: {{ .Values.autoscaling.idleTimeoutSeconds }}
  upscalingMode: {{ .Values.autoscaling.upscalingMode }}
  # The sidecar KubeRay adds to the head pod: the same restricted profile, the writable folders,
  # and the one service account token of the release's pods.
  securityContext:
    {{- include "ringtrain.containerSecurityContext" . | nindent 4 }}
  volumeMounts:
    {{- include "ringtrain.writableMounts" . | nindent 4 }}
    - name: autoscaler-api-token
      mountPath: /var/run/secrets/kubernetes.io/serviceaccount
      readOnly: true
{{- end }}
headGroupSpec:
  serviceType: {{ .Values.head.serviceType }}
  rayStartParams:
    {{- include "ringtrain.rayStartParams" (dict "root" . "params" .Values.head.rayStartParams) | nindent 4 }}
  template:
    {{- include "ringtrain.podTemplate" (dict "root" . "group" .Values.head "component" "head") | nindent 4 }}
workerGroupSpecs:
{{- range $group := include "ringtrain.workerGroups" . | fromYamlArray }}
  - groupName: {{ $group.name }}
    replicas: {{ $group.replicas }}
    minReplicas: {{ hasKey $group "minReplicas" | ternary $group.minReplicas $group.replicas }}
    maxReplicas: {{ hasKey $group "maxReplicas" | ternary $group.maxReplicas $group.replicas }}
    rayStartParams:
      {{- include "ringtrain.rayStartParams" (dict "root" $ "params" $group.rayStartParams) | nindent 6 }}
    template:
      {{- include "ringtrain.podTemplate" (dict "root" $ "group" $group "component" "worker") | nindent 6 }}
{{- end }}
{{- end }}

{{/*
A ringtrain metric with the PrometheusRule's series selector, e.g. ray_ringtrain_step{namespace="a"}.
Call with (list $ "ray_ringtrain_step").
*/}}
{{- define "ringtrain.series" -}}
{{- $root := index . 0 }}
{{- $metric := index . 1 }}
{{- with $root.Values.monitoring.prometheusRule.seriesSelector }}
{{- printf "%s{%s}" $metric . }}
{{- else }}
{{- $metric }}
{{- end }}
{{- end }}
