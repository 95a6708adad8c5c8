// An agent on the official TypeScript MCP SDK, driven line by line (tests/test_mcp_ts_client.py):
//
//     MCP_TS_MODULES=.venv/node_modules node testkit/mcpts.mjs
//
// Each line on stdin is one JSON command with an "id"; each gets one JSON line on stdout with
// that id, {"id", "ok": true, ...} or {"id", "ok": false, "error": "<message>", "code": <HTTP
// status or JSON-RPC code>}, when it is done: commands run concurrently (a "close" can end a
// "call" still waiting). Commands ("name" picks one of several clients):
//   {"op": "version"}
//   {"op": "connect", "name", "url", "headers"?, "sessionId"?}  -> {"sessionId"}
//       (with "sessionId": joins that session, as a client reconnecting does: no initialize)
//   {"op": "list", "name"}                                      -> {"tools": [names]}
//   {"op": "call", "name", "tool", "arguments", "timeout"?}      -> {"isError", "text"}
//   {"op": "terminate", "name"}   the transport's terminateSession (DELETE)
//   {"op": "close", "name"}       the client's close (aborts what is in flight)
//   {"op": "errors", "name"}      -> {"errors": [what the client's onerror saw]}
//   {"op": "oauth", "url"}        connect with an OAuth client provider and no token
// The SDK is loaded from MCP_TS_MODULES (`make test` installs it into .venv/node_modules).
import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import readline from 'node:readline';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const modules = process.env.MCP_TS_MODULES ?? path.join(here, '..', '.venv', 'node_modules');
const require = createRequire(path.join(modules, 'package.json'));
const { Client } = require('@modelcontextprotocol/sdk/client/index.js');
const { StreamableHTTPClientTransport } = require('@modelcontextprotocol/sdk/client/streamableHttp.js');
const sdkPackage = path.join(modules, '@modelcontextprotocol', 'sdk', 'package.json');
const { version } = JSON.parse(readFileSync(sdkPackage, 'utf8'));

const agents = new Map(); // name -> {client, transport, errors}

function failure(error) {
  return { ok: false, error: String(error?.message ?? error), code: error?.code ?? null };
}

async function connect({ name, url, headers = {}, sessionId }) {
  const transport = new StreamableHTTPClientTransport(new URL(url), {
    requestInit: { headers },
    sessionId,
  });
  const client = new Client({ name: `ts-agent-${name}`, version: '1.0.0' });
  const errors = [];
  client.onerror = (error) => errors.push(String(error?.message ?? error));
  agents.set(name, { client, transport, errors });
  await client.connect(transport);
  return { sessionId: transport.sessionId ?? null };
}

function oauthProvider() {
  const redirect = 'http://127.0.0.1:9/callback';
  return {
    get redirectUrl() { return redirect; },
    get clientMetadata() { return { redirect_uris: [redirect], client_name: 'ts-agent' }; },
    clientInformation() { return undefined; },
    saveClientInformation() {},
    tokens() { return undefined; },
    saveTokens() {},
    redirectToAuthorization() {},
    saveCodeVerifier() {},
    codeVerifier() { return 'verifier'; },
  };
}

const commands = {
  version: async () => ({ version }),
  connect,
  list: async ({ name }) => {
    const { tools } = await agents.get(name).client.listTools();
    return { tools: tools.map((t) => t.name).sort() };
  },
  call: async ({ name, tool, arguments: args, timeout }) => {
    const options = timeout === undefined ? undefined : { timeout };
    const result = await agents.get(name).client.callTool({ name: tool, arguments: args }, undefined, options);
    return { isError: Boolean(result.isError), text: result.content?.[0]?.text ?? '' };
  },
  terminate: async ({ name }) => {
    await agents.get(name).transport.terminateSession();
    return {};
  },
  close: async ({ name }) => {
    await agents.get(name).client.close();
    return {};
  },
  errors: async ({ name }) => ({ errors: agents.get(name).errors }),
  oauth: async ({ url }) => {
    const transport = new StreamableHTTPClientTransport(new URL(url), { authProvider: oauthProvider() });
    const client = new Client({ name: 'ts-agent-oauth', version: '1.0.0' });
    await client.connect(transport);
    return {};
  },
};

async function run(line) {
  let command = {};
  let answer;
  try {
    command = JSON.parse(line);
    answer = { ok: true, ...(await commands[command.op](command)) };
  } catch (error) {
    answer = failure(error);
  }
  process.stdout.write(`${JSON.stringify({ id: command.id ?? null, ...answer })}\n`);
}

const running = [];
const lines = readline.createInterface({ input: process.stdin });
for await (const line of lines) {
  if (line.trim()) running.push(run(line));
}
// stdin closed: the agents leave (aborting what they still wait for), then the answers go out.
for (const { client } of agents.values()) {
  await client.close().catch(() => {});
}
await Promise.allSettled(running);
