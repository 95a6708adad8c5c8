"""Test doubles and process helpers shared by tests/ and bench/, in the spirit of mitmproxy's
`mitmproxy/test` package: the fake vendor, a real redis-server, the proxy as a child process,
and waiting without sleeping longer than needed. Nothing here is shipped with the proxy."""
