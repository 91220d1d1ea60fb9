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

{{- /* The images have no defaults: gpupart publishes no image, and a repository without a
registry names none that exists. Every image helper checks both, so one failed render names
every image value still to set, whichever template renders first. */}}
{{- define "gpupart.checkImages" -}}
{{- $missing := list -}}
{{- if and (or .Values.operator.enabled .Values.node.enabled .Values.extender.enabled) (not .Values.image.repository) -}}
{{- $missing = append $missing "image.repository (build the image from the repository's Dockerfile and push it where your nodes pull from, docs/install.md: --set image.repository=<your-registry>/gpupart)" -}}
{{- end -}}
{{- if and (eq .Values.scheduler.mode "dedicated") (not .Values.scheduler.image.repository) -}}
{{- $missing = append $missing "scheduler.image.repository (scheduler.mode=dedicated runs the upstream kube-scheduler: the repository your control plane's comes from, on kubeadm shown by kubectl -n kube-system get pods -l component=kube-scheduler -o jsonpath='{..image}', or your mirror of it: --set scheduler.image.repository=<your-registry>/kube-scheduler)" -}}
{{- end -}}
{{- if $missing -}}
{{- fail (printf "set the images first: %s" (join "; " $missing)) -}}
{{- end -}}
{{- end -}}

{{- define "gpupart.image" -}}
{{- include "gpupart.checkImages" . -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "gpupart.schedulerImage" -}}
{{- include "gpupart.checkImages" . -}}
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

{{/* The user name a component's requests carry: its ServiceAccount; "" when the chart does not run it.
Call with (dict "root" $ "component" "operator"). */}}
{{- define "gpupart.identity" -}}
{{- $v := .root.Values -}}
{{- $on := dict "operator" $v.operator.enabled "node" $v.node.enabled "extender" (and $v.extender.enabled (eq $v.scheduler.mode "existing")) "scheduler" (eq $v.scheduler.mode "dedicated") -}}
{{- if index $on .component -}}
{{- printf "system:serviceaccount:%s:%s-%s" .root.Release.Namespace (include "gpupart.fullname" .root) .component -}}
{{- end -}}
{{- end -}}

