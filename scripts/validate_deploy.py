"""Offline validation of the deployment files: deploy/ (Dockerfile, plain Kubernetes manifests,
Grafana dashboard) and helm/ (the engram chart and the example app chart that includes it).

Run by scripts/validate-deploy.sh (and so by scripts/test.sh) with the venv's Python, which has
helm-python-sdk (Helm's engine as a library: lint, template) and kubernetes-validate (the
Kubernetes OpenAPI schemas). Usage: validate_deploy.py ENGRAM_BINARY

Every rendered object is validated strictly (unknown fields rejected) against the oldest
Kubernetes version the chart supports and the newest the schemas know. The Prometheus Operator
kinds (ServiceMonitor, PodMonitor, PrometheusRule) have no bundled schema: they are checked against the strict
subsets in scripts/deploy-schemas/, which list only fields of the real CRDs. Each rendered
config.yaml (with the container's ENGRAM_* variables) goes through `engram serve --check-config`.

Prints one line per check and a cargo-style `test result:` line, which test.sh adds to its totals.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate.utils as kv
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "engram"
EXAMPLE_CHART = ROOT / "helm" / "examples" / "app-with-engram"
MANIFESTS = ROOT / "deploy" / "kubernetes"
DASHBOARD = ROOT / "deploy" / "grafana" / "engram-dashboard.json"
CHART_DASHBOARD = CHART / "dashboards" / "engram-dashboard.json"
ALERTS = ROOT / "deploy" / "grafana" / "engram-alerts.yaml"
CRD_SCHEMAS = ROOT / "scripts" / "deploy-schemas"

# The chart's kubeVersion floor (native sidecars) and the newest schemas kubernetes-validate has.
KUBE_VERSIONS = ("1.29.0", kv.latest_version())
DATA_DIR = "/var/lib/engram"


class CheckFailed(Exception):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


# --- YAML and schemas -------------------------------------------------------------------------


class StrictLoader(yaml.SafeLoader):
    """Rejects duplicate keys, which PyYAML would silently collapse and the API server rejects."""


def _mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_documents(text: str, source: str) -> list[dict]:
    try:
        documents = [d for d in yaml.load_all(text, Loader=StrictLoader) if d is not None]
    except yaml.YAMLError as error:
        raise CheckFailed(f"{source}: invalid YAML: {error}") from error
    for document in documents:
        expect(isinstance(document, dict), f"{source}: a document is not a mapping")
        expect("apiVersion" in document and "kind" in document, f"{source}: no apiVersion/kind")
    return documents


# kubernetes-validate reads and parses its schema files on every call; they never change.
kv.schema_contents = functools.lru_cache(maxsize=None)(kv.schema_contents)


@functools.lru_cache(maxsize=None)
def crd_validator(kind: str, version: str) -> jsonschema.protocols.Validator:
    """A strict validator for a CRD kind, resolving ObjectMeta & co. from the Kubernetes schemas."""
    path = CRD_SCHEMAS / f"{kind.lower()}-monitoring-v1.json"
    schema = json.loads(path.read_text())
    minor = [v for v in kv.all_versions() if kv.major_minor(v) <= kv.major_minor(version)][-1]
    definitions = kv.schema_contents(
        f"kubernetes-json-schema/v{minor}-local-strict/_definitions.json", version
    )
    registry = Resource.from_contents(definitions) @ Registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validate_object(obj: dict, source: str) -> None:
    name = f"{obj['kind']}/{obj.get('metadata', {}).get('name', '?')}"
    for version in KUBE_VERSIONS:
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            errors = sorted(crd_validator(obj["kind"], version).iter_errors(obj), key=str)
            expect(
                not errors,
                f"{source}: {name}: " + "; ".join(
                    f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors[:3]
                ),
            )
            continue
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as error:
            path = ".".join(str(p) for p in error.path)
            raise CheckFailed(
                f"{source}: {name} fails Kubernetes {version}: {path}: {error.message}"
            ) from error
        except kv.SchemaNotFoundError as error:
            raise CheckFailed(f"{source}: {error.message}") from error


# --- what every engram pod must get right -----------------------------------------------------


def pod_specs(objects: list[dict]) -> list[tuple[str, dict]]:
    return [
        (o["metadata"]["name"], o["spec"]["template"]["spec"])
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
    ]


def engram_container(spec: dict) -> tuple[dict, bool] | None:
    """The engram container and whether it is a native sidecar (an init container)."""
    for container in spec.get("initContainers", []):
        if container["name"] == "engram":
            return container, True
    for container in spec.get("containers", []):
        if container["name"] == "engram":
            return container, False
    return None


def check_engram_pod(name: str, spec: dict, config: dict, objects: list[dict]) -> None:
    found = engram_container(spec)
    expect(found is not None, f"{name}: no engram container")
    container, native = found
    where = f"{name}/engram"
    if native:
        expect(container.get("restartPolicy") == "Always", f"{where}: init container without restartPolicy: Always")
    context = container.get("securityContext", {})
    pod_context = spec.get("securityContext", {})
    expect(
        context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is True,
        f"{where}: runAsNonRoot is not set",
    )
    user = context.get("runAsUser", pod_context.get("runAsUser"))
    expect(user is not None and user != 0, f"{where}: needs a numeric non-root runAsUser")
    expect(context.get("readOnlyRootFilesystem") is True, f"{where}: root filesystem is writable")
    expect(context.get("allowPrivilegeEscalation") is False, f"{where}: privilege escalation allowed")
    expect("ALL" in context.get("capabilities", {}).get("drop", []), f"{where}: capabilities not dropped")
    expect(container.get("resources", {}).get("requests"), f"{where}: no resource requests")

    # Probes and scraping go to the ops listener when there is one (a sidecar's proxy stays on
    # loopback), else to the proxy's own port.
    server = config["server"]
    port = int(str(server.get("ops_listen") or server["listen"]).rsplit(":", 1)[1])
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    expect(port in ports.values(), f"{where}: serves probes on {port} but declares ports {ports}")
    if native or len(spec.get("containers", [])) > 1:
        listen_host = str(server["listen"]).rsplit(":", 1)[0]
        trust = config.get("identity", {}).get("trust", "headers")
        expect(
            listen_host in ("127.0.0.1", "[::1]", "localhost") or trust != "headers",
            f"{where}: a sidecar trusting headers must keep server.listen on loopback, not {listen_host}",
        )

    def probe_target(probe_name: str) -> tuple[str, int]:
        probe = container.get(probe_name)
        expect(probe and "httpGet" in probe, f"{where}: no HTTP {probe_name}")
        target = probe["httpGet"]["port"]
        return probe["httpGet"]["path"], ports.get(target, target)

    if container.get("startupProbe"):
        expect(probe_target("startupProbe") == ("/healthz", port), f"{where}: startup probe is not /healthz on {port}")
    expect(probe_target("livenessProbe") == ("/healthz", port), f"{where}: liveness is not /healthz on {port}")
    expect(probe_target("readinessProbe") == ("/readyz", port), f"{where}: readiness is not /readyz on {port}")

    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    data_dir = str(config["store"]["data_dir"])
    expect(data_dir in mounts, f"{where}: store.data_dir {data_dir} is not a mounted volume")
    data_volume = volumes.get(mounts[data_dir], {})
    expect(
        "emptyDir" in data_volume or "persistentVolumeClaim" in data_volume,
        f"{where}: {data_dir} is neither an emptyDir nor a PersistentVolumeClaim",
    )
    expect("/etc/engram" in mounts, f"{where}: /etc/engram (config.yaml) is not mounted")

    drain_seconds = int(config.get("server", {}).get("drain_timeout_ms", 30000)) / 1000
    grace = spec.get("terminationGracePeriodSeconds", 30)
    expect(
        grace >= drain_seconds + 5,
        f"{name}: terminationGracePeriodSeconds {grace} leaves no room for the {drain_seconds:.0f} s drain",
    )

    annotations_port = None
    for obj in objects:
        template = obj.get("spec", {}).get("template", {})
        if template.get("spec") is spec:
            annotations_port = template.get("metadata", {}).get("annotations", {}).get("prometheus.io/port")
    if annotations_port is not None:
        expect(annotations_port == str(port), f"{name}: prometheus.io/port {annotations_port} is not {port}")


def check_references(name: str, spec: dict, objects: list[dict], external: frozenset = frozenset()) -> None:
    """Every ConfigMap, Secret key and claim a pod uses exists among the objects (or is external)."""
    present = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    for volume in spec.get("volumes", []):
        if "configMap" in volume:
            expect(("ConfigMap", volume["configMap"]["name"]) in present, f"{name}: ConfigMap {volume['configMap']['name']} is missing")
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            expect(("PersistentVolumeClaim", claim) in present, f"{name}: claim {claim} is missing")
    for container in spec.get("initContainers", []) + spec.get("containers", []):
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if not ref or ref["name"] in external:
                continue
            secret = present.get(("Secret", ref["name"]))
            expect(secret is not None, f"{name}: Secret {ref['name']} is missing")
            keys = set(secret.get("data", {})) | set(secret.get("stringData", {}))
            expect(ref["key"] in keys, f"{name}: Secret {ref['name']} has no key {ref['key']}")


def check_config(engram: Path, config_text: str, container: dict, source: str) -> dict:
    """`engram serve --check-config` accepts the file with the container's ENGRAM_* overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_") and k != "RUST_LOG"}
    for variable in container.get("env", []):
        if "__" in variable["name"] and variable["name"].startswith("ENGRAM_"):
            env[variable["name"]] = variable.get("value", "redis://from-a-secret:6379")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as file:
        file.write(config_text)
    try:
        result = subprocess.run(
            [str(engram), "serve", "--check-config", "--config", file.name],
            env=env, capture_output=True, text=True, timeout=30,
        )
    finally:
        os.unlink(file.name)
    expect(result.returncode == 0, f"{source}: engram rejects the config: {result.stderr.strip()}")
    return yaml.safe_load(config_text) or {}


