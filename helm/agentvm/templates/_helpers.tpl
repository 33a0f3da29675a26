{{/*
The components, each one Deployment of `avm <component>`, each given the
service key. Not the sandbox tier (templates/sandbox.yaml): its pods hold no
secret and are trusted by no component.
*/}}
{{- define "agentvm.components" -}}
gateway auth resource session config observability runtime
{{- end }}

{{/* The components that own tables (AVM_DATABASE_URL). */}}
{{- define "agentvm.storageComponents" -}}
auth resource session config observability
{{- end }}

{{- define "agentvm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
<release>-agentvm, or the release name alone when it already says agentvm.
Components append "-<component>" (at most 14 characters), so this stays
within 63 - 14 - 9 ("-headless") characters.
*/}}
{{- define "agentvm.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "agentvm.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of everything the release makes. */}}
{{- define "agentvm.labels" -}}
helm.sh/chart: {{ include "agentvm.chart" . }}
app.kubernetes.io/name: {{ include "agentvm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: agentvm
{{- end }}

{{/* Selector labels of the release's pods (the sandbox pods' too). */}}
{{- define "agentvm.releaseSelector" -}}
app.kubernetes.io/name: {{ include "agentvm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
A podSelector of the release's pods the NetworkPolicies trust: every
component's, never the sandbox pods', where tenants' commands run.
*/}}
{{- define "agentvm.trustedPods" -}}
matchLabels:
  {{- include "agentvm.releaseSelector" . | nindent 2 }}
matchExpressions:
  - key: app.kubernetes.io/component
    operator: NotIn
    values: [sandbox]
{{- end }}

{{/*
The sandbox tier's ServiceAccount and NetworkPolicy, and in pool mode its
Deployment and Service: <fullname>-sandbox.
*/}}
{{- define "agentvm.sandboxName" -}}
{{- printf "%s-sandbox" (include "agentvm.fullname" .) }}
{{- end }}

{{/*
Where the runtime gets sandboxes: "pool" (the chart's Deployment of
`avm sandbox` pods) or "kubernetes" (a pod per image, claimed through
agent-sandbox from the warm pools of templates/sandbox-templates.yaml).
*/}}
{{- define "agentvm.sandboxProvider" -}}
{{- .Values.sandbox.provider | default "pool" }}
{{- end }}

{{/* The environments of kubernetes mode, each with its SandboxTemplate and SandboxWarmPool. */}}
{{- define "agentvm.sandboxEnvironments" -}}
shell python node
{{- end }}

{{/*
The environments that may have a pool of their own in pool mode
(sandbox.environments.<name>.replicas): shell's is the pool of
sandbox.replicas, which serves every environment without one.
*/}}
{{- define "agentvm.sandboxPoolEnvironments" -}}
python node
{{- end }}

{{/*
Pool mode: the environments given a pool of their own (replicas above 0),
space-separated; empty when none, or in kubernetes mode. Each is a
Deployment, headless Service and PDB <fullname>-sandbox-<environment>,
named in the runtime's [runtime.sandbox] pools.
*/}}
{{- define "agentvm.sandboxOwnPools" -}}
{{- if eq (include "agentvm.sandboxProvider" .) "pool" }}
{{- $pools := list }}
{{- range $environment := splitList " " (include "agentvm.sandboxPoolEnvironments" $) }}
{{- if gt (int ((index $.Values.sandbox.environments $environment).replicas | default 0)) 0 }}
{{- $pools = append $pools $environment }}
{{- end }}
{{- end }}
{{- join " " $pools }}
{{- end }}
{{- end }}

{{/*
The label that tells the pools' pods apart (pool mode, once an environment
has a pool of its own): agentvm.io/environment, shell, python or node.
*/}}
{{- define "agentvm.sandboxEnvironmentLabel" -}}
agentvm.io/environment
{{- end }}

{{/*
Selector labels of sandbox pods: every sandbox pod's (the sandbox
NetworkPolicy's), and with an environment those of that pool's pods only.
Call with (dict "root" $ "environment" $name), $name empty for every pod.
*/}}
{{- define "agentvm.sandboxSelector" -}}
{{ include "agentvm.selector" (dict "root" .root "component" "sandbox") }}
{{- with .environment }}
{{ include "agentvm.sandboxEnvironmentLabel" $.root }}: {{ . }}
{{- end }}
{{- end }}

{{/*
An environment's SandboxTemplate and SandboxWarmPool (kubernetes mode), or
its pool's Deployment, Service and PDB (pool mode); call with
(dict "root" $ "environment" $name).
*/}}
{{- define "agentvm.sandboxEnvironmentName" -}}
{{- printf "%s-%s" (include "agentvm.sandboxName" .root) .environment }}
{{- end }}

{{/*
An environment's image (sandbox.environments.<name>.image): its
repository, tag or digest as the chart's image takes them; an empty
repository is the chart's image. Call with (dict "root" $ "environment" $name).
*/}}
{{- define "agentvm.sandboxEnvironmentImage" -}}
{{- $image := (index .root.Values.sandbox.environments .environment).image | default dict }}
{{- if not $image.repository }}
{{- include "agentvm.image" .root }}
{{- else if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else if $image.tag }}
{{- printf "%s:%s" $image.repository $image.tag }}
{{- else }}
{{- $image.repository }}
{{- end }}
{{- end }}

{{/*
The sandbox pods' labels and annotations (pool and kubernetes modes): the
selector's (with the environment's label in pool mode once an environment
has a pool of its own), sandbox.podLabels and sandbox.podAnnotations; never
the common ones, which may be trusted elsewhere or ask a webhook to inject
secrets or identities. Call with (dict "root" $ "environment" $name), $name
empty for no environment label.
*/}}
{{- define "agentvm.sandboxPodMetadata" -}}
{{- $v := .root.Values.sandbox -}}
labels:
  {{- /* sandbox.podLabels, never in place of the selector's. */}}
  {{- with omit ($v.podLabels | default dict) "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component" (include "agentvm.sandboxEnvironmentLabel" .root) }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- include "agentvm.sandboxSelector" . | nindent 2 }}
{{- with $v.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
What every sandbox pod's spec has (pool and kubernetes modes): its own
ServiceAccount without a token, no service links, the RuntimeClass and
the scheduling of sandbox.* (spread among the pods of its environment's
pool, where it has one). Call with (dict "root" $ "matchLabelKeys" list
"environment" $name).
*/}}
{{- define "agentvm.sandboxPodSpec" -}}
{{- $root := .root }}
{{- $v := $root.Values.sandbox }}
{{- $selector := dict "root" $root "environment" .environment -}}
serviceAccountName: {{ include "agentvm.sandboxServiceAccountName" $root }}
# No token: tenants' commands run here.
automountServiceAccountToken: false
enableServiceLinks: false
terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
{{- with $v.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $root.Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $root.Values.imagePullSecrets }}
# Used by the kubelet to pull the image; not in the pod.
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml (merge (dict) (deepCopy ($v.podSecurityContext | default dict)) (deepCopy $root.Values.podSecurityContext)) | nindent 2 }}
{{- with ($v.nodeSelector | default $root.Values.nodeSelector) }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with ($v.tolerations | default $root.Values.tolerations) }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with ($v.affinity | default $root.Values.affinity) }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $root.Values.topologySpread.enabled }}
topologySpreadConstraints:
  {{- range $key := $root.Values.topologySpread.topologyKeys }}
  - maxSkew: 1
    topologyKey: {{ $key }}
    whenUnsatisfiable: {{ $root.Values.topologySpread.whenUnsatisfiable }}
    labelSelector:
      matchLabels:
        {{- include "agentvm.sandboxSelector" $selector | nindent 8 }}
    {{- with $.matchLabelKeys }}
    matchLabelKeys:
      {{- toYaml . | nindent 6 }}
    {{- end }}
  {{- end }}
{{- end }}
{{- end }}

