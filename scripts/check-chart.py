#!/usr/bin/env python3
"""Checks the Helm chart helm/agentvm without a cluster.

Lints it (Helm's own linter, strict), renders it with the default values,
with values-production.yaml and with every option on, validates each manifest
against the Kubernetes OpenAPI schemas of the oldest version the chart
supports and the newest bundled (strict: unknown fields are errors), and
insists on what the chart promises: every component with its Deployment,
Service, ServiceAccount, PodDisruptionBudget, NetworkPolicy (and HPA when
autoscaled); every container with liveness and readiness probes, resource
requests and limits, the restricted security context and emptyDirs for its
writable paths; the environment each component needs. And that no tenant
code runs in a runtime pod: the runtime's [runtime.sandbox] says provider =
"pool" with the chart's sandbox Service as the pool; the sandbox pods mount
no token and no Secret, take no Secret into their environment, carry none of
the components' labels, annotations or environment, have a NetworkPolicy of
their own (ingress from the runtimes only; egress to DNS and the internet,
never the cloud metadata range), and no component's NetworkPolicy admits
them. Values the chart must refuse are tried too (a runtime.sandbox.provider
other than pool among them). Prints every problem and exits 1 if there is any.

With `--avm PATH`, each rendered container's command line and environment
(secrets replaced by stand-ins, the runtime's ConfigMap as its AVM_CONFIG)
are also given to that `avm` binary with `--print-config`, which must accept
them: the chart and the binary agree on every variable and flag. `avm
sandbox` reads no configuration (and has no --print-config): it is started
with the rendered flags (on 127.0.0.1:0, its root in a scratch directory) and
must answer gRPC health, `ready` included, as the probes ask.

Needs `pip install helm-python-sdk kubernetes-validate pyyaml` (Helm's
renderer and linter as a library, and the schemas, offline).
"""

from __future__ import annotations

import argparse
import copy
import functools
import ipaddress
import os
import pathlib
import re
import select
import subprocess
import sys
import tempfile
import tomllib
import urllib.parse

import helm_python as helm
import kubernetes_validate
import kubernetes_validate.utils
import yaml

# kubernetes-validate parses its schema files (the definitions are megabytes)
# on every call; parsed once, the whole check takes seconds instead of half a
# minute. The parsed documents are only read.
kubernetes_validate.utils.schema_contents = functools.lru_cache(maxsize=None)(
    kubernetes_validate.utils.schema_contents
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "agentvm"
RELEASE, NAMESPACE = "avm", "agentvm"
FULLNAME = f"{RELEASE}-agentvm"
COMPONENTS = ["gateway", "auth", "resource", "session", "config", "observability", "runtime"]
STORAGE = {"auth", "resource", "session", "config", "observability"}
PEERS = ["auth", "resource", "session", "config", "observability", "runtime"]
SANDBOX = f"{FULLNAME}-sandbox"
SANDBOX_PORT = 7010
# The runtime's pool: the chart's headless sandbox Service.
POOL = [f"http://{SANDBOX}:{SANDBOX_PORT}"]
# What the sandbox pods' NetworkPolicy must keep commands from: the cloud
# metadata service (and the rest of the link-local range).
METADATA_RANGE = "169.254.0.0/16"
# Labels the release's namespace carries for certain (NetworkPolicy
# namespaceSelectors are evaluated against these).
NAMESPACE_LABELS = {"kubernetes.io/metadata.name": NAMESPACE}
# Custom resources: no schema is bundled, so only their shape is checked here.
CUSTOM_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1", "HTTPRoute": "gateway.networking.k8s.io/v1"}

# Everything the chart can switch on, over the production values.
EVERYTHING = {
    "image": {"digest": "sha256:" + "0" * 64},
    "database": {"url": "postgres://avm:secret@db:5432/agentvm", "existingSecret": ""},
    "redis": {"url": "redis://redis:6379/0", "existingSecret": ""},
    "llm": {"provider": "openai", "model": "gpt-4o-mini", "baseUrl": "http://llm:8000/v1",
            "apiKey": {"value": "sk-test", "existingSecret": ""}},
    "secrets": {"serviceKey": {"existingSecret": "mine", "existingSecretKey": "service-key"}},
    "otel": {"endpoint": "http://collector:4317"},
    "listenHost": "::",
    "networkPolicy": {"extraGrpcFrom": [{"namespaceSelector": {"matchLabels": {"team": "internal"}}}],
                      "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]},
    "httpRoute": {"enabled": True, "parentRefs": [{"name": "public", "namespace": "gateway-system"}],
                  "hostnames": ["agentvm.example.com"], "timeouts": {"request": "0s"}},
    "extraEnv": [{"name": "TZ", "value": "UTC"}],
    # Common pod settings the sandbox pods must not take (a webhook's secret
    # injection, a cloud identity).
    "podLabels": {"azure.workload.identity/use": "true"},
    "podAnnotations": {"vault.hashicorp.com/agent-inject": "true"},
    "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/agentvm"}},
    "sandbox": {
        "image": {"repository": "registry.example.com/agentvm-python", "tag": "0.1.0"},
        "isolate": True,
        "claimIdle": "15m",
        "expose": ["/opt/tools"],
        "runtimeClassName": "gvisor",
        "nodeSelector": {"agentvm/sandbox": "true"},
        "tolerations": [{"key": "agentvm/sandbox", "operator": "Exists", "effect": "NoSchedule"}],
        # A selector label among them is ignored: the pods stay sandbox pods.
        "podLabels": {"pool": "default", "app.kubernetes.io/component": "runtime"},
        "podAnnotations": {"note": "sandbox"},
        # isolate needs user namespaces, which RuntimeDefault refuses.
        "securityContext": {"seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/avm-userns.json"},
                            "readOnlyRootFilesystem": False, "capabilities": {"add": ["SYS_ADMIN"]}},
        "pdb": {"enabled": True, "minAvailable": 1},
        "networkPolicy": {
            "dnsTo": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                       "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
            "extraEgress": [{"to": [{"ipBlock": {"cidr": "10.20.30.40/32"}}], "ports": [{"port": 443, "protocol": "TCP"}]}],
        },
    },
    "runtime": {"autoscaling": {"customMetric": {"enabled": True}},
                "workspaceStore": {"url": "s3://bucket/prefix", "existingSecret": "aws"},
                "sandbox": {"isolate": True, "network": False, "expose": ["/opt/tools"]},
                "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                "extraConfig": "[runtime.fetch]\nallow = [\"wiki.internal\"]\n"},
    "gateway": {"pdb": {"enabled": True, "minAvailable": 2}},
}

