"""Resilience policies composed per route: retry, rate limit, breaker, cache, search recovery."""
