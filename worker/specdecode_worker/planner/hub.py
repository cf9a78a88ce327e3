"""Models on a Hugging Face hub, read without downloading their weights.

- ``HubClient.resolve(repo, revision)``: the commit a revision points at and the model's files with
  their sizes (one ``model_info`` call, plus the shard index when the model has one).
- ``HubClient.header_folder(model, folder)``: a folder the planner reads as if it held the model:
  the small files the planner opens (``config.json``, the shard index, optionally
  ``tokenizer.json``) and every safetensors file as its real header followed by a hole up to the
  file's real size. The header costs two HTTP range reads (its 8-byte length, then its JSON), so a
  141 GB checkpoint costs its headers' few kilobytes per shard; the hole costs no disk. The planner's
  checkpoint reader only reads headers and checks them against the file size, so the plan's bytes
  are those of the same files in a local folder.
- ``partition(files, parts)``: the split of a model's files into download parts that the planner
  reports and ``specdecode-worker fetch`` downloads.

Endpoint and token come from the environment (``HF_ENDPOINT``, ``HF_TOKEN`` or the token file),
read when a client is made. Errors become ``HubError`` with one line saying what to change; no
message ever holds the token.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from ..errors import InputError
from ..model_rules.checkpoint import MAX_HEADER_BYTES

DEFAULT_ENDPOINT = "https://huggingface.co"
# Download parts per model: one file each at most, so progress moves in steps of a shard or a few
# (the download Job caps how many run at once). 32 parts of two sources keep the plan well under
# the termination log's 4096 bytes.
MAX_PARTS = 32
HEADER_READERS = 8  # safetensors headers read at once
INDEX_FILE = "model.safetensors.index.json"
# Top-level files a served model needs: weights, configs, tokenizer and chat template files.
# Other files (README, .bin/.pth duplicates, an ``original/`` folder) are neither planned nor fetched.
MODEL_FILE_SUFFIXES = (".safetensors", ".json", ".model", ".tiktoken", ".txt", ".jinja")
# What the planner opens besides the safetensors headers.
PLANNER_FILES = ("config.json", INDEX_FILE)
TOKENIZER_FILE = "tokenizer.json"

COMMIT = re.compile(r"[0-9a-f]{40}")

T = TypeVar("T")


class HubError(InputError):
    """A hub request failed; ``kind`` is auth, repo, revision, file, endpoint (not a hub), unreachable or
    hub (a server error)."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind

    @property
    def retryable(self) -> bool:
        """Whether trying again later may succeed without changing anything."""
        return self.kind in ("unreachable", "hub")


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int


@dataclass(frozen=True)
class HubModel:
    """One model at one commit: the files a worker needs and their sizes."""

    repo: str
    revision: str
    commit: str
    files: tuple[HubFile, ...]

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def parts(self) -> int:
        """How many download parts the planner reports: one per file, at most MAX_PARTS."""
        return max(1, min(MAX_PARTS, len(self.files)))

    def source(self) -> dict:
        """The plan's ``sources`` entry for this model."""
        return {"repo": self.repo, "revision": self.revision, "commit": self.commit, "bytes": self.bytes,
                "partBytes": [sum(f.size for f in part) for part in partition(self.files, self.parts)]}