# Values the chart must refuse, and a part of the reason it must give.
REFUSED = [
    ({"session": {"replicas": 2}}, "set database.url or database.existingSecret"),
    ({"runtime": {"autoscaling": {"enabled": True}}}, "set redis.url or redis.existingSecret"),
    ({"llm": {"apiKey": {"value": "a", "existingSecret": "b"}}}, "not both"),
    ({"gatway": {"replicas": 1}}, "gatway"),
    ({"auth": {"resources": {"limits": None}}}, "missing property 'limits'"),
    # No mode runs tenants' commands in a runtime pod.
    ({"runtime": {"sandbox": {"provider": "local"}}}, 'runtime.sandbox.provider is "local"'),
    ({"runtime": {"sandbox": {"provider": "process"}}}, 'runtime.sandbox.provider is "process"'),
    ({"runtime": {"sandbox": {"pool": ["http://elsewhere:7010"]}}}, "runtime.sandbox.pool is set by the chart"),
    ({"runtime": {"extraEnv": [{"name": "AVM_RUNTIME_SANDBOX", "value": '{provider="local"}'}]}},
     "would replace the runtime's [runtime.sandbox]"),
    ({"extraEnv": [{"name": "AVM_RUNTIME", "value": '{sandbox={provider="local"}}'}]},
     "would replace the runtime's [runtime.sandbox]"),
    ({"runtime": {"extraEnv": [{"name": "AVM_CONFIG", "value": "/tmp/mine.toml"}]}},
     "would replace the runtime's [runtime.sandbox]"),
    ({"runtime": {"extraConfig": "[runtime.sandbox]\nprovider = \"local\"\n"}}, "runtime.extraConfig has a [runtime.sandbox]"),
    ({"sandbox": {"replicas": -1}}, "replicas"),
]


def merge(base: dict, over: dict) -> dict:
    """Returns base with over merged into it, as Helm merges values files."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def kube_versions() -> list[str]:
    """Returns the oldest Kubernetes the chart supports and the newest with bundled schemas."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    oldest = re.search(r"(\d+\.\d+)", chart["kubeVersion"]).group(1) + ".0"
    return [oldest, kubernetes_validate.latest_version()]


class Check:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def expect(self, ok: bool, where: str, what: str) -> None:
        if not ok:
            self.problems.append(f"{where}: {what}")


def lint(check: Check, name: str, values: dict) -> None:
    report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE)
    for message in report.get("messages", []):
        # 1 is info (such as "icon is recommended"); warnings fail under strict.
        if message["severity"] >= 2:
            check.problems.append(f"{name}: helm lint: {message['path']}: {message['error']}")
    for error in report.get("errors") or []:
        check.problems.append(f"{name}: helm lint: {error}")


def render(values: dict) -> tuple[list[dict], str]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs, notes = [], ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs, notes


