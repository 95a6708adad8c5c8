"""Offline checks of deploy/: no Docker engine, no cluster, no network.

- The Grafana dashboard and the Prometheus alerts query only metrics (and label names and
  values) that a real proxy exports: a proxy is started in front of the fake vendor, traffic
  goes through it, and /metrics is read. Every PromQL expression also passes promtool, and the
  alerts pass their promtool unit tests (deploy/prometheus/alerts_test.yaml).
- The Kubernetes manifests (base and gateway overlay, built with `kubectl kustomize`) validate
  against the Kubernetes schemas (kubernetes-validate, strict); the ServiceMonitor CRD, which no
  schema covers, gets a structural check; cross-references (selectors, ports, Secret keys,
  probe paths, shutdown budget) are checked; the config they mount passes check-config.
- yamllint on every YAML file; docker-compose config; the Dockerfile's user, healthcheck,
  entrypoint and config path, the healthcheck and SIGTERM run for real against the
  entrypoint's command, and the package builds from exactly the files the build context sends.

Tools: promtool (Debian `prometheus`) and docker-compose (Debian `docker-compose`), installed by
`make test`; kubectl (kustomize) from the machine image, with a Python merge of the
kustomizations when it is absent; yamllint and kubernetes-validate from the test extras.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families
from yamllint import linter as yamllint_linter
from yamllint.config import YamlLintConfig

from proxy import cli
from proxy.app import STATE
from proxy.config import load_config, parse_duration
from proxy.loopmetrics import Family
from proxy.metrics import BREAKER_STATES, RELOAD_RESULTS, STATUS_CLASSES
from testkit.fakevendor import Fault
from testkit.procs import Child, free_port
from testkit.redisha import PROXY_COMMANDS
from tests.conftest import route

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "search-proxy.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
ALERTS_TEST = DEPLOY / "prometheus" / "alerts_test.yaml"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
COMPOSE = DEPLOY / "docker-compose.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"
IMAGE_CONFIG = DEPLOY / "config.yaml"
K8S_BASE = DEPLOY / "k8s" / "base"
K8S_GATEWAY = DEPLOY / "k8s" / "overlays" / "gateway"
K8S_CONFIG = K8S_BASE / "config.yaml"

METRIC = re.compile(r"\bsearch_proxy_[a-z_]+")
SELECTOR = re.compile(r"\b(search_proxy_[a-z_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
QUANTILE = re.compile(r"histogram_quantile\(([0-9.]+),.*?\b(search_proxy_[a-z_]+)_bucket\b")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-[^}]*)?\}")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
# Labels Prometheus adds when scraping.
TARGET_LABELS = {"instance", "job", "namespace", "pod", "container", "service", "endpoint"}
# The label values the proxy emits, where they form a closed set (proxy/metrics.py).
LABEL_VALUES = {
    ("search_proxy_requests", "status_class"): set(STATUS_CLASSES),
    ("search_proxy_upstream_attempts", "outcome"): {
        "ok",
        "client_error",
        "429",
        "5xx",
        "timeout",
        "connect_error",
        "reset",
        "malformed",
        "empty",
        "terminal",
    },
    ("search_proxy_ratelimit", "decision"): {"allowed", "delayed", "rejected"},
    ("search_proxy_cache", "result"): {"hit", "miss", "stale", "bypass", "store"},
    ("search_proxy_breaker_transitions", "to"): set(BREAKER_STATES),
    ("search_proxy_breaker_probes", "result"): {"ok", "failed"},
    ("search_proxy_redis_transitions", "to"): {"up", "down"},
    ("search_proxy_config_reloads", "result"): set(RELOAD_RESULTS),
}
# Series without a route label: the dashboard's $route does not apply to them.
NOT_PER_ROUTE = {
    "search_proxy_redis_up",
    "search_proxy_redis_configured",
    "search_proxy_redis_transitions_total",
    "search_proxy_search_provider_outcomes_total",
    "search_proxy_config_reloads_total",
    "search_proxy_config_info",
    "search_proxy_build_info",
}
# Kinds that no Kubernetes schema covers: each gets a structural check of its own instead.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
YAMLLINT_CONFIG = """
extends: relaxed
rules:
  line-length: {max: 140}
  indentation: {spaces: 2, indent-sequences: consistent}
"""


def need(command: str, package: str) -> str:
    """The path of a command that `make test` installs; a clear failure (never a skip) if absent."""
    path = shutil.which(command)
    if path is None:
        pytest.fail(
            f"{command} is not installed: `make test` installs it "
            f"(sh scripts/ensure-package.sh {command} {package})"
        )
    return path


def env_refs(path: Path) -> dict[str, bool]:
    """The ${VAR} references in a config's values (not its comments): name -> has a default."""
    refs: dict[str, bool] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
        elif isinstance(node, str):
            for name, default in ENV_REF.findall(node):
                refs[name] = refs.get(name, True) and bool(default)

    walk(yaml.safe_load(path.read_text()))
    return refs


def required_env(path: Path) -> set[str]:
    """The variables a config cannot start without."""
    return {name for name, has_default in env_refs(path).items() if not has_default}


def run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, **kwargs)


