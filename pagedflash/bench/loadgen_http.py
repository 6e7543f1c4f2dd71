"""The load generator's HTTP client: an ``httpcore`` connection pool (the HTTP/1.1 layer under httpx,
installed with it) whose ``http://`` connections are plain asyncio streams.

Why not ``httpx.AsyncClient``: its client CPU per streamed chunk, which limits one client process
at high chunk rates. Its reads go through anyio (a cancel scope and exception mapping per read) and its response
layers (decoders, chunker, request context) run for every piece. Client CPU per chunk against
tests/openai_standin.py on a contended 2-core machine (three interleaved runs each): 8 streams of
500 chunks 2 ms apart (one chunk a read) 205-222 us through httpx, 101-118 us through this pool; 64
streams of 400 chunks 5 ms apart (chunks sharing reads) 26-47 us and 16-25 us. JSON parsing, at
about 5 us a chunk, is left as it is. Each request is bounded by the caller's ``asyncio.wait_for``,
so reads and writes here take no timeout of their own. ``https://`` URLs use httpcore's default
backend (TLS through anyio).
"""

from __future__ import annotations

import asyncio
import select
import socket


def _httpcore():
    try:
        import httpcore
    except ImportError as e:
        raise ImportError("bench online needs httpx (and the httpcore it installs): pip install httpx") from e
    return httpcore


def _backend_class():
    httpcore = _httpcore()

    class Stream(httpcore.AsyncNetworkStream):
        def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
            self.reader, self.writer = reader, writer

        async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            return await self.reader.read(max_bytes)

        async def write(self, buffer: bytes, timeout: float | None = None) -> None:
            if buffer:
                self.writer.write(buffer)
                await self.writer.drain()

        async def aclose(self) -> None:
            self.writer.close()

        def get_extra_info(self, info: str):
            sock = self.writer.get_extra_info("socket")
            if info == "socket":
                return sock
            if info == "is_readable":  # httpcore drops a kept-alive connection the server has closed
                if sock is None or self.reader.at_eof():
                    return True
                poll = select.poll()
                poll.register(sock.fileno(), select.POLLIN)
                return bool(poll.poll(0))
            return None

    class AsyncioBackend(httpcore.AsyncNetworkBackend):
        async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
            local = (local_address, 0) if local_address else None
            reader, writer = await asyncio.open_connection(host, port, local_addr=local)
            sock = writer.get_extra_info("socket")
            for option in socket_options or ():
                sock.setsockopt(*option)
            return Stream(reader, writer)

        async def sleep(self, seconds: float) -> None:
            await asyncio.sleep(seconds)

    return AsyncioBackend


def connection_pool(base_url: str, *, connections: int):
    """An ``httpcore.AsyncConnectionPool`` for ``base_url`` with TCP_NODELAY and room for
    ``connections`` requests in flight (a smaller pool would queue requests in the client and count
    the wait as TTFT)."""
    httpcore = _httpcore()
    backend = None if base_url.startswith("https:") else _backend_class()()
    return httpcore.AsyncConnectionPool(max_connections=connections, max_keepalive_connections=connections,
                                        network_backend=backend,
                                        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
