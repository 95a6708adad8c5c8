"""search-proxy: a resilience layer between AI agents and web-search APIs."""

__version__ = "0.1.0"
