"""One Redis connection that carries every small command a process sends, pipelined: the
commands requests issue in the same turn of the event loop go out in one write, and one reader
hands each reply to its caller in order. redis-py gives each command a pooled connection of its
own, a write, a read under a timer and its bookkeeping: ~50 us of CPU a command, three times on
a cache miss with Redis configured, which made such a miss cost twice one without Redis. On the
line a command costs ~15 us. The connection is redis-py's own (its handshake, TLS, parser, and
on Sentinel its lookup of the master).

- A caller that stops waiting (a timeout, an agent gone) leaves its reply to be read and
  dropped: the order holds, and nobody else's call fails for it.
- A line whose oldest command has waited past `stalled_after` (Redis stopped answering, a
  partition that sends no reset, a reply of many megabytes, or this loop too busy to read) is
  retired at the next command, which opens a new line: its callers keep waiting for their own
  replies, each within its own timeout, and it closes once none is left, or `RETIRED_FOR`
  stalled_after's later at most. So no command queues behind a dead connection, as none did
  on redis-py's pool, and a slow one fails nobody.
- A connection whose socket breaks (Redis restarted, CLIENT KILL, a Sentinel master demoted)
  fails its callers with `ConnectionDropped`, and each sends its command once more on a new
  line, as redis-py resends once on a connection Redis dropped; never after a timeout. A reply
  that cannot be read (the ones after it may have run) and a client closing fail their callers
  without a resend.
- A command of `LARGE` bytes or more (a big cache entry) takes redis-py's own pooled path, so
  its transfer does not hold the small ones up behind it; so does any command while the line
  carries `MAX_CARRIED` bytes of commands not yet answered (a burst of medium cache entries):
  the pooled path's connections are bounded (the link's `max_connections`), and a burst past
  them waits or goes in-process. So a line never holds more than `MAX_CARRIED` bytes unsent,
  whether or not Redis reads: what it wrote and is unanswered is in that count.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import math
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Final

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.client import EMPTY_RESPONSE, NEVER_DECODE
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

LARGE: Final = 64 * 1024  # bytes of a command sent on a pooled connection of its own
# Bytes of commands a line carries at once (sent and not answered yet, or not sent): what 16
# commands just under LARGE make, the most the link let out before the line had no bound of
# its own. A few thousand small commands fit.
MAX_CARRIED: Final = 16 * LARGE
RETIRED_FOR: Final = 10  # stalled_after's a retired line may wait for its replies


class PipelinedRedis(Redis):
    """A redis.asyncio client whose commands share one pipelined connection (`_Line`);
    everything else (pub/sub, large commands, NEVER_DECODE reads) uses its pool as usual."""

    # Seconds a command may wait for its reply before its line is retired (`connect` sets the
    # link's own give-up time).
    stalled_after = 0.3
    # Where a command taking a pooled connection gets its turn (the link's bound on them):
    # raises PoolBusy when none came.
    pooled_slot: Callable[[], AbstractAsyncContextManager[None]] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._line: _Line | None = None
        self._lines: set[_Line] = set()  # the current one and those retired, until closed

    def _current_line(self) -> _Line:
        line = self._line
        if line is not None and line.stalled():
            line.retire()
        if line is None or not line.open_for_commands:
            line = self._line = _Line(self.connection_pool, self.stalled_after, self._lines)
        return line

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if NEVER_DECODE in options:
            return await self._pooled(args, options)
        try:
            try:
                reply = await self._current_line().call(args)
            except ConnectionDropped:
                reply = await self._current_line().call(args)  # once, on a new connection
        except _TooLarge:
            return await self._pooled(args, options)
        except ResponseError:
            if EMPTY_RESPONSE in options:
                return options[EMPTY_RESPONSE]
            raise
        options.pop(EMPTY_RESPONSE, None)
        options.pop("keys", None)  # for redis-py's client-side cache only
        callback = self.response_callbacks.get(args[0])
        if callback is None:
            return reply
        value = callback(reply, **options)
        return await value if inspect.isawaitable(value) else value

    async def _pooled(self, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
        """redis-py's own way: a pooled connection for the command."""
        if self.pooled_slot is None:
            return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]  # redis-py: unannotated
        async with self.pooled_slot():
            return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]  # redis-py: unannotated

    def register_script(self, script: str | bytes) -> AsyncScript:  # type: ignore[override]  # redis-py annotates `self` as a union of its clients
        return LineScript(self, script)

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        self._line = None
        await asyncio.gather(*(line.close() for line in list(self._lines)))
        await super().aclose(close_connection_pool)


