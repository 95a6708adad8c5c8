"""The parts of `server.workers` that need no process: the key and what `auto` means, the
supervisor's restart backoff, how the fleet's metrics add up, and the combined admin answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config import ConfigError, ConfigErrors, parse_config
from proxy.cores import MAX_WORKERS, cgroup_quota, quota_cpus, workers_for
from proxy.fleet import combine_admin, combine_reloads
from proxy.fleetmetrics import (
    FLEET_RULES,
    Slot,
    families,
    fleet_exposition,
    merge,
    retire,
    retire_worker,
    write_snapshot,
    write_supervisor,
)
from proxy.metrics import BREAKER_STATES, Metrics
from proxy.supervisor import MAX_BACKOFF_S, restart_delay

ROUTE = {"prefix": "/t", "upstream": "http://127.0.0.1:9"}
REDIS = {"url": "redis://127.0.0.1:6379/0"}


def config(server: dict[str, object], **top: object):
    return parse_config({"server": server, "routes": {"t": ROUTE}, **top}, {})


# --------------------------------------------------------------------------- the key


def test_workers_is_1_by_default_a_number_or_auto():
    assert config({}).server.workers == 1
    assert config({"workers": 4}, redis=REDIS).server.workers == 4
    from_env = {"server": {"workers": "${W}"}, "redis": REDIS, "routes": {"t": ROUTE}}
    assert parse_config(from_env, {"W": "3"}).server.workers == 3
    assert parse_config(from_env, {"W": "auto"}).server.workers == "auto"
    assert config({"workers": "auto"}, redis=REDIS).server.workers == "auto"
    for bad in (0, -1, MAX_WORKERS + 1, "two", 1.5, True):
        with pytest.raises(ConfigError) as info:
            config({"workers": bad}, redis=REDIS)
        assert str(info.value) == (
            f"server.workers: expected a whole number from 1 to {MAX_WORKERS}, or auto, got {bad!r}"
        )


@pytest.mark.parametrize("workers", [2, "auto"])
def test_several_workers_without_redis_are_refused_saying_why_and_what_to_set(workers):
    with pytest.raises(ConfigErrors) as info:
        config({"workers": workers})
    (error,) = info.value.errors
    assert error.path == "server.workers"
    assert "keep rate limits, breakers, the cache and client quotas to themselves" in error.reason
    assert error.reason.endswith(
        "configure redis (a server all workers share; a local redis-server will do) or set "
        "workers: 1"
    )
    assert config({"workers": 1}).redis is None  # one worker: in-process state is whole


def test_a_broken_redis_section_is_reported_once_not_also_as_missing():
    with pytest.raises(ConfigErrors) as info:
        config({"workers": 2}, redis={"url": "http://nope"})
    assert [e.path for e in info.value.errors] == ["redis.url"]


def test_auto_is_one_worker_per_cpu_lowered_to_the_whole_cpus_of_a_quota():
    assert workers_for(8, None) == 8
    assert workers_for(8, 2.0) == 2
    assert workers_for(8, 1.5) == 1  # a worker on half a CPU would be throttled
    assert workers_for(2, 0.5) == 1  # never none
    assert workers_for(4, 16.0) == 4
    assert quota_cpus("max 100000") is None
    assert quota_cpus("250000 100000\n") == 2.5
    assert quota_cpus("garbage") is None


def test_the_cgroup_quota_is_the_smallest_on_the_way_to_the_root(tmp_path: Path):
    pod = tmp_path / "kubepods" / "pod1"
    container = pod / "c1"
    container.mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (pod / "cpu.max").write_text("200000 100000\n")  # the pod's limit: 2 CPUs
    (container / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota("0::/kubepods/pod1/c1\n", tmp_path) == 2.0
    assert cgroup_quota("0::/\n", tmp_path) is None
    assert cgroup_quota("4:memory:/x\n", tmp_path) is None  # cgroup v1 only


# --------------------------------------------------------------------------- restarts


def test_a_crash_loop_backs_off_to_a_bound_and_the_first_restart_is_at_once():
    delays = [restart_delay(n) for n in range(1, 10)]
    assert delays == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, MAX_BACKOFF_S, MAX_BACKOFF_S]


# --------------------------------------------------------------------------- metrics


def worker_metrics(requests: int, in_flight: int, breaker: str, open_s: float) -> Metrics:
    m = Metrics()
    for _ in range(requests):
        m.route("t").observe(200, 0.01, 0.001)
    m.route("t").in_flight.set(in_flight)
    m.breaker_state.labels("t").set(BREAKER_STATES[breaker])
    m.breaker_open_seconds.labels("t").inc(open_s)
    m.identify("1.0", "abc")
    return m


def value(found, name: str, **labels: str) -> float:
    for family in found:
        for sample_name, sample_labels, v in family["samples"]:
            if sample_name == name and all(sample_labels.get(k) == x for k, x in labels.items()):
                return float(v)
    raise AssertionError(f"no {name} {labels}")


def test_the_fleet_sums_work_and_takes_the_worst_or_the_most_of_what_workers_share():
    a = families(worker_metrics(3, 2, "open", 10.0).registry)
    b = families(worker_metrics(4, 1, "closed", 7.0).registry)
    fleet = merge([Slot(live=[a]), Slot(live=[b])])
    ok = {"route": "t", "status_class": "2xx"}
    assert value(fleet, "search_proxy_requests_total", **ok) == 7
    assert value(fleet, "search_proxy_request_duration_seconds_count", route="t") == 7
    assert value(fleet, "search_proxy_request_duration_seconds_bucket", route="t", le="0.01") == 7
    assert value(fleet, "search_proxy_in_flight_requests", route="t") == 3
    assert value(fleet, "search_proxy_breaker_state", route="t") == 2  # max: open
    # Both saw the one breaker open: its time is counted once, not once per worker.
    assert value(fleet, "search_proxy_breaker_open_seconds_total", route="t") == 10
    assert value(fleet, "search_proxy_build_info", version="1.0") == 1
    start_a = value(a, "process_start_time_seconds")
    start_b = value(b, "process_start_time_seconds")
    assert value(fleet, "process_start_time_seconds") == min(start_a, start_b)


def test_every_rule_names_a_metric_the_proxy_exports():
    exported = {
        f"{f['name']}_total" if f["type"] == "counter" else f["name"]
        for f in families(Metrics().registry)
    } | {"search_proxy_redis_up"}
    assert set(FLEET_RULES) <= exported


def test_a_dead_workers_counters_stay_in_its_slot_and_its_gauges_go():
    dead = families(worker_metrics(5, 3, "open", 4.0).registry)
    retired = retire([], dead)
    assert {f["type"] for f in retired} == {"counter", "histogram"}
    retired = retire(retired, families(worker_metrics(1, 0, "closed", 1.0).registry))
    live = families(worker_metrics(2, 1, "closed", 0.0).registry)
    fleet = merge([Slot(retired=retired, live=[live])])
    assert value(fleet, "search_proxy_requests_total", route="t", status_class="2xx") == 8
    assert value(fleet, "search_proxy_in_flight_requests", route="t") == 1  # the live one's
    assert value(fleet, "search_proxy_breaker_open_seconds_total", route="t") == 5


def test_the_run_directory_keeps_counts_across_a_death(tmp_path: Path, monkeypatch):
    monkeypatch.setattr("os.getpid", lambda: 101)
    write_snapshot(tmp_path, 0, families(worker_metrics(3, 0, "closed", 0.0).registry))
    monkeypatch.setattr("os.getpid", lambda: 102)
    write_snapshot(tmp_path, 1, families(worker_metrics(4, 0, "closed", 0.0).registry))
    write_supervisor(tmp_path, {"up": 1, "restarts": 1})
    retire_worker(tmp_path, 1, 102)  # worker 1 died; its replacement has not scraped yet
    assert not (tmp_path / "metrics-1-102.json").exists()
    text = fleet_exposition(tmp_path, 2).decode()
    assert 'search_proxy_requests_total{route="t",status_class="2xx"} 7.0' in text
    assert "search_proxy_workers 1.0" in text
    assert "search_proxy_worker_restarts_total 1.0" in text
    assert text.count("# TYPE search_proxy_requests_total counter") == 1


# --------------------------------------------------------------------------- admin answers


def report(result: str, errors: list[str] | None = None) -> dict[str, object]:
    return {"result": result, "trigger": "admin", "hash": "h", "errors": errors or []}


def test_a_reload_of_the_fleet_fails_if_any_worker_failed_and_names_each():
    answers = {0: (200, report("applied")), 1: (422, report("failed", ["x: y"])), 2: None}
    combined = combine_reloads(answers)
    assert combined["result"] == "failed"
    assert combined["workers"] == [
        {"worker": 0, "result": "applied", "hash": "h", "errors": []},
        {"worker": 1, "result": "failed", "hash": "h", "errors": ["x: y"]},
        {"worker": 2, "result": "unreachable"},
    ]
    both = combine_reloads({0: (200, report("unchanged")), 1: (200, report("applied"))})
    assert both["result"] == "applied"


def test_a_cache_purge_of_the_fleet_adds_up_what_each_worker_dropped():
    answers = {
        0: (200, {"route": "t", "local": 2, "shared": 5}),
        1: (200, {"route": "t", "local": 3, "shared": 5}),
    }
    assert combine_admin("clear_cache", answers) == {
        "route": "t",
        "local": 5,
        "shared": 5,
        "workers": [{"worker": 0, "local": 2}, {"worker": 1, "local": 3}],
    }
    reset = combine_admin("reset_breaker", {0: (200, {"route": "t", "state": "closed"}), 1: None})
    assert reset["workers"] == [
        {"worker": 0, "state": "closed"},
        {"worker": 1, "error": "unreachable"},
    ]
