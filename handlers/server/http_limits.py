"""What a client may hold of the server before its request is known: uvicorn's httptools parser keeps a request's
line and headers in memory without any limit (four connections sending 64 MiB of headers each grew a server by
294 MB, no key needed), and accepts any number of connections.

``bounded_protocol`` gives uvicorn a protocol that answers 431 and closes a connection whose request line and
headers pass ``max_head_bytes`` (64 KiB by default: nginx's large_client_header_buffers, 4 x 8 KiB, is of that
order), and 503 at once to a connection past ``max_connections`` open ones, before reading anything from it
(`warmstart serve --max-header-bytes --max-connections`). Either answer is followed by a short lingering close, as
nginx does: what the client still sends is read and dropped for LINGER_SECONDS, since closing a socket with unread
data resets the connection and the client would never see the answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

LINGER_SECONDS = 2.0


def _response(status: str, message: str, extra: str = "") -> bytes:
    body = message.encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}\r\n"
            f"{extra}connection: close\r\n\r\n").encode() + body


def bounded_protocol(max_head_bytes: int, max_connections: int) -> type:
    """An HttpToolsProtocol with those two bounds, for uvicorn.Config(http=...)."""
    too_large = _response("431 Request Header Fields Too Large",
                          f"the request line and headers pass {max_head_bytes} bytes")
    too_many = _response("503 Service Unavailable", f"this server holds {max_connections} connections already; "
                         "retry later", "retry-after: 1\r\n")

    class BoundedHttpTools(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0
            self._in_head = True  # from the connection's first byte, and again from each request's first byte
            self._refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse(too_many)

        def _refuse(self, answer: bytes) -> None:
            self._refused = True
            self.transport.write(answer)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            asyncio.get_running_loop().call_later(LINGER_SECONDS, self.transport.close)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes = True, 0

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            if self._refused or self.transport.is_closing():
                return  # dropped
            super().data_received(data)
            # Counted after parsing: bytes that arrive while the head is still incomplete are all head (a chunk that
            # also ends an earlier request counts whole; at worst one read's worth too early).
            if self._in_head and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > max_head_bytes:
                    self._refuse(too_large)

    return BoundedHttpTools