def config_of(objects: list[dict], spec: dict) -> str:
    for volume in spec.get("volumes", []):
        if volume["name"] == "engram-config":
            for obj in objects:
                if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == volume["configMap"]["name"]:
                    return obj["data"]["config.yaml"]
    raise CheckFailed("no engram-config ConfigMap volume")


def check_objects(engram: Path, objects: list[dict], source: str, external=frozenset()) -> None:
    for obj in objects:
        validate_object(obj, source)
    for name, spec in pod_specs(objects):
        check_references(name, spec, objects, external)
        found = engram_container(spec)
        if found is None:
            continue
        container, _ = found
        text = config_of(objects, spec)
        check_config(engram, text, container, f"{source}: {name}")
        effective = yaml.safe_load(text) or {}
        for variable in container.get("env", []):
            if variable["name"] == "ENGRAM_STORE__DATA_DIR":
                effective.setdefault("store", {})["data_dir"] = variable["value"]
        expect("listen" in effective.get("server", {}), f"{source}: config sets no server.listen")
        expect("data_dir" in effective.get("store", {}), f"{source}: config sets no store.data_dir")
        check_engram_pod(name, spec, effective, objects)


# --- the chart --------------------------------------------------------------------------------

EXISTING = frozenset({"llm-keys", "engram-admin", "redis-credentials", "engram-client-keys", "engram-identity"})