def partition(files: Iterable[HubFile], parts: int) -> list[list[HubFile]]:
    """Split ``files`` into ``parts`` groups of about equal bytes, the same way every time.

    Largest file first, each into the group with the fewest bytes so far (the lowest index on a
    tie); within a group, files keep path order. Depends only on the (path, size) pairs, not on
    their order, so the planner and every download pod compute the same split.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    groups: list[list[HubFile]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for f in sorted(files, key=lambda f: (-f.size, f.path)):
        k = min(range(parts), key=lambda i: (loads[i], i))
        groups[k].append(f)
        loads[k] += f.size
    return [sorted(g, key=lambda f: f.path) for g in groups]


def is_model_file(path: str) -> bool:
    return "/" not in path and not path.startswith(".") and path.endswith(MODEL_FILE_SUFFIXES)


def model_name(folder: str | Path) -> str:
    """A model folder's name, as plans and the API name it: the folder's own name, except for a
    cache folder ``<owner>/<name>/<commit>`` (where ``specdecode-worker fetch`` puts a hub model),
    whose name is the model's, not the commit's."""
    path = Path(folder).resolve()
    return path.parent.name if COMMIT.fullmatch(path.name) and path.parent.name else path.name


def redact(text: str) -> str:
    """``text`` with the hub token of the environment masked: for error output, where an unforeseen
    exception could carry it. Our own messages never hold it."""
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    return text.replace(token, "***") if token and len(token) >= 4 else text


def endpoint_from_env() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


class HubClient:
    """Calls to one hub endpoint with one token (both from the environment by default)."""

    def __init__(self, endpoint: str | None = None, token: str | None = None):
        from huggingface_hub import HfApi, get_token

        self.endpoint = (endpoint or endpoint_from_env()).rstrip("/")
        self._token = token if token is not None else get_token()
        # token=False: never fall back to a token found elsewhere than the one decided here
        self._api = HfApi(endpoint=self.endpoint, token=self.token_for_download)
        self._small: dict[tuple[str, str, str], bytes] = {}

    @property
    def has_token(self) -> bool:
        return bool(self._token)

    @property
    def token_for_download(self) -> str | bool:
        """What to pass as ``token=`` to huggingface_hub: this client's token, or False for none."""
        return self._token or False

    # --- errors -----------------------------------------------------------------------------------

    def explain(self, exc: BaseException, repo: str, revision: str, path: str | None = None) -> HubError | None:
        """One line saying what failed and what to change (never the token); None: not a hub failure."""
        from huggingface_hub.errors import (
            GatedRepoError,
            RemoteEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        status = _status(exc)
        where = f"{repo} on {self.endpoint}"
        token_hint = ("the token given (HF_TOKEN; in a SpecDecodeDeployment, modelStore.hub.tokenSecret) was refused"
                      if self.has_token else
                      "no token was given: set HF_TOKEN (in a SpecDecodeDeployment, modelStore.hub.tokenSecret)")
        if status == 401:
            if isinstance(exc, RepositoryNotFoundError) and not self.has_token:
                return HubError(f"401 Unauthorized: repository {where} not found, or private or gated and "
                                f"{token_hint}", "auth")
            return HubError(f"401 Unauthorized for {where}: {token_hint}", "auth")
        if status == 403 or isinstance(exc, GatedRepoError):
            return HubError(f"{status} Forbidden: the hub refuses {where} to this token (a gated model: accept "
                            "its terms on the hub with the token's account; or give a token with read access to it, "
                            "modelStore.hub.tokenSecret)", "auth")
        if isinstance(exc, RevisionNotFoundError):
            return HubError(f"revision '{revision}' not found in {where}: give an existing branch, tag or "
                            "commit sha", "revision")
        if isinstance(exc, RemoteEntryNotFoundError) or (
                path and status == 404 and not isinstance(exc, RepositoryNotFoundError)):
            return HubError(f"file '{path}' not found in {where} at revision '{revision}'", "file")
        if isinstance(exc, RepositoryNotFoundError) or status == 404:
            return HubError(f"repository {repo} not found on {self.endpoint}: check the model name (owner/name)",
                            "repo")
        if status is not None:
            return HubError(f"the hub at {self.endpoint} answered {status} for {repo}@{revision}"
                            f"{f' {path}' if path else ''}; try again later", "hub")
        # Network failures only: a local OSError (a full disk) is the caller's to explain.
        if isinstance(exc, (ConnectionError, TimeoutError, socket.gaierror)) or type(exc).__module__.startswith(
                ("httpx", "httpcore")):
            return HubError(f"cannot reach the hub at {self.endpoint} ({type(exc).__name__}: {exc}): check "
                            "HF_ENDPOINT (in a SpecDecodeDeployment, modelStore.hub.endpoint) and the network",
                            "unreachable")
        return None

    def call(self, fn: Callable[[], T], repo: str, revision: str, path: str | None = None) -> T:
        try:
            return fn()
        except HubError:
            raise
        except Exception as exc:
            error = self.explain(exc, repo, revision, path)
            if error is None:
                raise
            raise error from None

    # --- reads ------------------------------------------------------------------------------------

    def resolve(self, repo: str, revision: str = "main") -> HubModel:
        """The commit ``revision`` points at and the model files there (those a worker loads)."""
        if repo.count("/") != 1 or not all(repo.split("/")):
            raise HubError(f"model '{repo}': a hub model is named owner/name", "repo")
        info = self.call(lambda: self._api.model_info(repo, revision=revision, files_metadata=True), repo, revision)
        commit = info.sha
        if not commit or not COMMIT.fullmatch(commit):
            raise HubError(f"the hub at {self.endpoint} names no commit for {repo}@{revision} (sha {commit!r}); "
                           "HF_ENDPOINT must be a Hugging Face compatible hub", "endpoint")
        sizes = {s.rfilename: (s.lfs.size if s.lfs else s.size) for s in info.siblings or []}
        missing = [name for name, size in sizes.items() if size is None and is_model_file(name)]
        if missing:
            raise HubError(f"the hub at {self.endpoint} lists {repo} without file sizes ({missing[0]})", "hub")
        wanted = {name for name in sizes if is_model_file(name)}
        if "config.json" not in wanted:
            raise HubError(f"{repo}@{revision}: no config.json at the top of the repository; give the repository "
                           "of a transformers model", "file")
        if INDEX_FILE in wanted:
            shards = self._indexed_shards(repo, commit, sizes)
            wanted = {n for n in wanted if not n.endswith(".safetensors")} | shards
        elif not any(n.endswith(".safetensors") for n in wanted):
            raise HubError(f"{repo}@{revision}: no *.safetensors weights at the top of the repository; the planner "
                           "reads safetensors headers only", "file")
        files = tuple(HubFile(n, sizes[n]) for n in sorted(wanted))
        return HubModel(repo=repo, revision=revision, commit=commit, files=files)

    def _indexed_shards(self, repo: str, commit: str, sizes: dict[str, int | None]) -> set[str]:
        raw = self.read_file(repo, commit, INDEX_FILE)
        try:
            weight_map = json.loads(raw)["weight_map"]
            shards = set(weight_map.values())
        except (ValueError, KeyError, TypeError, AttributeError):
            raise HubError(f"{repo}@{commit} {INDEX_FILE}: field 'weight_map' must be an object of tensor name "
                           "-> file", "file") from None
        absent = sorted(s for s in shards if not isinstance(s, str) or s not in sizes)
        if absent:
            raise HubError(f"{repo}@{commit} {INDEX_FILE}: names shard '{absent[0]}', which is not in the "
                           "repository", "file")
        return shards

    def read_range(self, repo: str, commit: str, path: str, start: int, length: int) -> bytes:
        """``length`` bytes of a file from ``start`` (one HTTP range read)."""
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        url = hf_hub_url(repo, path, revision=commit, endpoint=self.endpoint)

        def get() -> bytes:
            headers = build_hf_headers(token=self.token_for_download)
            headers["Range"] = f"bytes={start}-{start + length - 1}"
            response = get_session().get(url, headers=headers, follow_redirects=True)
            hf_raise_for_status(response)
            return response.content

        data = self.call(get, repo, commit, path)
        if len(data) != length:
            raise HubError(f"{repo}@{commit} {path}: asked for {length} bytes from byte {start}, got {len(data)}; "
                           f"the hub at {self.endpoint} does not answer range reads", "hub")
        return data

    def read_file(self, repo: str, commit: str, path: str) -> bytes:
        """A whole small file (config, index, tokenizer), kept for later calls."""
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        key = (repo, commit, path)
        if key not in self._small:
            url = hf_hub_url(repo, path, revision=commit, endpoint=self.endpoint)

            def get() -> bytes:
                response = get_session().get(url, headers=build_hf_headers(token=self.token_for_download),
                                             follow_redirects=True)
                hf_raise_for_status(response)
                return response.content

            self._small[key] = self.call(get, repo, commit, path)
        return self._small[key]

    def read_header(self, model: HubModel, path: str) -> bytes:
        """The 8-byte length and JSON header of one safetensors file (two range reads)."""
        size = next(f.size for f in model.files if f.path == path)
        if size < 8:
            raise HubError(f"{model.repo}@{model.commit} {path}: truncated safetensors file ({size} bytes)", "file")
        (n,) = struct.unpack("<Q", self.read_range(model.repo, model.commit, path, 0, 8))
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise HubError(f"{model.repo}@{model.commit} {path}: header length {n} bytes does not fit a "
                           f"{size}-byte file; the file is corrupt or not safetensors", "file")
        return struct.pack("<Q", n) + self.read_range(model.repo, model.commit, path, 8, n)

    def header_folder(self, model: HubModel, folder: Path, tokenizer: bool = False) -> Path:
        """Write the folder the planner reads for ``model`` (see the module docstring)."""
        folder.mkdir(parents=True, exist_ok=True)
        small = PLANNER_FILES + ((TOKENIZER_FILE,) if tokenizer else ())
        names = {f.path for f in model.files}
        for name in small:
            if name in names:
                (folder / name).write_bytes(self.read_file(model.repo, model.commit, name))
        shards = [f for f in model.files if f.path.endswith(".safetensors")]

        def write(f: HubFile) -> None:
            header = self.read_header(model, f.path)
            with open(folder / f.path, "wb") as fh:
                fh.write(header)
                fh.truncate(f.size)  # a hole: the planner stats the size, never reads the data

        # Round trips dominate against a remote hub (two per shard): a few at a time.
        with ThreadPoolExecutor(max_workers=HEADER_READERS) as pool:
            list(pool.map(write, shards))
        return folder