class LineScript(AsyncScript):
    """redis-py's script, sent as its EVALSHA straight to the client that registered it. redis-py's
    own call adds ~4 us a command on the way: copies of keys and args, an import, and an
    isinstance check against its Pipeline that goes through typing's Protocol machinery. Any
    other client (a pipeline) takes redis-py's way."""

    async def __call__(  # type: ignore[no-untyped-def]  # as redis-py's, which is unannotated
        self, keys=None, args=None, client=None
    ):
        if client is not None and client is not self.registered_client:
            return await super().__call__(keys, args, client)
        run = self.registered_client.execute_command
        # Read once, as redis-py does: `args` may be an iterator, and a retry sends the same.
        keys = tuple(keys) if keys else ()
        sent = (len(keys), *keys, *(args or ()))
        try:
            return await run("EVALSHA", self.sha, *sent)
        except NoScriptError:  # Redis restarted, or SCRIPT FLUSH: load it and send it again
            self.sha = await self.registered_client.script_load(self.script)
            return await run("EVALSHA", self.sha, *sent)


def pack(args: tuple[Any, ...], encoding: str, errors: str) -> bytes | None:
    """The command in Redis's protocol, byte for byte what redis-py's `pack_command` writes,
    when its name is one word and its arguments are str, bytes, int or float (every command sent
    here); None for anything else, which redis-py packs. Its packing (an encoder call and three
    joins an argument) was a tenth of a Redis command's CPU. None too once the command reaches
    LARGE bytes: redis-py sends a large value as a chunk of its own, where one buffer would copy
    it twice."""
    name = args[0]
    if type(name) is not str or not name.isalpha():  # 'SCRIPT LOAD': redis-py splits the words
        return None
    word = name.encode()
    parts = [b"*%d\r\n$%d\r\n%b\r\n" % (len(args), len(word), word)]
    size = 0
    for arg in args[1:]:
        kind = type(arg)
        if kind is str:
            data = arg.encode(encoding, errors)
        elif kind is bytes:
            data = arg
        elif kind is int:
            data = b"%d" % arg
        elif kind is float:
            data = repr(arg).encode()
        else:  # memoryview, bytearray, bool (refused), an int subclass ...
            return None
        size += len(data)
        if size >= LARGE:
            return None
        parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


class PoolBusy(Exception):
    """Every pooled connection stayed busy: this process is busy, not Redis down."""


class _TooLarge(Exception):
    """Not for the line: a command of LARGE bytes or more, or one that would take the line past
    MAX_CARRIED."""


class ConnectionDropped(RedisConnectionError):
    """The connection broke under a command (redis-py's ConnectionError from the socket): it
    may be sent once more on a new line."""