def validate_schemas(check: Check, name: str, docs: list[dict], versions: list[str]) -> None:
    for doc in docs:
        where = f"{name}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"
        if doc.get("kind") in CUSTOM_KINDS:
            check.expect(doc.get("apiVersion") == CUSTOM_KINDS[doc["kind"]], where, "unexpected apiVersion")
            check.expect(bool(doc.get("spec")), where, "no spec")
            continue
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                check.problems.append(f"{where}: invalid for Kubernetes {version}: {err.message} at {list(err.path)}")
            except kubernetes_validate.SchemaNotFoundError:
                check.problems.append(f"{where}: no schema in Kubernetes {version} for {doc.get('apiVersion')}")


def check_container(check: Check, where: str, component: str, pod: dict, container: dict) -> None:
    port = 8080 if component == "gateway" else 7000
    check.expect(container.get("args") == [component, "--listen", container["args"][-1]]
                 and container["args"][-1].endswith(f":{port}"), where, f"args are {container.get('args')}")
    # Probes: HTTP /health and /ready on the gateway, gRPC health elsewhere.
    for probe, path in (("livenessProbe", "/health"), ("readinessProbe", "/ready")):
        spec = container.get(probe)
        if not spec:
            check.problems.append(f"{where}: no {probe}")
            continue
        if component == "gateway":
            get = spec.get("httpGet", {})
            ok = get.get("path") == path and get.get("port") in ("http", 8080)
            check.expect(ok, where, f"{probe} is not GET {path} on 8080: {spec}")
        else:
            check.expect(spec.get("grpc", {}).get("port") == 7000, where, f"{probe} is not gRPC health on 7000: {spec}")
    # Resources: requests and limits of CPU and memory.
    resources = container.get("resources", {})
    for kind in ("requests", "limits"):
        for resource in ("cpu", "memory"):
            check.expect(resource in resources.get(kind, {}), where, f"no {resource} in resources.{kind}")
    # The restricted security context (pod-level settings count where Kubernetes inherits them).
    pod_sc, sc = pod.get("securityContext", {}), container.get("securityContext", {})
    check.expect(sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, where, "runAsNonRoot is not true")
    check.expect(sc.get("readOnlyRootFilesystem") is True, where, "readOnlyRootFilesystem is not true")
    check.expect(sc.get("allowPrivilegeEscalation") is False, where, "allowPrivilegeEscalation is not false")
    check.expect("ALL" in sc.get("capabilities", {}).get("drop", []), where, "capabilities do not drop ALL")
    seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
    check.expect(seccomp.get("type") == "RuntimeDefault", where, f"seccompProfile is {seccomp}")
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    check.expect(isinstance(uid, int) and uid > 0, where, f"runAsUser is {uid}")
    # Writable paths on a read-only root: emptyDirs.
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    for path in ("/var/lib/agentvm", "/tmp"):
        volume = volumes.get(mounts.get(path, ""), {})
        check.expect("emptyDir" in volume, where, f"{path} is not an emptyDir")


