"""``esamp.platform.http_client.request``: one request, its status and body, against a local server."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from esamp.platform.http_client import BAD_ANSWER, request


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # a fixed-length answer naming the header it got
        data = json.dumps({"path": self.path, "secret": self.headers.get("X-Secret")}).encode()
        self.send_response(404 if self.path == "/missing" else 200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):  # a chunked answer holding the body it got
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for part in (body[:3], body[3:]):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_get_with_a_header_and_a_status(server):
    status, body = asyncio.run(request("127.0.0.1", server, "/records?group=g", headers={"X-Secret": "s"}, timeout=5))
    assert status == 200 and json.loads(body) == {"path": "/records?group=g", "secret": "s"}
    assert asyncio.run(request("127.0.0.1", server, "/missing", timeout=5))[0] == 404


def test_post_gets_a_chunked_answer_joined(server):
    status, body = asyncio.run(
        request("127.0.0.1", server, "/v1/completions", method="POST", body=b'{"prompt": [1, 2]}', timeout=5)
    )
    assert (status, body) == (200, b'{"prompt": [1, 2]}')


def test_an_answer_that_is_not_http_is_a_bad_answer():
    listener = socket.create_server(("127.0.0.1", 0))

    def answer():
        conn, _ = listener.accept()
        conn.recv(1024)
        conn.sendall(b"hello")
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    try:
        assert asyncio.run(request("127.0.0.1", listener.getsockname()[1], "/", timeout=5)) == (BAD_ANSWER, b"")
    finally:
        listener.close()
