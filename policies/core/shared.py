"""What shared state's callers use at run time, without loading redis-py: the answer meaning
Redis could not be used, and the guard that keeps a late script from acting. The link itself
(policies/core/redislink.py) is imported only where Redis is configured, so a proxy without
Redis never loads redis-py (about 7 MiB of memory); elsewhere it is a type, imported for the
checker alone."""

from __future__ import annotations

import enum
from typing import Final


class Unavailable(enum.Enum):
    """Returned instead of a value when Redis could not be used; callers fall back.

    An enum member, so `if value is UNAVAILABLE: return` narrows the type for the checker.
    """

    UNAVAILABLE = "UNAVAILABLE"

    def __repr__(self) -> str:
        return "UNAVAILABLE"


UNAVAILABLE: Final = Unavailable.UNAVAILABLE

# A script's answer meaning "not done: past not_after, the caller has given up". A caller that
# still receives it was not late: the clock offset is wrong (`resync`).
LATE: Final = -1

# The Lua lines that end a script with LATE once Redis's clock is past ARGV[i] (ms; 0 = unknown).
LATE_GUARD_LUA: Final = """
local function too_late(not_after)
  local limit = tonumber(not_after)
  if limit == nil or limit <= 0 then return false end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000 > limit
end
"""
