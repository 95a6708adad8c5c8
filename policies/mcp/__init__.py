"""MCP routes: a remote MCP server (streamable HTTP) behind the route's policies, per tool call.

An agent's MCP client POSTs JSON-RPC messages to one endpoint and gets JSON or an SSE stream
back (progress notifications, then the result). HTTP-level policies would cache an `initialize`
with another client's session, or retry a whole stream. Here a route's `mcp:` section makes
the proxy read the messages:

- `tools/call` of a tool listed in `idempotent_tools` goes through the route's chain (cache,
  breaker, search recovery, retry, rate limit) as one search would. `McpUpstream`, at the
  bottom, relays the call's progress notifications to the agent as they arrive (`Flow.interim`)
  and hands the chain the final JSON-RPC response, classified: a JSON-RPC error or tool error
  the config marks transient is a 5xx, an empty search result inside the tool's content is
  EMPTY (so the query is simplified), anything else ends the call.
- Everything else (`initialize`, notifications, other methods, tools not known to be
  idempotent, the GET stream, DELETE) passes straight through, never cached or coalesced;
  `initialize` and `notifications/initialized` with the route's retries (policies/mcp/
  lifecycle.py). A session belongs to the credentials that opened it (sessions.py); while the
  server is down, a route with a cache opens sessions itself from what the server last said
  (offline.py), so an agent starting then gets its idempotent tool calls answered stale.

Each attempt goes upstream under an id of its own, and every answer (fresh, retried, cached,
stale) reaches the agent under the agent's own JSON-RPC id. A failure the proxy answers
itself is a tool error (`isError`) carrying the proxy's message for a tool call, a JSON-RPC
error for other requests: an MCP client raises on a non-2xx answer, losing the message.
"""

from policies.mcp.config import (
    KNOWN_SERVERS,
    SECTION,
    TRANSIENT_CODES,
    TRANSIENT_TOOL_ERRORS,
    McpConfig,
    search_profile,
)
from policies.mcp.messages import (
    PROXY_ERROR_CODE,
    Cancelled,
    SseParser,
    assess,
    encode,
    is_response,
    mcp_classifier,
    parse_message,
    rpc_error,
    sse_event,
    tool_error,
)
from policies.mcp.route import McpRoute, McpUpstream, build_route
from policies.mcp.sessions import SessionOwners

__all__ = [
    "KNOWN_SERVERS",
    "PROXY_ERROR_CODE",
    "SECTION",
    "TRANSIENT_CODES",
    "TRANSIENT_TOOL_ERRORS",
    "Cancelled",
    "McpConfig",
    "McpRoute",
    "McpUpstream",
    "SessionOwners",
    "SseParser",
    "assess",
    "build_route",
    "encode",
    "is_response",
    "mcp_classifier",
    "parse_message",
    "rpc_error",
    "search_profile",
    "sse_event",
    "tool_error",
]
