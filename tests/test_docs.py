"""docs/ kept true: every config key, metric and endpoint a page names exists, and every one the
proxy has is named; every link resolves; every `sh` block runs against `make demo`'s proxy (the
demo module as a child process) and the embedding page's Python runs as written.

Config keys are found by asking the parser, as a user would: a probe key in a section is refused
with the list of the keys it allows, and each of those is probed in turn for keys of its own.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from proxy import oauth
from proxy.app import build_admin_app, build_app
from proxy.config import ConfigErrors, parse_config
from proxy.fleetmetrics import FLEET_METRICS, FLEET_RULES
from proxy.loopmetrics import Family
from proxy.metrics import Metrics
from proxy.reload import RESTART_ONLY
from proxy.testing.harness import DEMO_CONFIG
from testkit.procs import ROOT, Child, free_port

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
LINKED = [ROOT / "README.md", ROOT / "deploy" / "README.md", *PAGES]
PROBE = "zz_probe"


def read(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def sections(page: Path, level: str = "## ") -> dict[str, str]:
    """Each `## heading`'s text, up to the next heading of that level."""
    out: dict[str, str] = {}
    heading = ""
    for line in read(page).splitlines():
        if line.startswith(level):
            heading = line.removeprefix(level).strip()
            out[heading] = ""
        elif heading:
            out[heading] += line + "\n"
    return out


def first_cells(text: str) -> list[str]:
    """The `code` spans of the first cell of each row of the tables in `text` (a row may
    name several keys: `` `sentinel.username`, `sentinel.password` ``)."""
    cells = []
    for line in text.splitlines():
        if line.startswith("| `"):
            cells += re.findall(r"`([^`]+)`", line.split("|")[1])
    return cells


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


# --------------------------------------------------------------------------- links


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in read(page).splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", LINKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_to_a_file_and_heading(page: Path) -> None:
    text = re.sub(r"^```.*?^```", "", read(page), flags=re.S | re.M)  # code is not links
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not ours to check offline
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no such heading in {file.relative_to(ROOT)}")
    assert not broken, broken


