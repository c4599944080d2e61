"""A fault-injecting HTTP proxy for tests: put it in front of a real server (a moto S3 server) and it forwards
every request, except that chosen ones are answered with a 5xx or have their body cut off midway.

    with FaultProxy(moto_endpoint) as proxy:
        proxy.fail(r"/snapshots/.*\\.msgpack$", nth=1, fault="cut")   # the first matching GET loses its body
        proxy.fail(r"/refs/latest$", nth=2, fault=503)
        ... AWS_ENDPOINT_URL=proxy.url ...
        assert proxy.count(r"/refs/latest$") == 3

Requests are counted per fault, by the path (query string excluded) matching the regular expression;
``nth`` counts from 1. A "cut" fault sends the upstream status and headers, with the full Content-Length, then
half the body, then closes the connection: what a connection reset mid-body looks like to the client.
"""

from __future__ import annotations

import http.client
import http.server
import re
import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Literal
from urllib.parse import urlsplit

Fault = Literal["cut", 500, 503]
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


@dataclass
class _Rule:
    pattern: re.Pattern[str]
    nth: int
    fault: Fault
    seen: int = 0


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream_host, self.upstream_port = parts.hostname or "127.0.0.1", parts.port or 80
        self._rules: list[_Rule] = []
        self._paths: list[str] = []
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    def fail(self, path_pattern: str, *, nth: int, fault: Fault) -> None:
        """Answer the ``nth`` request whose path matches ``path_pattern`` with ``fault``."""
        with self._lock:
            self._rules.append(_Rule(re.compile(path_pattern), nth, fault))

    def count(self, path_pattern: str) -> int:
        """How many requests so far had a path matching ``path_pattern``."""
        pattern = re.compile(path_pattern)
        with self._lock:
            return sum(1 for path in self._paths if pattern.search(path))

    def _fault_for(self, path: str) -> Fault | None:
        with self._lock:
            self._paths.append(path)
            fault = None
            for rule in self._rules:
                if rule.pattern.search(path):
                    rule.seen += 1
                    if rule.seen == rule.nth and fault is None:
                        fault = rule.fault
            return fault

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler_class(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy._fault_for(urlsplit(self.path).path)
                if fault in (500, 503):
                    self._answer_error(int(fault))
                    return
                upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                    upstream.request(self.command, self.path, body=body or None, headers=headers)
                    response = upstream.getresponse()
                    payload = response.read()
                    self.send_response(response.status, response.reason)
                    for key, value in response.getheaders():
                        if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                            self.send_header(key, value)
                    length = int(response.getheader("Content-Length") or len(payload))
                    self.send_header("Content-Length", str(length))
                    self.end_headers()
                    if self.command == "HEAD":
                        return
                    if fault == "cut" and payload:
                        self.wfile.write(payload[: len(payload) // 2])
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    self.wfile.write(payload)
                finally:
                    upstream.close()

            def _answer_error(self, status: int) -> None:
                code = "InternalError" if status == 500 else "ServiceUnavailable"
                body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward  # noqa: N815 (the http.server names)

            def log_message(self, *args: object) -> None:
                pass

        return Handler
