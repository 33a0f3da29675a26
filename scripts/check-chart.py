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
code runs in a runtime pod, in either sandbox mode: the runtime's
[runtime.sandbox] says provider = "pool" with the chart's sandbox Service as
the pool (and, for python or node given sandbox.environments.<name>.replicas,
exactly their pools' Services as [runtime.sandbox] pools, no pools key
without one), or provider = "kubernetes" with [runtime.sandbox.kubernetes]
naming the chart's SandboxWarmPools (agent-sandbox v0.5.6,
extensions.agents.x-k8s.io/v1beta1), each referring to a rendered
SandboxTemplate; never local or process. Each pool's Service and PDB (and
an environment's Deployment) selects its own pool's pods only, by the
agentvm.io/environment label; the shell pool's Deployment keeps the
selector it has always had (immutable). The sandbox pods (the pools'
Deployments or the SandboxTemplates' pods, whose pod spec is validated as a
Pod; an environment's own image given `avm` by the init container that
copies it) mount no token and no Secret, take no Secret into their environment,
carry none of the components' labels, annotations or environment, run
hardened (read-only root, no capabilities, RuntimeDefault seccomp) under
sandbox.runtimeClassName when set, have a NetworkPolicy of their own
(ingress from the runtimes only; egress to DNS and the internet, never the
cloud metadata range nor networkPolicy.kubernetesApi), and no component's
NetworkPolicy admits them. Only the runtime's pods mount a ServiceAccount
token, and only in kubernetes mode, where its Role grants exactly create,
get and delete on sandboxclaims, bound to the runtime's ServiceAccount
alone. Values the chart must refuse are tried too (a provider other than
pool or kubernetes among them). Prints every problem and exits 1 if there
is any.

