"""A stand-in for the Hugging Face Hub on a loopback port, serving one folder as one
repository over the HTTP endpoints `huggingface_hub.snapshot_download` uses (revision info,
tree listing, HEAD/GET of each file under /resolve/). The client is the real
huggingface_hub: it lays out the cache (HF_HOME) itself, as with the real Hub."""

from __future__ import annotations

import hashlib
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _handler(repo: str, folder: Path) -> type[BaseHTTPRequestHandler]:
    files = {f.name: f for f in sorted(folder.iterdir()) if f.is_file()}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _json(self, payload) -> None:
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _file(self) -> Path | None:
            prefix = f"/{repo}/resolve/"
            if not self.path.startswith(prefix):
                return None
            _revision, _, name = self.path[len(prefix):].split("?")[0].partition("/")
            return files.get(name)

        def _headers(self, path: Path) -> bytes:
            data = path.read_bytes()
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return data

        def do_HEAD(self) -> None:
            path = self._file()
            if path is None:
                self.send_error(404)
                return
            self._headers(path)

        def do_GET(self) -> None:
            api = f"/api/models/{repo}"
            if self.path.startswith(f"{api}/tree/"):
                self._json([{"type": "file", "path": name, "size": f.stat().st_size,
                             "oid": hashlib.sha1(f.read_bytes()).hexdigest()} for name, f in files.items()])
            elif self.path.startswith(f"{api}/revision/"):
                self._json({"id": repo, "sha": COMMIT, "siblings": [{"rfilename": n} for n in files]})
            elif (path := self._file()) is not None:
                self.wfile.write(self._headers(path))
            else:
                self.send_error(404)

    return Handler


@contextmanager
def fake_hub(repo: str, folder: Path):
    """Serve `folder` as model repository `repo`; yields the endpoint URL (HF_ENDPOINT)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(repo, folder))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
