"""A stand-in for the Hugging Face hub on 127.0.0.1, for the download tests (``HF_ENDPOINT``).

It answers what huggingface_hub asks when it downloads a model repository: the repository's
revision and file tree (``/api/models/ORG/NAME/revision/REV``, ``.../tree/REV``) and each file
(``HEAD``/``GET /ORG/NAME/resolve/REV/PATH``, with the commit, ETag and size headers the hub
sends). Unknown repositories get the hub's 404 ``RepoNotFound``, gated ones its 403 ``GatedRepo``.
Files are served as plain HTTP (no Xet), which every huggingface_hub version still downloads.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.gated: set[str] = set()
        self.downloads: list[str] = []  # "repo/path" of every file body served
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo: str, folder: Path | None = None, files: dict[str, bytes] | None = None) -> None:
        """Serve ``repo`` with every file of ``folder`` (by relative path) and ``files``."""
        content = dict(files or {})
        if folder is not None:
            for path in sorted(Path(folder).rglob("*")):
                if path.is_file():
                    content[path.relative_to(folder).as_posix()] = path.read_bytes()
        self.repos[repo] = content

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- answers --------------------------------------------------------------------------------

    @staticmethod
    def _send(handler, status: int, payload: bytes, headers: dict[str, str], body: bool) -> None:
        handler.send_response(status)
        for key, value in {"Content-Length": str(len(payload)), **headers}.items():
            handler.send_header(key, value)
        handler.end_headers()
        if body:
            handler.wfile.write(payload)

    def _json(self, handler, value, body: bool, status: int = 200, headers: dict | None = None) -> None:
        self._send(
            handler, status, json.dumps(value).encode(), {"Content-Type": "application/json", **(headers or {})}, body
        )

    def _answer(self, handler, body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo, what = "/".join(parts[2:4]), parts[4]
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo, what = "/".join(parts[:2]), "resolve"
        else:
            return self._json(handler, {"error": "not found"}, body, 404)
        if repo not in self.repos:
            return self._json(handler, {"error": "Repository not found"}, body, 404, {"X-Error-Code": "RepoNotFound"})
        if repo in self.gated:
            return self._json(
                handler, {"error": "Access to this model is restricted"}, body, 403, {"X-Error-Code": "GatedRepo"}
            )
        files = self.repos[repo]
        if what == "revision":
            return self._json(
                handler,
                {
                    "id": repo,
                    "modelId": repo,
                    "sha": COMMIT,
                    "private": False,
                    "siblings": [{"rfilename": name} for name in files],
                },
                body,
            )
        if what == "tree":
            return self._json(
                handler,
                [
                    {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in files.items()
                ],
                body,
            )
        name = "/".join(parts[4:])
        if name not in files:
            return self._json(handler, {"error": "Entry not found"}, body, 404, {"X-Error-Code": "EntryNotFound"})
        data = files[name]
        if body:
            self.downloads.append(f"{repo}/{name}")
        self._send(
            handler,
            200,
            data,
            {
                "X-Repo-Commit": COMMIT,
                "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                "Content-Type": "application/octet-stream",
            },
            body,
        )
