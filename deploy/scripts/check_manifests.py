#!/usr/bin/env python3
"""Checks rendered Kubernetes manifests (Helm and kustomize output).

check_manifests.py validate FILE... [--allow-root] [--promtool PATH]
    * every core object against the Kubernetes OpenAPI schemas (kubernetes-validate,
      strict: unknown fields are errors), for the oldest and the newest supported version;
    * ServiceMonitor/PrometheusRule (CRDs, no schema shipped): structure, honorLabels: false and the pod-label metricRelabelings, and
      the PrometheusRule's groups through `promtool check rules`;
    * the DaemonSet against stepwatch's deployment contract (security context, hostPID,
      socket hostPath, probes, args, env, resources).
check_manifests.py compare HELM_FILE KUSTOMIZE_FILE
    the kustomize build equals the chart render (Helm-only labels and the Namespace aside).
"""

import argparse
import os
import subprocess
import sys
import tempfile

import kubernetes_validate
import yaml
from report import report_errors

KUBE_VERSIONS = ("1.25.0", "1.37.0")
HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
AGENT_ARGS_PREFIX = [
    "agent",
    "--http-listen",
    "0.0.0.0:19447",
    "--socket",
    "/run/stepwatch/stepwatch.sock",
    "--socket-mode",
    "0666",
    "--node-name",
    "$(NODE_NAME)",
]


class Checker:
    def __init__(self):
        self.errors = []
        self.checked = 0

    def expect(self, cond, where, what):
        self.checked += 1
        if not cond:
            self.errors.append(f"{where}: {what}")


def load(paths):
    objects = []
    for path in paths:
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    objects.append(doc)
    return objects


def name_of(obj):
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


def validate_core(c, obj):
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
            c.expect(True, name_of(obj), "")
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            c.expect(False, name_of(obj), f"kubernetes {version} schema: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            c.expect(False, name_of(obj), e.message)


def pod_label_rules():
    """The metric_relabel_configs of the example's Kubernetes scrape job, in the Operator's
    camelCase: what every ServiceMonitor endpoint must begin its metricRelabelings with, so
    that a tenant's exported_namespace/pod/container move back into namespace/pod/container.
    tests/prometheus_multinode.rs runs the same rules on a real Prometheus."""
    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "prometheus",
        "prometheus-example.yml",
    )
    with open(path) as f:
        cfg = yaml.safe_load(f)
    rules = cfg["scrape_configs"][0]["metric_relabel_configs"]

    def camel(k):
        return k.split("_")[0] + "".join(w.title() for w in k.split("_")[1:])

    return [{camel(k): v for k, v in r.items()} for r in rules]


def expect_monitoring_v1(c, obj):
    """Checks that a Prometheus Operator object is monitoring.coreos.com/v1; its name."""
    where = name_of(obj)
    c.expect(
        obj["apiVersion"] == "monitoring.coreos.com/v1",
        where,
        "apiVersion must be monitoring.coreos.com/v1",
    )
    return where


