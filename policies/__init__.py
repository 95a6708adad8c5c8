"""Resilience policies composed per route: retry, backoff, rate limit, breaker, cache, search recovery."""
