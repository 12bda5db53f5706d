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