# A standalone engram's default trust, client_keys, needs client keys and an upstream key.
CLIENT_KEYS = {"clientKeys": {"existingSecret": "engram-client-keys"}}
UPSTREAM_KEY = {"apiKey": {"existingSecret": "llm-keys", "existingSecretKey": "openai"}}

SCENARIOS = {
    "sidecar_default": {},
    "sidecar_ordinary_container_with_inline_secrets": {
        "sidecar": {"native": False, "preStopSleepSeconds": 5},
        "upstream": {"apiKey": {"value": "sk-test"}},
        "adminToken": {"value": "admin-test"},
    },
    "sidecar_monitoring_and_dashboard": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}, "namespaceSelector": {"any": True}},
        "dashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}, "namespace": "monitoring"},
        "metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "prom"}, "jobLagSeconds": 2}},
    },
    "sidecar_embedded": {"store": {"backend": "embedded"}, "metrics": {"podAnnotations": False}},
    "standalone_bundled_redis_persistent": {
        "mode": "standalone",
        "replicaCount": 2,
        "identity": CLIENT_KEYS,
        "upstream": UPSTREAM_KEY,
        "redis": {"bundled": {"persistence": {"enabled": True, "storageClass": "fast"}}},
    },
    "standalone_external_redis": {
        "mode": "standalone",
        "replicaCount": 3,
        "redis": {"url": "redis://redis.shared.svc:6379"},
        "upstream": UPSTREAM_KEY,
        "identity": CLIENT_KEYS,
        "adminToken": {"existingSecret": "engram-admin"},
        "serviceMonitor": {"enabled": True},
        "dashboard": {"enabled": True},
    },
    "standalone_redis_url_from_secret": {
        "mode": "standalone",
        "redis": {"existingSecret": "redis-credentials"},
        "identity": CLIENT_KEYS,
        "upstream": UPSTREAM_KEY,
        "extraEnv": [{"name": "ENGRAM_LOGGING__LEVEL", "value": "debug"}],
    },
    "standalone_embedded_persistent_with_config": {
        "mode": "standalone",
        "store": {"backend": "embedded", "persistence": {"enabled": True}},
        "identity": {"trust": "signed", "signingSecret": {"existingSecret": "engram-identity"}},
        "memory": {"budget_tokens": 4096, "weights": {"recency": 0.5}, "retrieval": {"top_facts": 8}},
        "config": {"server": {"drain_timeout_ms": 60000}, "worker": {"concurrency": 4}},
        "service": {"type": "LoadBalancer", "annotations": {"a": "b"}},
    },
    "standalone_headers_forced": {
        "mode": "standalone",
        "store": {"backend": "embedded"},
        "identity": {"trust": "headers"},
        "config": {"identity": {"allow_headers_off_loopback": True}},
    },
}

