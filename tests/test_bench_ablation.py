"""`make bench ablation` (bench/ablation.py): the variants of the every-policy route it measures
are valid configs, each the whole route less exactly its sections, and a section's cost is the
whole route's time less its variant's, round by round."""

from __future__ import annotations

from bench.ablation import DROPS, costs, variants
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
