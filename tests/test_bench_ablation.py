"""`make bench ablation` (bench/ablation.py): the variants of the every-policy route it measures
are valid configs, each the whole route less exactly its sections, and a section's cost is the
whole route's time less its variant's, round by round."""

from __future__ import annotations

from bench.ablation import DROPS, costs, latency_scenario, variants
from bench.core import FULL
from proxy.config import parse_config


def test_each_variant_is_a_valid_route_less_exactly_its_sections() -> None:
    found = variants("http://127.0.0.1:9")
    every = found["every policy"][FULL]
    assert set(DROPS.values()) <= {(k,) for k in every} | {("search", "fallback")}
    for name, sections in DROPS.items():
        route = found[f"without {name}"][FULL]
        assert set(every) - set(route) == set(sections), name
        assert all(route[k] == every[k] for k in route), name
    assert set(found["no policy"][FULL]) == {"prefix", "upstream"}
    for name, routes in found.items():
        config = parse_config({"routes": routes})  # a variant the proxy would refuse fails here
        assert set(config.routes) == {FULL, "other"}, name


def test_a_sections_cost_is_the_whole_less_the_route_without_it_per_round() -> None:
    us = {"every policy": [300.0, 310.0]}
    us |= {f"without {name}": [290.0, 280.0] for name in DROPS}
    us["without cache"] = [230.0, 250.0]
    found = costs(us)
    assert set(found) == set(DROPS)
    assert found["cache"] == [70.0, 60.0]  # round by round, not medians apart
    assert found["retry"] == [10.0, 30.0]


def test_the_c1_scenario_reports_added_p50_and_cpu_per_round() -> None:
    names = ["bare forwarder", "every policy", "no policy", *(f"without {n}" for n in DROPS)]
    p50 = {name: [595.0, 585.0] for name in names}  # each section adds +5 us
    p50["bare forwarder"] = [400.0, 420.0]
    p50["every policy"] = [600.0, 590.0]  # +200 and +170 over the bare forwarder, round by round
    p50["no policy"] = [410.0, 440.0]
    p50["without cache"] = [500.0, 520.0]  # the cache adds +100 and +70
    cpu = {name: [250.0, 250.0] for name in names}
    cpu["every policy"] = [440.0, 420.0]
    found = latency_scenario(p50, cpu)
    figures = {f.label: f.text for f in found.figures}
    assert figures["every policy, miss, added p50"] == "+185 us"
    assert figures["its added CPU"] == "+180 us/request"
    assert figures["no policy, added p50"] == "+15 us"
    costs_from = next(i for i, line in enumerate(found.details) if "added p50 (" in line) + 1
    listed = [line.split()[0] for line in found.details[costs_from:]]
    assert listed[0] == "cache"  # the largest first
    assert "+85 (min +70, max +100, n=2) us" in found.details[costs_from]
    assert len(listed) == len(DROPS)
