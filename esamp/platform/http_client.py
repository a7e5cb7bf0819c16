"""One HTTP request on a connection of its own, with asyncio and nothing else: the small client
that benchmarks/serve_bench.py uses to load a served deployment and the serving middleware uses
to read each rank's side channel, so no HTTP library is needed."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

BAD_ANSWER = 502  # the status given to an answer that is not HTTP


async def request(
    host: str,
    port: int,
    path: str,
    *,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
    timeout: float,
) -> tuple[int, bytes]:
    """``method path`` on ``host:port`` (HTTP/1.1, the connection closed after the answer): the
    status and the body, a chunked body joined. An answer that is not HTTP has status
    ``BAD_ANSWER``. Raises ``OSError`` when there is no connection, ``asyncio.TimeoutError`` when
    connecting or reading the answer takes longer than ``timeout`` seconds."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    try:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)
    if b"transfer-encoding: chunked" in head.lower():
        payload = _unchunk(payload)
    return (int(status[1]) if len(status) > 1 and status[1].isdigit() else BAD_ANSWER), payload


def _unchunk(data: bytes) -> bytes:
    out, rest = [], data
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        if n == 0:
            break
        out.append(rest[:n])
        rest = rest[n + 2 :]
    return b"".join(out)
