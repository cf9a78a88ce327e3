"""A local model hub over HTTP that the unmodified ``huggingface_hub`` client talks to (HF_ENDPOINT).

It serves model folders the way the Hugging Face hub API does, for the calls the client makes:

- ``GET /api/models/{repo}[/revision/{rev}][?blobs=true]``: model info with ``sha`` and ``siblings``
  (sizes, blob ids and LFS sizes with ``blobs=true``);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]``: the file listing ``snapshot_download`` reads;
- ``HEAD|GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag`` (plus ``X-Linked-Etag``
  and ``X-Linked-Size`` for LFS-sized files), ``Accept-Ranges``, and single-range reads (206).

Never a ``X-Xet-*`` header or ``xetHash``: the client downloads over plain HTTP. Errors carry the
hub's ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``), so the client
raises its own typed errors. With a token configured, a request without it, or with another one,
gets 401.

Files are read from disk as they are, so sparse checkpoints (devtools/checkpoints.py) serve a "141 GB"
model whose headers cost a few kilobytes. The server counts every body byte it sends, in total and
per ``repo/path``, and can throttle bodies to a byte rate for slow-download tests.

Ids are not content hashes: a commit is derived from the repo name and the folder's listing (paths,
sizes, modification times), blob ids and LFS ids from the commit, path and size. The client only
compares them; hashing a sparse 141 GB checkpoint would defeat the purpose.

In-process::

    with HubServer(token="t") as hub:
        commit = hub.add_repo("org/model", folder)       # branch "main" -> a commit of this folder
        os.environ["HF_ENDPOINT"] = hub.url
        ...; hub.bytes_sent; hub.bytes_for("org/model", "config.json")

As a process (``python -m tests.hub_server --root DIR --port P [--token T] [--throttle B]``): every
``DIR/<owner>/<name>`` folder is a repo at ``main``. It prints ``hub listening on URL`` once ready.
Test-only endpoints, without the token: ``GET /_stats`` (``bytesSent``, ``requests``, ``files``),
``POST /_stats/reset``, ``POST /_repos`` with ``{"repo", "folder", "revision"}`` (answers
``{"commit"}``; moves a branch or adds a repo).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

CHUNK = 1 << 16
# Files from this size on are listed and resolved as LFS files, as the hub stores weights.
LFS_THRESHOLD = 1 << 20
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def _sha(*parts: object, algo: str = "sha1") -> str:
    return hashlib.new(algo, "\0".join(map(str, parts)).encode()).hexdigest()


@dataclass(frozen=True)
class Snapshot:
    """One commit of a repo: its id and the files it holds (path -> size)."""

    commit: str
    folder: Path
    files: dict[str, int]

    def path(self, name: str) -> Path:
        return self.folder / name

    def blob_id(self, name: str) -> str:
        return _sha(self.commit, name, self.files[name])

    def lfs_id(self, name: str) -> str:
        return _sha(self.commit, name, self.files[name], algo="sha256")

    def is_lfs(self, name: str) -> bool:
        return self.files[name] >= LFS_THRESHOLD or name.endswith(".safetensors")


def _listing(folder: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``folder``, hidden paths (``.cache/``...) left out."""
    files = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts):
            files[rel.as_posix()] = path.stat().st_size
    return files


@dataclass
class Repo:
    commits: dict[str, Snapshot] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> Snapshot | None:
        commit = self.refs.get(revision, revision if _COMMIT.match(revision) else None)
        return self.commits.get(commit) if commit else None


