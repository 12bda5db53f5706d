{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "stepwatch.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name. */}}
{{- define "stepwatch.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "stepwatch.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "stepwatch.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stepwatch.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "stepwatch.labels" -}}
helm.sh/chart: {{ include "stepwatch.chart" . }}
{{ include "stepwatch.selectorLabels" . }}
app.kubernetes.io/component: agent
app.kubernetes.io/part-of: stepwatch
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "stepwatch.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "stepwatch.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository:tag, or repository@digest when image.digest is set (the digest pins the image;
     a tag can be moved). */}}
{{- define "stepwatch.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "stepwatch.socketPath" -}}
{{- printf "%s/%s" (.Values.socket.hostPath | trimSuffix "/") .Values.socket.name }}
{{- end }}

{{/* The CSI plugin's host directory, also its path in the agent container. */}}
{{- define "stepwatch.csiPluginDir" -}}
{{- printf "%s/plugins/%s" (.Values.csi.kubeletDir | trimSuffix "/") .Values.csi.driverName }}
{{- end }}

{{/* Each alert's threshold as it is written in files/stepwatch-rules.yml (which must hold it
     exactly once in the alert's expression) and how a new value is written in its place
     (prometheusRule.alerts.<name>.threshold). */}}
{{- define "stepwatch.alertThresholds" -}}
StepwatchLowPredictedHeadroom: {literal: "< 0.05", format: "< %v"}
StepwatchLowObservedHeadroom: {literal: "< 0.05", format: "< %v"}
StepwatchFirstStepDivergence: {literal: "> 0.1", format: "> %v"}
StepwatchFirstStepActivationDivergence: {literal: "> 0.1", format: "> %v"}
StepwatchJobStalled: {literal: "clamp_min(10 *", format: "clamp_min(%v *"}
StepwatchSamplerLagging: {literal: "> 0.1", format: "> %v"}
StepwatchMemoryGrowthOOMForecast: {literal: "< 3600", format: "< %v"}
{{- end }}

{{/* Alerts the agent posts itself (--alertmanager-url) with the rule's name and labels. */}}
{{- define "stepwatch.fastPathAlerts" -}}
- StepwatchStep2OOMPredicted
- StepwatchLowPredictedHeadroom
- StepwatchFirstStepDivergence
- StepwatchFirstStepActivationDivergence
{{- end }}

{{/* Labels kube-prometheus-stack selects by (`release: <its release>`, from prometheusRelease)
     merged with an object's own extra labels (the dict passed as .extra), which win: a
     `release` set there too is not written twice. Call with (dict "root" $ "extra" LABELS). */}}
{{- define "stepwatch.monitoringLabels" -}}
{{- $labels := deepCopy (.extra | default dict) }}
{{- with .root.Values.prometheusRelease }}
{{- if not (hasKey $labels "release") }}{{ $_ := set $labels "release" . }}{{ end }}
{{- end }}
{{- with $labels }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/* The GPUs asked of the NVIDIA toolkit: nvidia.visibleDevices split at commas, as a YAML list. */}}
{{- define "stepwatch.visibleDevices" -}}
{{- $devs := list }}
{{- range splitList "," .Values.nvidia.visibleDevices }}
{{- with trim . }}{{ $devs = append $devs . }}{{ end }}
{{- end }}
{{- toYaml $devs }}
{{- end }}

{{/* The GPU Operator's label for third-party GPU clients (gpuOperator.clientLabel). */}}
{{- define "stepwatch.gpuClientLabel" -}}nvidia.com/gpu.deploy.client{{- end }}

{{/* nodeSelector, plus the GPU Operator's client label with gpuOperator.clientLabel=nodeSelector. */}}
{{- define "stepwatch.nodeSelector" -}}
{{- $sel := deepCopy (.Values.nodeSelector | default dict) }}
{{- if eq .Values.gpuOperator.clientLabel "nodeSelector" }}
{{- $_ := set $sel (include "stepwatch.gpuClientLabel" .) "true" }}
{{- end }}
{{- with $sel }}{{ toYaml . }}{{ end }}
{{- end }}

{{/* affinity, and with gpuOperator.clientLabel=affinity a required node affinity on the GPU
     Operator's client label: each of the user's nodeSelectorTerms (or one empty term) becomes
     two, one where the label is "true" and one where it is absent. Terms are ORed, so the agent
     runs on nodes where the label is "true" or missing, and the DaemonSet controller removes it
     while the operator says anything else (paused-for-driver-upgrade, paused-for-mig-change). */}}
{{- define "stepwatch.affinity" -}}
{{- $affinity := deepCopy (.Values.affinity | default dict) }}
{{- if eq .Values.gpuOperator.clientLabel "affinity" }}
{{- $label := include "stepwatch.gpuClientLabel" . }}
{{- $node := $affinity.nodeAffinity | default dict }}
{{- $required := $node.requiredDuringSchedulingIgnoredDuringExecution | default dict }}
{{- $terms := list }}
{{- range $term := $required.nodeSelectorTerms | default (list dict) }}
{{- range $expr := list (dict "key" $label "operator" "In" "values" (list "true")) (dict "key" $label "operator" "DoesNotExist") }}
{{- $t := deepCopy $term }}
{{- $_ := set $t "matchExpressions" (append ($t.matchExpressions | default list) $expr) }}
{{- $terms = append $terms $t }}
{{- end }}
{{- end }}
{{- $_ := set $required "nodeSelectorTerms" $terms }}
{{- $_ = set $node "requiredDuringSchedulingIgnoredDuringExecution" $required }}
{{- $_ = set $affinity "nodeAffinity" $node }}
{{- end }}
{{- with $affinity }}{{ toYaml . }}{{ end }}
{{- end }}