def check_env(check: Check, where: str, component: str, container: dict, values: dict, secrets: dict) -> None:
    env = {e["name"]: e for e in container.get("env", [])}
    has_database = bool(values["database"]["url"] or values["database"]["existingSecret"])
    has_redis = bool(values["redis"]["url"] or values["redis"]["existingSecret"])
    has_llm_key = bool(values["llm"]["apiKey"]["value"] or values["llm"]["apiKey"]["existingSecret"])
    wanted = {"AVM_AUTH_SERVICE_KEY", "AVM_SERVER_DATA_DIR"} | {f"AVM_{p.upper()}_ADDR" for p in PEERS}
    if component in STORAGE and has_database:
        wanted.add("AVM_DATABASE_URL")
    if component in ("gateway", "runtime"):
        wanted.add("AVM_REDIS_KEY_PREFIX")
        if has_redis:
            wanted.add("AVM_REDIS_URL")
    if component in ("config", "auth"):
        wanted.add("AVM_CONFIG_SECRET_KEY")
    if component == "config":
        if has_llm_key:
            wanted.add("LLM_API_KEY")
    if component == "runtime":
        wanted.add("AVM_CONFIG")
        if values["runtime"]["advertise"]:
            wanted |= {"POD_IP", "AVM_SERVER_ADVERTISE"}
        if values["runtime"]["workspaceStore"]["url"]:
            wanted.add("AVM_RUNTIME_WORKSPACE_STORE")
    if values["otel"]["endpoint"]:
        wanted |= {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME"}
    for name in sorted(wanted - env.keys()):
        check.problems.append(f"{where}: no {name} in the environment")
    # Secrets only where they are needed.
    check.expect(component in ("config", "auth") or "AVM_CONFIG_SECRET_KEY" not in env, where,
                 f"AVM_CONFIG_SECRET_KEY given to {component}")
    for name in ("LLM_API_KEY", "LLM_PROVIDER", "LLM_MODEL", "LLM_BASE_URL"):
        check.expect(component == "config" or name not in env, where, f"{name} given to {component}")
    check.expect(component in STORAGE or "AVM_DATABASE_URL" not in env, where, "AVM_DATABASE_URL given")
    for name, peer in (("AVM_AUTH_ADDR", "auth"), ("AVM_RUNTIME_ADDR", "runtime")):
        if name in env:
            check.expect(env[name].get("value") == f"http://{FULLNAME}-{peer}:7000", where, f"{name} is {env[name]}")
    if "AVM_SERVER_ADVERTISE" in env:
        check.expect(env["AVM_SERVER_ADVERTISE"].get("value") == "http://$(POD_IP):7000", where, "AVM_SERVER_ADVERTISE")
        check.expect(list(env).index("POD_IP") < list(env).index("AVM_SERVER_ADVERTISE"), where,
                     "POD_IP must come before AVM_SERVER_ADVERTISE, which refers to it")
    # Every secret the chart itself must provide is rendered, with the key.
    for name, variable in env.items():
        ref = variable.get("valueFrom", {}).get("secretKeyRef")
        if ref and ref["name"].startswith(FULLNAME + "-"):
            check.expect(ref["key"] in secrets.get(ref["name"], set()), where,
                         f"{name} names {ref['name']}/{ref['key']}, which the chart does not render")


def check_release(check: Check, name: str, values: dict, docs: list[dict], notes: str) -> None:
    merged = values
    by_kind: dict[tuple[str, str], dict] = {}
    for doc in docs:
        key = (doc["kind"], doc["metadata"]["name"])
        check.expect(key not in by_kind, name, f"{key} rendered twice")
        by_kind[key] = doc
    secrets = {n: set(d.get("data", {})) | set(d.get("stringData", {})) for (k, n), d in by_kind.items() if k == "Secret"}
    for component in COMPONENTS:
        full = f"{FULLNAME}-{component}"
        component_values = merged[component]
        kinds = ["Deployment", "Service", "ServiceAccount"]
        if component_values["pdb"]["enabled"]:
            kinds.append("PodDisruptionBudget")
        if merged["networkPolicy"]["enabled"]:
            kinds.append("NetworkPolicy")
        if component_values["autoscaling"]["enabled"]:
            kinds.append("HorizontalPodAutoscaler")
        for kind in kinds:
            check.expect((kind, full) in by_kind, name, f"no {kind} {full}")
        deployment = by_kind.get(("Deployment", full))
        if not deployment:
            continue
        pod = deployment["spec"]["template"]["spec"]
        check.expect(pod.get("enableServiceLinks") is False, f"{name}: {full}", "service links are on")
        check.expect(bool(pod.get("topologySpreadConstraints")) == merged["topologySpread"]["enabled"],
                     f"{name}: {full}", "topologySpreadConstraints")
        autoscaled = component_values["autoscaling"]["enabled"]
        check.expect(("replicas" in deployment["spec"]) != autoscaled, f"{name}: {full}",
                     "replicas must be set unless an HPA owns them")
        for container in pod.get("initContainers", []) + pod["containers"]:
            where = f"{name}: {full} container {container['name']}"
            check_container(check, where, component, pod, container)
            check_env(check, where, component, container, merged, secrets)
        hpa = by_kind.get(("HorizontalPodAutoscaler", full))
        if hpa:
            metrics = [m["type"] for m in hpa["spec"]["metrics"]]
            custom = component == "runtime" and component_values["autoscaling"]["customMetric"]["enabled"]
            check.expect(metrics == (["Resource", "Pods"] if custom else ["Resource"]), f"{name}: {full}",
                         f"HPA metrics are {metrics}")
    # The runtimes' headless Service, and the ConfigMap behind AVM_CONFIG.
    headless = by_kind.get(("Service", f"{FULLNAME}-runtime-headless"))
    check.expect(headless is not None and headless["spec"].get("clusterIP") == "None", name, "no headless runtime Service")
    check_runtime_config(check, name, merged, by_kind)
    check_sandbox(check, name, merged, by_kind)
    # Only the gateway is open to everyone.
    for (kind, object_name), doc in by_kind.items():
        if kind != "NetworkPolicy":
            continue
        open_rules = [rule for rule in doc["spec"].get("ingress", []) if not rule.get("from")]
        check.expect(not open_rules or object_name == f"{FULLNAME}-gateway", f"{name}: {object_name}",
                     "accepts traffic from anywhere")
    check.expect("created the operator tenant" in notes, name, "NOTES.txt does not say how to get the admin key")
    for kind, enabled in (("Ingress", "ingress"), ("HTTPRoute", "httpRoute"), ("ServiceMonitor", "serviceMonitor")):
        present = any(k == kind for k, _ in by_kind)
        check.expect(present == bool(merged[enabled]["enabled"]), name, f"{kind} rendered: {present}")


def runtime_sandbox(by_kind: dict) -> dict | None:
    """Returns [runtime.sandbox] of the runtime's rendered avm.toml, or None when it does not parse."""
    config = by_kind.get(("ConfigMap", f"{FULLNAME}-runtime"), {}).get("data", {}).get("avm.toml", "")
    try:
        return tomllib.loads(config).get("runtime", {}).get("sandbox", {})
    except tomllib.TOMLDecodeError:
        return None


def check_runtime_config(check: Check, name: str, values: dict, by_kind: dict) -> None:
    """The runtime runs no tenant command: [runtime.sandbox] sends them all to the chart's pool."""
    where = f"{name}: ConfigMap {FULLNAME}-runtime"
    sandbox = runtime_sandbox(by_kind)
    if sandbox is None:
        check.problems.append(f"{where}: avm.toml is not TOML")
        return
    check.expect(sandbox.get("provider") == "pool", where, f"[runtime.sandbox] provider is {sandbox.get('provider')!r}, not \"pool\"")
    check.expect(sandbox.get("pool") == POOL, where, f"[runtime.sandbox] pool is {sandbox.get('pool')!r}, not {POOL}")
    for address in sandbox.get("pool") or []:
        url = urllib.parse.urlsplit(address)
        check.expect(url.scheme == "http" and bool(url.hostname) and url.port is not None, where,
                     f"pool address {address!r} is not http://host:port")
    # Every other key of runtime.sandbox, as given.
    for key, value in values["runtime"].get("sandbox", {}).items():
        check.expect(sandbox.get(key) == value, where, f"[runtime.sandbox] {key} is {sandbox.get(key)!r}, not {value!r}")


def selects(selector: dict | None, labels: dict) -> bool:
    """Whether a LabelSelector matches labels (an empty or absent selector matches everything)."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def admits(peer: dict, labels: dict, cluster_ranges: list) -> bool:
    """Whether a NetworkPolicyPeer admits a pod of the release's namespace with these labels (whose address is in
    one of cluster_ranges)."""
    if "ipBlock" in peer:
        block = ipaddress.ip_network(peer["ipBlock"]["cidr"], strict=False)
        return any(block.version == r.version and block.overlaps(r) for r in cluster_ranges)
    if "namespaceSelector" in peer and not selects(peer["namespaceSelector"], NAMESPACE_LABELS):
        return False
    return selects(peer.get("podSelector"), labels)


def check_sandbox(check: Check, name: str, values: dict, by_kind: dict) -> None:
    """The sandbox tier: where tenants' commands run, with no secret and no way into the release."""
    sandbox = values["sandbox"]
    where = f"{name}: {SANDBOX}"
    kinds = ["Deployment", "Service"]
    if not sandbox["serviceAccountName"]:
        kinds.append("ServiceAccount")
    if sandbox["pdb"]["enabled"]:
        kinds.append("PodDisruptionBudget")
    if values["networkPolicy"]["enabled"]:
        kinds.append("NetworkPolicy")
    for kind in kinds:
        check.expect((kind, SANDBOX) in by_kind, name, f"no {kind} {SANDBOX}")
    deployment = by_kind.get(("Deployment", SANDBOX))
    if not deployment:
        return
    check.expect(deployment["spec"].get("replicas") == sandbox["replicas"], where,
                 f"replicas are {deployment['spec'].get('replicas')}, not {sandbox['replicas']}")
    template = deployment["spec"]["template"]
    pod, labels = template["spec"], template["metadata"].get("labels", {})
    selector = {"app.kubernetes.io/name": "agentvm", "app.kubernetes.io/instance": RELEASE,
                "app.kubernetes.io/component": "sandbox"}
    check.expect(all(labels.get(k) == v for k, v in selector.items()), where, f"pod labels are {labels}")
    check.expect(deployment["spec"]["selector"].get("matchLabels") == selector, where, "selector")
    # Nothing of the components': their labels and annotations may bring secrets or identities.
    annotations = template["metadata"].get("annotations", {})
    for key in values["podLabels"]:
        check.expect(key not in labels or key in sandbox["podLabels"], where, f"takes the common pod label {key}")
    for key in values["podAnnotations"]:
        check.expect(key not in annotations or key in sandbox["podAnnotations"], where,
                     f"takes the common pod annotation {key}")
    # No token, no Secret.
    check.expect(pod.get("automountServiceAccountToken") is False, where, "automountServiceAccountToken is not false")
    check.expect(pod.get("enableServiceLinks") is False, where, "service links are on")
    for volume in pod.get("volumes", []):
        check.expect(set(volume) == {"name", "emptyDir"}, where, f"volume {volume['name']} is not an emptyDir: {volume}")
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        check.expect(not pod.get(flag), where, f"{flag} is on")
    if sandbox["runtimeClassName"]:
        check.expect(pod.get("runtimeClassName") == sandbox["runtimeClassName"], where, "runtimeClassName")
    account = pod.get("serviceAccountName", "default")
    components = {f"{FULLNAME}-{c}" for c in COMPONENTS}
    check.expect(account not in components, where, f"uses the component ServiceAccount {account}")
    rendered = by_kind.get(("ServiceAccount", account))
    if rendered is not None:
        check.expect(rendered.get("automountServiceAccountToken") is False, where,
                     f"its ServiceAccount {account} automounts a token")
        check.expect(not rendered["metadata"].get("annotations"), where,
                     f"its ServiceAccount {account} has annotations {rendered['metadata'].get('annotations')}")
    else:
        check.expect(account == sandbox["serviceAccountName"] != "", where, f"its ServiceAccount {account} is not rendered")
    containers = pod.get("initContainers", []) + pod["containers"]
    check.expect(len(pod["containers"]) == 1, where, "not one container")
    pod_sc = pod.get("securityContext", {})
    for container in containers:
        at = f"{where} container {container['name']}"
        for variable in container.get("env", []):
            ref = variable.get("valueFrom", {})
            check.expect("secretKeyRef" not in ref, at, f"{variable['name']} comes from a Secret")
            check.expect(not variable["name"].startswith("AVM_") or variable["name"].startswith("AVM_SANDBOX_"), at,
                         f"{variable['name']} in the environment")
        check.expect(not any("secretRef" in source for source in container.get("envFrom", [])), at, "envFrom a Secret")
        check.expect(not container.get("envFrom"), at, "envFrom")
        args = container.get("args", [])
        check.expect(args[:2] == ["sandbox", "--listen"] and len(args) > 2 and args[2].endswith(f":{SANDBOX_PORT}")
                     and args[3:5] == ["--root", "/workspaces"], at, f"args are {args}")
        check.expect(("--no-isolate" in args) != sandbox["isolate"], at, f"--no-isolate with isolate {sandbox['isolate']}")
        check.expect("--claim-idle" in args and args[args.index("--claim-idle") + 1] == sandbox["claimIdle"], at,
                     "--claim-idle")
        check.expect("--token-key" not in args, at, "--token-key: a pool's sandbox learns its runtime's key when claimed")
        ports = [(p.get("name"), p.get("containerPort")) for p in container.get("ports", [])]
        check.expect(ports == [("grpc", SANDBOX_PORT)], at, f"ports are {ports}")
        for probe, service in (("startupProbe", None), ("livenessProbe", None), ("readinessProbe", "ready")):
            grpc = container.get(probe, {}).get("grpc", {})
            check.expect(grpc.get("port") == SANDBOX_PORT and grpc.get("service") == service, at,
                         f"{probe} is not gRPC health{' of ' + service if service else ''} on {SANDBOX_PORT}")
        resources = container.get("resources", {})
        for kind in ("requests", "limits"):
            for resource in ("cpu", "memory"):
                check.expect(resource in resources.get(kind, {}), at, f"no {resource} in resources.{kind}")
        sc = container.get("securityContext", {})
        check.expect(sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, at, "runAsNonRoot is not true")
        check.expect(sc.get("readOnlyRootFilesystem") is True, at, "readOnlyRootFilesystem is not true")
        check.expect(sc.get("allowPrivilegeEscalation") is False, at, "allowPrivilegeEscalation is not false")
        check.expect(not sc.get("privileged"), at, "privileged")
        check.expect(sc.get("capabilities") == {"drop": ["ALL"]}, at, f"capabilities are {sc.get('capabilities')}")
        uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
        check.expect(isinstance(uid, int) and uid > 0, at, f"runAsUser is {uid}")
        # RuntimeDefault, unless the values give a profile that allows what isolate needs.
        wanted = (sandbox["securityContext"].get("seccompProfile") or sandbox["podSecurityContext"].get("seccompProfile")
                  or {"type": "RuntimeDefault"})
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
        check.expect(seccomp == wanted, at, f"seccompProfile is {seccomp}, not {wanted}")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        for path in ("/workspaces", "/tmp"):
            check.expect("emptyDir" in volumes.get(mounts.get(path, ""), {}), at, f"{path} is not an emptyDir")
    # Found through its headless Service, ready pods only.
    service = by_kind.get(("Service", SANDBOX), {}).get("spec", {})
    check.expect(service.get("clusterIP") == "None" and service.get("publishNotReadyAddresses") is False, where,
                 "the Service is not headless of ready pods")
    check.expect([(p.get("name"), p.get("port")) for p in service.get("ports", [])] == [("grpc", SANDBOX_PORT)], where,
                 "the Service's ports")
    check.expect(service.get("selector") == selector, where, "the Service's selector")
    if not values["networkPolicy"]["enabled"]:
        return
    # Its NetworkPolicy: only the runtimes in; DNS and the internet out.
    denied = [ipaddress.ip_network(c) for c in sandbox["networkPolicy"]["deniedCidrs"]]
    policy = by_kind.get(("NetworkPolicy", SANDBOX), {}).get("spec", {})
    check.expect(policy.get("podSelector", {}).get("matchLabels") == selector, where, "the NetworkPolicy's podSelector")
    check.expect(sorted(policy.get("policyTypes", [])) == ["Egress", "Ingress"], where,
                 f"NetworkPolicy policyTypes are {policy.get('policyTypes')}")
    runtime = dict(selector, **{"app.kubernetes.io/component": "runtime"})
    for rule in policy.get("ingress", []):
        peers = rule.get("from") or [{}]
        check.expect(all(set(p) == {"podSelector"} and p["podSelector"] == {"matchLabels": runtime} for p in peers),
                     where, f"NetworkPolicy ingress admits more than the runtimes: {rule}")
        check.expect([p.get("port") for p in rule.get("ports", [])] in (["grpc"], [SANDBOX_PORT]), where,
                     f"NetworkPolicy ingress ports {rule.get('ports')}")
    extra = sandbox["networkPolicy"]["extraEgress"]
    egress = [rule for rule in policy.get("egress", []) if rule not in extra]
    metadata = ipaddress.ip_network(METADATA_RANGE)
    wide = 0
    for rule in egress:
        if not rule.get("to"):
            check.expect(sorted(p.get("port") for p in rule.get("ports", [])) == [53, 53], where,
                         f"NetworkPolicy egress to anywhere beyond DNS: {rule}")
            continue
        for peer in rule["to"]:
            if "ipBlock" not in peer:
                continue
            block = ipaddress.ip_network(peer["ipBlock"]["cidr"])
            excepted = [ipaddress.ip_network(c) for c in peer["ipBlock"].get("except", [])]
            if block.prefixlen == 0:
                wide += 1
                for cidr in (c for c in denied if c.version == block.version):
                    check.expect(cidr in excepted, where, f"NetworkPolicy egress to {block} does not except {cidr}")
            if block.version == 4 and block.overlaps(metadata):
                check.expect(any(metadata.subnet_of(e) for e in excepted), where,
                             f"NetworkPolicy egress to {block} does not except {METADATA_RANGE}")
    check.expect(wide == 2, where, "NetworkPolicy egress is not to 0.0.0.0/0 and ::/0")
    # No component's NetworkPolicy admits the sandbox pods (the gateway's open
    # port aside: the sandbox's egress keeps its pods off the cluster's addresses).
    for (kind, object_name), doc in by_kind.items():
        if kind != "NetworkPolicy" or object_name == SANDBOX:
            continue
        for rule in doc["spec"].get("ingress", []):
            if not rule.get("from"):
                check.expect(object_name == f"{FULLNAME}-gateway", f"{name}: {object_name}", "admits the sandbox pods")
                continue
            for peer in rule["from"]:
                check.expect(not admits(peer, labels, denied), f"{name}: {object_name}",
                             f"ingress admits the sandbox pods: {peer}")


