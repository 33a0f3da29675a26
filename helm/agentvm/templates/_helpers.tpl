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

{{/* The sandbox tier's Deployment, Service and ServiceAccount: <fullname>-sandbox. */}}
{{- define "agentvm.sandboxName" -}}
{{- printf "%s-sandbox" (include "agentvm.fullname" .) }}
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
{{- /* Tenants' commands run in the sandbox pool, never in a runtime pod. */}}
{{- $sandbox := .Values.runtime.sandbox | default dict }}
{{- if and (hasKey $sandbox "provider") (ne (toString $sandbox.provider) "pool") }}
{{- fail (printf "runtime.sandbox.provider is %q: the chart runs tenants' commands only in its sandbox pool (provider = \"pool\", set by the chart); \"local\" or \"process\" would run them in the runtime's pods, beside its secrets. Remove runtime.sandbox.provider, and size the pool with sandbox.replicas" (toString $sandbox.provider)) }}
{{- end }}
{{- if hasKey $sandbox "pool" }}
{{- fail "runtime.sandbox.pool is set by the chart (its sandbox Service, http://<release>-agentvm-sandbox:7010): remove it, and size the pool with sandbox.replicas" }}
{{- end }}
{{- if regexMatch "(?m)^\\s*\\[\\s*runtime\\s*\\.\\s*sandbox\\s*\\]" (.Values.runtime.extraConfig | default "") }}
{{- fail "runtime.extraConfig has a [runtime.sandbox] table: the chart renders that one (provider = \"pool\"); give its limits in runtime.sandbox" }}
{{- end }}
{{- /* Nor through the runtime's environment, which overrides its configuration file. */}}
{{- range $variable := concat (.Values.extraEnv | default list) (.Values.runtime.extraEnv | default list) }}
{{- $name := upper (toString $variable.name) }}
{{- if or (eq $name "AVM_CONFIG") (eq $name "AVM_RUNTIME") (hasPrefix "AVM_RUNTIME_SANDBOX" $name) }}
{{- fail (printf "extraEnv %s would replace the runtime's [runtime.sandbox] (provider = \"pool\", set by the chart): set its limits in runtime.sandbox, size the pool with sandbox.*" $variable.name) }}
{{- end }}
{{- end }}
{{- end }}
