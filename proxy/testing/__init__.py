"""Test doubles shipped with the package, for agents' test suites as well as ours: the fake search
vendor (`fakevendor`), the proxy with a fake vendor behind each route (`harness`), its pytest
plugin (`plugin`, the `search_proxy` fixture) and `make demo` (`demo`)."""
