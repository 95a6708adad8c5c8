"""pybreaker, loaded without redis-py. When redis-py is installed, pybreaker imports it at once
for a storage of its own that the proxy never uses (circuits are shared through our link:
policies/breaker/fleet.py), and redis-py with its imports costs a process ~7 MiB. A proxy
without Redis should not pay that, so pybreaker is imported with redis-py marked missing (a
None in sys.modules: import raises ModuleNotFoundError, which pybreaker expects), unless it is
loaded already; the mark goes at once, so a later `import redis` works as usual. The mark is
the process's: this runs at the proxy's import, before it starts any thread (a program that
embeds it imports redis-py on another thread at that moment at its own risk)."""

from __future__ import annotations

import sys

_hidden = "redis" not in sys.modules
if _hidden:
    sys.modules["redis"] = None  # type: ignore[assignment]  # documented: import raises
try:
    import pybreaker
finally:
    if _hidden:
        del sys.modules["redis"]

__all__ = ["pybreaker"]