def check_service_monitor(c, obj, services):
    where = expect_monitoring_v1(c, obj)
    spec = obj.get("spec", {})
    endpoints = spec.get("endpoints") or []
    c.expect(endpoints, where, "no endpoints")
    selector = spec.get("selector", {}).get("matchLabels", {})
    matched = [
        s
        for s in services
        if selector
        and all(s["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())
    ]
    c.expect(matched, where, f"selector {selector} matches no Service")
    port_names = {p.get("name") for s in matched for p in s["spec"].get("ports", [])}
    for ep in endpoints:
        c.expect(
            ep.get("honorLabels") is False,
            where,
            "endpoints must set honorLabels: false (the target's job and instance win)",
        )
        rules = pod_label_rules()
        c.expect(
            (ep.get("metricRelabelings") or [])[: len(rules)] == rules,
            where,
            "metricRelabelings must begin with the pod-label rules of deploy/prometheus/prometheus-example.yml "
            f"(exported_namespace/pod/container back to namespace/pod/container): {rules}",
        )
        c.expect(
            ep.get("port") in port_names,
            where,
            f"endpoint port {ep.get('port')!r} not a port of the Service",
        )
        c.expect(ep.get("path", "/metrics") == "/metrics", where, "path must be /metrics")
        allowed = {
            "port",
            "path",
            "scheme",
            "interval",
            "scrapeTimeout",
            "honorLabels",
            "relabelings",
            "metricRelabelings",
            "honorTimestamps",
            "tlsConfig",
            "bearerTokenSecret",
            "authorization",
            "bearerTokenFile",
        }
        c.expect(
            set(ep) <= allowed, where, f"unexpected endpoint fields {sorted(set(ep) - allowed)}"
        )


def check_prometheus_rule(c, obj, promtool):
    where = expect_monitoring_v1(c, obj)
    groups = obj.get("spec", {}).get("groups")
    c.expect(groups, where, "spec.groups is empty")
    if not groups:
        return
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as f:
        yaml.safe_dump({"groups": groups}, f)
        path = f.name
    try:
        res = subprocess.run([promtool, "check", "rules", path], capture_output=True, text=True)
        c.expect(
            res.returncode == 0, where, "promtool check rules failed:\n" + res.stdout + res.stderr
        )
    finally:
        os.unlink(path)
    alerts = {r["alert"]: r for g in groups for r in g["rules"] if "alert" in r}
    down = alerts.get("StepwatchAgentDown")
    c.expect(
        down is not None and down["expr"].startswith("up{"),
        where,
        "StepwatchAgentDown missing or not on up{...}",
    )


def container_checks(c, where, ctr, allow_root):
    sc = ctr.get("securityContext", {})
    c.expect(sc.get("readOnlyRootFilesystem") is True, where, "readOnlyRootFilesystem must be true")
    c.expect(not sc.get("privileged", False), where, "must not be privileged")
    c.expect(
        sc.get("allowPrivilegeEscalation") is False, where, "allowPrivilegeEscalation must be false"
    )
    c.expect(
        "ALL" in sc.get("capabilities", {}).get("drop", []), where, "capabilities must drop ALL"
    )
    added = set(sc.get("capabilities", {}).get("add", []))
    c.expect(added <= {"CHOWN"}, where, f"unexpected capabilities {sorted(added)}")
    res = ctr.get("resources", {})
    for kind in ("requests", "limits"):
        c.expect(
            {"cpu", "memory"} <= set(res.get(kind, {})),
            where,
            f"resources.{kind} needs cpu and memory",
        )


DEVICE_MOUNT_ROOT = "/var/run/nvidia-container-devices/"


def nvidia_devices_requested(ds):
    """The devices the NVIDIA container toolkit would inject into the agent container, by each
    of its three ways, as the toolkit reads them: NVIDIA_VISIBLE_DEVICES; mounts whose source is
    /dev/null under /var/run/nvidia-container-devices/<device> (its DevicesFromMounts, with
    accept-nvidia-visible-devices-as-volume-mounts); CDI annotations cdi.k8s.io/* naming
    nvidia.com/gpu=<device>. The toolkit takes one of them; the agent must use exactly one."""
    template = ds["spec"]["template"]
    pod = template["spec"]
    agent = next(x for x in pod.get("containers", []) if x["name"] == "agent")
    ways = []
    env = {e["name"]: e.get("value") for e in agent.get("env", [])}
    if "NVIDIA_VISIBLE_DEVICES" in env:
        ways.append(env["NVIDIA_VISIBLE_DEVICES"].split(","))
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    mounted = [
        m["mountPath"][len(DEVICE_MOUNT_ROOT) :]
        for m in agent.get("volumeMounts", [])
        if m["mountPath"].startswith(DEVICE_MOUNT_ROOT)
        and vols.get(m["name"], {}).get("hostPath", {}).get("path") == "/dev/null"
    ]
    if mounted:
        ways.append(mounted)
    annotations = template.get("metadata", {}).get("annotations", {}) or {}
    cdi = [
        dev.split("=", 1)[1]
        for key, value in annotations.items()
        if key.startswith("cdi.k8s.io/")
        for dev in value.split(",")
        if dev.startswith("nvidia.com/gpu=")
    ]
    if cdi:
        ways.append(cdi)
    return ways[0] if len(ways) == 1 else ways


def check_daemonset(c, ds, services, allow_root, metrics_proxy=False):
    where = name_of(ds)
    pod = ds["spec"]["template"]["spec"]
    c.expect(pod.get("hostPID") is True, where, "hostPID must be true (PIDs from NVML/SO_PEERCRED)")
    c.expect(not pod.get("hostNetwork", False), where, "hostNetwork is not needed")
    if metrics_proxy:
        c.expect(
            pod.get("automountServiceAccountToken") is True,
            where,
            "kube-rbac-proxy needs the API token",
        )
    else:
        c.expect(
            pod.get("automountServiceAccountToken") is False, where, "the agent needs no API token"
        )
    c.expect(pod.get("nodeSelector"), where, "nodeSelector for GPU nodes expected")
    c.expect(pod.get("tolerations"), where, "tolerations for GPU taints expected")
    psc = pod.get("securityContext", {})
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    sock = [v for v in vols.values() if v.get("hostPath", {}).get("path") == "/run/stepwatch"]
    c.expect(
        len(sock) == 1 and sock[0]["hostPath"].get("type") == "DirectoryOrCreate",
        where,
        "hostPath /run/stepwatch (DirectoryOrCreate) expected",
    )
    agents = [x for x in pod.get("containers", []) if x["name"] == "agent"]
    c.expect(len(agents) == 1, where, "one container named agent expected")
    if not agents:
        return
    agent = agents[0]
    cw = f"{where} container agent"
    prefix = list(AGENT_ARGS_PREFIX)
    if metrics_proxy:
        prefix[2] = "127.0.0.1:19448"  # behind the proxy: loopback only
    c.expect(
        agent.get("args", [])[: len(prefix)] == prefix,
        cw,
        f"args must start with {prefix}, got {agent.get('args')}",
    )
    c.expect("command" not in agent, cw, "command must stay the image's entrypoint (stepwatch)")
    env = {e["name"]: e for e in agent.get("env", [])}
    c.expect(
        env.get("NODE_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        == "spec.nodeName",
        cw,
        "NODE_NAME from fieldRef spec.nodeName",
    )
    # The GPUs come from the NVIDIA toolkit: NVIDIA_VISIBLE_DEVICES=all (envvar), or, with
    # nvidia.deviceListStrategy, /dev/null mounts under /var/run/nvidia-container-devices/
    # (volume-mounts) or a cdi.k8s.io/ pod annotation (cdi-annotations).
    requested = nvidia_devices_requested(ds)
    c.expect(
        requested == ["all"],
        cw,
        f"the NVIDIA toolkit must be asked for all GPUs by one means, got {requested}",
    )
    c.expect(
        env.get("NVIDIA_DRIVER_CAPABILITIES", {}).get("value") == "utility",
        cw,
        "NVIDIA_DRIVER_CAPABILITIES=utility",
    )
    serving = agent
    if metrics_proxy:
        proxies = [x for x in pod.get("containers", []) if x["name"] == "metrics-proxy"]
        c.expect(len(proxies) == 1, where, "a metrics-proxy container expected")
        serving = proxies[0] if proxies else {}
        pargs = serving.get("args", [])
        for arg in (
            "--secure-listen-address=0.0.0.0:19447",
            "--upstream=http://127.0.0.1:19448/",
            "--ignore-paths=/healthz,/readyz",
        ):
            c.expect(arg in pargs, f"{where} container metrics-proxy", f"{arg} expected in {pargs}")
        c.expect(not agent.get("ports"), cw, "behind the proxy the agent exposes no port")
    ports = {p["name"]: p for p in serving.get("ports", [])}
    c.expect(
        ports.get("metrics", {}).get("containerPort") == 19447,
        cw,
        "containerPort 19447 named metrics",
    )
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = agent.get(probe, {}).get("httpGet", {})
        if metrics_proxy:
            c.expect(
                get.get("path") == path
                and get.get("port") == 19447
                and get.get("scheme") == "HTTPS",
                cw,
                f"{probe} GET {path} on 19447 over HTTPS (through the proxy)",
            )
        else:
            c.expect(
                get.get("path") == path and get.get("port") in ("probes", "metrics", 19447),
                cw,
                f"{probe} GET {path} on the probes' port (or 19447)",
            )
    mounts = {m["mountPath"]: m for m in agent.get("volumeMounts", [])}
    c.expect(
        mounts.get("/run/stepwatch", {}).get("name") == sock[0]["name"] if sock else False,
        cw,
        "socket hostPath mounted at /run/stepwatch",
    )
    c.expect(
        not any(m.get("readOnly") for m in mounts.values() if m["mountPath"] == "/run/stepwatch"),
        cw,
        "socket dir must be writable",
    )
    sc = agent.get("securityContext", {})
    non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
    if allow_root:
        c.expect(
            sc.get("runAsUser", psc.get("runAsUser")) == 0,
            cw,
            "runAsRoot variant must run as UID 0",
        )
    else:
        c.expect(non_root is True, cw, "runAsNonRoot must be true")
        c.expect(sc.get("runAsUser", psc.get("runAsUser", 0)) != 0, cw, "runAsUser must not be 0")
    for ctr in pod.get("initContainers", []) + pod.get("containers", []):
        container_checks(c, f"{where} container {ctr['name']}", ctr, allow_root)
    labels = ds["spec"]["template"]["metadata"].get("labels", {})
    svc_ok = [
        s
        for s in services
        if all(labels.get(k) == v for k, v in s["spec"].get("selector", {}).items())
        and any(
            p.get("name") == "metrics" and p.get("port") == 19447
            for p in s["spec"].get("ports", [])
        )
    ]
    c.expect(svc_ok, where, "a Service with port 19447 named metrics selecting the agent pods")


def cmd_validate(args):
    c = Checker()
    objects = load(args.files)
    services = [o for o in objects if o["kind"] == "Service"]
    kinds = {}
    for obj in objects:
        kinds[obj["kind"]] = kinds.get(obj["kind"], 0) + 1
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            if obj["kind"] == "ServiceMonitor":
                check_service_monitor(c, obj, services)
            elif obj["kind"] == "PrometheusRule":
                check_prometheus_rule(c, obj, args.promtool)
            else:
                c.expect(False, name_of(obj), "unknown monitoring.coreos.com kind")
        else:
            validate_core(c, obj)
        if obj["kind"] == "DaemonSet":
            check_daemonset(c, obj, services, args.allow_root, args.metrics_proxy)
    for kind in args.require or []:
        c.expect(kind in kinds, "render", f"no {kind} object")
    for kind in args.forbid or []:
        c.expect(kind not in kinds, "render", f"unexpected {kind} object")
    return report_errors(
        c.errors,
        f"{len(objects)} objects ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}): "
        f"{c.checked - len(c.errors)}/{c.checked} checks ok",
        failed=not objects,
    )


def strip(obj):
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if k not in HELM_ONLY_LABELS}
    if isinstance(obj, list):
        return [strip(v) for v in obj]
    return obj


def cmd_compare(args):
    helm_objs = {(o["kind"], o["metadata"]["name"]): strip(o) for o in load([args.helm])}
    kust_objs = {
        (o["kind"], o["metadata"]["name"]): o
        for o in load([args.kustomize])
        if o["kind"] != "Namespace"
    }
    errors = []
    for key in sorted(set(helm_objs) | set(kust_objs)):
        if key not in kust_objs:
            errors.append(f"{key[0]}/{key[1]} only in the Helm render")
        elif key not in helm_objs:
            errors.append(f"{key[0]}/{key[1]} only in the kustomize build")
        elif helm_objs[key] != kust_objs[key]:
            errors.append(f"{key[0]}/{key[1]} differs between Helm and kustomize")
    return report_errors(
        errors,
        f"{len(helm_objs)} Helm objects, {len(kust_objs)} kustomize objects (Namespace aside): "
        + ("differ" if errors else "identical"),
        failed=not helm_objs,
    )


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate")
    v.add_argument("files", nargs="+")
    v.add_argument("--allow-root", action="store_true")
    v.add_argument(
        "--metrics-proxy", action="store_true", help="the render has metricsProxy.enabled"
    )
    v.add_argument("--promtool", default="promtool")
    v.add_argument("--require", action="append")
    v.add_argument("--forbid", action="append")
    cmp_ = sub.add_parser("compare")
    cmp_.add_argument("helm")
    cmp_.add_argument("kustomize")
    args = p.parse_args()
    return cmd_validate(args) if args.command == "validate" else cmd_compare(args)


if __name__ == "__main__":
    sys.exit(main())