# ---------------------------------------------------------------------------------------------
# PromQL: the expressions, the metric names and labels they use


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every query variable."""
    found = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            found.append((f"variable {var['name']}", query))
    return found


def alert_rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def alert_exprs() -> list[tuple[str, str]]:
    return [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]


def family_of(name: str, families: dict[str, tuple[str, tuple[str, ...]]]) -> str | None:
    """The exported family a PromQL metric name belongs to (foo_total, foo_bucket...)."""
    if name in families:
        return name
    if name.endswith("_total") and families.get(name[: -len("_total")], ("",))[0] == "counter":
        return name[: -len("_total")]
    for suffix in HISTOGRAM_SUFFIXES:
        base = name[: -len(suffix)]
        if name.endswith(suffix) and families.get(base, ("",))[0] == "histogram":
            return base
    return None


def check_exprs(
    exprs: list[tuple[str, str]],
    families: dict[str, tuple[str, tuple[str, ...]]],
    exposed: set[str],
) -> list[str]:
    """Problems: metric names not exposed, unknown label names, unknown label values."""
    problems = []
    for where, expr in exprs:
        names = METRIC.findall(expr)
        if not names:
            problems.append(f"{where}: no search_proxy_ metric in {expr!r}")
        labels_here = set(TARGET_LABELS)
        for name in names:
            family = family_of(name, families)
            if family is None or name not in exposed:
                problems.append(f"{where}: {name} is not exported by the proxy")
                continue
            labels_here |= set(families[family][1])
            if name.endswith("_bucket"):
                labels_here.add("le")
        for name, body in SELECTOR.findall(expr):
            family = family_of(name, families)
            if family is None:
                continue
            allowed = set(families[family][1]) | TARGET_LABELS | {"le"}
            for label, op, value in MATCHER.findall(body):
                if label not in allowed:
                    problems.append(f"{where}: {name} has no label {label!r}")
                known = LABEL_VALUES.get((family, label))
                if known is None or "$" in value:
                    continue
                values = value.split("|") if op in ("=~", "!~") else [value]
                for v in values:
                    if v not in known:
                        problems.append(f"{where}: {name}{{{label}}} is never {v!r}")
        for group in GROUPING.findall(expr):
            for label in (x.strip() for x in group.split(",") if x.strip()):
                if label not in labels_here:
                    problems.append(f"{where}: no metric of the expression has label {label!r}")
    return problems


def promql_for_promtool(expr: str) -> str:
    """Grafana's variables replaced by what they expand to, so promtool can parse the query."""
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m")
    return re.sub(r"\$\{?route\}?", ".*", expr)


async def test_dashboard_and_alerts_query_only_metrics_the_proxy_exports(
    vendor: Any, start_proxy: Any
) -> None:
    quick = {"initial": "1ms", "max": "5ms", "jitter": "none"}
    dead_port = free_port()  # nobody listens on it: Redis is "down"
    client = await start_proxy(
        {
            "redis": {"url": f"redis://127.0.0.1:{dead_port}/0", "timeout": "50ms"},
            "routes": {
                "tavily": route(
                    f"{vendor.url}/tavily",
                    "/tavily",
                    retry={"attempts": 3, "on": ["429", "5xx", "timeout"], "backoff": quick},
                    rate_limit={"rate": "20/s", "burst": 1, "max_wait": "1s"},
                    search={"vendor": "tavily"},
                ),
                "tight": route(
                    f"{vendor.url}/tavily",
                    "/tight",
                    retry={
                        "attempts": 3,
                        "on": ["5xx"],
                        "backoff": quick,
                        "budget": {"ratio": 0.0, "min_per_s": 0},
                    },
                ),
                "limited": route(
                    f"{vendor.url}/tavily",
                    "/limited",
                    rate_limit={"rate": "1/m", "burst": 1, "max_wait": "0s"},
                ),
            },
        }
    )

    async def search(prefix: str, query: str) -> int:
        resp = await client.post(f"{prefix}/search", json={"query": query})
        await resp.read()
        return resp.status

    assert await search("/tavily", "kubernetes sidecar") == 200
    vendor.script(Fault.status(503))  # retried (and the retry waits for a token: delayed)
    assert await search("/tavily", "prometheus alerting rules") == 200
    vendor.script(Fault.empty())  # empty results: simplified variants are tried
    await search("/tavily", "very specific query about grafana dashboard provisioning files")
    vendor.script(Fault.status(432))  # Tavily's plan limit: terminal
    await search("/tavily", "quota")
    vendor.script(Fault.status(503))  # no budget: the retry is refused
    assert await search("/tight", "budget") == 503
    assert await search("/limited", "first") == 200
    assert await search("/limited", "second") == 429  # rate limited: rejected
    assert (await client.get("/readyz")).status == 503  # Redis is down
    resp = await client.get("/metrics")
    assert resp.status == 200
    text = await resp.text()

    exposed: set[str] = set()
    with_samples: set[str] = set()
    for fam in text_string_to_metric_families(text):
        exposed.add(fam.name)
        for sample in fam.samples:
            exposed.add(sample.name)
            with_samples.add(fam.name)
    metrics = client.app[STATE].metrics
    families = {
        m.name: (m.kind, m.labelnames) for m in vars(metrics).values() if isinstance(m, Family)
    }
    families.update(
        (m._name, (m._type, tuple(m._labelnames)))
        for m in vars(metrics).values()
        if isinstance(m, MetricWrapperBase)
    )
    # Counters are exposed as foo_total (the family "foo"), histograms as foo_bucket/_sum/_count.
    for name, (kind, _) in families.items():
        if name in exposed and kind == "counter":
            exposed.add(f"{name}_total")
        if name in exposed and kind == "histogram":
            exposed.update(name + s for s in HISTOGRAM_SUFFIXES)

    problems = check_exprs(dashboard_exprs() + alert_exprs(), families, exposed)
    assert not problems, "\n".join(problems)
    # The traffic really went through: these families carry samples, not just HELP lines.
    for name in (
        "search_proxy_requests",
        "search_proxy_upstream_attempts",
        "search_proxy_retries",
        "search_proxy_retry_budget_exhausted",
        "search_proxy_ratelimit",
        "search_proxy_request_duration_seconds",
        "search_proxy_redis_transitions",
    ):
        assert name in with_samples, f"{name}: no samples after the traffic"


# ---------------------------------------------------------------------------------------------
# The dashboard


