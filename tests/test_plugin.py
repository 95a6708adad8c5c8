"""The pytest plugin as an agent developer gets it: the package's wheel, built and installed
(unpacked onto PYTHONPATH: pure Python), loads its `search_proxy` fixture through the `pytest11`
entry point into a project of its own (a temporary directory with its own conftest.py and no
search-proxy source), where a LangGraph-style loop (a fake chat model calling langchain-tavily's
tool) runs through the proxy while the fixture injects vendor faults."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

from testkit.procs import ROOT

CONFTEST = '''
"""An agent project's conftest: its own proxy config, and its agent loop."""

import pytest
from langchain_core.messages import HumanMessage


@pytest.fixture
def search_proxy_config():
    """The project's config: Tavily, failing over to Exa; its keys are the proxy's."""
    def route(vendor, origin, header, value, **more):
        return {
            "prefix": f"/{vendor}",
            "upstream": origin,
            "headers": {"set": {header: value}},
            "search": {"vendor": vendor},
            "retry": {"attempts": 2, "backoff": {"initial": "10ms", "max": "20ms"}},
            **more,
        }

    return {
        "routes": {
            "tavily": route(
                "tavily", "https://api.tavily.com", "Authorization", "Bearer tvly-proxy",
                fallback={"providers": ["exa"]},
            ),
            "exa": route("exa", "https://api.exa.ai", "x-api-key", "exa-proxy"),
        }
    }


def run_agent(model, tools, question):
    """The agent loop: the model answers or calls tools, until it answers."""
    messages = [HumanMessage(question)]
    by_name = {tool.name: tool for tool in tools}
    while True:
        reply = model.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return messages
        for call in reply.tool_calls:
            messages.append(by_name[call["name"]].invoke(call))
'''

TESTS = '''
import json
import os

from conftest import run_agent
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, ToolMessage
from langchain_tavily import TavilySearch

QUESTION = "What does the EU AI act regulate?"


def agent(search_proxy):
    """A model that searches once, then answers; the Tavily tool pointed at the proxy."""
    model = FakeMessagesListChatModel(
        responses=[
            AIMessage(
                "",
                tool_calls=[{"name": "tavily_search", "args": {"query": "EU AI act"}, "id": "c1"}],
            ),
            AIMessage("It regulates AI systems by risk."),
        ]
    )
    tool = TavilySearch(
        max_results=2, tavily_api_key="agent-key", api_base_url=search_proxy.url_for("tavily")
    )
    return model, [tool]


def tool_output(messages):
    """What the tool said, as the LLM reads it."""
    (message,) = [m for m in messages if isinstance(m, ToolMessage)]
    return message.content


def test_the_agent_answers_while_tavily_is_down(search_proxy):
    search_proxy.fail("tavily", 503)  # until the test ends
    messages = run_agent(*agent(search_proxy), QUESTION)
    assert messages[-1].content == "It regulates AI systems by risk."
    found = json.loads(tool_output(messages))
    assert [r["url"] for r in found["results"]] == [
        "https://example.com/eu-ai-act/1",
        "https://example.com/eu-ai-act/2",
    ]
    assert found["search_proxy"] == {"provider": "exa", "why": "tavily failed: upstream 503"}
    assert search_proxy.calls("tavily") == 2 and search_proxy.calls("exa") == 1
    assert search_proxy.requests("exa")[0].headers["x-api-key"] == "exa-proxy"


def test_a_blip_never_reaches_the_agent(search_proxy):
    search_proxy.disconnect("tavily", times=1)
    found = json.loads(tool_output(run_agent(*agent(search_proxy), QUESTION)))
    assert "search_proxy" not in found and len(found["results"]) == 2
    assert search_proxy.calls("tavily") == 2 and search_proxy.calls("exa") == 0


def test_the_fixture_is_the_installed_packages_entry_point(request):
    plugin = request.config.pluginmanager.get_plugin("search_proxy")
    assert plugin.__name__ == "proxy.testing.plugin"
    assert plugin.__file__.startswith(os.environ["INSTALLED_SITE"])


def test_when_every_vendor_fails_the_llm_reads_what_was_tried(search_proxy):
    search_proxy.disconnect("tavily")
    search_proxy.fail("exa", 503, retry_after=20)
    said = tool_output(run_agent(*agent(search_proxy), QUESTION))
    assert (
        "Error 502: All 2 providers failed: tavily unreachable after 2 attempts, exa 503 (retry "
        "after 20s). Retry in 20s."
    ) in said
    assert "127.0.0.1" not in said
'''


def build_wheel(tmp: Path) -> Path:
    """The package's wheel, built from the files it is made of (not the work tree's caches)."""
    source = tmp / "source"
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    for package in ("proxy", "policies"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__py*"))
    out = tmp / "wheel"
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*pip, "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = out.glob("search_proxy-*.whl")
    return wheel


def test_an_agent_project_runs_its_agent_through_the_fixture_with_injected_faults(
    tmp_path: Path,
) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(build_wheel(tmp_path)) as wheel:
        wheel.extractall(site)  # a pure-Python wheel, installed
    project = tmp_path / "agent-project"
    project.mkdir()
    (project / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (project / "test_agent.py").write_text(textwrap.dedent(TESTS))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "PYTHON"))}
    env["PYTHONPATH"] = env["INSTALLED_SITE"] = str(site)

    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed" in done.stdout, done.stdout
