"""A real HTTP server on a free loopback port for the gateway's media fetches: an image,
a 404, redirects (same host, another host name, to file:, a loop), bodies over the cap
(declared and streamed) and a slow drip."""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from media_helpers import png


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


@contextmanager
def media_server() -> Iterator[str]:
    """The server running in a thread; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), MediaHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