# Stand-ins for what Secrets hold, shaped as the binary expects them.
STAND_INS = {
    "AVM_DATABASE_URL": "postgres://avm:secret@127.0.0.1:1/agentvm",
    "AVM_REDIS_URL": "redis://127.0.0.1:1/0",
    "LLM_API_KEY": "sk-stand-in",
}


def check_sandbox_binary(check: Check, where: str, avm: str, container: dict) -> None:
    """Starts `avm sandbox` with a container's flags (its own address and root
    replaced) and asks it the probes' gRPC health questions."""
    args = list(container["args"])
    with tempfile.TemporaryDirectory() as scratch:
        if "--listen" in args:
            args[args.index("--listen") + 1] = "127.0.0.1:0"
        if "--root" in args:
            at = args.index("--root") + 1
            args[at] = str(pathlib.Path(scratch, args[at].lstrip("/")))
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": scratch, "TMPDIR": scratch}
        for variable in container.get("env", []):
            env[variable["name"]] = variable.get("value", "")
        log = pathlib.Path(scratch, "stderr")
        with log.open("w") as stderr:
            process = subprocess.Popen([avm, *args], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=stderr, text=True)
        try:
            # It says where it listens once it does (within seconds).
            started, _, _ = select.select([process.stdout], [], [], 30)
            line = process.stdout.readline() if started and process.stdout else ""
            address = line.strip().removeprefix("listening: grpc ") if line.startswith("listening: grpc ") else None
            if address is None:
                process.kill()
                process.communicate(timeout=30)
                check.problems.append(f"{where}: avm sandbox does not start with {args}: {line.strip()} "
                                      f"{log.read_text().strip()}")
                return
            for service in ([], ["--service", "ready"]):
                health = subprocess.run([avm, "health", "--grpc", address, *service], env=env, capture_output=True,
                                        text=True, timeout=30)
                check.expect(health.returncode == 0, where,
                             f"avm sandbox does not answer gRPC health {service}: {health.stderr.strip()}")
            process.terminate()
            process.communicate(timeout=30)
            check.expect(process.returncode == 0, where, f"avm sandbox did not stop cleanly: {log.read_text().strip()}")
        finally:
            if process.poll() is None:
                process.kill()
                process.communicate()