{{/* Who makes the Bindings that carry gpupart.io/assignment: the extender, which in
scheduler.mode=dedicated is a sidecar of the scheduler pod and so runs as the scheduler's account. */}}
{{- define "gpupart.assigner" -}}
{{- if not .Values.extender.enabled -}}
{{- else if eq .Values.scheduler.mode "dedicated" -}}
{{- include "gpupart.identity" (dict "root" . "component" "scheduler") -}}
{{- else -}}
{{- include "gpupart.identity" (dict "root" . "component" "extender") -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the extender's Ed25519 private key (data key `keys`, PEM). */}}
{{- define "gpupart.assignmentKeySecret" -}}
{{- default (printf "%s-assignment-key" (include "gpupart.fullname" .)) .Values.assignmentKey.existingSecret -}}
{{- end -}}

{{- define "gpupart.assignmentKeyDir" -}}/etc/gpupart/assignment-key{{- end -}}

{{/* The ConfigMap the extender publishes its public keys to and the node agents read. */}}
{{- define "gpupart.assignmentPublicKeys" -}}
{{- printf "%s-assignment-public-keys" (include "gpupart.fullname" .) -}}
{{- end -}}

{{/* The extender Service's DNS name (scheduler.mode=existing): its certificate's name. */}}
{{- define "gpupart.extenderHost" -}}
{{- printf "%s-extender.%s.svc" (include "gpupart.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* Secret with the extender's server certificate, its key and the client CA (mode existing). */}}
{{- define "gpupart.extenderTlsSecret" -}}
{{- $t := .Values.extender.tls -}}
{{- if and $t.secretName $t.certManager.issuerRef -}}
{{- fail "extender.tls: set secretName or certManager.issuerRef, not both" -}}
{{- end -}}
{{- if $t.secretName -}}
{{- $t.secretName -}}
{{- else if $t.certManager.issuerRef -}}
{{- printf "%s-extender-tls" (include "gpupart.fullname" .) -}}
{{- else -}}
{{- fail "scheduler.mode=existing serves the extender over HTTPS with client certificates: set extender.tls.secretName (a Secret with tls.crt, tls.key and ca.crt) or extender.tls.certManager.issuerRef" -}}
{{- end -}}
{{- end -}}

{{/* Where kube-scheduler reaches the extender: loopback in its own pod (dedicated), else the
Service over HTTPS. */}}
{{- define "gpupart.extenderUrl" -}}
{{- if eq .Values.scheduler.mode "dedicated" -}}
{{- printf "http://127.0.0.1:%d%s" (int .Values.extender.port) .Values.extender.urlPrefix -}}
{{- else -}}
{{- printf "https://%s:%d%s" (default (include "gpupart.extenderHost" .) .Values.extender.tls.urlHost) (int .Values.extender.port) .Values.extender.urlPrefix -}}
{{- end -}}
{{- end -}}

{{/* The extender's settings file: the user's extender.settings under what the chart decides. */}}
{{- define "gpupart.extenderSettings" -}}
{{- $e := .Values.extender -}}
{{- $chart := dict "port" (int $e.port) "url_prefix" $e.urlPrefix "log_level" $e.logLevel "health_host" "0.0.0.0" "health_port" (int $e.healthPort) "assignment_key_file" (printf "%s/keys" (include "gpupart.assignmentKeyDir" .)) "assignment_public_keys" (printf "%s/%s" .Release.Namespace (include "gpupart.assignmentPublicKeys" .)) -}}
{{- $user := deepCopy $e.settings -}}
{{- if eq .Values.scheduler.mode "dedicated" -}}
{{- /* Sidecar: only kube-scheduler, in the same pod, can reach it. */ -}}
{{- $_ := set $chart "host" "127.0.0.1" -}}
{{- $_ := set $chart "scheduler_names" (list .Values.scheduler.schedulerName) -}}
{{- else -}}
{{- $_ := set $chart "host" "0.0.0.0" -}}
{{- $_ := set $chart "tls_cert_file" "/etc/gpupart/tls/tls.crt" -}}
{{- $_ := set $chart "tls_key_file" "/etc/gpupart/tls/tls.key" -}}
{{- $_ := set $chart "tls_client_ca_file" "/etc/gpupart/tls/ca.crt" -}}
{{- if not (hasKey $user "scheduler_names") -}}
{{- $_ := set $chart "scheduler_names" (list "default-scheduler") -}}
{{- end -}}
{{- end -}}
{{- toYaml (merge $chart $user) -}}
{{- end -}}

{{/* The extender container: the scheduler pod's sidecar (dedicated) or the Deployment's. */}}
{{- define "gpupart.extenderContainer" -}}
{{- $e := .Values.extender -}}
- name: extender
  image: {{ include "gpupart.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  args: [extender, --config=/etc/gpupart/extender/settings.yaml]
  ports:
    {{- if ne .Values.scheduler.mode "dedicated" }}
    - {name: https, containerPort: {{ $e.port }}, protocol: TCP}
    {{- end }}
    # Plain HTTP, /healthz, /readyz and /metrics only (aggregate counters): the probes' port.
    - {name: health, containerPort: {{ $e.healthPort }}, protocol: TCP}
  livenessProbe:
    httpGet: {path: /healthz, port: health}
    initialDelaySeconds: 5
    periodSeconds: 10
    timeoutSeconds: 3
  # Ready once the watch cache holds the first list of Nodes and Pods.
  readinessProbe:
    httpGet: {path: /readyz, port: health}
    periodSeconds: 5
    timeoutSeconds: 3
  resources:
    {{- toYaml $e.resources | nindent 4 }}
  securityContext:
    {{- include "gpupart.restrictedContainer" . | nindent 4 }}
    runAsUser: 10001
    runAsGroup: 10001
  volumeMounts:
    - {name: extender-settings, mountPath: /etc/gpupart/extender, readOnly: true}
    - {name: assignment-key, mountPath: {{ include "gpupart.assignmentKeyDir" . }}, readOnly: true}
    {{- if ne .Values.scheduler.mode "dedicated" }}
    - {name: tls, mountPath: /etc/gpupart/tls, readOnly: true}
    {{- end }}
    - {name: extender-tmp, mountPath: /tmp}
{{- end -}}

{{- define "gpupart.extenderVolumes" -}}
- name: extender-settings
  configMap: {name: {{ include "gpupart.fullname" . }}-extender}
- name: assignment-key
  secret:
    secretName: {{ include "gpupart.assignmentKeySecret" . }}
    items: [{key: keys, path: keys}]
    defaultMode: 0440
{{- if ne .Values.scheduler.mode "dedicated" }}
- name: tls
  secret:
    secretName: {{ include "gpupart.extenderTlsSecret" . }}
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
    defaultMode: 0440
{{- end }}
- name: extender-tmp
  emptyDir: {sizeLimit: 64Mi}
{{- end -}}

{{/* The `extenders:` entry: files/scheduler-config.yaml's, pointed at the extender. */}}
{{- define "gpupart.schedulerConfig" -}}
{{- $cfg := .Files.Get "files/scheduler-config.yaml" | fromYaml -}}
{{- $ext := index $cfg.extenders 0 -}}
{{- $_ := set $ext "urlPrefix" (include "gpupart.extenderUrl" .) -}}
{{- $_ := set $ext "ignorable" .Values.scheduler.ignorable -}}
{{- $_ := set $ext "httpTimeout" .Values.scheduler.httpTimeout -}}
{{- $_ := set $ext "weight" (int .Values.scheduler.weight) -}}
{{- if eq .Values.scheduler.mode "existing" -}}
{{- $files := .Values.extender.tls.schedulerFiles -}}
{{- $_ := set $ext "enableHTTPS" true -}}
{{- $_ := set $ext "tlsConfig" (dict "certFile" $files.certFile "keyFile" $files.keyFile "caFile" $files.caFile "serverName" (include "gpupart.extenderHost" .)) -}}
{{- end -}}
{{- $profile := index $cfg.profiles 0 -}}
{{- $_ := set $profile "schedulerName" .Values.scheduler.schedulerName -}}
{{- $_ := set $profile "percentageOfNodesToScore" (int .Values.scheduler.percentageOfNodesToScore) -}}
{{- $_ := set $cfg "leaderElection" (dict "leaderElect" true "resourceName" .Values.scheduler.schedulerName "resourceNamespace" .Release.Namespace "resourceLock" "leases") -}}
{{- toYaml $cfg -}}
{{- end -}}