# What each scenario must render (kind counts) beyond passing validation.
EXPECTED_KINDS = {
    "sidecar_default": {"ConfigMap": 1, "Deployment": 2, "Service": 1},
    "sidecar_ordinary_container_with_inline_secrets": {"ConfigMap": 1, "Deployment": 2, "Service": 1, "Secret": 1},
    "sidecar_monitoring_and_dashboard": {"ConfigMap": 2, "Deployment": 2, "Service": 1, "PodMonitor": 1, "PrometheusRule": 1},
    "sidecar_embedded": {"ConfigMap": 1, "Deployment": 1},
    "standalone_bundled_redis_persistent": {"ConfigMap": 1, "Deployment": 2, "Service": 2, "PersistentVolumeClaim": 1},
    "standalone_external_redis": {"ConfigMap": 2, "Deployment": 1, "Service": 1, "ServiceMonitor": 1},
    "standalone_redis_url_from_secret": {"ConfigMap": 1, "Deployment": 1, "Service": 1},
    "standalone_embedded_persistent_with_config": {"ConfigMap": 1, "Deployment": 1, "Service": 1, "PersistentVolumeClaim": 1},
    "standalone_headers_forced": {"ConfigMap": 1, "Deployment": 1, "Service": 1},
}

# Values the chart must refuse, with a word of the reason.
REJECTED = {
    "embedded_store_with_replicas": ({"mode": "standalone", "store": {"backend": "embedded"}, "replicaCount": 2}, "replicaCount"),
    "unknown_memory_key": ({"memory": {"budget_token": 1}}, "budget_token"),
    "unknown_mode": ({"mode": "daemonset"}, "mode"),
    "standalone_without_client_keys": ({"mode": "standalone", "upstream": UPSTREAM_KEY}, "clientKeys"),
    "client_keys_without_upstream_key": ({"mode": "standalone", "identity": CLIENT_KEYS}, "upstream.apiKey"),
    "standalone_trusting_headers": ({"mode": "standalone", "identity": {"trust": "headers"}}, "allow_headers_off_loopback"),
    "signed_without_secret": ({"identity": {"trust": "signed"}}, "signingSecret"),
    "unknown_trust": ({"identity": {"trust": "anyone"}}, "trust"),
}