def check_binary(check: Check, name: str, avm: str, docs: list[dict]) -> None:
    """Runs `avm <args> --print-config` with each container's environment
    (`avm sandbox`: starts it and asks its health)."""
    configs = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    for doc in docs:
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        for container in pod["containers"]:
            where = f"{name}: {doc['metadata']['name']} container {container['name']}"
            if container["args"][0] == "sandbox":
                check_sandbox_binary(check, where, avm, container)
                continue
            with tempfile.TemporaryDirectory() as scratch:
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": scratch}
                mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
                for volume in pod.get("volumes", []):
                    if "configMap" in volume and volume["name"] in mounts:
                        # The ConfigMap's files, where the container would see them.
                        directory = pathlib.Path(scratch, mounts[volume["name"]].lstrip("/"))
                        directory.mkdir(parents=True)
                        for file, text in configs[volume["configMap"]["name"]].items():
                            (directory / file).write_text(text)
                for variable in container.get("env", []):
                    source = variable.get("valueFrom", {})
                    if "value" in variable:
                        # $(VAR) refers to a variable defined before, as Kubernetes expands it.
                        value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), variable["value"])
                    elif "fieldRef" in source:
                        value = "10.0.0.7"
                    else:
                        value = STAND_INS.get(variable["name"], "k" * 64)
                    env[variable["name"]] = value
                for key in ("AVM_CONFIG", "AVM_SERVER_DATA_DIR"):
                    if key in env:
                        env[key] = str(pathlib.Path(scratch, env[key].lstrip("/")))
                run = subprocess.run([avm, *container["args"], "--print-config"], env=env, capture_output=True,
                                     text=True, timeout=30)
            if run.returncode != 0:
                check.problems.append(f"{where}: avm refuses its configuration: {run.stderr.strip()}")
                continue
            printed = run.stdout
            check.expect(f'listen = "{container["args"][-1]}"' in printed, where, "avm does not show the --listen address")
            if container["name"] == "runtime":
                # What the ConfigMap says of [runtime.sandbox] is what the runtime runs with: the pool.
                config = tomllib.loads(configs[f"{FULLNAME}-runtime"]["avm.toml"])["runtime"]["sandbox"]
                effective = tomllib.loads(printed).get("runtime", {}).get("sandbox", {})
                check.expect(effective.get("provider") == "pool" and effective.get("pool") == POOL, where,
                             f"avm runs with provider {effective.get('provider')!r}, pool {effective.get('pool')!r}")
                for key, value in config.items():
                    check.expect(effective.get(key) == value, where,
                                 f"avm does not read [runtime.sandbox] {key} from AVM_CONFIG")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--avm", help="an avm binary that must accept every container's configuration")
    args = parser.parse_args()
    check = Check()
    versions = kube_versions()
    production = yaml.safe_load((CHART / "values-production.yaml").read_text())
    cases = {
        "default": {},
        "production": production,
        "everything": merge(production, EVERYTHING),
    }
    with helm.Chart.load(str(CHART)) as chart:
        defaults = chart.values
    counts = []
    for name, values in cases.items():
        lint(check, name, values)
        try:
            docs, notes = render(values)
        except (helm.HelmError, yaml.YAMLError) as err:
            check.problems.append(f"{name}: does not render: {err}")
            continue
        validate_schemas(check, name, docs, versions)
        check_release(check, name, merge(defaults, values), docs, notes)
        if args.avm:
            check_binary(check, name, args.avm, docs)
        counts.append(f"{name} {len(docs)}")
    for values, reason in REFUSED:
        try:
            render(values)
            check.problems.append(f"values {values} were accepted; the chart must refuse them")
        except helm.HelmError as err:
            check.expect(reason in str(err), f"values {values}", f"refused, but not saying {reason!r}: {err}")
    if check.problems:
        print(f"chart check: {len(check.problems)} problem(s):", file=sys.stderr)
        for problem in check.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"chart check: ok (manifests: {', '.join(counts)}; Kubernetes {' and '.join(versions)} schemas; "
          f"{len(REFUSED)} bad value sets refused{'; avm accepts every configuration' if args.avm else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