With `--avm PATH`, each rendered container's command line and environment
(secrets replaced by stand-ins, the runtime's ConfigMap as its AVM_CONFIG)
are also given to that `avm` binary with `--print-config`, which must accept
them: the chart and the binary agree on every variable and flag, the
[runtime.sandbox.kubernetes] table included. `avm sandbox` reads no
configuration (and has no --print-config): it is started with the rendered
flags of each sandbox pod, the pool's and the SandboxTemplates' (on
127.0.0.1:0, its root in a scratch directory) and must answer gRPC health,
`ready` included, as the probes ask.

Needs `pip install helm-python-sdk kubernetes-validate pyyaml` (Helm's
renderer and linter as a library, and the schemas, offline).
"""

from __future__ import annotations

import argparse
import copy
import functools
import ipaddress
import json
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
# agent-sandbox (v0.5.6): the kubernetes mode's SandboxTemplates and
# SandboxWarmPools, and the claims the runtime may make.
AGENT_SANDBOX = "extensions.agents.x-k8s.io/v1beta1"
ENVIRONMENTS = ["shell", "python", "node"]
# Pool mode: the environments that may have a pool of their own
# (sandbox.environments.<name>.replicas), and the label telling the pools' pods apart.
POOL_ENVIRONMENTS = ["python", "node"]
ENVIRONMENT_LABEL = "agentvm.io/environment"
# The runtime's Role in kubernetes mode, exactly.
CLAIM_RULES = [{"apiGroups": ["extensions.agents.x-k8s.io"], "resources": ["sandboxclaims"],
                "verbs": ["create", "get", "delete"]}]
# Custom resources: no schema is bundled, so only their shape is checked here
# (a SandboxTemplate's pod is validated as a Pod).
CUSTOM_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1", "HTTPRoute": "gateway.networking.k8s.io/v1",
                "SandboxTemplate": AGENT_SANDBOX, "SandboxWarmPool": AGENT_SANDBOX}

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
    "networkPolicy": {"kubernetesApi": ["203.0.113.10/32", "2001:db8::10/128"],
                      "extraGrpcFrom": [{"namespaceSelector": {"matchLabels": {"team": "internal"}}}],
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
        "environments": {"python": {"image": {"repository": "registry.example.com/python",
                                              "digest": "sha256:" + "1" * 64}, "warm": 3},
                         "node": {"image": {"repository": "registry.example.com/node", "tag": ""}, "warm": 0}},
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
    # Only the two modes whose sandboxes are pods of their own.
    ({"sandbox": {"provider": "local"}}, "value must be one of 'pool', 'kubernetes'"),
    ({"sandbox": {"provider": "process"}}, "value must be one of 'pool', 'kubernetes'"),
    ({"sandbox": {"provider": "agent-sandbox"}}, "value must be one of 'pool', 'kubernetes'"),
    ({"sandbox": {"provider": "kubernetes"}, "runtime": {"sandbox": {"provider": "local"}}},
     'runtime.sandbox.provider is "local"'),
    ({"sandbox": {"provider": "kubernetes"}, "runtime": {"sandbox": {"provider": "pool"}}},
     'runtime.sandbox.provider is "pool"'),
    ({"runtime": {"sandbox": {"kubernetes": {"namespace": "elsewhere"}}}}, "runtime.sandbox.kubernetes is set by the chart"),
    ({"runtime": {"extraConfig": "[runtime.sandbox.kubernetes]\nkubeconfig = \"/tmp/k\"\n"}},
     "runtime.extraConfig has a [runtime.sandbox]"),
    ({"sandbox": {"environments": {"ruby": {"image": {}, "warm": 1}}}}, "additional properties 'ruby' not allowed"),
    ({"sandbox": {"environments": {"python": {"warm": -1}}}}, "/sandbox/environments/python/warm"),
    # Pools of their own: python and node only (shell's is sandbox.replicas), and never set by hand.
    ({"sandbox": {"environments": {"python": {"replicas": -1}}}}, "/sandbox/environments/python/replicas"),
    ({"sandbox": {"environments": {"node": {"replicas": "two"}}}}, "/sandbox/environments/node/replicas"),
    ({"sandbox": {"environments": {"shell": {"replicas": 1}}}}, "additional properties 'replicas' not allowed"),
    ({"runtime": {"sandbox": {"pools": {"python": ["http://elsewhere:7010"]}}}},
     "runtime.sandbox.pools is set by the chart"),
    ({"sandbox": {"runtimeClassName": "g Visor"}}, "/sandbox/runtimeClassName"),
    ({"networkPolicy": {"kubernetesApi": ["kubernetes.default"]}}, "/networkPolicy/kubernetesApi/0"),
    # The Role that claims sandboxes goes to the runtime's own ServiceAccount only.
    ({"sandbox": {"provider": "kubernetes"}, "serviceAccount": {"create": False}}, 'not "default"'),
    ({"sandbox": {"provider": "kubernetes", "serviceAccountName": f"{FULLNAME}-runtime"}},
     "the sandbox pods, where tenants' commands run, need one of their own"),
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


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML whose mappings name each key once: a key given twice (a sandbox.podLabels key the chart sets as well)
    is an error, not the last one winning quietly."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def render(values: dict) -> tuple[list[dict], str]:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    docs, notes = [], ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        docs.extend(doc for doc in yaml.load_all(text, Loader=UniqueKeyLoader) if doc)
    return docs, notes


def validate_schemas(check: Check, name: str, docs: list[dict], versions: list[str]) -> None:
    for doc in docs:
        where = f"{name}: {doc.get('kind')} {doc.get('metadata', {}).get('name')}"
        if doc.get("kind") in CUSTOM_KINDS:
            check.expect(doc.get("apiVersion") == CUSTOM_KINDS[doc["kind"]], where, "unexpected apiVersion")
            check.expect(bool(doc.get("spec")), where, "no spec")
            if doc.get("kind") != "SandboxTemplate":
                continue
            # Its pod, as the controller will make it.
            template = doc.get("spec", {}).get("podTemplate", {})
            doc = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": doc["metadata"]["name"], **template.get("metadata", {})},
                   "spec": template.get("spec", {})}
            where += " podTemplate"
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
    check_tokens(check, name, merged, by_kind)
    check_rbac(check, name, merged, by_kind)
    # Only the gateway is open to everyone.
    for (kind, object_name), doc in by_kind.items():
        if kind != "NetworkPolicy":
            continue
        open_rules = [rule for rule in doc["spec"].get("ingress", []) if not rule.get("from")]
        check.expect(not open_rules or object_name == f"{FULLNAME}-gateway", f"{name}: {object_name}",
                     "accepts traffic from anywhere")
    check.expect("created the operator tenant" in notes, name, "NOTES.txt does not say how to get the admin key")
    if merged["sandbox"]["provider"] == "kubernetes":
        check.expect("agent-sandbox v0.5.6" in notes and "extensions" in notes, name,
                     "NOTES.txt does not say agent-sandbox v0.5.6 with its extensions must be installed")
        check.expect(re.search(r"create, get and\s+delete sandboxclaims", notes) is not None, name,
                     "NOTES.txt does not say what the runtime's Role may do")
    for kind, enabled in (("Ingress", "ingress"), ("HTTPRoute", "httpRoute"), ("ServiceMonitor", "serviceMonitor")):
        present = any(k == kind for k, _ in by_kind)
        check.expect(present == bool(merged[enabled]["enabled"]), name, f"{kind} rendered: {present}")


def own_pools(values: dict) -> list[str]:
    """Pool mode: the environments given a pool of their own (replicas above 0), in the chart's order."""
    if values["sandbox"]["provider"] != "pool":
        return []
    return [e for e in POOL_ENVIRONMENTS if (values["sandbox"]["environments"][e].get("replicas") or 0) > 0]


def pool_name(environment: str | None) -> str:
    """A pool's Deployment, Service and PDB: the shell pool's (None) or an environment's own."""
    return f"{SANDBOX}-{environment}" if environment else SANDBOX


def runtime_sandbox(by_kind: dict) -> dict | None:
    """Returns [runtime.sandbox] of the runtime's rendered avm.toml, or None when it does not parse."""
    config = by_kind.get(("ConfigMap", f"{FULLNAME}-runtime"), {}).get("data", {}).get("avm.toml", "")
    try:
        return tomllib.loads(config).get("runtime", {}).get("sandbox", {})
    except tomllib.TOMLDecodeError:
        return None


def check_runtime_config(check: Check, name: str, values: dict, by_kind: dict) -> None:
    """The runtime runs no tenant command: [runtime.sandbox] sends them all to sandbox pods, the chart's pool or
    the pods claimed from its warm pools."""
    where = f"{name}: ConfigMap {FULLNAME}-runtime"
    sandbox = runtime_sandbox(by_kind)
    if sandbox is None:
        check.problems.append(f"{where}: avm.toml is not TOML")
        return
    provider = values["sandbox"]["provider"]
    check.expect(sandbox.get("provider") in ("pool", "kubernetes"), where,
                 f"[runtime.sandbox] provider is {sandbox.get('provider')!r}: tenants' commands would run in a runtime pod")
    check.expect(sandbox.get("provider") == provider, where,
                 f"[runtime.sandbox] provider is {sandbox.get('provider')!r}, not sandbox.provider {provider!r}")
    if provider == "pool":
        check.expect(sandbox.get("pool") == POOL, where, f"[runtime.sandbox] pool is {sandbox.get('pool')!r}, not {POOL}")
        check.expect("kubernetes" not in sandbox, where, "[runtime.sandbox.kubernetes] in pool mode")
        # Exactly the environments given a pool of their own, each naming its pool's headless Service on the
        # sandbox port; no pools key at all without one.
        wanted_pools = {e: [f"http://{pool_name(e)}:{SANDBOX_PORT}"] for e in own_pools(values)}
        if wanted_pools:
            check.expect(sandbox.get("pools") == wanted_pools, where,
                         f"[runtime.sandbox] pools is {sandbox.get('pools')!r}, not {wanted_pools!r}")
        else:
            check.expect("pools" not in sandbox, where,
                         f"[runtime.sandbox] pools is {sandbox.get('pools')!r} with no environment given replicas")
        for environment, addresses in (sandbox.get("pools") or {}).items():
            check.expect(environment in POOL_ENVIRONMENTS, where, f"pools.{environment}: not python or node")
            for address in addresses:
                url = urllib.parse.urlsplit(address)
                service = by_kind.get(("Service", url.hostname or ""), {}).get("spec", {})
                check.expect(url.scheme == "http" and url.port == SANDBOX_PORT
                             and [(p.get("name"), p.get("port")) for p in service.get("ports", [])]
                             == [("grpc", SANDBOX_PORT)], where,
                             f"pools.{environment} names {address!r}, not a rendered Service on {SANDBOX_PORT}")
    else:
        check.expect("pool" not in sandbox, where, "[runtime.sandbox] pool in kubernetes mode")
        check.expect("pools" not in sandbox, where, "[runtime.sandbox] pools in kubernetes mode")
        # The pod's own namespace and service account: no namespace, no kubeconfig.
        wanted = {"port": SANDBOX_PORT, "warm_pools": {e: f"{SANDBOX}-{e}" for e in ENVIRONMENTS}}
        check.expect(sandbox.get("kubernetes") == wanted, where,
                     f"[runtime.sandbox.kubernetes] is {sandbox.get('kubernetes')!r}, not {wanted!r}")
        for environment, pool in (sandbox.get("kubernetes") or {}).get("warm_pools", {}).items():
            check.expect(("SandboxWarmPool", pool) in by_kind, where,
                         f"warm_pools.{environment} names {pool}, which the chart does not render")
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


def chart_image(values: dict, image: dict | None = None, default_tag: str | None = None) -> str:
    """Returns an image reference as the chart makes it: image (with default_tag when it has none), or the
    chart's own when image names no repository."""
    if not image or not image.get("repository"):
        image, default_tag = values["image"], yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    if image.get("digest"):
        return f"{image['repository']}@{image['digest']}"
    tag = image.get("tag") or default_tag
    return f"{image['repository']}:{tag}" if tag else image["repository"]


def sandbox_pods(by_kind: dict) -> list[tuple[str, dict]]:
    """Returns every sandbox pod template the release renders: the pool's and the SandboxTemplates'."""
    pods = []
    pools = {pool_name(e) for e in [None, *POOL_ENVIRONMENTS]}
    for (kind, object_name), doc in by_kind.items():
        if kind == "Deployment" and object_name in pools:
            pods.append((object_name, doc["spec"]["template"]))
        elif kind == "SandboxTemplate":
            pods.append((object_name, doc["spec"].get("podTemplate", {})))
    return pods


def pod_specs(by_kind: dict) -> list[tuple[str, str, dict]]:
    """Returns (kind, name, pod spec) of everything rendered that makes pods."""
    specs = []
    for (kind, object_name), doc in by_kind.items():
        if kind == "Deployment":
            specs.append((kind, object_name, doc["spec"]["template"]["spec"]))
        elif kind == "SandboxTemplate":
            specs.append((kind, object_name, doc["spec"].get("podTemplate", {}).get("spec", {})))
    return specs


def check_sandbox(check: Check, name: str, values: dict, by_kind: dict) -> None:
    """The sandbox tier: where tenants' commands run, with no secret and no way into the release."""
    sandbox = values["sandbox"]
    provider = sandbox["provider"]
    where = f"{name}: {SANDBOX}"
    kinds = []
    if not sandbox["serviceAccountName"]:
        kinds.append("ServiceAccount")
    if values["networkPolicy"]["enabled"]:
        kinds.append("NetworkPolicy")
    pool_kinds = ["Deployment", "Service"] + (["PodDisruptionBudget"] if sandbox["pdb"]["enabled"] else [])
    if provider == "pool":
        kinds += pool_kinds
    else:
        for kind in pool_kinds:
            check.expect((kind, SANDBOX) not in by_kind, name, f"{kind} {SANDBOX} rendered in {provider} mode")
    for kind in kinds:
        check.expect((kind, SANDBOX) in by_kind, name, f"no {kind} {SANDBOX}")
    selector = {"app.kubernetes.io/name": "agentvm", "app.kubernetes.io/instance": RELEASE,
                "app.kubernetes.io/component": "sandbox"}
    check_pools(check, name, values, by_kind, selector)
    if provider == "pool":
        check.expect(not any(k in ("SandboxTemplate", "SandboxWarmPool") for k, _ in by_kind), where,
                     "agent-sandbox objects rendered in pool mode")
    else:
        check_sandbox_templates(check, name, values, by_kind, selector)
    pods = sandbox_pods(by_kind)
    check.expect(bool(pods), where, "no sandbox pod is rendered")
    if not values["networkPolicy"]["enabled"]:
        return
    # Its NetworkPolicy: only the runtimes in; DNS and the internet out.
    denied = [ipaddress.ip_network(c) for c in sandbox["networkPolicy"]["deniedCidrs"]]
    api_server = [ipaddress.ip_network(c) for c in values["networkPolicy"]["kubernetesApi"]]
    policy = by_kind.get(("NetworkPolicy", SANDBOX), {}).get("spec", {})
    check.expect(policy.get("podSelector", {}).get("matchLabels") == selector, where, "the NetworkPolicy's podSelector")
    for object_name, template in pods:
        check.expect(selects(policy.get("podSelector"), template.get("metadata", {}).get("labels", {})), where,
                     f"the NetworkPolicy does not select the pods of {object_name}")
    check.expect(sorted(policy.get("policyTypes", [])) == ["Egress", "Ingress"], where,
                 f"NetworkPolicy policyTypes are {policy.get('policyTypes')}")
    runtime = dict(selector, **{"app.kubernetes.io/component": "runtime"})
    for rule in policy.get("ingress", []):
        peers = rule.get("from") or [{}]
        check.expect(all(set(p) == {"podSelector"} and p["podSelector"] == {"matchLabels": runtime} for p in peers),
                     where, f"NetworkPolicy ingress admits more than the runtimes: {rule}")
        check.expect([p.get("port") for p in rule.get("ports", [])] in (["grpc"], [SANDBOX_PORT]), where,
                     f"NetworkPolicy ingress ports {rule.get('ports')}")
    # The runtimes do get in (on the sandbox's gRPC port), and out to them and, in kubernetes mode, to the API server.
    check.expect(any(any(admits(p, runtime, []) for p in rule.get("from") or [{}]) for rule in policy.get("ingress", [])),
                 where, "NetworkPolicy ingress does not admit the runtimes")
    # To every pool's pods (an environment's own among them) and every SandboxTemplate's.
    for object_name, template in pods:
        check.expect(egress_allowed(by_kind, runtime, SANDBOX_PORT, labels=template.get("metadata", {}).get("labels", {})),
                     where, f"the runtimes' egress to the pods of {object_name} on port {SANDBOX_PORT} is not allowed")
    if provider == "kubernetes":
        for network in api_server or [ipaddress.ip_network("10.96.0.1/32")]:
            for port in (443, 6443):
                check.expect(egress_allowed(by_kind, runtime, port, address=network.network_address), where,
                             f"the runtimes' egress to the Kubernetes API server {network}:{port} is not allowed")
    for network in api_server:
        for object_name, template in pods:
            check.expect(not egress_allowed(by_kind, template.get("metadata", {}).get("labels", {}), 443,
                                            address=network.network_address), where,
                         f"the pods of {object_name} may reach the Kubernetes API server {network}")
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
                for cidr in (c for c in denied + api_server if c.version == block.version):
                    check.expect(cidr in excepted, where, f"NetworkPolicy egress to {block} does not except {cidr}")
            if block.version == 4 and block.overlaps(metadata):
                check.expect(any(metadata.subnet_of(e) for e in excepted), where,
                             f"NetworkPolicy egress to {block} does not except {METADATA_RANGE}")
    check.expect(wide == 2, where, "NetworkPolicy egress is not to 0.0.0.0/0 and ::/0")
    # No component's NetworkPolicy admits the sandbox pods (the gateway's open
    # port aside: the sandbox's egress keeps its pods off the cluster's addresses).
    for _, template in pods:
        labels = template.get("metadata", {}).get("labels", {})
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


def check_pools(check: Check, name: str, values: dict, by_kind: dict, selector: dict) -> None:
    """Pool mode: the shell pool (sandbox.replicas) and a pool of its own per environment given replicas, each a
    Deployment, a headless Service of its ready pods on the sandbox port and a PDB; each Service and PDB (and an
    environment's Deployment) selects its own pool's pods only. None of them in kubernetes mode."""
    sandbox = values["sandbox"]
    pool_mode = sandbox["provider"] == "pool"
    pools = own_pools(values)
    kinds = ["Deployment", "Service"] + (["PodDisruptionBudget"] if sandbox["pdb"]["enabled"] else [])
    templates: dict[str | None, dict] = {}
    for environment in [None, *POOL_ENVIRONMENTS]:
        object_name = pool_name(environment)
        wanted = pool_mode and (environment is None or environment in pools)
        for kind in kinds:
            check.expect(((kind, object_name) in by_kind) == wanted, name,
                         f"{kind} {object_name} {'not rendered' if wanted else 'rendered'}")
        deployment = by_kind.get(("Deployment", object_name))
        if wanted and deployment:
            templates[environment] = deployment["spec"]["template"]
    labels_of = {e: t.get("metadata", {}).get("labels", {}) for e, t in templates.items()}
    for environment, template in templates.items():
        object_name = pool_name(environment)
        where = f"{name}: {object_name}"
        # The pools' pods are told apart once an environment has one of its own; the default is unchanged.
        label = environment or ("shell" if pools else None)
        own = dict(selector, **({ENVIRONMENT_LABEL: label} if label else {}))
        check.expect(labels_of[environment].get(ENVIRONMENT_LABEL) == label, where,
                     f"pods labelled {ENVIRONMENT_LABEL}={labels_of[environment].get(ENVIRONMENT_LABEL)!r}, not {label!r}")
        deployment = by_kind[("Deployment", object_name)]["spec"]
        replicas = sandbox["replicas"] if environment is None else sandbox["environments"][environment]["replicas"]
        check.expect(deployment.get("replicas") == replicas, where, f"replicas are {deployment.get('replicas')}, not {replicas}")
        # The shell Deployment keeps the selector it has always had (a Deployment's selector cannot change on
        # upgrade); it matches the other pools' pods as well, which their own ReplicaSets (selecting by
        # pod-template-hash) own, so it neither counts nor adopts them. An environment's selects its own.
        wanted_selector = {"matchLabels": selector if environment is None else own}
        check.expect(deployment.get("selector") == wanted_selector, where,
                     f"the Deployment's selector is {deployment.get('selector')}, not {wanted_selector}")
        check_sandbox_pod(check, where, values, by_kind, template, own, environment)
        # Found through its headless Service, ready pods only.
        service = by_kind.get(("Service", object_name), {}).get("spec", {})
        check.expect(service.get("clusterIP") == "None" and service.get("publishNotReadyAddresses") is False, where,
                     "the Service is not headless of ready pods")
        check.expect([(p.get("name"), p.get("port"), p.get("targetPort")) for p in service.get("ports", [])]
                     == [("grpc", SANDBOX_PORT, "grpc")], where, f"the Service's ports are {service.get('ports')}")
        check.expect(service.get("selector") == own, where, f"the Service's selector is {service.get('selector')}, not {own}")
        budget = by_kind.get(("PodDisruptionBudget", object_name), {}).get("spec")
        if budget is not None:
            check.expect(budget.get("selector") == {"matchLabels": own}, where,
                         f"the PDB's selector is {budget.get('selector')}, not {own}")
            limit = {k: budget[k] for k in ("minAvailable", "maxUnavailable") if k in budget}
            wanted_limit = {k: v for k, v in sandbox["pdb"].items() if k in ("minAvailable", "maxUnavailable")}
            wanted_limit = {"minAvailable": wanted_limit["minAvailable"]} if "minAvailable" in wanted_limit else wanted_limit
            check.expect(limit == wanted_limit, where, f"the PDB allows {limit}, not {wanted_limit}")
        # Each pool's Service, PDB, Deployment (but the shell one's, above) and topology spread select its own
        # pool's pods and no other pool's.
        spread = [c.get("labelSelector") for c in template.get("spec", {}).get("topologySpreadConstraints", [])]
        for other, labels in labels_of.items():
            mine = other == environment
            whose = f"the pods of {pool_name(other)}"
            check.expect(selects({"matchLabels": service.get("selector") or {"": ""}}, labels) == mine, where,
                         f"the Service {'does not select' if mine else 'selects'} {whose}")
            if budget is not None:
                check.expect(selects(budget.get("selector"), labels) == mine, where,
                             f"the PDB {'does not select' if mine else 'selects'} {whose}")
            if environment is not None or mine:
                check.expect(selects(deployment.get("selector"), labels) == mine, where,
                             f"the Deployment {'does not select' if mine else 'selects'} {whose}")
            for selector_of_spread in spread:
                check.expect(selects(selector_of_spread, labels) == mine, where,
                             f"a topologySpreadConstraint {'does not count' if mine else 'counts'} {whose}")


def check_sandbox_templates(check: Check, name: str, values: dict, by_kind: dict, selector: dict) -> None:
    """kubernetes mode: a SandboxTemplate and a SandboxWarmPool per environment, whose pods are the pool's in all
    but their image (and the init container that gives it `avm`)."""
    templates = {n: d for (k, n), d in by_kind.items() if k == "SandboxTemplate"}
    pools = {n: d for (k, n), d in by_kind.items() if k == "SandboxWarmPool"}
    wanted = {f"{SANDBOX}-{e}" for e in ENVIRONMENTS}
    check.expect(set(templates) == wanted, name, f"SandboxTemplates are {sorted(templates)}, not {sorted(wanted)}")
    check.expect(set(pools) == wanted, name, f"SandboxWarmPools are {sorted(pools)}, not {sorted(wanted)}")
    for pool_name, pool in pools.items():
        where = f"{name}: SandboxWarmPool {pool_name}"
        check.expect(pool.get("apiVersion") == AGENT_SANDBOX, where, f"apiVersion is {pool.get('apiVersion')}")
        reference = pool.get("spec", {}).get("sandboxTemplateRef")
        check.expect(reference == {"name": pool_name} and pool_name in templates, where,
                     f"sandboxTemplateRef {reference} is not its rendered SandboxTemplate")
    for environment in ENVIRONMENTS:
        object_name = f"{SANDBOX}-{environment}"
        settings = values["sandbox"]["environments"][environment]
        where = f"{name}: {object_name}"
        replicas = pools.get(object_name, {}).get("spec", {}).get("replicas")
        check.expect(replicas == settings["warm"], where, f"warm pool replicas are {replicas}, not {settings['warm']}")
        template = templates.get(object_name)
        if not template:
            continue
        spec = template.get("spec", {})
        check.expect(template.get("apiVersion") == AGENT_SANDBOX, where, f"apiVersion is {template.get('apiVersion')}")
        # The chart's NetworkPolicy governs the pods; claims add nothing to them.
        check.expect(spec.get("networkPolicyManagement") == "Unmanaged", where,
                     f"networkPolicyManagement is {spec.get('networkPolicyManagement')!r}, not Unmanaged")
        check.expect("networkPolicy" not in spec, where, "a networkPolicy agent-sandbox would ignore")
        check.expect(spec.get("envVarsInjectionPolicy", "Disallowed") == "Disallowed", where,
                     f"envVarsInjectionPolicy is {spec.get('envVarsInjectionPolicy')!r}: claims could set variables")
        check.expect(spec.get("volumeClaimTemplatesPolicy", "Disallowed") == "Disallowed", where,
                     f"volumeClaimTemplatesPolicy is {spec.get('volumeClaimTemplatesPolicy')!r}")
        check.expect(not spec.get("volumeClaimTemplates"), where, "volumeClaimTemplates")
        check.expect(set(spec) <= {"podTemplate", "networkPolicyManagement", "envVarsInjectionPolicy",
                                   "volumeClaimTemplatesPolicy", "service"}, where, f"spec has {sorted(spec)}")
        check_sandbox_pod(check, where, values, by_kind, spec.get("podTemplate", {}), selector, environment)


def check_sandbox_pod(check: Check, where: str, values: dict, by_kind: dict, template: dict, selector: dict,
                      environment: str | None) -> None:
    """A sandbox pod (the pool's, or an environment's SandboxTemplate's): hardened, with no token and no Secret."""
    sandbox = values["sandbox"]
    pod, labels = template.get("spec", {}), template.get("metadata", {}).get("labels", {})
    check.expect(all(labels.get(k) == v for k, v in selector.items()), where, f"pod labels are {labels}")
    # Nothing of the components': their labels and annotations may bring secrets or identities.
    annotations = template.get("metadata", {}).get("annotations", {})
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
    for flag in ("hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace"):
        check.expect(not pod.get(flag), where, f"{flag} is on")
    check.expect(pod.get("runtimeClassName") == (sandbox["runtimeClassName"] or None), where,
                 f"runtimeClassName is {pod.get('runtimeClassName')!r}, not {sandbox['runtimeClassName']!r}")
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
    check.expect(len(pod.get("containers", [])) == 1, where, "not one container")
    if not pod.get("containers"):
        return
    pod_sc = pod.get("securityContext", {})
    container = pod["containers"][0]
    init = pod.get("initContainers", [])
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for each in init + pod["containers"]:
        at = f"{where} container {each['name']}"
        for variable in each.get("env", []):
            ref = variable.get("valueFrom", {})
            check.expect("secretKeyRef" not in ref, at, f"{variable['name']} comes from a Secret")
            check.expect(not variable["name"].startswith("AVM_") or variable["name"].startswith("AVM_SANDBOX_"), at,
                         f"{variable['name']} in the environment")
        check.expect(not each.get("env"), at, "env: a sandbox reads no configuration")
        check.expect(not any("secretRef" in source for source in each.get("envFrom", [])), at, "envFrom a Secret")
        check.expect(not each.get("envFrom"), at, "envFrom")
        resources = each.get("resources", {})
        for kind in ("requests", "limits"):
            for resource in ("cpu", "memory"):
                check.expect(resource in resources.get(kind, {}), at, f"no {resource} in resources.{kind}")
        sc = each.get("securityContext", {})
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
        for mount in each.get("volumeMounts", []):
            check.expect("emptyDir" in volumes.get(mount["name"], {}), at, f"{mount['mountPath']} is not an emptyDir")
    at = f"{where} container {container['name']}"
    args = container.get("args", [])
    check.expect(args[:2] == ["sandbox", "--listen"] and len(args) > 2 and args[2].endswith(f":{SANDBOX_PORT}")
                 and args[3:5] == ["--root", "/workspaces"], at, f"args are {args}")
    check.expect(("--no-isolate" in args) != sandbox["isolate"], at, f"--no-isolate with isolate {sandbox['isolate']}")
    check.expect("--claim-idle" in args and args[args.index("--claim-idle") + 1] == sandbox["claimIdle"], at,
                 "--claim-idle")
    check.expect("--scratch" in args and args[args.index("--scratch") + 1] == "/tmp" and "--kill-strays" in args, at,
                 "--scratch /tmp --kill-strays")
    check.expect("--token-key" not in args, at, "--token-key: a sandbox learns its runtime's key when claimed")
    ports = [(p.get("name"), p.get("containerPort")) for p in container.get("ports", [])]
    check.expect(ports == [("grpc", SANDBOX_PORT)], at, f"ports are {ports}")
    for probe, service in (("startupProbe", None), ("livenessProbe", None), ("readinessProbe", "ready")):
        grpc = container.get(probe, {}).get("grpc", {})
        check.expect(grpc.get("port") == SANDBOX_PORT and grpc.get("service") == service, at,
                     f"{probe} is not gRPC health{' of ' + service if service else ''} on {SANDBOX_PORT}")
    mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
    for path in ("/workspaces", "/tmp"):
        check.expect(path in mounts, at, f"{path} is not mounted")
    if environment is None:
        check.expect(not init, where, "init containers in a pool's pod")
        image = chart_image(values, sandbox["image"], yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])
        check.expect(container.get("image") == image, at, f"image is {container.get('image')}, not {image}")
        return
    # An environment's image, given `avm` (and tini) by an init container of the chart's image.
    image = chart_image(values, sandbox["environments"][environment]["image"])
    check.expect(container.get("image") == image, at, f"image is {container.get('image')}, not {image}")
    check.expect(container.get("command") == ["/opt/avm/tini", "--", "/opt/avm/avm"], at,
                 f"command is {container.get('command')}")
    binary = mounts.get("/opt/avm", {})
    check.expect(binary.get("readOnly") is True, at, "/opt/avm is not mounted read-only")
    check.expect(len(init) == 1, where, f"{len(init)} init containers, not the one that copies avm")
    for copier in init:
        at = f"{where} container {copier['name']}"
        check.expect(copier.get("image") == chart_image(values), at, f"image is {copier.get('image')}, not the chart's")
        command = copier.get("command", [])
        check.expect(command[:1] == ["cp"] and "/usr/local/bin/avm" in command and "/usr/bin/tini" in command
                     and command[-1].rstrip("/") == "/opt/avm", at, f"command is {command}")
        check.expect([(m["name"], m["mountPath"]) for m in copier.get("volumeMounts", [])]
                     == [(binary.get("name"), "/opt/avm")], at, "mounts more than the avm emptyDir")


