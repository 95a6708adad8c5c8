"""The pipelined connection a URL's (or a Sentinel master's) commands share
(policies/core/redisline.py), against a real redis-server: each caller gets its own reply in
order, a caller that gives up costs nobody else theirs, a stalled or broken connection fails its
own callers and the next command opens a new one."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis import Redis as SyncRedis
from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from policies.core.outcome import Outcome
from policies.core.redisclient import connect
from policies.core.redisconfig import RedisConfig
from policies.core.redisline import (
    LARGE,
    MAX_CARRIED,
    RETIRED_FOR,
    ConnectionDropped,
    LineScript,
    PipelinedRedis,
    _Line,
    pack,
)
from testkit.redisserver import RedisServer
from testkit.waiting import eventually


@pytest.fixture
async def line(redis_server: RedisServer) -> AsyncIterator[PipelinedRedis]:
    client = connect(RedisConfig(url=redis_server.url), 0.5)
    assert isinstance(client, PipelinedRedis)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def other(redis_server: RedisServer) -> AsyncIterator[Redis]:
    """A plain redis-py client beside the line, to pause Redis and to look at it."""
    client = Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        await client.aclose()


async def reads_processed(client: Redis) -> int:
    return int((await client.info("stats"))["total_reads_processed"])


async def retire_with_a_caller_waiting(
    line: PipelinedRedis, other: Redis
) -> tuple[_Line, asyncio.Future[Any], asyncio.Future[Any]]:
    """Redis paused for 300 ms; a GET stuck on the line past its stalled_after (50 ms); a
    second GET, which retires the line and opens a new one: (the retired line, the stuck GET,
    the second GET)."""
    await other.set("s", "ok")
    line.stalled_after = 0.05
    await line.ping()
    retired = line._line
    assert retired is not None
    await other.execute_command("CLIENT", "PAUSE", "300", "ALL")
    stuck = asyncio.ensure_future(line.get("s"))
    await asyncio.sleep(0.1)
    fresh = asyncio.ensure_future(line.get("s"))
    await asyncio.sleep(0)
    return retired, stuck, fresh


async def test_a_burst_goes_out_in_one_write_and_each_caller_gets_its_own_reply(
    line: PipelinedRedis, other: Redis
) -> None:
    await other.mset({f"k{i}": f"v{i}" for i in range(50)})
    await line.ping()  # open
    before = await reads_processed(other)
    found = await asyncio.gather(*(line.get(f"k{i}") for i in range(50)))
    assert found == [f"v{i}".encode() for i in range(50)]
    # redis-py's own client reads 50 commands in 50 reads of 16 connections; here Redis reads
    # the burst from one connection in a read or two (`other` adds its own INFO).
    assert await reads_processed(other) - before <= 4
    listing = await other.client_list()
    assert len(listing) == 2  # the line, and `other`


async def test_an_error_reply_goes_to_its_own_caller_only(line: PipelinedRedis) -> None:
    await line.hset("a-hash", "f", "1")
    found = await asyncio.gather(
        line.set("plain", "1"), line.incr("a-hash"), line.get("plain"), return_exceptions=True
    )
    assert found[0] is True  # SET's reply through redis-py's own callback
    assert isinstance(found[1], ResponseError) and "WRONGTYPE" in str(found[1])
    assert found[2] == b"1"


async def test_a_caller_that_gives_up_costs_nobody_else_their_reply(
    line: PipelinedRedis, other: Redis
) -> None:
    await other.mset({"g1": "one", "g2": "two", "g3": "three", "g4": "four"})
    first_id = await line.client_id()
    await other.execute_command("CLIENT", "PAUSE", "200", "ALL")
    a = asyncio.ensure_future(line.get("g1"))
    b = asyncio.ensure_future(line.get("g2"))
    c = asyncio.ensure_future(line.get("g3"))
    await asyncio.sleep(0.02)
    b.cancel()
    assert await a == b"one"
    assert await c == b"three"
    assert b.cancelled()
    assert await line.get("g4") == b"four"  # g2's late reply was dropped, not handed on
    assert await line.client_id() == first_id  # the same connection throughout


async def test_a_stalled_line_is_retired_its_callers_wait_and_the_next_command_opens_a_new_one(
    line: PipelinedRedis, other: Redis
) -> None:
    await other.set("s", "ok")
    line.stalled_after = 0.05
    first_id = await line.client_id()
    await other.execute_command("CLIENT", "PAUSE", "300", "ALL")
    stuck = asyncio.ensure_future(line.get("s"))
    await asyncio.sleep(0.1)
    assert not stuck.done()  # waiting on the paused Redis
    fresh = asyncio.ensure_future(line.get("s"))
    # Both answered once Redis is: the stuck one on its own line, within its own time.
    assert await stuck == b"ok"
    assert await fresh == b"ok"  # on a new connection
    assert await line.client_id() != first_id
    # The retired line closed once nobody waited on it.
    listing = await other.client_list()
    assert first_id not in {int(c["id"]) for c in listing}
    assert len(listing) == 2  # the new line, and `other`


async def test_a_retired_line_closes_as_soon_as_its_last_caller_gives_up(
    line: PipelinedRedis, other: Redis
) -> None:
    retired, stuck, fresh = await retire_with_a_caller_waiting(line, other)
    assert retired.retiring and not retired.broken  # its caller still waits
    stuck.cancel()  # as its timeout would
    reader = retired._reader
    assert reader is not None
    # Closed while Redis is still paused, not when its answer comes.
    await asyncio.wait_for(asyncio.gather(reader, return_exceptions=True), 0.2)
    assert retired.broken
    assert await fresh == b"ok"


async def test_a_loop_too_busy_to_read_fails_nobody(line: PipelinedRedis, other: Redis) -> None:
    """A reply already in the socket while the loop is busy for longer than `stalled_after`
    (a CPU-bound stretch): the next command retires the line, and the earlier caller still
    gets its reply (dropping the line would have failed it and marked Redis down)."""
    await other.mset({"early": "1", "late": "2"})
    line.stalled_after = 0.05
    await line.ping()
    early = asyncio.ensure_future(line.get("early"))
    for _ in range(3):  # queued, then written
        await asyncio.sleep(0)
    time.sleep(0.15)  # noqa: ASYNC251  # the point: the loop serves nothing; the reply arrives
    late = await line.get("late")
    assert late == b"2"
    assert await early == b"1"


async def test_a_dropped_connection_sends_its_commands_once_more_on_a_new_one(
    line: PipelinedRedis, redis_server: RedisServer
) -> None:
    await line.mset({f"d{i}": str(i) for i in range(5)})
    first_id = await line.client_id()
    # Killed from outside while this loop does nothing: the commands below are written to a
    # connection Redis has closed, and learn of it from the reader.
    with SyncRedis.from_url(redis_server.url) as killer:
        assert killer.client_kill_filter(_id=first_id) == 1
    found = await asyncio.gather(*(line.get(f"d{i}") for i in range(5)))
    assert found == [str(i).encode() for i in range(5)]
    assert await line.client_id() != first_id


async def test_a_line_that_broke_while_a_caller_waited_for_it_to_open_sends_on_a_new_one(
    line: PipelinedRedis,
) -> None:
    await line.set("w", "ok")
    await line.aclose()  # the next command opens a new line
    waiting = asyncio.ensure_future(line.get("w"))
    await asyncio.sleep(0)  # it waits on the connect
    opening = line._line._opening if line._line is not None else None
    assert opening is not None and not opening.done()
    # Its socket broke after the connect finished and before the waiting caller resumes.
    broken = ConnectionDropped("broken under it")
    opening.add_done_callback(lambda _: line._line.drop(broken) if line._line else None)
    assert await asyncio.wait_for(waiting, 2.0) == b"ok"


async def test_a_large_command_takes_a_pooled_connection_of_its_own(
    line: PipelinedRedis, other: Redis
) -> None:
    big = b"y" * LARGE
    await line.ping()
    assert await line.set("big", big) is True
    assert await line.get("big") == big  # a large reply is read on the line
    listing = await other.client_list()
    assert len(listing) == 3  # the line, the pooled connection, `other`
    assert await line.set("small", "1") is True
    assert len(await other.client_list()) == 3  # a small one does not


async def test_a_server_gone_fails_the_waiting_callers_at_once_and_the_line_reopens() -> None:
    server = RedisServer()
    server.start()
    line = connect(RedisConfig(url=server.url), 5.0)  # timeouts far past what this waits
    pauser = Redis.from_url(server.url)
    try:
        await line.set("r", "1")
        await pauser.execute_command("CLIENT", "PAUSE", "5000", "ALL")
        waiting = [asyncio.ensure_future(line.get("r")) for _ in range(3)]
        await asyncio.sleep(0.05)
        server.stop()
        done, _ = await asyncio.wait(waiting, timeout=2.0)
        assert len(done) == 3
        for task in waiting:
            assert isinstance(task.exception(), RedisConnectionError)
        with pytest.raises(RedisConnectionError):
            await line.get("r")  # nobody listening: refused, not left waiting
        server.start()  # on the same port
        await line.set("r", "2")
        assert await line.get("r") == b"2"
    finally:
        await line.aclose()
        await pauser.aclose()
        server.stop()


async def test_a_connect_nobody_waits_for_any_more_fails_without_a_word(
    redis_server: RedisServer,
) -> None:
    """A server that accepts and never answers the handshake: the caller gives up first; the
    connect's failure, heard by nobody, must not reach asyncio's handler ("Task exception was
    never retrieved", with its traceback, in the logs)."""
    reported: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = silent.sockets[0].getsockname()[1]
    line = connect(RedisConfig(url=f"redis://127.0.0.1:{port}/0"), 0.1)
    try:
        caller = asyncio.ensure_future(line.ping())
        await asyncio.sleep(0.02)
        caller.cancel()
        await asyncio.sleep(0.3)  # the handshake's 100 ms read timeout has passed
        line.connection_pool.connection_kwargs["port"] = redis_server.port
        assert await line.ping() is True  # a new line, to a server that answers
        del caller  # (its CancelledError's frames hold the old line)
        gc.collect()
        await asyncio.sleep(0)
        assert reported == []
    finally:
        loop.set_exception_handler(None)
        await line.aclose()
        silent.close()


async def test_a_line_closed_under_a_caller_waiting_to_open_is_not_sent_again(
    line: PipelinedRedis, other: Redis
) -> None:
    """Closed by the client (its first, synchronous step), not by a broken socket: the
    caller gets the error, and no new line opens behind the closing client's back."""
    await line.set("w", "ok")
    await line.aclose()
    waiting = asyncio.ensure_future(line.get("w"))
    await asyncio.sleep(0)  # it waits on the connect
    opened = line._line
    assert opened is not None and opened._opening is not None
    closed = RedisConnectionError("the Redis client closed")
    opened._opening.add_done_callback(lambda _: opened.drop(closed))
    with pytest.raises(RedisConnectionError) as raised:
        await asyncio.wait_for(waiting, 2.0)
    assert not isinstance(raised.value, ConnectionDropped)  # not sent again
    assert line._line is opened  # no new line
    await asyncio.sleep(0.05)  # its reader closes the connection
    assert line._lines == set()
    assert len(await other.client_list()) == 1  # `other` alone


async def test_a_reply_that_cannot_be_read_fails_the_line_without_a_resend(
    redis_server: RedisServer, other: Redis
) -> None:
    """The commands behind an unreadable reply may have run: they are not sent again."""
    decoding = PipelinedRedis.from_url(redis_server.url, decode_responses=True)
    await other.set("bad", b"\xff\xfe")
    try:
        await decoding.ping()
        found = await asyncio.gather(
            decoding.get("bad"), decoding.incr("ctr"), return_exceptions=True
        )
        assert all(type(f) is RedisConnectionError for f in found), found
        assert await other.get("ctr") == b"1"  # INCR ran once
    finally:
        await decoding.aclose()


async def test_closing_the_client_closes_its_retired_lines_too(
    line: PipelinedRedis, other: Redis
) -> None:
    retired, stuck, fresh = await retire_with_a_caller_waiting(line, other)
    assert retired.retiring and not retired.broken
    await line.aclose()
    assert retired.broken and line._lines == set()
    for task in (stuck, fresh):
        with pytest.raises(RedisConnectionError):
            await task


async def test_a_retired_line_gives_up_on_its_callers_after_a_while(
    redis_server: RedisServer, other: Redis
) -> None:
    """A caller with no timeout of its own (the link's callers all have one) is not left
    waiting on a retired line for ever: RETIRED_FOR stalled_after's after it retired."""
    line = connect(RedisConfig(url=redis_server.url), 2.0)  # a handshake outlasts the pause
    assert isinstance(line, PipelinedRedis)
    try:
        await other.set("s", "ok")
        line.stalled_after = 0.05
        await line.ping()
        await other.execute_command("CLIENT", "PAUSE", "1000", "ALL")
        stuck = asyncio.ensure_future(line.get("s"))
        await asyncio.sleep(0.1)
        fresh = asyncio.ensure_future(line.get("s"))  # retires the line
        retired_at = asyncio.get_running_loop().time()
        with pytest.raises(RedisConnectionError) as raised:
            await stuck
        assert not isinstance(raised.value, ConnectionDropped)  # not sent again
        waited = asyncio.get_running_loop().time() - retired_at
        assert RETIRED_FOR * 0.05 * 0.9 <= waited < 0.9  # before the pause ends
        assert await fresh == b"ok"
    finally:
        await line.aclose()


# --- packing and scripts: what the line writes is what redis-py would have written ------------

PACKED_LIKE_REDIS_PY: list[tuple[Any, ...]] = [
    ("GET", "k"),
    ("SET", "k", "", "PX", 5000, "NX"),
    ("EVALSHA", "a" * 40, 2, "p:cache:{r:ab}", "p:cache-lock:{r:ab}", 1733150000.125, "tok", 0),
    ("SET", "naïve ключ 検索", b"\x00\xff raw bytes\r\n", -17, 10**30, 1e-07, float("inf")),
    ("EVALSHA", "b" * 40, 0, 3.0, -0.0, 123456789012345678),
]


@pytest.mark.parametrize("args", PACKED_LIKE_REDIS_PY)
@pytest.mark.parametrize(("encoding", "errors"), [("utf-8", "strict"), ("latin-1", "replace")])
def test_a_command_is_packed_byte_for_byte_as_redis_py_packs_it(
    args: tuple[Any, ...], encoding: str, errors: str
) -> None:
    theirs = Connection(encoding=encoding, encoding_errors=errors).pack_command(*args)
    assert pack(args, encoding, errors) == b"".join(theirs)


@pytest.mark.parametrize(
    "args",
    [
        ("SCRIPT LOAD", "return 1"),  # two words: redis-py sends them as two arguments
        ("GET", memoryview(b"k")),
        ("GET", bytearray(b"k")),
        ("SET", "k", True),  # redis-py refuses it
        ("SET", "k", Outcome.OK),  # a str subclass: redis-py's encoder decides
        (b"GET", "k"),
    ],
)
def test_anything_else_is_left_to_redis_py(args: tuple[Any, ...]) -> None:
    assert pack(args, "utf-8", "strict") is None


@pytest.mark.parametrize("value", [b"x" * LARGE, "x" * LARGE, b"x" * (LARGE // 2)])
def test_a_large_command_is_left_to_redis_py_which_sends_its_value_as_it_is(value: Any) -> None:
    # Two halves reach LARGE together: redis-py then sends each value as a chunk of its own.
    args = ("SET", "k", value) if len(value) == LARGE else ("MSET", "a", value, "b", value)
    assert pack(args, "utf-8", "strict") is None
    assert pack(args[:2], "utf-8", "strict") is not None


async def test_a_script_runs_on_the_line_and_is_loaded_again_after_redis_forgot_it(
    line: PipelinedRedis, other: Redis
) -> None:
    script = line.register_script("return {KEYS[1], ARGV[1], redis.call('INCR', KEYS[1])}")
    assert isinstance(script, LineScript)
    assert await script(keys=["n"], args=["x"]) == [b"n", b"x", 1]
    await other.script_flush()
    # NOSCRIPT: loaded again and sent once more, and the INCR ran once for the two sends.
    assert await script(keys=["n"], args=["y"], client=line) == [b"n", b"y", 2]
    listing = await other.client_list()
    assert len(listing) == 2  # the line and `other`: no pooled connection was taken


async def test_a_script_given_another_client_runs_on_that_client(
    line: PipelinedRedis, other: Redis
) -> None:
    script = line.register_script("return redis.call('INCR', KEYS[1])")
    async with other.pipeline(transaction=False) as pipe:
        await script(keys=["p"], client=pipe)
        await script(keys=["p"], client=pipe)
        assert await pipe.execute() == [1, 2]
    assert await script(keys=["p"], client=other) == 3


async def test_a_script_sends_the_same_arguments_again_after_redis_forgot_it(
    line: PipelinedRedis, other: Redis
) -> None:
    script = line.register_script("return {#KEYS, unpack(ARGV)}")
    await other.script_flush()
    # An iterator is read once: the second send (after NOSCRIPT) carries what the first did.
    assert await script(keys=iter(["k"]), args=(a for a in ["g1", "g2"])) == [1, b"g1", b"g2"]


async def test_a_redis_that_stops_reading_holds_at_most_max_carried_bytes_on_the_line() -> None:
    """Redis frozen (SIGSTOP): nothing it was sent is read, so everything written stays in
    this process's buffers. 40 commands of 60 KB: the line takes what fits in MAX_CARRIED, the
    rest go to pooled connections, and the line's unsent bytes never pass that bound."""
    server = RedisServer()
    server.start()
    line = connect(RedisConfig(url=server.url), 5.0)
    assert isinstance(line, PipelinedRedis)
    value = b"v" * 60_000
    try:
        await line.ping()  # open
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        sets = [asyncio.ensure_future(line.set(f"f{i}", value)) for i in range(40)]
        current = line._line
        assert current is not None and current.conn is not None
        # The line fills up to its bound; the commands past it have gone to pooled connections.
        await eventually(lambda: current._carried > MAX_CARRIED - len(value))
        writer = current.conn._writer
        assert writer is not None
        carried = current._carried
        assert MAX_CARRIED - len(value) < carried <= MAX_CARRIED
        assert writer.transport.get_write_buffer_size() <= carried
        for task in sets:
            task.cancel()
        await asyncio.gather(*sets, return_exceptions=True)
    finally:
        if server.proc is not None:
            os.kill(server.proc.pid, signal.SIGCONT)
        await line.aclose()
        server.stop()
