"""A local HTTP server that speaks the Hugging Face hub's file protocol, for huggingface-hub's own
download, cache and revision code to run against (`HF_ENDPOINT=http://127.0.0.1:PORT`).

What huggingface-hub 2.x asks of the hub for `hf_hub_download(repo_id, filename, revision=...)`:
`HEAD /{repo_id}/resolve/{revision}/{filename}`, whose answer must carry `X-Repo-Commit` (the commit the
revision points to: the cache keeps the file under `snapshots/{commit}/`), an `ETag` (the blob's name
in the cache) and `Content-Length`; then `GET` of the same URL for the bytes (unless the blob is cached
already). Errors are told apart by `X-Error-Code`: `RepoNotFound` (with a 401, as the hub answers for a
repository it will not show), `RevisionNotFound`, `EntryNotFound` (404s). Files are served from a folder,
one subfolder per repository (`owner/name/...`); every revision in `revisions` (branch or tag names, and
the commit itself) resolves to that repository's one commit.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote


@dataclass
class Hub:
    root: Path  # root/owner/name/<files>
    revisions: tuple[str, ...] = ("main",)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path) of every request
    url: str = ""

    def commit(self, repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()  # one fixed commit per repository


class _Handler(BaseHTTPRequestHandler):
    hub: Hub

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        hub = self.hub
        hub.requests.append((self.command, self.path))
        path = unquote(self.path.split("?", 1)[0]).lstrip("/")
        parts = path.split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return self._error(404, "EntryNotFound", f"no route {path}")
        repo, revision, filename = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
        if not (hub.root / repo).is_dir():
            return self._error(401, "RepoNotFound", f"Repository Not Found for url: {self.path}")
        commit = hub.commit(repo)
        if revision not in (*hub.revisions, commit):
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        file = hub.root / repo / filename
        if not file.is_file():
            return self._error(404, "EntryNotFound", f"Entry not found: {filename}", commit)
        data = file.read_bytes()
        self.send_response(200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        payload = ('{"error": "' + message + '"}').encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit is not None:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass


@contextmanager
def serve_hub(root: Path, revisions: tuple[str, ...] = ("main",)) -> Iterator[Hub]:
    """A threaded server on 127.0.0.1 (a free port) serving `root`; stopped at the end of the block."""
    hub = Hub(root, revisions)
    handler = type("Handler", (_Handler,), {"hub": hub})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="fake-hub", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
