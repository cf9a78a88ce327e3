"""``specdecode-worker fetch``: download one part of a hub model at a pinned commit into a folder.

The model's files are split with ``hub.partition`` exactly as the planner reported them
(``sources.*.partBytes``), so N download pods (an Indexed Job) each fetch one part of the same
folder. Files already complete in the folder are skipped without a request, so a rerun, or a part
retried after another finished, downloads nothing twice. Files arrive atomically (the client writes a
temporary file and renames it), so a file at its full size is complete.

Exit codes: 0 done; 2 something to change (token, repository, revision, free space; one line
says what); 4 the hub is unreachable or failing (retry); 1 internal error. With
``--termination-log`` the line (or, on success, a summary) is also written there.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import shutil
import time
from pathlib import Path

from .. import termination
from ..contract import ExitCode
from ..errors import InputError
from ..flags import CommandParser
from .hub import HubClient, HubError, HubFile, partition

PROGRESS_EVERY_S = 10.0


def parser() -> CommandParser:
    p = CommandParser(prog="specdecode-worker fetch",
                      description="Download (a part of) a hub model at one commit into a folder.")
    p.add_argument("--repo", required=True, help="hub model, OWNER/NAME")
    p.add_argument("--commit", required=True, help="the 40-hex commit to download (a plan's sources.*.commit)")
    p.add_argument("--dest", required=True, help="folder to download into, e.g. /models/OWNER/NAME/COMMIT")
    p.add_argument("--parts", type=int, default=1, help="how many parts the files are split into (default 1: all)")
    p.add_argument("--part", default="0",
                   help="which part to download, 0-based; 'env' reads $JOB_COMPLETION_INDEX (default 0)")
    p.add_argument("--termination-log", help="also write the outcome line to this file")
    return p


def _part_index(value: str, parts: int) -> int:
    if parts < 1:
        raise InputError(f"--parts: must be >= 1, got {parts}")
    raw = os.environ.get("JOB_COMPLETION_INDEX", "") if value == "env" else value
    if value == "env" and raw == "":
        raise InputError("--part env: $JOB_COMPLETION_INDEX is not set (it is, in an Indexed Job's pods)")
    try:
        part = int(raw)
    except ValueError:
        raise InputError(f"--part: must be an integer or 'env', got {raw!r}") from None
    if not 0 <= part < parts:
        raise InputError(f"--part: must be in 0..{parts - 1} for --parts {parts}, got {part}")
    return part


def _gb(n: int) -> str:
    """Bytes for a person: 3.42 GB, 714 B."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def free_bytes(folder: Path) -> int:
    """Free bytes on the filesystem that holds ``folder``."""
    return shutil.disk_usage(folder).free


def _disk_full(dest: Path, needed: int, free: int) -> InputError:
    return InputError(f"disk full: {dest} needs {_gb(needed)} more but its filesystem has {_gb(free)} free; "
                      "make the model cache larger (modelStore.hub.cache) or free space on it")


def _drop_stale_partials(dest: Path, f: HubFile) -> None:
    """Remove what a killed download of ``f`` left behind.

    huggingface_hub downloads into ``.cache/huggingface/download/<hash>.<etag>.<8 hex>.incomplete``
    (``<hash>``: urlsafe base64 of the SHA-1 of ``<file name>.metadata``) and removes it on any
    failure it sees, but not after SIGKILL (an evicted pod), and a new attempt never reuses it.
    """
    folder = dest / ".cache" / "huggingface" / "download" / Path(f.path).parent
    digest = hashlib.sha1(f"{Path(f.path).name}.metadata".encode()).digest()
    prefix = base64.urlsafe_b64encode(digest).decode() + "."
    if folder.is_dir():
        for leftover in folder.iterdir():
            if leftover.name.startswith(prefix) and leftover.name.endswith(".incomplete"):
                leftover.unlink(missing_ok=True)


def _complete(dest: Path, f: HubFile) -> bool:
    path = dest / f.path
    return path.is_file() and path.stat().st_size == f.size


class _Progress:
    """What ``hf_hub_download`` reports a download to: a log line now and then, not a terminal bar."""

    def __init__(self, total: int | None = None, initial: int = 0, desc: str = "", **_):
        self.total, self.done, self.desc = total, initial, desc
        self._last = time.monotonic()

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, n: int | float | None = 1) -> None:
        self.done += int(n or 0)
        now = time.monotonic()
        if now - self._last >= PROGRESS_EVERY_S:
            self._last = now
            of = f" / {_gb(self.total)}" if self.total else ""
            print(f"  {self.desc}: {_gb(self.done)}{of}", flush=True)

    def close(self) -> None:
        pass


def fetch(client: HubClient, repo: str, commit: str, dest: Path, parts: int, part: int) -> tuple[int, int]:
    """Download part ``part`` of ``parts`` into ``dest``; return (files downloaded, bytes downloaded)."""
    from huggingface_hub import hf_hub_download

    model = client.resolve(repo, commit)
    if model.commit != commit:  # a branch or tag name given as --commit: the pin would not hold
        raise InputError(f"--commit {commit}: the hub resolves it to {model.commit}; give the commit sha itself")
    files = partition(model.files, parts)[part]
    label = f"{repo}@{commit[:12]} part {part} of {parts}"
    missing = [f for f in files if not _complete(dest, f)]
    needed = sum(f.size for f in missing)
    print(f"fetch {label}: {len(files)} files, {_gb(sum(f.size for f in files))}; "
          f"{len(files) - len(missing)} complete already, {_gb(needed)} to download into {dest}", flush=True)
    dest.mkdir(parents=True, exist_ok=True)
    for f in missing:
        _drop_stale_partials(dest, f)
    free = free_bytes(dest)
    if needed > free:
        raise _disk_full(dest, needed, free)
    done = 0
    for i, f in enumerate(missing, 1):
        print(f"  [{i}/{len(missing)}] {f.path} ({_gb(f.size)})", flush=True)
        # A file of another size is no download of this commit (the client would keep it): replace it.
        (dest / f.path).unlink(missing_ok=True)

        def download(f: HubFile = f) -> None:
            hf_hub_download(repo, f.path, revision=commit, local_dir=dest, endpoint=client.endpoint,
                            token=client.token_for_download, tqdm_class=_Progress)

        try:
            client.call(download, repo, commit, f.path)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _disk_full(dest, needed - done, free_bytes(dest)) from None
            raise
        if not _complete(dest, f):
            raise HubError(f"{repo}@{commit} {f.path}: downloaded {(dest / f.path).stat().st_size} bytes, the hub "
                           f"lists {f.size}; try again", "hub")
        done += f.size
    print(f"fetch {label}: done, {len(missing)} files ({_gb(done)}) downloaded", flush=True)
    return len(missing), done


def main(argv: list[str] | None = None) -> int:
    return termination.run("fetch", parser, argv, _fetch_part)


def _fetch_part(args) -> termination.Outcome:
    part = _part_index(args.part, args.parts)
    count, size = fetch(HubClient(), args.repo, args.commit, Path(args.dest), args.parts, part)
    return (f"fetched {args.repo}@{args.commit} part {part} of {args.parts}: {count} files, {size} bytes",
            ExitCode.OK, None)