def test_dashboard_structure() -> None:
    board = dashboard()
    assert 36 <= board["schemaVersion"] <= 41
    assert board["uid"] == "search-proxy"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    route_var = variables["route"]
    assert route_var["type"] == "query"
    assert route_var["query"]["query"] == "label_values(search_proxy_requests_total, route)"
    assert route_var["datasource"]["uid"] == "${datasource}"
    assert route_var["includeAll"] and route_var["multi"] and route_var["allValue"] == ".*"

    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    used: set[str] = set()
    quantiles: set[tuple[str, str]] = set()
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel.get("description"), f"panel {panel['title']!r} has no description"
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            expr = target["expr"]
            used.update(METRIC.findall(expr))
            quantiles.update(QUANTILE.findall(expr))
            for name, body in SELECTOR.findall(expr):
                # Every per-route series follows the route variable.
                if name not in NOT_PER_ROUTE:
                    assert 'route=~"$route"' in body, f"{panel['title']}: {name} ignores $route"
            if "_bucket" in expr:
                assert "histogram_quantile" in expr and re.search(r"by \(le\b", expr), expr
    # What the dashboard is for (the list of panels).
    for name in (
        "search_proxy_requests_total",
        "search_proxy_upstream_attempts_total",
        "search_proxy_retries_total",
        "search_proxy_retry_budget_exhausted_total",
        "search_proxy_breaker_state",
        "search_proxy_cache_total",
        "search_proxy_ratelimit_total",
        "search_proxy_redis_up",
        "search_proxy_redis_configured",
        "search_proxy_config_reloads_total",
        "search_proxy_config_info",
        "search_proxy_build_info",
    ):
        assert name in used, f"no panel shows {name}"
    for metric in ("search_proxy_request_duration_seconds", "search_proxy_overhead_seconds"):
        assert {("0.5", metric), ("0.99", metric)} <= quantiles, f"{metric}: p50/p99 missing"


def test_dashboard_and_alert_queries_parse_with_promtool(tmp_path: Path) -> None:
    promtool = need("promtool", "prometheus")
    rules = [
        {"record": f"check:expr_{i}", "expr": promql_for_promtool(expr)}
        for i, (_, expr) in enumerate(dashboard_exprs())
        if not expr.startswith("label_values(")
    ]
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = run([promtool, "check", "rules", str(path)])
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------------------------------------
# Prometheus: the rules, their unit tests, the compose stack's config


def test_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    promtool = need("promtool", "prometheus")
    for args in (
        ["check", "rules", str(ALERTS)],
        ["test", "rules", str(ALERTS_TEST)],
        ["check", "config", str(PROMETHEUS_YML)],
    ):
        done = run([promtool, *args])
        assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}{done.stderr}"


