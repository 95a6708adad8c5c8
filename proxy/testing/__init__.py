"""Test doubles shipped with the package, for agents' test suites as well as ours: the fake search
vendor (`fakevendor`)."""