def test_every_page_is_in_the_index() -> None:
    index = read(DOCS / "README.md")
    missing = [p.name for p in PAGES if p.name != "README.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not list {missing}"


# --------------------------------------------------------------------------- config keys

ROUTE = {"prefix": "/t", "upstream": "http://127.0.0.1:9", "search": {"vendor": "tavily"}}


def _allowed(raw: dict[str, Any], path: str) -> list[str] | None:
    """The keys the mapping at `path` allows, from the error about the probe key in it; None
    when the value there is not a mapping of keys."""
    try:
        parse_config(raw, {})
    except ConfigErrors as exc:
        for error in exc.errors:
            if error.path == f"{path}.{PROBE}".lstrip(".") and error.reason.startswith(
                "unknown key"
            ):
                return error.reason.split("(allowed: ", 1)[1].rstrip(")").split(", ")
    return None


def _place(section: str, keys: tuple[str, ...]) -> tuple[dict[str, Any], str]:
    """A config with the probe key under `keys` of the documented `section` (a YAML path as
    the reference's headings write it: `server`, `clients`, `routes.<name>.retry` ...), and the
    YAML path of the mapping the probe is in."""
    route: dict[str, Any] = copy.deepcopy(ROUTE)
    doc: dict[str, Any] = {"routes": {"t": route}}
    if section == "clients":
        root, base = {"token": "t" * 20}, "clients.c"
        doc["clients"] = {"c": root}
    elif section == "profiles":
        root, base = {}, "profiles.p"
        doc["profiles"] = {"p": root}
    elif section == "routes.<name>":
        root, base = route, "routes.t"
    elif section.startswith("routes.<name>."):
        name = section.removeprefix("routes.<name>.")
        root, base = route.setdefault(name, {}), f"routes.t.{name}"
    else:
        root, base = doc.setdefault(section, {}), section
    for key in keys:
        if not isinstance(root.get(key), dict):
            root[key] = {}
        root = root[key]
    root[PROBE] = 1
    return doc, ".".join((base, *keys))


def accepted(section: str) -> dict[str, list[str] | None]:
    """Every key `section` accepts, each with the keys it accepts in turn (None for a key whose
    value is not a mapping), asked of the parser itself."""
    keys = _allowed(*_place(section, ())) or []
    return {key: _allowed(*_place(section, (key,))) for key in keys}


def documented_sections() -> dict[str, str]:
    """docs/configuration.md's `## \\`path\\`` sections by YAML path (`routes.<name>.retry`)."""
    out = {}
    for heading, text in sections(DOCS / "configuration.md").items():
        m = re.match(r"`([^`]+)`", heading)
        if m:
            out[m.group(1)] = text
    return out


def test_every_section_of_the_config_has_its_own_part_in_the_reference() -> None:
    documented = documented_sections()
    top = _allowed({"routes": {"t": ROUTE}, PROBE: 1}, "")
    assert top
    assert set(top) <= {path.split(".")[0] for path in documented}
    for key, nested in accepted("routes.<name>").items():
        if nested is not None and key not in ("timeouts", "headers"):  # a policy's section
            assert f"routes.<name>.{key}" in documented, f"no section for routes.<name>.{key}"


@pytest.mark.parametrize("path", sorted(documented_sections()))
def test_every_key_the_config_accepts_is_documented_and_every_documented_key_exists(
    path: str,
) -> None:
    text = documented_sections()[path]
    if path == "profiles":  # written as a commented YAML example, which must be valid
        (example,) = code_blocks(text, "yaml")
        rows = re.findall(r"^    (\w+):", example, re.M)
        parse_config({**yaml.safe_load(example), "routes": {"t": ROUTE}}, {})
    else:
        rows = [row.removeprefix(f"{path}.") for row in first_cells(text)]
    if path == "clients":
        rows = [row.removeprefix("<name>").lstrip(".") for row in rows if row != "<name>"]
    assert rows, f"{path}: no keys documented"
    keys = accepted(path)
    assert keys, f"{path}: the parser accepts no keys there"

    for row in rows:
        key, _, sub = row.partition(".")
        assert key in keys, f"{path}: documents `{row}`, which the config does not accept"
        if sub:
            assert keys[key] is not None and sub in keys[key], f"{path}: no key `{row}`"
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # fences are no spans
    mentioned = {
        word for span in re.findall(r"`([^`]+)`", prose) for word in re.findall(r"\w+", span)
    }
    for key, nested in keys.items():
        assert key in rows or any(r.startswith(f"{key}.") for r in rows), (
            f"{path}.{key} is accepted but not documented in docs/configuration.md"
        )
        if f"{path}.{key}" in documented_sections():
            continue  # a policy's section, documented in its own part
        for sub in nested or ():
            assert f"{key}.{sub}" in rows or sub in mentioned, (
                f"{path}.{key}.{sub} is accepted but not documented in docs/configuration.md"
            )


# --------------------------------------------------------------------------- metrics


def exported_metrics() -> dict[str, tuple[str, ...]]:
    """Every metric the proxy registers, by its exposed name, with its label names (Redis's
    too, registered only with `redis` configured)."""
    out: dict[str, tuple[str, ...]] = {}
    metrics = Metrics()
    metrics.redis_is_configured(True)
    registry = metrics.registry
    for collector in registry._collector_to_names:  # the registry's own table
        if isinstance(collector, Family):  # proxy/loopmetrics.py
            name, kind, labels = collector.name, collector.kind, collector.labelnames
        elif isinstance(collector, MetricWrapperBase):  # prometheus-client's own
            name, kind = collector._name, collector._type
            labels = tuple(collector._labelnames)
        else:
            continue  # a collector updating another's value at scrape time, or process_*
        exposed = f"{name}_total" if kind == "counter" else name
        out[exposed] = labels
    for name, (kind, _) in FLEET_METRICS.items():  # the supervisor's, with several workers
        out[f"{name}_total" if kind == "counter" else name] = ()
    return out


def documented_metrics() -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for line in sections(DOCS / "metrics.md")["Metrics"].splitlines():
        if not line.startswith("| `search_proxy_"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        labels = cells[-1]
        while "(" in labels:  # label values in parentheses, possibly nested
            labels = re.sub(r"\([^()]*\)", "", labels)
        out[cells[0].strip("`")] = tuple(x.strip() for x in labels.split(",") if x.strip())
    return out


def test_every_metric_is_documented_with_its_labels_and_every_documented_one_exists() -> None:
    exported, documented = exported_metrics(), documented_metrics()
    assert sorted(exported.keys() - documented.keys()) == [], "exported, not in docs/metrics.md"
    assert sorted(documented.keys() - exported.keys()) == [], "in docs/metrics.md, not exported"
    for name, labels in exported.items():
        assert set(documented[name]) == set(labels), f"{name}: labels {labels}"


def test_how_each_metric_adds_up_across_workers_is_documented_as_the_code_does_it() -> None:
    text = sections(DOCS / "metrics.md", "### ")["Several workers"]
    rows = {
        cells[0]: set(re.findall(r"`([a-z_]+)`", cells[1]))
        for line in text.splitlines()
        if line.startswith("| ")
        and len(cells := [c.strip() for c in line.strip("|").split("|")]) == 2
    }
    for rule in ("max", "min"):
        assert rows[rule] == {name for name, how in FLEET_RULES.items() if how == rule}, rule
    assert not rows["summed"] & FLEET_RULES.keys()


# --------------------------------------------------------------------------- endpoints


def served(app: Any) -> set[tuple[str, str]]:
    return {
        (route.method, route.resource.canonical)
        for route in app.router.routes()
        if route.resource is not None and route.method != "HEAD"
    }


def documented_calls(heading: str) -> set[tuple[str, str]]:
    calls = set()
    for cell in first_cells(sections(DOCS / "endpoints.md")[heading]):
        method, _, path = cell.rpartition(" ")
        calls.add((method or "*", path))
    return calls


def test_every_endpoint_of_the_agents_port_is_documented_and_exists() -> None:
    config = parse_config({"routes": {"t": ROUTE}}, {})
    actual = served(build_app(config)) - {("*", "/{tail}"), ("*", "/mcp/")}
    # /admin and /admin/... answer where the admin endpoints are: one row, `/admin/...`.
    actual = {(m, "/admin/..." if p.startswith("/admin") else p) for m, p in actual}
    documented = documented_calls("Reserved endpoints")
    # What an OAuth client looks for, answered by the catch-all when no route serves it: one
    # row of patterns (`/.well-known/oauth-*`), each matching a path of proxy/oauth.py's and
    # every such path matched.
    answered = (*oauth.DISCOVERY, *oauth.ENDPOINTS)
    patterns = {p for _, p in documented if any(fnmatch(a, p) for a in answered)}
    assert all(any(fnmatch(a, p) for p in patterns) for a in answered), patterns
    paths = {p for _, p in documented} - patterns
    assert {p for _, p in actual} == paths
    for method, path in actual:  # "*": every method reaches the handler, which may refuse
        assert method == "*" or (method, path) in documented, (method, path)


def test_every_admin_endpoint_is_documented_and_exists() -> None:
    app = build_app(parse_config({"routes": {"t": ROUTE}}, {}))
    assert served(build_admin_app(app)) == documented_calls("Admin endpoints")


def test_the_reload_section_names_every_restart_only_setting() -> None:
    text = sections(DOCS / "endpoints.md")["Reload (SIGHUP, POST /admin/reload, the file watch)"]
    for path in RESTART_ONLY:
        top, _, key = path.partition(".")
        assert f"`{key or top}`" in text or f"`{path}`" in text, f"{path} is not named"


# --------------------------------------------------------------------------- commands


@pytest.fixture(scope="module")
def demo() -> Iterator[tuple[int, int]]:
    """`make demo`'s proxy (the module it runs), on free ports."""
    port, admin_port = free_port(), free_port()
    argv = [sys.executable, "-m", "proxy.testing.demo", "--port", str(port)]
    child = Child("demo", [*argv, "--admin-port", str(admin_port)], pipe_stdout=True)
    try:
        assert child.proc.stdout is not None
        for line in child.proc.stdout:
            if line.startswith(b"search-proxy demo:"):
                break
        else:
            pytest.fail("the demo did not start")
        yield port, admin_port
    finally:
        child.stop()


SH_BLOCKS = [
    pytest.param(page, i, block, id=f"{page.stem}-{i}")
    for page in PAGES
    for i, block in enumerate(code_blocks(read(page), "sh"))
]


def run_sh(block: str, port: int, admin_port: int) -> subprocess.CompletedProcess[str]:
    """A documented `sh` block as a reader runs it: in the checkout, the venv's commands on
    PATH, the proxy's documented address being the demo's."""
    script = block.replace(":8080", f":{port}").replace(":8081", f":{admin_port}")
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),  # this checkout's code, whatever the venv's install points at
    }
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_pages_show_commands_to_run() -> None:
    assert len(SH_BLOCKS) >= 5, [p.id for p in SH_BLOCKS]