def render(chart: Path, values: dict, name: str = "demo") -> list[dict]:
    with helm.Chart.load(str(chart)) as loaded:
        manifests = loaded.render(values, name=name, namespace="apps", is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml") and text.strip():
            objects.extend(load_documents(text, path))
    return objects


def lint(chart: Path, values: dict) -> None:
    report = helm.lint(str(chart), values, strict=True, kube_version="v1.29.0", with_subcharts=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report["errors"]]
    expect(not problems, "helm lint: " + "; ".join(str(p["error"]).strip() for p in problems))


def kinds(objects: list[dict]) -> dict:
    counts: dict = {}
    for obj in objects:
        counts[obj["kind"]] = counts.get(obj["kind"], 0) + 1
    return counts


def chart_scenario(engram: Path, scenario: str) -> None:
    values = SCENARIOS[scenario]
    lint(CHART, values)
    objects = render(CHART, values)
    expect(kinds(objects) == EXPECTED_KINDS[scenario], f"rendered {kinds(objects)}, expected {EXPECTED_KINDS[scenario]}")
    check_objects(engram, objects, f"helm template ({scenario})", EXISTING)
    for obj in objects:
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"].endswith("-dashboard"):
            expect(obj["metadata"]["labels"].get("grafana_dashboard") == "1", "dashboard ConfigMap lacks grafana_dashboard: \"1\"")
            expect(obj["data"]["engram-dashboard.json"].strip() == CHART_DASHBOARD.read_text().strip(), "dashboard ConfigMap differs from the file")
            json.loads(obj["data"]["engram-dashboard.json"])
        if obj["kind"] == "PrometheusRule":
            prometheus_rule(obj, values["metrics"]["prometheusRule"])


def prometheus_rule(obj: dict, values: dict) -> None:
    """The chart's alerts are the Grafana rules' (deploy/grafana/engram-alerts.yaml), with the
    chart's thresholds and labels."""
    expect(obj["metadata"]["labels"].get("release") == values["labels"]["release"], "PrometheusRule lacks its labels")
    rules = {r["alert"]: r for g in obj["spec"]["groups"] for r in g["rules"]}
    grafana = yaml.safe_load(ALERTS.read_text())
    grafana_rules = {r["title"]: r for g in grafana["groups"] for r in g["rules"]}
    expect(set(rules) == set(grafana_rules), f"alerts {sorted(rules)} differ from Grafana's {sorted(grafana_rules)}")
    for name, rule in grafana_rules.items():
        query = next(d["model"]["expr"] for d in rule["data"] if d["refId"] == "A")
        threshold = next(d["model"]["conditions"][0]["evaluator"]["params"][0] for d in rule["data"] if d["refId"] == "B")
        if name == "EngramJobLagHigh":
            expect(rules[name]["expr"] == f"{query} > {values['jobLagSeconds']}", f"{name}: {rules[name]['expr']}")
            expect(threshold == 1, f"Grafana's {name} threshold is {threshold}, the chart's default 1")
        else:
            expect(rules[name]["expr"] == query, f"{name}: {rules[name]['expr']} is not {query}")


def chart_rejects(scenario: str) -> None:
    values, reason = REJECTED[scenario]
    try:
        render(CHART, values)
    except (helm.HelmError, CheckFailed) as error:
        expect(reason in str(error), f"refused for another reason: {error}")
        return
    raise CheckFailed("the chart rendered values it must refuse")


def example_app_chart(engram: Path) -> None:
    """The app chart that includes the sidecar from its engram dependency renders and validates."""
    with tempfile.TemporaryDirectory() as scratch:
        chart = Path(scratch) / EXAMPLE_CHART.name
        shutil.copytree(EXAMPLE_CHART, chart, ignore=shutil.ignore_patterns("charts", "Chart.lock"))
        shutil.copytree(CHART, chart / "charts" / "engram")
        lint(chart, {})
        objects = render(chart, {}, name="shop")
        check_objects(engram, objects, "helm template (app-with-engram)", EXISTING)
        app = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "shop-chat-app"]
        expect(len(app) == 1, "the example app Deployment is missing")
        expect(engram_container(app[0]["spec"]["template"]["spec"]) is not None, "the app pod has no sidecar")