def egress_allowed(by_kind: dict, source: dict, port: int, labels: dict | None = None,
                   address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = None) -> bool:
    """Whether the rendered NetworkPolicies let pods with the source labels open TCP `port` of a pod of the
    release's namespace with `labels`, or of `address` (anything, where no policy isolates their egress)."""
    policies = [doc["spec"] for (kind, _), doc in by_kind.items() if kind == "NetworkPolicy"
                and "Egress" in doc["spec"].get("policyTypes", []) and selects(doc["spec"].get("podSelector"), source)]
    if not policies:
        return True
    # The sandbox's port by its name too.
    names = {None, port} | ({"grpc"} if port == SANDBOX_PORT else set())
    for rule in (rule for spec in policies for rule in spec.get("egress", [])):
        if not any(p.get("protocol", "TCP") == "TCP" and p.get("port") in names for p in rule.get("ports") or [{}]):
            continue
        for peer in rule.get("to") or [{}]:
            if labels is not None and "ipBlock" not in peer and admits(peer, labels, []):
                return True
            if address is not None and ("ipBlock" in peer or not peer):
                block = peer.get("ipBlock", {"cidr": "::/0" if address.version == 6 else "0.0.0.0/0"})
                network = ipaddress.ip_network(block["cidr"])
                if (network.version == address.version and address in network
                        and not any(address in ipaddress.ip_network(e) for e in block.get("except", []))):
                    return True
    return False