class Stats:
    """Body bytes sent, in total and per ``repo/path``, and the request count (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.total = 0
            self.requests = 0
            self.files: Counter[str] = Counter()

    def request(self) -> None:
        with self._lock:
            self.requests += 1

    def sent(self, key: str | None, n: int) -> None:
        with self._lock:
            self.total += n
            if key:
                self.files[key] += n

    def as_json(self) -> dict:
        with self._lock:
            return {"bytesSent": self.total, "requests": self.requests, "files": dict(self.files)}


class Throttle:
    """Paces all bodies together to ``rate`` bytes per second (None: no limit)."""

    def __init__(self, rate: float | None):
        self.rate = rate
        self._lock = threading.Lock()
        self._free_at = 0.0

    def wait(self, n: int) -> None:
        if not self.rate:
            return
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + n / self.rate
            until = self._free_at
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class Hub:
    """The repos and their revisions, and the answers to the API calls (no HTTP here)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.repos: dict[str, Repo] = {}

    def add_repo(self, repo: str, folder: str | Path, revision: str = "main") -> str:
        """Point ``revision`` of ``repo`` at a snapshot of ``folder``; return the commit sha."""
        if repo.count("/") != 1:
            raise ValueError(f"repo must be owner/name, got {repo!r}")
        folder = Path(folder).resolve()
        files = _listing(folder)
        commit = _sha(repo, json.dumps(sorted((p, s, (folder / p).stat().st_mtime_ns) for p, s in files.items())))
        with self._lock:
            entry = self.repos.setdefault(repo, Repo())
            entry.commits[commit] = Snapshot(commit, folder, files)
            entry.refs[revision] = commit
        return commit

    def snapshot(self, repo: str, revision: str) -> Snapshot:
        with self._lock:
            entry = self.repos.get(repo)
            if entry is None:
                raise HubError(404, "RepoNotFound", f"Repository not found: {repo}")
            snap = entry.resolve(revision)
        if snap is None:
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return snap

    def model_info(self, repo: str, revision: str, blobs: bool) -> dict:
        snap = self.snapshot(repo, revision)
        siblings = []
        for name, size in snap.files.items():
            sibling: dict = {"rfilename": name}
            if blobs:
                sibling.update(size=size, blobId=snap.blob_id(name))
                if snap.is_lfs(name):
                    sibling["lfs"] = {"size": size, "sha256": snap.lfs_id(name), "pointerSize": 134}
            siblings.append(sibling)
        return {"_id": _sha(repo)[:24], "id": repo, "modelId": repo, "sha": snap.commit, "private": False,
                "disabled": False, "gated": False, "tags": [], "downloads": 0, "likes": 0,
                "library_name": "transformers", "siblings": siblings}

    def tree(self, repo: str, revision: str, prefix: str, recursive: bool) -> list[dict]:
        snap = self.snapshot(repo, revision)
        base = prefix.strip("/")
        entries, folders = [], set()
        for name, size in snap.files.items():
            if base and not name.startswith(base + "/"):
                continue
            rest = name[len(base) + 1:] if base else name
            if "/" in rest:
                parts = rest.split("/")
                depth = len(parts) - 1 if recursive else 1
                for k in range(1, depth + 1):
                    folders.add("/".join(([base] if base else []) + parts[:k]))
                if not recursive:
                    continue
            entry = {"type": "file", "oid": snap.blob_id(name), "size": size, "path": name}
            if snap.is_lfs(name):
                entry["lfs"] = {"oid": snap.lfs_id(name), "size": size, "pointerSize": 134}
            entries.append(entry)
        if base and not entries and not folders:
            raise HubError(404, "EntryNotFound", f"{base} does not exist on \"{revision}\"", snap.commit)
        dirs = [{"type": "directory", "oid": _sha(snap.commit, d), "size": 0, "path": d} for d in sorted(folders)]
        return dirs + entries


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the client pools connections
    server: "_Server"

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without this, the client's delayed ACK adds
        # about 40 ms to every small response.
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.lock:
            self.server.connections.add(self.request)

    def finish(self) -> None:
        with self.server.lock:
            self.server.connections.discard(self.request)
        super().finish()

    def log_message(self, format: str, *args) -> None:  # quiet: tests read counters, not logs
        pass

    # --- plumbing ---------------------------------------------------------------------------------

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, counted: bool = True) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD" and body:
            if counted:  # before the write, as in _stream
                self.server.throttle.wait(len(body))
                self.server.stats.sent(None, len(body))
            self.wfile.write(body)

    def _json(self, obj: object, counted: bool = True) -> None:
        self._send(200, json.dumps(obj).encode(), counted=counted)

    def _error(self, err: HubError) -> None:
        headers = {"X-Error-Message": err.message}
        if err.code:
            headers["X-Error-Code"] = err.code
        if err.commit:
            headers["X-Repo-Commit"] = err.commit
        self._send(err.status, json.dumps({"error": err.message}).encode(), headers)

    def _authorised(self) -> None:
        token = self.server.token
        if token is None:
            return
        given = self.headers.get("Authorization")
        if given is None:
            raise HubError(401, None, "Authorization required: no token given")
        if given != f"Bearer {token}":
            raise HubError(401, None, "Invalid credentials in Authorization header")

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/")[1:]]
        query = parse_qs(url.query)
        try:
            if parts[:1] == ["_stats"] or parts[:1] == ["_repos"]:  # test controls: neither counted nor guarded
                return self._admin(parts)
            self.server.stats.request()
            self._authorised()
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._api(parts[2] + "/" + parts[3], parts[4:], query)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]))
            raise HubError(404, None, f"no such endpoint: {url.path}")
        except HubError as err:
            self._error(err)

    do_GET = do_HEAD = do_POST = _dispatch

    # --- endpoints --------------------------------------------------------------------------------

    def _admin(self, parts: list[str]) -> None:
        if parts == ["_stats"] and self.command == "GET":
            return self._json(self.server.stats.as_json(), counted=False)
        if parts == ["_stats", "reset"] and self.command == "POST":
            self.server.stats.reset()
            return self._json({}, counted=False)
        if parts == ["_repos"] and self.command == "POST":
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            commit = self.server.hub.add_repo(body["repo"], body["folder"], body.get("revision", "main"))
            return self._json({"commit": commit}, counted=False)
        raise HubError(404, None, f"no such endpoint: /{'/'.join(parts)}")

    def _api(self, repo: str, rest: list[str], query: dict) -> None:
        hub = self.server.hub
        if not rest:
            return self._json(hub.model_info(repo, "main", "blobs" in query))
        if rest[0] == "revision" and len(rest) == 2:
            return self._json(hub.model_info(repo, rest[1], "blobs" in query))
        if rest[0] == "tree" and len(rest) >= 2:
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            return self._json(hub.tree(repo, rest[1], "/".join(rest[2:]), recursive))
        raise HubError(404, None, f"no such endpoint: /api/models/{repo}/{'/'.join(rest)}")

    def _resolve(self, repo: str, revision: str, name: str) -> None:
        snap = self.server.hub.snapshot(repo, revision)
        if name not in snap.files:
            raise HubError(404, "EntryNotFound", f"Entry not found: {name}", snap.commit)
        size = snap.files[name]
        headers = {"X-Repo-Commit": snap.commit, "ETag": f'"{snap.blob_id(name)}"', "Accept-Ranges": "bytes",
                   "Content-Disposition": f'inline; filename="{quote(name.rpartition("/")[2])}"'}
        if snap.is_lfs(name):
            headers.update({"X-Linked-Etag": f'"{snap.lfs_id(name)}"', "X-Linked-Size": str(size)})
        start, end, status = 0, size, HTTPStatus.OK
        wanted = self.headers.get("Range")
        if wanted and self.command == "GET":
            span = _parse_range(wanted, size)
            if span is None:
                headers["Content-Range"] = f"bytes */{size}"
                return self._send(416, b"", headers)
            start, end = span
            status = HTTPStatus.PARTIAL_CONTENT
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        self._stream(status, snap.path(name), start, end, headers, f"{repo}/{name}")

    def _stream(self, status: int, path: Path, start: int, end: int, headers: dict, key: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command == "HEAD":
            return
        with path.open("rb") as fh:
            fh.seek(start)
            left = end - start
            while left > 0:
                chunk = fh.read(min(CHUNK, left))
                if not chunk:  # the file shrank under us: end the connection, the client sees a short body
                    self.close_connection = True
                    return
                self.server.throttle.wait(len(chunk))
                # Counted before the write: a client that has read a chunk must find it counted
                # (counted after, a test could read the counter between the two).
                self.server.stats.sent(key, len(chunk))
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    self.server.stats.sent(key, -len(chunk))
                    self.close_connection = True
                    return
                left -= len(chunk)


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` -> [start, end) within the file, or None (416)."""
    match = _RANGE.match(header.strip())
    if not match or match.groups() == ("", ""):
        return None
    first, last = match.groups()
    if first == "":
        start, end = max(0, size - int(last)), size
    else:
        start = int(first)
        end = size if last == "" else min(size, int(last) + 1)
    if start >= size or start >= end:
        return None
    return start, end


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, hub: Hub, token: str | None, throttle: float | None):
        super().__init__(address, _Handler)
        self.hub, self.token = hub, token
        self.stats = Stats()
        self.throttle = Throttle(throttle)
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()

    def close_connections(self) -> None:
        """End the kept-alive connections too: a later server on the same port must not find a
        client's pooled connection still answered by this one."""
        with self.lock:
            open_now = list(self.connections)
        for conn in open_now:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class HubServer:
    """The local hub on a free loopback port, in a background thread; a context manager."""

    def __init__(self, token: str | None = None, throttle: float | None = None, host: str = "127.0.0.1",
                 port: int = 0):
        self.hub = Hub()
        self._server = _Server((host, port), self.hub, token, throttle)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def stats(self) -> Stats:
        return self._server.stats

    @property
    def bytes_sent(self) -> int:
        return self._server.stats.total

    def bytes_for(self, repo: str, path: str) -> int:
        return self._server.stats.files[f"{repo}/{path}"]

    def set_throttle(self, rate: float | None) -> None:
        self._server.throttle.rate = rate

    def add_repo(self, repo: str, folder: str | Path, revision: str = "main") -> str:
        return self.hub.add_repo(repo, folder, revision)

    def start(self) -> HubServer:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._server.close_connections()
        if self._thread:
            self._thread.join(timeout=5)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def add_root(server: HubServer, root: Path) -> dict[str, str]:
    """Every ``root/<owner>/<name>`` folder as a repo at ``main``; returns repo -> commit."""
    commits = {}
    for owner in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for folder in sorted(p for p in owner.iterdir() if p.is_dir() and not p.name.startswith(".")):
            repo = f"{owner.name}/{folder.name}"
            commits[repo] = server.add_repo(repo, folder)
    return commits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.hub_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, type=Path, help="folder of <owner>/<name> model folders")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    p.add_argument("--token", default=os.environ.get("HUB_SERVER_TOKEN"),
                   help="require this bearer token (default $HUB_SERVER_TOKEN; none: open)")
    p.add_argument("--throttle", type=float, help="bytes per second for all bodies together")
    args = p.parse_args(argv)
    server = HubServer(token=args.token, throttle=args.throttle, host=args.host, port=args.port)
    commits = add_root(server, args.root)
    for repo, commit in commits.items():
        print(f"repo {repo} main {commit}", flush=True)
    print(f"hub listening on {server.url}", flush=True)
    try:
        server._server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server._server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