def schema_matches_config() -> None:
    """values.schema.json's memory keys are config.yaml's, and values.yaml keeps its defaults."""
    config = yaml.safe_load((ROOT / "config.yaml").read_text())["memory"]
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["memory"]

    def compare(section: dict, node: dict, path: str) -> None:
        keys, documented = set(node["properties"]), set(section)
        expect(keys == documented, f"schema {path}: extra {sorted(keys - documented)}, missing {sorted(documented - keys)}")
        for key, value in section.items():
            if isinstance(value, dict):
                compare(value, node["properties"][key], f"{path}.{key}")

    compare(config, schema, "memory")
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["memory"]
    for key, value in defaults.items():
        expect(config[key] == value, f"values.yaml memory.{key} = {value!r}, config.yaml's default is {config[key]!r}")


# --- plain manifests, dashboard, Dockerfile ---------------------------------------------------


def plain_manifests(engram: Path) -> None:
    files = sorted(MANIFESTS.glob("*.yaml"))
    expect(files, "no manifests in deploy/kubernetes")
    objects = []
    for path in files:
        objects.extend(load_documents(path.read_text(), str(path.relative_to(ROOT))))
    check_objects(engram, objects, "deploy/kubernetes")
    services = {o["metadata"]["name"] for o in objects if o["kind"] == "Service"}
    for _, spec in pod_specs(objects):
        found = engram_container(spec)
        if found:
            for variable in found[0].get("env", []):
                if variable["name"] == "ENGRAM_STORE__REDIS_URL":
                    host = re.sub(r"^redis://([^:/]+).*$", r"\1", variable["value"])
                    expect(host in services, f"Redis URL host {host} is no Service here")
    secret = next(o for o in objects if o["kind"] == "Secret")
    expect(all("REPLACE-ME" in v for v in secret["stringData"].values()), "the Secret must hold only placeholders")


def dashboard_copies() -> None:
    expect(DASHBOARD.read_bytes() == CHART_DASHBOARD.read_bytes(),
           f"{CHART_DASHBOARD.relative_to(ROOT)} differs from {DASHBOARD.relative_to(ROOT)}: copy it over")
    dashboard = json.loads(DASHBOARD.read_text())
    expect(isinstance(dashboard.get("title"), str) and isinstance(dashboard.get("panels"), list), "not a Grafana dashboard")


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#")))
    return [tuple(line.strip().split(None, 1)) for line in joined.splitlines() if line.strip()]