def check_tokens(check: Check, name: str, values: dict, by_kind: dict) -> None:
    """Only the runtime's pods mount a ServiceAccount token, and only in kubernetes mode (to claim sandboxes)."""
    accounts = {n: d for (k, n), d in by_kind.items() if k == "ServiceAccount"}
    for account_name, account in accounts.items():
        check.expect(account.get("automountServiceAccountToken") is False, f"{name}: ServiceAccount {account_name}",
                     "automountServiceAccountToken is not false")
    for kind, object_name, pod in pod_specs(by_kind):
        mounted = pod.get("automountServiceAccountToken")
        if mounted is None:
            mounted = accounts.get(pod.get("serviceAccountName", "default"), {}).get("automountServiceAccountToken", True)
        projected = [v["name"] for v in pod.get("volumes", [])
                     if any("serviceAccountToken" in source for source in v.get("projected", {}).get("sources", []))]
        wanted = kind == "Deployment" and object_name == f"{FULLNAME}-runtime" and values["sandbox"]["provider"] == "kubernetes"
        check.expect(bool(mounted) == wanted, f"{name}: {kind} {object_name}",
                     f"{'mounts' if mounted else 'does not mount'} a ServiceAccount token")
        check.expect(not projected, f"{name}: {kind} {object_name}", f"projects a ServiceAccount token: {projected}")


