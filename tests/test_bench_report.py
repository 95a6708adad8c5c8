"""`make bench`'s report arithmetic (bench/report.py): figures paired within a round, the order
a round runs its paths in, and how a figure reads next to its target."""

from __future__ import annotations

import pytest

from bench.report import at_most, in_turn, median, per_round


def test_a_round_runs_forwards_then_the_next_backwards() -> None:
    paths = ("bare", "plain", "miss", "hit")
    assert in_turn(paths, 0) == ["bare", "plain", "miss", "hit"]
    assert in_turn(paths, 1) == ["hit", "miss", "plain", "bare"]
    assert in_turn(paths, 2) == in_turn(paths, 0)
    # Over two rounds each path runs right after a different neighbour.
    assert in_turn(paths, 1)[1:] != in_turn(paths, 0)[1:]


def test_a_figure_is_taken_against_the_same_rounds_reference() -> None:
    # The host swung between rounds: the bare forwarder ran at 1,000, 2,000 and 1,000 req/s,
    # and the proxy at 90% of it each time.
    bare = [1000.0, 2000.0, 1000.0]
    proxy = [900.0, 1800.0, 900.0]
    ratios = per_round(proxy, bare, lambda v, a: v / a)
    assert ratios == pytest.approx([0.9, 0.9, 0.9])
    # A slow round for the proxy and a fast one for the bare forwarder, paired by index.
    assert per_round([3.0, 1.0], [1.0, 2.0], lambda v, a: v - a) == [2.0, -1.0]


def test_a_slow_run_reads_as_one_bad_round_not_as_the_figure() -> None:
    # c=1 p50 (ms): the miss adds 0.3 ms over the bare forwarder. The host was slow (+0.8 ms)
    # for the bare forwarder's runs in rounds 2 and 3 and for the miss's run in round 3 only.
    bare = [0.7, 1.5, 1.5]
    miss = [1.0, 1.0, 1.8]
    added = per_round(miss, bare, lambda v, a: v - a)
    assert added == pytest.approx([0.3, -0.5, 0.3])
    assert median(added) == pytest.approx(0.3)
    # The difference of the medians of runs reads -0.5 ms: a target of +0.1 "met" by chance.
    assert median(miss) - median(bare) == pytest.approx(-0.5)


def test_rounds_that_do_not_line_up_are_refused() -> None:
    with pytest.raises(ValueError, match="3 rounds against 2"):
        per_round([1.0, 2.0, 3.0], [1.0, 2.0], lambda v, a: v / a)


def test_a_negative_added_p50_reads_with_one_sign() -> None:
    figure = at_most("every policy, miss", -0.214, 0.1, "{:+.3f} ms")
    assert figure.text == "-0.214 ms"
    assert figure.target == "<= +0.100 ms"
    assert figure.met is True
    assert at_most("every policy, miss", 0.33, 0.1, "{:+.3f} ms").met is False