def dockerfile(engram: Path) -> None:
    instructions = dockerfile_instructions((ROOT / "deploy" / "Dockerfile").read_text())
    stages = [i for i, (op, _) in enumerate(instructions) if op.upper() == "FROM"]
    expect(len(stages) >= 2, "not a multi-stage build")
    final = instructions[stages[-1]:]
    ops = {}
    for op, args in final:
        ops.setdefault(op.upper(), []).append(args)
    expect(not re.search(r":latest\b|^[^:@]+$", final[0][1]), f"runtime base {final[0][1]} is not pinned to a tag")
    users = ops.get("USER", [])
    expect(users and re.fullmatch(r"[1-9][0-9]*(:[0-9]+)?", users[-1]), "the runtime stage must end on a numeric non-root USER")
    expect(ops.get("ENTRYPOINT") == ['["engram"]'], "ENTRYPOINT is not [\"engram\"]")
    cmd = json.loads(ops["CMD"][-1])
    config_path = cmd[cmd.index("--config") + 1]
    copies = [args.split() for args in ops.get("COPY", [])]
    local = [c for c in copies if not any(a.startswith("--from") for a in c)]
    expect(any(c[-1] == config_path for c in local), f"nothing is copied to {config_path}")
    server = yaml.safe_load((ROOT / "deploy" / "config.yaml").read_text())["server"]
    listening = {str(server[key]).rsplit(":", 1)[1] for key in ("listen", "ops_listen") if server.get(key)}
    exposed = {port for args in ops.get("EXPOSE", []) for port in args.split()}
    expect(exposed == listening, f"EXPOSE {sorted(exposed)} is not the ports of {server}")
    expect(any(DATA_DIR in v for v in ops.get("VOLUME", [])), f"{DATA_DIR} is no VOLUME")
    check_config(engram, (ROOT / "deploy" / "config.yaml").read_text(), {}, "deploy/config.yaml")

    # Every local COPY source is in the build context .dockerignore lets through.
    allowed = [l[1:].rstrip("/") for l in (ROOT / ".dockerignore").read_text().splitlines() if l.startswith("!")]
    for copy in [c for op, a in instructions if op.upper() == "COPY" for c in [a.split()]]:
        if any(a.startswith("--from") for a in copy):
            continue
        for source in [a for a in copy[:-1] if not a.startswith("--")]:
            expect(any(source == a or source.startswith(a + "/") for a in allowed), f"COPY {source} is excluded by .dockerignore")

    # The builder's Rust is at least the crate's rust-version.
    rust = re.search(r"ARG RUST_VERSION=(\d+)\.(\d+)", (ROOT / "deploy" / "Dockerfile").read_text())
    needed = re.search(r'rust-version = "(\d+)\.(\d+)', (ROOT / "Cargo.toml").read_text())
    expect(rust and needed and (int(rust[1]), int(rust[2])) >= (int(needed[1]), int(needed[2])), "builder Rust is older than rust-version")


# --- runner -----------------------------------------------------------------------------------


def main() -> int:
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_file():
        print("usage: validate_deploy.py ENGRAM_BINARY (build it with `cargo build --bin engram`)")
        return 2
    engram = Path(sys.argv[1])
    checks = [
        ("dockerfile", lambda: dockerfile(engram)),
        ("dashboard_copies_identical", dashboard_copies),
        ("plain_manifests", lambda: plain_manifests(engram)),
        ("chart_schema_matches_config_yaml", schema_matches_config),
        ("example_app_chart_includes_sidecar", lambda: example_app_chart(engram)),
    ]
    checks += [(f"chart_{s}", functools.partial(chart_scenario, engram, s)) for s in SCENARIOS]
    checks += [(f"chart_rejects_{s}", functools.partial(chart_rejects, s)) for s in REJECTED]

    started = time.monotonic()
    failed = []
    print(f"\nrunning {len(checks)} deployment checks (Kubernetes {', '.join(KUBE_VERSIONS)})")
    for name, check in checks:
        try:
            check()
            print(f"test deploy::{name} ... ok")
        except CheckFailed as error:
            print(f"test deploy::{name} ... FAILED\n    {error}")
            failed.append(name)
        except Exception:  # a crash in a check is a failure of that check, not of the run
            print(f"test deploy::{name} ... FAILED")
            traceback.print_exc(file=sys.stdout)
            failed.append(name)
    elapsed = time.monotonic() - started
    passed = len(checks) - len(failed)
    status = "ok" if not failed else "FAILED"
    print(f"\ntest result: {status}. {passed} passed; {len(failed)} failed; 0 ignored; 0 measured; 0 filtered out; finished in {elapsed:.2f}s\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
