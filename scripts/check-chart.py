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
writable paths; the environment each component needs. Values the chart must
refuse are tried too. Prints every problem and exits 1 if there is any.

With `--avm PATH`, each rendered container's command line and environment
(secrets replaced by stand-ins, the runtime's ConfigMap as its AVM_CONFIG)
are also given to that `avm` binary with `--print-config`, which must accept
them: the chart and the binary agree on every variable and flag.

Needs `pip install helm-python-sdk kubernetes-validate pyyaml` (Helm's
renderer and linter as a library, and the schemas, offline).
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import pathlib
import re
import subprocess
import sys
import tempfile

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
    config = by_kind.get(("ConfigMap", f"{FULLNAME}-runtime"), {}).get("data", {}).get("avm.toml", "")
    isolate = "true" if merged["runtime"]["sandbox"]["isolate"] else "false"
    check.expect(f"isolate = {isolate}" in config, name, f"the runtime's avm.toml does not say isolate = {isolate}")
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


# Stand-ins for what Secrets hold, shaped as the binary expects them.
STAND_INS = {
    "AVM_DATABASE_URL": "postgres://avm:secret@127.0.0.1:1/agentvm",
    "AVM_REDIS_URL": "redis://127.0.0.1:1/0",
    "LLM_API_KEY": "sk-stand-in",
}


def check_binary(check: Check, name: str, avm: str, docs: list[dict]) -> None:
    """Runs `avm <args> --print-config` with each container's environment."""
    configs = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    for doc in docs:
        if doc["kind"] != "Deployment":
            continue
        pod = doc["spec"]["template"]["spec"]
        for container in pod["containers"]:
            where = f"{name}: {doc['metadata']['name']} container {container['name']}"
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
                config = next(iter(configs.values()), {}).get("avm.toml", "")
                isolate = re.search(r"isolate = (\w+)", config)
                check.expect(isolate is not None and f"isolate = {isolate.group(1)}" in printed, where,
                             "avm does not read [runtime.sandbox] isolate from AVM_CONFIG")


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