def test_alert_rules_structure() -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    assert doc["groups"] and all(g["name"] and g["rules"] for g in doc["groups"])
    rules = alert_rules()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
        if "for" in rule:
            parse_duration(rule["for"], rule["alert"])
    by_metric = {m: r for r in rules for m in METRIC.findall(r["expr"])}
    # The alerts: breaker open > 1 minute, stale serving, vendor errors, retry budget,
    # Redis unreachable.
    breaker = by_metric["search_proxy_breaker_state"]
    assert parse_duration(breaker["for"], "for") >= 60
    assert 'result="stale"' in by_metric["search_proxy_cache_total"]["expr"]
    assert "search_proxy_upstream_attempts_total" in by_metric
    assert "search_proxy_retry_budget_exhausted_total" in by_metric
    assert "search_proxy_redis_up" in by_metric
    # Every alert has a unit test in which it fires.
    tests = yaml.safe_load(ALERTS_TEST.read_text())
    assert tests["rule_files"] == [ALERTS.name]
    fired = {
        case["alertname"]
        for t in tests["tests"]
        for case in t.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert fired == set(names)


# ---------------------------------------------------------------------------------------------
# Kubernetes


def kustomize_python(path: Path) -> list[dict[str, Any]]:
    """A small kustomize for these kustomizations (resources, configMapGenerator, labels,
    images, strategic-merge patches), used where no kubectl is installed."""
    kz = yaml.safe_load((path / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for res in kz.get("resources", []):
        target = (path / res).resolve()
        if target.is_dir():
            docs.extend(kustomize_python(target))
        else:
            docs.extend(d for d in yaml.safe_load_all(target.read_text()) if d)
    for gen in kz.get("configMapGenerator", []):
        data = {Path(f).name: (path / f).read_text() for f in gen.get("files", [])}
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": gen["name"]},
                "data": data,
            }
        )
    for entry in kz.get("labels", []):
        for doc in docs:
            doc["metadata"].setdefault("labels", {}).update(entry["pairs"])
    for image in kz.get("images", []):
        for doc in docs:
            spec = doc.get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                if c["image"] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for patch in kz.get("patches", []):
        body = yaml.safe_load((path / patch["path"]).read_text())
        for doc in docs:
            if (doc["kind"], doc["metadata"]["name"]) == (body["kind"], body["metadata"]["name"]):
                merged = strategic_merge(doc, body)
                doc.clear()
                doc.update(merged)
    return docs


def strategic_merge(base: Any, patch: Any) -> Any:
    """Strategic merge as kustomize applies it to these patches: maps merge, null deletes a key,
    lists of named maps merge by name (`$patch: delete` removes the item)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and all("name" in x for x in patch):
        out = copy.deepcopy(base)
        for item in patch:
            index = next((i for i, x in enumerate(out) if x.get("name") == item["name"]), None)
            if item.get("$patch") == "delete":
                if index is not None:
                    out.pop(index)
            elif index is None:
                out.append(copy.deepcopy(item))
            else:
                out[index] = strategic_merge(out[index], item)
        return out
    return copy.deepcopy(patch)


def kustomize(path: Path) -> list[dict[str, Any]]:
    """The kustomization built by `kubectl kustomize` (kustomize v5), or by the Python merge."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return kustomize_python(path)
    done = run([kubectl, "kustomize", str(path)])
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


@pytest.fixture(scope="module")
def builds() -> dict[str, list[dict[str, Any]]]:
    return {"base": kustomize(K8S_BASE), "gateway": kustomize(K8S_GATEWAY)}


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for d in find(docs, "Deployment"):
        yield d, d["spec"]["template"]


def proxy_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod["spec"]
    return [
        c
        for c in spec.get("initContainers", []) + spec.get("containers", [])
        if c["name"] == "search-proxy"
    ]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def check_service_monitor(doc: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    """What the ServiceMonitor CRD requires, and that it finds the gateway's metrics port."""
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
    spec = doc["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    selector = spec["selector"]["matchLabels"]
    services = [s for s in find(docs, "Service") if matches(selector, s["metadata"]["labels"])]
    assert len(services) == 1, f"ServiceMonitor selects {len(services)} Services"
    port_names = {p["name"] for p in services[0]["spec"]["ports"]}
    assert spec["endpoints"]
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
        assert endpoint["port"] in port_names
        assert endpoint.get("path", "/metrics") == "/metrics"
        parse_duration(endpoint.get("interval", "30s"), "interval")


@pytest.mark.parametrize("mode", ["base", "gateway"])
def test_manifests_validate_against_kubernetes_schemas(
    mode: str, builds: dict[str, list[dict[str, Any]]]
) -> None:
    version = kubernetes_validate.latest_version()
    docs = builds[mode]
    assert docs
    for doc in docs:
        where = f"{mode}: {doc['kind']} {doc['metadata']['name']}"
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            check_service_monitor(doc, docs)
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {exc}")


def test_the_schema_validation_catches_mistakes(builds: dict[str, list[dict[str, Any]]]) -> None:
    deployment = copy.deepcopy(find(builds["gateway"], "Deployment", "search-proxy")[0])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinessProbes"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)


def test_python_merge_matches_kustomize(builds: dict[str, list[dict[str, Any]]]) -> None:
    """The fallback build (no kubectl) gives what kustomize gives, but the ConfigMap hash."""

    def normalized(docs: list[dict[str, Any]]) -> dict[tuple[str, str], Any]:
        text = json.dumps(docs, sort_keys=True)
        text = re.sub(r'"(search-proxy-config)-[a-z0-9]{10}"', r'"\1"', text)
        return {(d["kind"], d["metadata"]["name"]): d for d in json.loads(text)}

    for mode, path in (("base", K8S_BASE), ("gateway", K8S_GATEWAY)):
        python = normalized(kustomize_python(path))
        assert python.keys() == normalized(builds[mode]).keys()
        for key, doc in normalized(builds[mode]).items():
            # kustomize leaves emptied maps and lists behind; so does the merge.
            assert python[key] == doc, f"{mode}: {key} differs"


# What a Secret's keys hold in these checks: a value an operator could have generated (the
# shipped placeholders are refused: test_the_shipped_admin_token_is_a_placeholder_start_up_refuses).
DUMMY_SECRET = "dk-8c3f1a9e5b7d2c4f6e0a"  # generated-looking: a guessable token is refused


def container_env(container: dict[str, Any], docs: list[dict[str, Any]]) -> dict[str, str]:
    """The environment a container gets: env values and the keys of its envFrom Secrets."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        secret = find(docs, "Secret", source["secretRef"]["name"])
        assert secret, f"envFrom names a missing Secret {source['secretRef']['name']}"
        env.update(
            dict.fromkeys(secret[0].get("stringData", secret[0].get("data", {})), DUMMY_SECRET)
        )
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def proxy_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The environment of the first search-proxy container of a build."""
    (proxy,) = proxy_containers(next(p for _, p in pod_specs(docs) if proxy_containers(p)))
    return container_env(proxy, docs)


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        if raw.lstrip().startswith("#") and not current:
            continue
        current += raw.rstrip("\\").strip() + " " if raw.rstrip().endswith("\\") else raw.strip()
        if not raw.rstrip().endswith("\\"):
            if current.strip():
                lines.append(current.strip())
            current = ""
    out = []
    for line in lines:
        instruction, _, args = line.partition(" ")
        out.append((instruction.upper(), args.strip()))
    return out


def image_command() -> list[str]:
    entrypoint = [json.loads(a) for i, a in dockerfile() if i == "ENTRYPOINT"][-1]
    cmd = [json.loads(a) for i, a in dockerfile() if i == "CMD"][-1]
    return entrypoint + cmd


def image_config_path() -> str:
    command = image_command()
    return command[command.index("--config") + 1]


def image_uid() -> int:
    user = [a for i, a in dockerfile() if i == "USER"][-1]
    return int(user.split(":")[0])


@pytest.mark.parametrize("mode", ["base", "gateway"])
def test_proxy_pods_are_wired_to_what_they_need(
    mode: str, builds: dict[str, list[dict[str, Any]]]
) -> None:
    docs = builds[mode]
    config_map = find(docs, "ConfigMap")
    assert len(config_map) == 1 and config_map[0]["metadata"]["name"].startswith(
        "search-proxy-config"
    )
    assert config_map[0]["data"] == {"config.yaml": K8S_CONFIG.read_text()}
    config_path = PurePosixPath(image_config_path())
    shutdown_grace = load_config(K8S_CONFIG, env=proxy_env(docs)).server.shutdown_grace
    redis_service = find(docs, "Service", "search-proxy-redis")[0]
    pods = [(d, p) for d, p in pod_specs(docs) if proxy_containers(p)]
    # The image every kustomization points at (the base's images: entry).
    (image,) = yaml.safe_load((K8S_BASE / "kustomization.yaml").read_text())["images"]
    proxy_image = f"{image['newName']}:{image['newTag']}"
    assert pods, "no pod runs search-proxy"
    for deployment, pod in pods:
        where = f"{mode}: {deployment['metadata']['name']}"
        spec = pod["spec"]
        (proxy,) = proxy_containers(pod)
        assert proxy["image"] == proxy_image, f"{where}: image {proxy['image']}"
        assert proxy["args"] == image_command()[1:], f"{where}: args differ from the image's CMD"
        # The config: a ConfigMap volume mounted where the image's CMD reads it.
        (mount,) = [m for m in proxy["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert volume["configMap"]["name"] == config_map[0]["metadata"]["name"], where
        assert config_path.name in config_map[0]["data"]
        # Probes on the proxy's real endpoints and port.
        ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
        assert list(ports.values()) == [8080], where
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            probe = proxy[kind]["httpGet"]
            assert probe["path"] in ("/healthz", "/readyz"), f"{where}: {kind}"
            assert ports.get(probe["port"], probe["port"]) == 8080, f"{where}: {kind}"
        assert proxy["livenessProbe"]["httpGet"]["path"] == "/healthz"
        resources = proxy["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]) and resources["limits"]["memory"]
        # Runs as the image's non-root user.
        security = {**spec.get("securityContext", {}), **proxy.get("securityContext", {})}
        assert security.get("runAsNonRoot") is True, where
        assert security.get("runAsUser", image_uid()) == image_uid() != 0, where
        assert security.get("readOnlyRootFilesystem") is True, where
        # Shutdown: the grace period covers the preStop sleep and the drain, with room left.
        command = proxy["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep", where
        pre_stop = float(command[1])
        grace = spec["terminationGracePeriodSeconds"]
        assert grace >= pre_stop + shutdown_grace + 5, f"{where}: {grace}s is too short"
        # Every ${VAR} the config needs comes from the container's environment.
        env = container_env(proxy, docs)
        missing = required_env(K8S_CONFIG) - set(env)
        assert not missing, f"{where}: the config needs {sorted(missing)}"
        host, port = re.match(r"redis://([^:/]+):(\d+)", env["REDIS_URL"]).groups()
        assert host == redis_service["metadata"]["name"], where
        assert int(port) in [p["port"] for p in redis_service["spec"]["ports"]], where
    # Every Service and PodDisruptionBudget selects pods that exist; every HPA a Deployment.
    templates = [p["metadata"]["labels"] for _, p in pod_specs(docs)]
    for obj in find(docs, "Service") + find(docs, "PodDisruptionBudget"):
        selector = obj["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert any(matches(selector, t) for t in templates), obj["metadata"]["name"]
    for svc in find(docs, "Service"):
        (dep,) = [
            d
            for d, p in pod_specs(docs)
            if matches(svc["spec"]["selector"], p["metadata"]["labels"])
        ]
        names = {
            p.get("name")
            for c in dep["spec"]["template"]["spec"]["containers"]
            + dep["spec"]["template"]["spec"].get("initContainers", [])
            for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, svc["metadata"]["name"]
    for hpa in find(docs, "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        assert find(docs, target["kind"], target["name"])
        assert hpa["spec"]["minReplicas"] >= 2


def test_sidecar_mode(builds: dict[str, list[dict[str, Any]]]) -> None:
    docs = builds["base"]
    (agent,) = find(docs, "Deployment", "agent")
    pod = agent["spec"]["template"]
    (proxy,) = pod["spec"]["initContainers"]
    assert proxy["name"] == "search-proxy" and proxy["restartPolicy"] == "Always"
    (app,) = pod["spec"]["containers"]
    assert {"name": "SEARCH_PROXY_URL", "value": "http://localhost:8080"} in app["env"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == proxy["ports"][0]["containerPort"]
    assert agent["spec"]["replicas"] >= 2 and find(docs, "PodDisruptionBudget", "agent")
    # The Secret's keys are exactly the variables the config refers to without a default.
    (secret,) = find(docs, "Secret", "search-proxy-vendor-keys")
    needed = required_env(K8S_CONFIG)
    assert set(secret["stringData"]) == needed


def test_gateway_mode(builds: dict[str, list[dict[str, Any]]]) -> None:
    docs = builds["gateway"]
    (gateway,) = find(docs, "Deployment", "search-proxy")
    assert "replicas" not in gateway["spec"], "the HPA owns replicas"
    (hpa,) = find(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "search-proxy"
    assert hpa["spec"]["minReplicas"] >= 3
    (service,) = find(docs, "Service", "search-proxy")
    (agent,) = find(docs, "Deployment", "agent")
    spec = agent["spec"]["template"]["spec"]
    assert not spec.get("initContainers") and not spec.get("volumes"), "the sidecar is gone"
    assert not agent["spec"]["template"]["metadata"].get("annotations")
    url = f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert {"name": "SEARCH_PROXY_URL", "value": url} in spec["containers"][0]["env"]
    assert find(docs, "PodDisruptionBudget", "search-proxy")
    assert find(docs, "ServiceMonitor", "search-proxy")
    # A worker per CPU of its limit in the gateway; one in a sidecar, which serves one agent.
    (proxy,) = gateway["spec"]["template"]["spec"]["containers"]
    assert proxy["resources"]["limits"]["cpu"] == "2"
    assert load_config(K8S_CONFIG, env=proxy_env(docs)).server.workers == "auto"
    assert load_config(K8S_CONFIG, env=proxy_env(builds["base"])).server.workers == 1


# ---------------------------------------------------------------------------------------------
# The configs


def test_kubernetes_config_passes_check_config(
    builds: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`search-proxy check-config` on the ConfigMap's file, with the pod's environment (the
    Secret's keys set to dummy values)."""
    docs = builds["base"]
    path = tmp_path / "config.yaml"
    path.write_text(find(docs, "ConfigMap")[0]["data"]["config.yaml"])
    for name in env_refs(path):
        monkeypatch.delenv(name, raising=False)
    for name, value in proxy_env(docs).items():
        monkeypatch.setenv(name, value)
    assert cli.main(["check-config", str(path)]) == 0
    config = load_config(path)
    assert config.server.host == "0.0.0.0" and config.server.port == 8080
    assert config.redis is not None and config.server.admin_token == DUMMY_SECRET
    # The admin endpoints stay inside the pod (their own listener, on loopback).
    assert (config.server.admin_host, config.server.admin_port) == ("127.0.0.1", 8081)
    assert config.routes["firecrawl"].prefix == "/v2"
    assert not config.routes["firecrawl"].strip_prefix


def readme_redis_blocks() -> list[str]:
    """The `redis:` YAML blocks of deploy/README.md's section on a highly available Redis."""
    text = (DEPLOY / "README.md").read_text()
    section = text.split("## Redis highly available", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```yaml\n(redis:\n.*?)```", section, re.S)


def test_the_readmes_sentinel_and_cluster_blocks_pass_check_config_in_the_kubernetes_config(
    builds: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Each documented `redis:` block, in place of the base's, in the ConfigMap's config with the
    pod's environment and REDIS_PASSWORD: check-config (which builds the link) accepts it."""
    docs = builds["base"]
    shipped = find(docs, "ConfigMap")[0]["data"]["config.yaml"]
    # The base's section: its `redis:` line and the indented (or blank) lines under it.
    section = re.compile(r"^redis:.*\n(?:(?:[ #].*)?\n)*", re.M)
    assert section.search(shipped)
    for name, value in proxy_env(docs).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("REDIS_PASSWORD", DUMMY_SECRET)
    topologies = []
    for block in readme_redis_blocks():
        path = tmp_path / "config.yaml"
        path.write_text(section.sub(lambda _, b=block: b + "\n", shipped, count=1))
        assert cli.main(["check-config", str(path)]) == 0, block
        redis = load_config(path).redis
        assert redis is not None and redis.password == DUMMY_SECRET
        topologies.append(redis.topology)
    assert topologies == ["sentinel", "cluster"]


def test_the_documented_acl_rule_is_the_one_the_tests_run_the_proxy_as() -> None:
    rule = re.search(
        r"ACL SETUSER search-proxy on >\.\.\. (.*)", (DEPLOY / "README.md").read_text()
    )
    assert rule is not None
    assert rule.group(1).strip() == f"~search-proxy:* &search-proxy:* {PROXY_COMMANDS}"


def test_the_shipped_admin_token_is_a_placeholder_start_up_refuses(
    builds: dict[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Applied as shipped, the proxy does not start with a known admin token: the Secret's value
    is a placeholder check-config (and so start-up) refuses, saying how to make a real one."""
    assert "change-me" not in "".join(p.read_text() for p in (DEPLOY / "k8s").rglob("*.yaml"))
    docs = builds["base"]
    (secret,) = find(docs, "Secret", "search-proxy-vendor-keys")
    path = tmp_path / "config.yaml"
    path.write_text(find(docs, "ConfigMap")[0]["data"]["config.yaml"])
    for name, value in proxy_env(docs).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SEARCH_PROXY_ADMIN_TOKEN", secret["stringData"]["SEARCH_PROXY_ADMIN_TOKEN"])
    assert cli.main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "server.admin_token: must be at least 16 visible ASCII characters" in err
    assert (
        "openssl rand -hex 32" in err
        and secret["stringData"]["SEARCH_PROXY_ADMIN_TOKEN"] not in err
    )


def test_image_config_passes_check_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config baked into the image works with an empty environment."""
    for name in env_refs(IMAGE_CONFIG):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["check-config", str(IMAGE_CONFIG)]) == 0
    config = load_config(IMAGE_CONFIG, env={})
    assert config.server.host == "0.0.0.0" and config.server.port == 8080
    assert config.redis is None and "${" not in IMAGE_CONFIG.read_text()


# What the proxy needs besides its in-process caches: about 65 MB idle, under 150 MB serving.
PROXY_WITHOUT_CACHES = 96 * 2**20
MEMORY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9, "": 1}


def memory_bytes(quantity: str) -> int:
    """A Kubernetes memory quantity (`256Mi`, `1Gi`, `512M`) in bytes."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|K|M|G|)", str(quantity))
    assert m, f"unexpected memory quantity {quantity!r}"
    return int(m.group(1)) * MEMORY_UNITS[m.group(2)]


def test_worst_case_cache_memory_fits_each_proxy_containers_memory_limit(
    builds: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """Every cached route may fill its in-process LRU to `cache.max_bytes`, and /v1/fetch's page
    cache to `fetch_api.cache.max_bytes`; all of them together, plus the proxy itself, must stay
    under the container's limit, or the kernel kills it."""
    for name, docs in builds.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(find(docs, "ConfigMap")[0]["data"]["config.yaml"])
        config = load_config(path, env=proxy_env(docs))
        caches = {
            r.name: r.section("cache").max_bytes for r in config.routes.values() if r.has("cache")
        }
        if config.fetch_api.providers and config.fetch_api.cache.enabled:  # the page cache
            caches["fetch_api"] = config.fetch_api.cache.max_bytes
        assert caches, f"{name}: no cached routes: this check would prove nothing"
        for _, pod in pod_specs(docs):
            for container in proxy_containers(pod):
                limit = memory_bytes(container["resources"]["limits"]["memory"])
                cached = sum(caches.values())
                assert cached + PROXY_WITHOUT_CACHES <= limit, (
                    f"{name}: {len(caches)} cached routes may hold {cached >> 20} MiB "
                    f"(cache.max_bytes each: {caches}), plus ~{PROXY_WITHOUT_CACHES >> 20} MiB for "
                    f"the proxy, over the container's memory limit of {limit >> 20} MiB"
                )


# ---------------------------------------------------------------------------------------------
# yamllint, docker-compose


def deploy_yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))


def test_yamllint() -> None:
    config = YamlLintConfig(YAMLLINT_CONFIG)
    files = deploy_yaml_files()
    assert len(files) >= 14
    problems = [
        f"{path.relative_to(REPO)}:{p.line}:{p.column}: [{p.level}] {p.desc} ({p.rule})"
        for path in files
        for p in yamllint_linter.run(path.read_text(), config, str(path))
    ]
    assert not problems, "\n".join(problems)


def test_docker_compose_stack() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    # docker-compose validates the file against the Compose schema and resolves ${VAR:-x}
    # (no engine needed for `config`), here with none of the stack's variables set.
    docker_compose = need("docker-compose", "docker-compose")
    referenced = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", COMPOSE.read_text()))
    clean = {k: v for k, v in os.environ.items() if k not in referenced}
    done = run([docker_compose, "-f", str(COMPOSE), "config"], cwd=DEPLOY, env=clean)
    assert done.returncode == 0, done.stdout + done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    assert set(services) == {"search-proxy", "redis", "prometheus", "grafana"}

    def mounts(service: str) -> dict[str, Path]:
        out = {}
        for volume in services[service].get("volumes", []):
            source, target = volume.split(":")[:2]
            path = (DEPLOY / source).resolve()
            assert path.exists(), f"{service}: {source} does not exist"
            out[target] = path
        return out

    proxy = services["search-proxy"]
    build = proxy["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert context == REPO and (context / build["dockerfile"]).resolve() == DOCKERFILE
    assert mounts("search-proxy")[image_config_path()] == K8S_CONFIG
    assert "8080:8080" in proxy["ports"]
    grace = parse_duration(proxy["stop_grace_period"], "stop_grace_period")
    env = {k: str(v) for k, v in resolved["search-proxy"]["environment"].items()}
    assert env["SEARCH_PROXY_ADMIN_TOKEN"] == ""  # none exported: the entrypoint makes one
    env["SEARCH_PROXY_ADMIN_TOKEN"] = compose_admin_token(resolved["search-proxy"], {})
    assert grace > load_config(K8S_CONFIG, env=env).server.shutdown_grace
    assert env["REDIS_URL"].startswith("redis://redis:6379")
    assert proxy["depends_on"]["redis"]["condition"] == "service_healthy"
    # Prometheus: its config and the rules file it names, the proxy as a target.
    prom_mounts = mounts("prometheus")
    prom_yml = next(t for t, p in prom_mounts.items() if p == PROMETHEUS_YML)
    prom = yaml.safe_load(PROMETHEUS_YML.read_text())
    for rule_file in prom["rule_files"]:
        target = str(PurePosixPath(prom_yml).parent / rule_file)
        assert prom_mounts[target] == ALERTS
    targets = [
        t for job in prom["scrape_configs"] for s in job["static_configs"] for t in s["targets"]
    ]
    assert "search-proxy:8080" in targets
    # Grafana: provisioning, the datasource at the prometheus service, the dashboard file.
    graf_mounts = mounts("grafana")
    provisioning = graf_mounts["/etc/grafana/provisioning"]
    datasources = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "search-proxy.yaml").read_text())[
        "providers"
    ]
    dashboards = {t: p for t, p in graf_mounts.items() if p == DASHBOARD}
    assert dashboards and all(t.startswith(provider["options"]["path"] + "/") for t in dashboards)


# ---------------------------------------------------------------------------------------------
# The Dockerfile


def test_dockerfile_essentials() -> None:
    instructions = dockerfile()
    froms = [a for i, a in instructions if i == "FROM"]
    args = dict(a.split("=", 1) for i, a in instructions if i == "ARG" and "=" in a)
    base = args.get("PYTHON_IMAGE", froms[-1])
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", base), base
    assert image_uid() != 0, "the image must not run as root"
    (health,) = [a for i, a in instructions if i == "HEALTHCHECK"]
    check = json.loads(re.search(r"\bCMD\s+(\[.*\])$", health).group(1))
    assert check[0] == "python" and "urllib" in check[2] and "/healthz" in check[2]
    for name in ("ENTRYPOINT", "CMD"):
        (last,) = [a for i, a in instructions if i == name][-1:]
        assert isinstance(json.loads(last), list), f"{name} must be in exec form"
    assert image_command()[0] == "search-proxy"
    assert ("STOPSIGNAL", "SIGTERM") in instructions
    assert ("COPY", f"deploy/config.yaml {image_config_path()}") in instructions
    # The image runs on uvloop (server.event_loop: auto): the package with its `fast` extra.
    assert any(i == "RUN" and "pip install '.[fast]'" in a for i, a in instructions)


def context_files() -> list[Path]:
    """The files `docker build -f deploy/Dockerfile .` sends (Dockerfile.dockerignore rules:
    the last matching pattern wins; a pattern matching a parent directory matches its files)."""
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            rules.append((line.startswith("!"), line.lstrip("!").strip("/")))

    def pattern(glob: str) -> re.Pattern[str]:
        # Go's filepath.Match plus `**`: * and ? stay within one path segment.
        parts = re.split(r"(\*\*/|\*\*|\*|\?)", glob)
        tokens = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
        return re.compile("".join(tokens.get(t, re.escape(t)) for t in parts))

    compiled = [(keep, pattern(p)) for keep, p in rules]

    def excluded(rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        verdict = False
        for keep, rx in compiled:
            if any(rx.fullmatch(p) for p in prefixes):
                verdict = not keep
        return verdict

    # Not walked (large), but they must be left out too.
    assert excluded(".venv/bin/python") and excluded(".git/HEAD")
    out = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in (".git", ".venv")]
        for name in names:
            path = Path(root) / name
            if not excluded(path.relative_to(REPO).as_posix()):
                out.append(path)
    return out


def test_build_context_installs_the_package(tmp_path: Path) -> None:
    """What the Dockerfile's `pip install .` gets builds a wheel with the packages and the
    console script; nothing else from the work tree (no .venv, tests, caches) is sent."""
    files = context_files()
    rels = {p.relative_to(REPO).as_posix() for p in files}
    assert "pyproject.toml" in rels and "deploy/config.yaml" in rels
    left_out = ("tests/", "testkit/", "bench/", ".venv/", ".git/")
    assert not any(r.startswith(left_out) or "__pycache__" in r for r in rels)
    context = tmp_path / "context"
    for path in files:
        target = context / path.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    out = tmp_path / "wheel"
    done = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(context),
        ]
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = out.glob("search_proxy-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "proxy/cli.py" in names and "policies/__init__.py" in names
    # Every module of the source tree, subpackages included, is in the wheel.
    sources = {
        str(path.relative_to(REPO))
        for package in ("proxy", "policies")
        for path in (REPO / package).rglob("*.py")
    }
    assert sources <= set(names), sorted(sources - set(names))
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    declared = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "search-proxy = proxy.cli:main" in declared
    # The pytest fixture for agents' test suites, its default config, and the licence.
    assert "[pytest11]\nsearch_proxy = proxy.testing.plugin" in declared
    assert "proxy/testing/demo.yaml" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_image_command_serves_passes_healthcheck_and_exits_0_on_sigterm() -> None:
    """The image's ENTRYPOINT + CMD (config path mapped to deploy/config.yaml), its HEALTHCHECK
    command, then SIGTERM as `docker stop` sends it."""
    port = free_port()
    command = [str(IMAGE_CONFIG) if a == image_config_path() else a for a in image_command()]
    command[0] = str(Path(sys.executable).with_name(command[0]))
    address = ["--host", "127.0.0.1", "--port", str(port), "--admin-port", "0"]
    proxy = Child("image-command", [*command, *address])
    try:
        proxy.wait_http(f"http://127.0.0.1:{port}/healthz", within=15)
        (health,) = [a for i, a in dockerfile() if i == "HEALTHCHECK"]
        check = json.loads(re.search(r"\bCMD\s+(\[.*\])$", health).group(1))
        check = [a.replace(":8080/", f":{port}/") for a in check]
        check[0] = sys.executable
        assert run(check).returncode == 0
        grace = load_config(IMAGE_CONFIG, env={}).server.shutdown_grace
        proxy.proc.send_signal(signal.SIGTERM)
        # Nothing in flight: it exits 0 at once, not at the end of its shutdown grace.
        assert proxy.proc.wait(timeout=min(5, grace)) == 0
        unhealthy = run(check)
        assert unhealthy.returncode != 0, "the healthcheck passes with nothing listening"
    finally:
        proxy.stop()


def compose_admin_token(service: dict[str, Any], env: dict[str, str]) -> str:
    """The admin token the compose service's entrypoint hands the proxy, run as docker would
    run it (with `env`), a stand-in `search-proxy` printing what it was given."""
    bin_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"compose-entrypoint-{os.getpid()}"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").unlink(missing_ok=True)
    (bin_dir / "python").symlink_to(sys.executable)
    fake = bin_dir / "search-proxy"
    fake.write_text('#!/bin/sh\necho "pid=$$ token=$SEARCH_PROXY_ADMIN_TOKEN args=$*"\n')
    fake.chmod(0o755)
    # Compose's own interpolation turns `$$` into `$` before the container runs.
    entrypoint = [part.replace("$$", "$") for part in service["entrypoint"]]
    shell = f"echo shell=$$; exec {shlex.join(entrypoint + service['command'])}"
    done = run(["sh", "-c", shell], env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env})
    assert done.returncode == 0, done.stdout + done.stderr
    shell_pid = re.search(r"shell=(\d+)", done.stdout)
    found = re.search(r"pid=(\d+) token=(\S*) args=(.*)", done.stdout)
    assert shell_pid and found, done.stdout
    assert found[1] == shell_pid[1]  # exec all the way: the proxy is the container's PID 1
    assert found[3] == " ".join(service["command"])
    return found[2]


def test_the_compose_stack_generates_its_admin_token_unless_given_one() -> None:
    """No fixed default an attacker could guess: each start without SEARCH_PROXY_ADMIN_TOKEN
    gets a generated token the proxy accepts; an exported one is used as it is."""
    from proxy.clients import token_problem

    service = yaml.safe_load(COMPOSE.read_text())["services"]["search-proxy"]
    first = compose_admin_token(service, {})
    second = compose_admin_token(service, {"SEARCH_PROXY_ADMIN_TOKEN": ""})
    assert token_problem(first) is None and token_problem(second) is None
    assert first != second
    mine = "op-5d9e2a7c1f4b8e3a6d0c"
    assert compose_admin_token(service, {"SEARCH_PROXY_ADMIN_TOKEN": mine}) == mine


def test_environment_of_compose_and_kubernetes_agree() -> None:
    """The compose stack sets every variable the shared config needs (as the Secret does)."""
    proxy = yaml.safe_load(COMPOSE.read_text())["services"]["search-proxy"]
    needed = required_env(K8S_CONFIG)
    assert needed <= set(proxy["environment"])
    assert os.path.basename(image_config_path()) == K8S_CONFIG.name