class _Line:
    def __init__(self, pool: ConnectionPool, stalled_after: float, live: set[_Line]) -> None:
        self.pool = pool
        self.stalled_after = stalled_after
        self.live = live  # the client's lines: this one is in it until it closes
        live.add(self)
        self.broken = False
        self.why: RedisConnectionError | None = None  # what broke it
        self.retiring = False  # takes no new commands; closes once none waits
        self.loop = asyncio.get_running_loop()
        self.conn: AbstractConnection | None = None
        self._opening: asyncio.Task[AbstractConnection] | None = None
        self._reader: asyncio.Task[None] | None = None
        # Callers in the order their commands were written, with when each was queued.
        self._waiting: collections.deque[tuple[asyncio.Future[Any], float, int]] = (
            collections.deque()
        )
        self._carried = 0  # bytes of the commands in `_waiting`
        self._unsent: list[bytes] = []
        encoder = pool.get_encoder()  # type: ignore[no-untyped-call]  # redis-py: unannotated
        self._encoding: str = encoder.encoding
        self._errors: str = encoder.encoding_errors

    @property
    def open_for_commands(self) -> bool:
        return not (self.broken or self.retiring)

    async def call(self, args: tuple[Any, ...]) -> Any:
        conn = self.conn or await self._open()
        if self.broken:  # broke while this caller waited for it to open: nothing was sent
            why = self.why
            if isinstance(why, ConnectionDropped):
                raise ConnectionDropped(str(why))
            raise RedisConnectionError(str(why) if why else "the Redis connection closed")
        command = pack(args, self._encoding, self._errors)
        packed = [command] if command is not None else conn.pack_command(*args)
        size = sum(map(len, packed))
        if size >= LARGE or self._carried + size > MAX_CARRIED:
            raise _TooLarge
        future: asyncio.Future[Any] = self.loop.create_future()
        if not self._unsent:
            self.loop.call_soon(self._flush)
        self._unsent += packed
        self._waiting.append((future, self.loop.time(), size))
        self._carried += size
        try:
            return await future
        except asyncio.CancelledError:
            if self.retiring:
                self._close_if_idle()
            raise

    def stalled(self) -> bool:
        """Whether its oldest command has waited past `stalled_after`."""
        return bool(self._waiting) and (self.loop.time() - self._waiting[0][1] > self.stalled_after)

    def retire(self) -> None:
        self.retiring = True
        self._close_if_idle()
        if not self.broken:
            # A backstop for callers without a timeout of their own: the link's have all
            # given up by then.
            self.loop.call_later(RETIRED_FOR * self.stalled_after, self._expire)

    def _expire(self) -> None:
        self.drop(RedisConnectionError("Redis did not answer on a retired connection"))

    def _close_if_idle(self) -> None:
        if all(future.done() for future, _, _ in self._waiting):
            self.drop(RedisConnectionError("the Redis connection was retired"))

    async def _open(self) -> AbstractConnection:
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._connect())
            # Its callers may all have given up: nobody is left to hear how it failed.
            self._opening.add_done_callback(_heard)
        # Shielded: callers that give up do not cancel the others' connect.
        return await asyncio.shield(self._opening)

    async def _connect(self) -> AbstractConnection:
        conn: AbstractConnection = self.pool.make_connection()  # type: ignore[no-untyped-call]  # redis-py: unannotated
        try:
            await conn.connect()  # type: ignore[no-untyped-call]  # redis-py: unannotated
        except BaseException:
            self.broken = True
            self.live.discard(self)
            await conn.disconnect(nowait=True)
            raise
        if self.broken:  # closed while it connected
            self.live.discard(self)
            await conn.disconnect(nowait=True)
            raise RedisConnectionError("the Redis connection closed")
        self.conn = conn
        self._reader = asyncio.ensure_future(self._read(conn))
        return conn

    def _flush(self) -> None:
        unsent, self._unsent = self._unsent, []
        conn = self.conn
        if self.broken or conn is None or not unsent:
            return
        writer = conn._writer  # redis-py's StreamWriter; sending without a drain per command
        if writer is None:
            self.drop(ConnectionDropped("the Redis connection closed"))
            return
        writer.writelines(unsent)  # at most MAX_CARRIED bytes: see the module's docstring

    async def _read(self, conn: AbstractConnection) -> None:
        try:
            while True:
                try:
                    reply = await conn.read_response(timeout=math.inf, disconnect_on_error=False)
                except ResponseError as exc:  # the command's error, in its place in the order
                    reply = exc
                if not self._waiting:
                    raise RedisConnectionError("Redis answered a command nobody sent")
                future, _, size = self._waiting.popleft()
                self._carried -= size
                if not future.done():  # else its caller gave up
                    if isinstance(reply, ResponseError):
                        future.set_exception(reply)
                    else:
                        future.set_result(reply)
                if self.retiring and all(f.done() for f, _, _ in self._waiting):
                    self.drop(RedisConnectionError("the Redis connection was retired"))
                    return
        except asyncio.CancelledError:
            self.drop(RedisConnectionError("the Redis connection closed"))
            raise
        except RedisConnectionError as exc:  # the socket broke (redis-py wraps OSError so)
            self.drop(ConnectionDropped(str(exc) or "the Redis connection closed"))
        except Exception as exc:  # a reply it could not read: the ones after it may have run
            self.drop(
                RedisConnectionError(f"a reply from Redis could not be read: {_describe(exc)}")
            )
        finally:
            self.live.discard(self)
            await conn.disconnect(nowait=True)

    def drop(self, exc: RedisConnectionError) -> None:
        """Fail every command on the line with `exc`; the reader closes the connection."""
        if self.broken and not self._waiting:
            return
        self.broken = True
        self.why = exc
        waiting, self._waiting = self._waiting, collections.deque()
        self._carried = 0
        self._unsent = []
        for future, _, _ in waiting:
            if not future.done():
                future.set_exception(exc)
        reader = self._reader
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()

    async def close(self) -> None:
        self.drop(RedisConnectionError("the Redis client closed"))
        self.live.discard(self)
        reader = self._reader
        if reader is not None:
            await asyncio.gather(reader, return_exceptions=True)
        elif self._opening is not None:
            await asyncio.gather(self._opening, return_exceptions=True)


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _heard(task: asyncio.Task[AbstractConnection]) -> None:
    """Mark a connect's failure as heard, so that asyncio does not log it as never retrieved
    (its callers, if any, raised it already)."""
    if not task.cancelled():
        task.exception()