def check_rbac(check: Check, name: str, values: dict, by_kind: dict) -> None:
    """kubernetes mode: the runtime's Role, exactly create, get and delete of sandboxclaims, bound to the runtime's
    ServiceAccount alone; pool mode: no RBAC at all."""
    for kind in ("ClusterRole", "ClusterRoleBinding"):
        check.expect(not any(k == kind for k, _ in by_kind), name, f"a {kind} is rendered")
    roles = {n: d for (k, n), d in by_kind.items() if k == "Role"}
    bindings = {n: d for (k, n), d in by_kind.items() if k == "RoleBinding"}
    if values["sandbox"]["provider"] != "kubernetes":
        check.expect(not roles and not bindings, name, f"RBAC in pool mode: {sorted(roles)} {sorted(bindings)}")
        return
    role = f"{FULLNAME}-runtime"
    check.expect(set(roles) == {role} and set(bindings) == {role}, name,
                 f"Roles {sorted(roles)} and RoleBindings {sorted(bindings)}, not {role}")
    rules = roles.get(role, {}).get("rules")
    normal = [dict(rule, verbs=sorted(rule.get("verbs", []))) for rule in rules or []]
    check.expect(normal == [dict(rule, verbs=sorted(rule["verbs"])) for rule in CLAIM_RULES]
                 and len(rules[0]["verbs"]) == len(set(rules[0]["verbs"])), f"{name}: Role {role}",
                 f"rules are {rules}, not {CLAIM_RULES}")
    runtime = by_kind.get(("Deployment", f"{FULLNAME}-runtime"), {})
    account = runtime.get("spec", {}).get("template", {}).get("spec", {}).get("serviceAccountName")
    binding = bindings.get(role, {})
    check.expect(binding.get("roleRef") == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
                 f"{name}: RoleBinding {role}", f"roleRef is {binding.get('roleRef')}")
    check.expect(binding.get("subjects") == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}],
                 f"{name}: RoleBinding {role}", f"subjects are {binding.get('subjects')}, not the runtime's {account}")
    # No other pod of the release has that ServiceAccount.
    for kind, object_name, pod in pod_specs(by_kind):
        if (kind, object_name) != ("Deployment", f"{FULLNAME}-runtime"):
            check.expect(pod.get("serviceAccountName", "default") != account, f"{name}: {kind} {object_name}",
                         f"uses the runtime's ServiceAccount {account}")


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
    (`avm sandbox`, the pool's or a SandboxTemplate's: starts it and asks its health)."""
    configs = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for kind, object_name, pod in pod_specs(by_kind):
        for container in pod["containers"]:
            where = f"{name}: {kind} {object_name} container {container['name']}"
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
                # What the ConfigMap says of [runtime.sandbox] is what the runtime runs with: the pool, or the
                # warm pools of kubernetes mode (the defaults of the keys the chart leaves out besides).
                config = tomllib.loads(configs[f"{FULLNAME}-runtime"]["avm.toml"])["runtime"]["sandbox"]
                effective = tomllib.loads(printed).get("runtime", {}).get("sandbox", {})
                if config["provider"] == "pool":
                    check.expect(effective.get("provider") == "pool" and effective.get("pool") == POOL, where,
                                 f"avm runs with provider {effective.get('provider')!r}, pool {effective.get('pool')!r}")
                    # Each environment's own pool as rendered; an environment without one claims from pool.
                    ran = effective.get("pools") or {}
                    for environment in POOL_ENVIRONMENTS:
                        given = config.get("pools", {}).get(environment, [])
                        check.expect((ran.get(environment) or []) == given, where,
                                     f"avm runs with pools.{environment} {ran.get(environment)!r}, not {given!r}")
                else:
                    check.expect(effective.get("provider") == "kubernetes", where,
                                 f"avm runs with provider {effective.get('provider')!r}, not \"kubernetes\"")
                for key, value in config.items():
                    if key == "pools":
                        continue
                    if key == "kubernetes":
                        claims = effective.get("kubernetes") or {}
                        for setting, given in value.items():
                            check.expect(claims.get(setting) == given, where,
                                         f"avm does not read [runtime.sandbox.kubernetes] {setting} from AVM_CONFIG")
                        check.expect(not claims.get("namespace") and not claims.get("kubeconfig"), where,
                                     "avm claims in another namespace or cluster than its pod's")
                        continue
                    check.expect(effective.get(key) == value, where,
                                 f"avm does not read [runtime.sandbox] {key} from AVM_CONFIG")


# What the namespace fence (`sandbox.isolate: true`) calls: the shipped
# seccomp profile must refuse none of them.
FENCE_SYSCALLS = {"unshare", "clone", "clone3", "setns", "mount", "umount2", "pivot_root", "prctl", "execve",
                  "sethostname", "mount_setattr", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount"}


def check_seccomp(check: Check) -> None:
    """deploy/seccomp/avm-userns.json: a deny-list profile refusing none of the fence's calls, every name a syscall."""
    where = "deploy/seccomp/avm-userns.json"
    profile = json.loads((ROOT / where).read_text())
    check.expect(profile.get("defaultAction") == "SCMP_ACT_ALLOW", where, "the default action must be SCMP_ACT_ALLOW")
    check.expect("SCMP_ARCH_X86_64" in profile.get("architectures", []), where, "x86-64 must be listed")
    denied = set()
    for rule in profile.get("syscalls", []):
        check.expect(rule.get("action") == "SCMP_ACT_ERRNO", where, f"rule {rule} must refuse with an errno")
        denied.update(rule.get("names", []))
    check.expect(not denied & FENCE_SYSCALLS, where, f"refuses what the fence calls: {sorted(denied & FENCE_SYSCALLS)}")
    check.expect({"bpf", "kexec_load", "init_module", "userfaultfd"} <= denied, where, "must refuse bpf, kexec, modules")
    table = pathlib.Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    if table.exists():
        known = set(re.findall(r"#define __NR_(\w+) ", table.read_text()))
        # Calls of other architectures only (x86-32's vm86, stime, …) are named too.
        others = {"vm86", "vm86old", "stime", "_sysctl"}
        unknown = denied - known - others
        check.expect(not unknown, where, f"not syscalls: {sorted(unknown)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--avm", help="an avm binary that must accept every container's configuration")
    args = parser.parse_args()
    check = Check()
    check_seccomp(check)
    versions = kube_versions()
    production = yaml.safe_load((CHART / "values-production.yaml").read_text())
    cases = {
        # Pool mode (works without agent-sandbox) and kubernetes mode (production's).
        "default": {},
        "production": production,
        "everything": merge(production, EVERYTHING),
        # Each mode with the other's settings: every option in pool mode, the defaults in kubernetes mode.
        "everything-pool": merge(merge(production, EVERYTHING), {"sandbox": {"provider": "pool"}}),
        "default-kubernetes": {"sandbox": {"provider": "kubernetes"}},
        # Pool mode with pools of their own for python and node (the shell pool serving the rest); every option
        # with python's alone (a label of the chart's among sandbox.podLabels is ignored); kubernetes mode, where
        # replicas mean nothing (its warm pools are the environments' pools).
        "pool-environments": {"sandbox": {"environments": {"python": {"replicas": 2}, "node": {"replicas": 1}}}},
        "everything-pool-python": merge(merge(production, EVERYTHING), {
            "sandbox": {"provider": "pool", "podLabels": {ENVIRONMENT_LABEL: "node"},
                        "environments": {"python": {"replicas": 3}}}}),
        "kubernetes-environments": {"sandbox": {"provider": "kubernetes",
                                                "environments": {"python": {"replicas": 2}, "node": {"replicas": 1}}}},
        # --set sandbox.runtimeClassName=gvisor: every sandbox pod runs under it.
        "gvisor": merge(production, {"sandbox": {"runtimeClassName": "gvisor"}}),
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
