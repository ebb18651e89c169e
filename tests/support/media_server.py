"""A real HTTP server on a free loopback port for the gateway's media fetches: an image,
a 404, redirects (same host, another host name, to file:, a loop, to any URL), bodies over
the cap (declared and streamed) and a slow drip; over TLS too. It counts the connections it
accepted and the requests it answered, so a test can tell that a refused URL reached nothing."""

import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from tests.support.media_helpers import png


class MediaHandler(BaseHTTPRequestHandler):
    image = png()

    def log_message(self, *args):  # quiet
        pass

    def _send(self, body: bytes, status: int = 200, length: int | None = None, **headers) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        port = self.server.server_address[1]
        path = self.path
        self.server.paths.append(path)
        self.server.hosts.append(self.headers.get("Host", ""))
        if path == "/ok.png":
            self._send(self.image, content_type="image/png")
        elif path == "/missing.png":
            self._send(b"nope", status=404)
        elif path == "/redirect":
            self._send(b"", status=302, location="/ok.png")
        elif path == "/redirect-elsewhere":
            self._send(b"", status=302, location=f"http://localhost:{port}/ok.png")
        elif path == "/redirect-file":
            self._send(b"", status=302, location="file:///etc/passwd")
        elif path.startswith("/redirect-to?"):  # /redirect-to?url=<quoted URL>
            self._send(b"", status=302, location=parse_qs(urlsplit(path).query)["url"][0])
        elif path == "/loop":
            self._send(b"", status=302, location="/loop")
        elif path == "/declared-big":
            self._send(b"x" * 10, length=10**9)
        elif path == "/streamed-big":  # no Content-Length: counted while it arrives
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(50):
                self.wfile.write(b"x" * 1000)
        elif path == "/slow":  # headers at once, then a drip that never ends in time
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(20):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self._send(b"?", status=500)


class _CountingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int]):
        super().__init__(address, MediaHandler)
        self.connections = 0  # accepted, whether a request came on them or not
        self.paths: list[str] = []  # the path of every GET answered, in arrival order
        self.hosts: list[str] = []  # and its Host header

    def verify_request(self, request, client_address) -> bool:
        self.connections += 1
        return True


@dataclass
class MediaServer:
    """A running server: `url` its base URL (no trailing slash), `port`, and what reached it."""

    url: str
    port: int
    _server: _CountingServer

    @property
    def connections(self) -> int:
        return self._server.connections

    @property
    def paths(self) -> list[str]:
        return list(self._server.paths)

    @property
    def hosts(self) -> list[str]:
        return list(self._server.hosts)


@contextmanager
def media_server(host: str = "127.0.0.1", tls: ssl.SSLContext | None = None) -> Iterator[MediaServer]:
    """The server on `host` (any loopback address), running in a thread; over TLS with `tls`
    (a server context: its certificate and key loaded)."""
    server = _CountingServer((host, 0))
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    try:
        yield MediaServer(f"{'https' if tls else 'http'}://{host}:{port}", port, server)
    finally:
        server.shutdown()
        server.server_close()
