{{/* Name of the chart, or nameOverride. */}}
{{- define "gpupart.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified prefix of every object name (room for a "-extender" style suffix). */}}
{{- define "gpupart.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "gpupart.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "gpupart.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object; call with (dict "root" $ "component" "operator"). */}}
{{- define "gpupart.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
{{ include "gpupart.selectorLabels" . }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "gpupart.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpupart.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- if .component }}
app.kubernetes.io/component: {{ .component }}
{{- end }}
{{- end -}}

{{- define "gpupart.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "gpupart.schedulerImage" -}}
{{- $tag := .Values.scheduler.image.tag -}}
{{- if not $tag -}}
{{- $v := regexReplaceAll "[-+].*$" (trimPrefix "v" .Capabilities.KubeVersion.Version) "" -}}
{{- $tag = printf "v%s" $v -}}
{{- end -}}
{{- printf "%s:%s" .Values.scheduler.image.repository $tag -}}
{{- end -}}

{{/* Container securityContext of every component but the node agent. */}}
{{- define "gpupart.restrictedContainer" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- end -}}

{{- define "gpupart.restrictedPod" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "gpupart.extenderUrl" -}}
{{- printf "http://%s-extender.%s.svc:%d%s" (include "gpupart.fullname" .) .Release.Namespace (int .Values.extender.port) .Values.extender.urlPrefix -}}
{{- end -}}

{{/* The `extenders:` entry: files/scheduler-config.yaml's, pointed at the extender Service. */}}
{{- define "gpupart.schedulerConfig" -}}
{{- $cfg := .Files.Get "files/scheduler-config.yaml" | fromYaml -}}
{{- $ext := index $cfg.extenders 0 -}}
{{- $_ := set $ext "urlPrefix" (include "gpupart.extenderUrl" .) -}}
{{- $_ := set $ext "ignorable" .Values.scheduler.ignorable -}}
{{- $_ := set $ext "httpTimeout" .Values.scheduler.httpTimeout -}}
{{- $_ := set $ext "weight" (int .Values.scheduler.weight) -}}
{{- $profile := index $cfg.profiles 0 -}}
{{- $_ := set $profile "schedulerName" .Values.scheduler.schedulerName -}}
{{- $_ := set $profile "percentageOfNodesToScore" (int .Values.scheduler.percentageOfNodesToScore) -}}
{{- $_ := set $cfg "leaderElection" (dict "leaderElect" true "resourceName" .Values.scheduler.schedulerName "resourceNamespace" .Release.Namespace "resourceLock" "leases") -}}
{{- toYaml $cfg -}}
{{- end -}}