@pytest.mark.parametrize(("page", "index", "block"), SH_BLOCKS)
def test_every_documented_command_runs(
    demo: tuple[int, int], page: Path, index: int, block: str
) -> None:
    done = run_sh(block, *demo)
    assert done.returncode == 0, f"{page.name} block {index}:\n{block}\n{done.stdout}{done.stderr}"
    assert done.stdout.strip(), f"{page.name} block {index} printed nothing"
    assert '"error":' not in done.stdout, done.stdout  # the proxy's error shape


# --------------------------------------------------------------------------- embedding.md


def python(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """The venv's Python with this checkout's code first, as a reader of the page runs it."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_embedding_example_runs_as_written() -> None:
    (example, *_) = code_blocks(read(DOCS / "embedding.md"), "python")
    done = python("-c", example)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "https://example.com/what-is-a-circuit-breaker/1"


def test_the_fixture_example_passes_in_a_project_of_its_own(tmp_path: Path) -> None:
    """The page's conftest (its config.yaml: the demo's) and test, run by pytest with the
    plugin loaded through the package's entry point, as an agent developer's install has it
    (`make test` installs the package)."""
    _, conftest, test = code_blocks(read(DOCS / "embedding.md"), "python")
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "test_agent.py").write_text(test)
    shutil.copy(DEMO_CONFIG, tmp_path / "config.yaml")
    done = python("-m", "pytest", "-q", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout
