"""`make bench core`'s chain figures (bench/chain.py): each policy's own time, read off timers
around the policies of the every-policy route as the proxy builds it."""

from __future__ import annotations

from bench.chain import every_policy_route, measure, own_seconds


async def test_a_miss_takes_time_in_every_policy_and_a_hit_only_up_to_the_cache() -> None:
    found = await measure(requests=30, rounds=2, warmup=10)
    own = found["own_us"]
    names = [type(p).__name__ for p in every_policy_route().policies]
    assert list(own["miss"]) == names  # every policy, in the chain's order
    assert all(us > 0 for us in own["miss"].values())
    after_cache = names.index("StaleCache") + 1
    assert all(own["hit"][n] > 0 for n in names[:after_cache])
    assert all(own["hit"][n] == 0 for n in names[after_cache:])  # a hit never reaches them
    assert found["total_us"]["miss"] > found["total_us"]["hit"] > 0


def test_a_policys_own_time_is_its_time_less_the_time_of_what_it_called() -> None:
    # Inside each, callees included: 10 s in the first, 7 in the second it calls, 3 in the last.
    assert own_seconds([10.0, 7.0, 3.0]) == [3.0, 4.0, 3.0]
    assert own_seconds([5.0, 5.0, 0.0]) == [0.0, 5.0, 0.0]  # a hit: nothing past the second