{{/*
The containers and volumes of a sandbox pod of an environment's image
(sandbox.environments.<name>.image): its SandboxTemplate's pods (kubernetes
mode) and its own pool's (pool mode, replicas above 0). The image needs no
`avm`: an init container copies it, and tini, from the chart's image.
Call with (dict "root" $ "environment" $name).
*/}}
{{- define "agentvm.sandboxEnvironmentPod" -}}
{{- $root := .root }}
{{- $v := $root.Values.sandbox }}
{{- $environment := .environment -}}
# The environment's image need not have `avm`: this copies it, and
# tini, out of the chart's image into the `avm` emptyDir. Exec form,
# no shell: the chart's image (deploy/Dockerfile, debian:bookworm-slim)
# has coreutils' cp, /usr/local/bin/avm and /usr/bin/tini; cp keeps
# their 0755 (the umask is 022). Both are linked against bookworm's
# glibc, so the environment's image must be a glibc one of that
# Debian release or newer (the python and node images' -bookworm tags
# are). tini is PID 1, as in the pool's pods: it reaps what commands
# leave behind and forwards signals.
initContainers:
  - name: avm
    image: {{ include "agentvm.image" $root }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    command:
      - cp
      - /usr/local/bin/avm
      - /usr/bin/tini
      - /opt/avm/
    resources:
      {{- toYaml $v.resources | nindent 6 }}
    securityContext:
      {{- include "agentvm.sandboxSecurityContext" $root | nindent 6 }}
    volumeMounts:
      - name: avm
        mountPath: /opt/avm
containers:
  - name: sandbox
    image: {{ include "agentvm.sandboxEnvironmentImage" (dict "root" $root "environment" $environment) }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    # No env, no envFrom: `avm sandbox` reads no configuration and
    # needs no secret; it learns its runtime's public token key when
    # it is claimed (no --token-key).
    command:
      - /opt/avm/tini
      - --
      - /opt/avm/avm
    args:
      {{- include "agentvm.sandboxArgs" $root | nindent 6 }}
    {{- include "agentvm.sandboxContainer" $root | nindent 4 }}
    volumeMounts:
      # Read-only: commands run as the sandbox's user, and must not
      # replace the binary that serves the next claim.
      - name: avm
        mountPath: /opt/avm
        readOnly: true
      - name: workspaces
        mountPath: /workspaces
      - name: tmp
        mountPath: /tmp
volumes:
  - name: avm
    emptyDir:
      sizeLimit: 256Mi
  # The root filesystem is read-only: the claimed image's workspace
  # and /tmp are emptyDirs.
  - name: workspaces
    emptyDir:
      sizeLimit: {{ $v.workspaces.sizeLimit }}
  - name: tmp
    emptyDir:
      sizeLimit: {{ $v.tmp.sizeLimit }}
{{- end }}

{{/*
The arguments of `avm sandbox` in every sandbox pod (pool and kubernetes
modes), after the binary.
*/}}
{{- define "agentvm.sandboxArgs" -}}
{{- $v := .Values.sandbox -}}
- sandbox
- --listen
{{- $host := .Values.listenHost }}
- {{ printf "%s:%s" (ternary (printf "[%s]" $host) $host (contains ":" $host)) (include "agentvm.sandboxPort" .) | quote }}
- --root
- /workspaces
- --claim-idle
- {{ $v.claimIdle | quote }}
# Alone in its container: when a claim ends, its /tmp is emptied
# and every other process of its user (what a command left) is
# killed, so nothing of one image meets the next.
- --scratch
- /tmp
- --kill-strays
{{- if not $v.isolate }}
- --no-isolate
{{- end }}
{{- range $v.expose }}
- --expose
- {{ . | quote }}
{{- end }}
{{- end }}

{{/*
The `avm sandbox` container's port, probes, resources and security context
(pool and kubernetes modes).
*/}}
{{- define "agentvm.sandboxContainer" -}}
{{- $v := .Values.sandbox }}
{{- $port := include "agentvm.sandboxPort" . -}}
ports:
  - name: grpc
    containerPort: {{ $port }}
    protocol: TCP
# grpc.health.v1: the whole server (startup, liveness) and `ready`
# (readiness), SERVING once it listens, NOT_SERVING from the moment
# it starts draining.
startupProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: 2
  failureThreshold: 30
livenessProbe:
  grpc:
    port: {{ $port }}
  periodSeconds: 10
  timeoutSeconds: 3
  failureThreshold: 3
readinessProbe:
  grpc:
    port: {{ $port }}
    service: ready
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 2
# Tenants' commands run in this container: its limits are theirs.
resources:
  {{- toYaml $v.resources | nindent 2 }}
securityContext:
  {{- include "agentvm.sandboxSecurityContext" . | nindent 2 }}
{{- end }}

{{/*
A sandbox pod container's security context: the common securityContext
with sandbox.securityContext over it, and what no override may loosen.
*/}}
{{- define "agentvm.sandboxSecurityContext" -}}
{{- $sc := merge (dict) (deepCopy (.Values.sandbox.securityContext | default dict)) (deepCopy .Values.securityContext) }}
{{- $_ := set $sc "runAsNonRoot" true }}
{{- $_ := set $sc "readOnlyRootFilesystem" true }}
{{- $_ := set $sc "allowPrivilegeEscalation" false }}
{{- $_ := set $sc "privileged" false }}
{{- $_ := set $sc "capabilities" (dict "drop" (list "ALL")) }}
{{- toYaml $sc }}
{{- end }}

{{/* The port `avm sandbox` listens on. */}}
{{- define "agentvm.sandboxPort" -}}
7010
{{- end }}

{{/*
The ServiceAccount of the sandbox pods: sandbox.serviceAccountName, else
their own (made whatever serviceAccount.create says, and without
serviceAccount.annotations, which may give the components a cloud identity).
*/}}
{{- define "agentvm.sandboxServiceAccountName" -}}
{{- default (include "agentvm.sandboxName" .) .Values.sandbox.serviceAccountName }}
{{- end }}

{{/* Selector labels of one component's pods; call with (dict "root" $ "component" $name). */}}
{{- define "agentvm.selector" -}}
{{ include "agentvm.releaseSelector" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels of one component's objects; call with (dict "root" $ "component" $name). */}}
{{- define "agentvm.componentLabels" -}}
{{ include "agentvm.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The ServiceAccount of a component. */}}
{{- define "agentvm.serviceAccountName" -}}
{{- $values := index .root.Values .component }}
{{- if .root.Values.serviceAccount.create }}
{{- printf "%s-%s" (include "agentvm.fullname" .root) .component }}
{{- else }}
{{- default "default" $values.serviceAccountName }}
{{- end }}
{{- end }}

{{- define "agentvm.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* The sandbox pods' image: sandbox.image when it names a repository, else the chart's. */}}
{{- define "agentvm.sandboxImage" -}}
{{- $image := .Values.sandbox.image | default dict }}
{{- if not $image.repository }}
{{- include "agentvm.image" . }}
{{- else if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/* The port a component listens on: 8080 for the gateway, 7000 for the others. */}}
{{- define "agentvm.port" -}}
{{- if eq . "gateway" }}8080{{ else }}7000{{ end }}
{{- end }}

{{/* The Secret of the keys the chart generates (kept across upgrades). */}}
{{- define "agentvm.keysSecret" -}}
{{- printf "%s-keys" (include "agentvm.fullname" .) }}
{{- end }}

{{/* The Secret of what values.yaml gives: the LLM key, database and Redis URLs. */}}
{{- define "agentvm.credentialsSecret" -}}
{{- printf "%s-credentials" (include "agentvm.fullname" .) }}
{{- end }}

{{/* Whether the chart's credentials Secret has anything to hold. */}}
{{- define "agentvm.hasCredentials" -}}
{{- $v := .Values }}
{{- if or (and $v.llm.apiKey.value (not $v.llm.apiKey.existingSecret)) (and $v.database.url (not $v.database.existingSecret)) (and $v.redis.url (not $v.redis.existingSecret)) }}true{{ end }}
{{- end }}

{{/*
A secretKeyRef of one setting: its existingSecret's existingSecretKey, else
the chart's Secret, where the key is the variable's name.
Call with (dict "setting" .Values.x "chartSecret" name "key" "VARIABLE").
*/}}
{{- define "agentvm.secretRef" -}}
secretKeyRef:
{{- if .setting.existingSecret }}
  name: {{ .setting.existingSecret }}
  key: {{ .setting.existingSecretKey }}
{{- else }}
  name: {{ .chartSecret }}
  key: {{ .key }}
{{- end }}
{{- end }}

{{/* Whether a component runs more than one pod, now or under its autoscaler. */}}
{{- define "agentvm.replicated" -}}
{{- $values := index .root.Values .component }}
{{- if or (gt (int $values.replicas) 1) (and $values.autoscaling.enabled (gt (int $values.autoscaling.maxReplicas) 1)) }}true{{ end }}
{{- end }}

{{/* Refuses values that would make a deployment that cannot work. */}}
{{- define "agentvm.validate" -}}
{{- $root := . }}
{{- $hasDatabase := or .Values.database.url .Values.database.existingSecret }}
{{- $hasRedis := or .Values.redis.url .Values.redis.existingSecret }}
{{- range $component := splitList " " (include "agentvm.storageComponents" $root) }}
{{- if and (include "agentvm.replicated" (dict "root" $root "component" $component)) (not $hasDatabase) }}
{{- fail (printf "%s runs more than one replica: its replicas share a database, so set database.url or database.existingSecret (Postgres)" $component) }}
{{- end }}
{{- end }}
{{- range $component := list "gateway" "runtime" }}
{{- if and (include "agentvm.replicated" (dict "root" $root "component" $component)) (not $hasRedis) }}
{{- fail (printf "%s runs more than one replica: its replicas share rate limits and events through Redis, so set redis.url or redis.existingSecret" $component) }}
{{- end }}
{{- end }}
{{- if and .Values.llm.apiKey.value .Values.llm.apiKey.existingSecret }}
{{- fail "llm.apiKey: give value or existingSecret, not both" }}
{{- end }}
{{- /* Tenants' commands run in sandbox pods (pool or kubernetes), never in a runtime pod. */}}
{{- $provider := include "agentvm.sandboxProvider" . }}
{{- if not (has $provider (list "pool" "kubernetes")) }}
{{- fail (printf "sandbox.provider is %q: it is \"pool\" (the chart's sandbox pool) or \"kubernetes\" (a sandbox pod per image through agent-sandbox); tenants' commands never run in the runtime's pods (\"local\" or \"process\")" $provider) }}
{{- end }}
{{- $sandbox := .Values.runtime.sandbox | default dict }}
{{- if and (hasKey $sandbox "provider") (ne (toString $sandbox.provider) $provider) }}
{{- fail (printf "runtime.sandbox.provider is %q: the chart sets it from sandbox.provider (%q), which runs tenants' commands only in sandbox pods; \"local\" or \"process\" would run them in the runtime's pods, beside its secrets. Remove runtime.sandbox.provider, and choose the mode with sandbox.provider" (toString $sandbox.provider) $provider) }}
{{- end }}
{{- if hasKey $sandbox "pool" }}
{{- fail "runtime.sandbox.pool is set by the chart (its sandbox Service, http://<release>-agentvm-sandbox:7010): remove it, and size the pool with sandbox.replicas" }}
{{- end }}
{{- if hasKey $sandbox "pools" }}
{{- fail "runtime.sandbox.pools is set by the chart (the Services of the pools of sandbox.environments.<environment>.replicas, http://<release>-agentvm-sandbox-<environment>:7010): remove it, and give python or node a pool of its own with sandbox.environments.<environment>.replicas" }}
{{- end }}
{{- if hasKey $sandbox "kubernetes" }}
{{- fail "runtime.sandbox.kubernetes is set by the chart (the warm pools of sandbox.environments): remove it" }}
{{- end }}
{{- if regexMatch "(?m)^\\s*\\[\\s*runtime\\s*\\.\\s*sandbox\\s*[\\].]" (.Values.runtime.extraConfig | default "") }}
{{- fail "runtime.extraConfig has a [runtime.sandbox] table: the chart renders that one (and [runtime.sandbox.kubernetes]); give its limits in runtime.sandbox" }}
{{- end }}
{{- if eq $provider "kubernetes" }}
{{- $account := include "agentvm.serviceAccountName" (dict "root" . "component" "runtime") }}
{{- if eq $account "default" }}
{{- fail "sandbox.provider is \"kubernetes\": the runtime's ServiceAccount is given a Role to claim sandboxes, so it must be its own, not \"default\" (which every pod without one uses): set serviceAccount.create, or runtime.serviceAccountName" }}
{{- end }}
{{- if eq $account (include "agentvm.sandboxServiceAccountName" .) }}
{{- fail (printf "sandbox.serviceAccountName is the runtime's ServiceAccount %q: the sandbox pods, where tenants' commands run, need one of their own" $account) }}
{{- end }}
{{- end }}
{{- /* Nor through the runtime's environment, which overrides its configuration file. */}}
{{- range $variable := concat (.Values.extraEnv | default list) (.Values.runtime.extraEnv | default list) }}
{{- $name := upper (toString $variable.name) }}
{{- if or (eq $name "AVM_CONFIG") (eq $name "AVM_RUNTIME") (hasPrefix "AVM_RUNTIME_SANDBOX" $name) }}
{{- fail (printf "extraEnv %s would replace the runtime's [runtime.sandbox] (its provider is the chart's, sandbox.provider): set its limits in runtime.sandbox, the sandboxes with sandbox.*" $variable.name) }}
{{- end }}
{{- end }}
{{- end }}
