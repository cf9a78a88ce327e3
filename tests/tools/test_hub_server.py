"""The local hub (tests/hub_server.py) against the unmodified huggingface_hub client: what it lists,
what it downloads, its errors, its byte counters, and the process form the cluster tests start."""

import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from devtools.checkpoints import write_model
from tests.hub_server import HubServer, _parse_range

REPO = "org/Qwen2.5-0.5B-Instruct"


@pytest.fixture(autouse=True)
def no_token(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.fixture
def cache(tmp_path):
    # The client falls back to its cache when the hub refuses a request: one cache per test
    return tmp_path / "hf-cache"


@pytest.fixture
def folder(tmp_path):
    return write_model(tmp_path / "src" / "Qwen2.5-0.5B-Instruct", "qwen2.5-0.5b-instruct")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_model_info_lists_files_with_sizes_and_the_commit(folder):
    with HubServer() as hub:
        commit = hub.add_repo(REPO, folder)
        info = HfApi(endpoint=hub.url, token=False).model_info(REPO, files_metadata=True)
    assert info.sha == commit and len(commit) == 40
    sizes = {s.rfilename: (s.lfs.size if s.lfs else s.size) for s in info.siblings}
    assert sizes == {p.name: p.stat().st_size for p in folder.iterdir()}
    assert next(s for s in info.siblings if s.rfilename == "model.safetensors").lfs is not None


@pytest.fixture
def small(tmp_path):
    """A folder of real bytes: a 3 MB LFS-sized file, small files, and one in a subfolder."""
    folder = tmp_path / "small" / "m"
    (folder / "original").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(os.urandom(3 << 20))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    (folder / "original" / "params.json").write_text("{}")
    return folder


def test_client_downloads_byte_identical_files_and_the_server_counts_them(small, tmp_path, cache):
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    with HubServer() as hub:
        commit = hub.add_repo("org/m", small)
        out = Path(snapshot_download("org/m", endpoint=hub.url, token=False, local_dir=tmp_path / "out",
                                     cache_dir=cache))
        sent = hub.bytes_sent
        names = [p.relative_to(small).as_posix() for p in small.rglob("*") if p.is_file()]
        per_file = {name: hub.bytes_for("org/m", name) for name in names}
        config = hf_hub_download("org/m", "config.json", revision=commit, endpoint=hub.url, token=False,
                                 cache_dir=cache)
        meta = get_hf_file_metadata(hf_hub_url("org/m", "model.safetensors", endpoint=hub.url), token=False)
    assert len(names) == 4
    for name in names:
        assert _digest(out / name) == _digest(small / name), name
    assert per_file == {name: (small / name).stat().st_size for name in names}  # each file served once, whole
    assert sent >= sum(per_file.values())  # plus the API's JSON
    assert Path(config).read_bytes() == (small / "config.json").read_bytes()
    assert (meta.commit_hash, meta.size) == (commit, 3 << 20)
    assert meta.xet_file_data is None  # plain HTTP downloads, never Xet


def test_safetensors_metadata_through_range_reads(folder):
    with HubServer() as hub:
        hub.add_repo(REPO, folder)
        meta = HfApi(endpoint=hub.url, token=False).get_safetensors_metadata(REPO)
        served = hub.bytes_for(REPO, "model.safetensors")
    with open(folder / "model.safetensors", "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    tensors = meta.files_metadata["model.safetensors"].tensors
    assert set(tensors) == set(header) - {"__metadata__"}
    # the client reads its first 100 kB only, never the ~1 GB of (sparse) data behind it
    assert served == 100_001 < (folder / "model.safetensors").stat().st_size


def test_range_header_forms():
    assert _parse_range("bytes=0-7", 100) == (0, 8)
    assert _parse_range("bytes=90-", 100) == (90, 100)
    assert _parse_range("bytes=-10", 100) == (90, 100)
    assert _parse_range("bytes=0-100000", 100) == (0, 100)  # clipped, as HTTP says
    assert _parse_range("bytes=100-", 100) is None and _parse_range("bytes=5-2", 100) is None
    assert _parse_range("items=0-1", 100) is None and _parse_range("bytes=-", 100) is None


def test_token_required_when_configured(folder, cache):
    with HubServer(token="s3cret") as hub:
        hub.add_repo(REPO, folder)
        assert HfApi(endpoint=hub.url, token="s3cret").model_info(REPO).id == REPO
        for token in (False, "wrong"):
            with pytest.raises(HfHubHTTPError) as info:
                HfApi(endpoint=hub.url, token=token).model_info(REPO)
            assert info.value.response.status_code == 401
            with pytest.raises(HfHubHTTPError) as info:
                hf_hub_download(REPO, "config.json", endpoint=hub.url, token=token, cache_dir=cache)
            assert info.value.response.status_code == 401
        assert hub.bytes_for(REPO, "config.json") == 0


def test_missing_repo_revision_and_file_are_the_clients_own_errors(folder, cache):
    with HubServer() as hub:
        hub.add_repo(REPO, folder)
        api = HfApi(endpoint=hub.url, token=False)
        with pytest.raises(RepositoryNotFoundError):
            api.model_info("org/absent")
        with pytest.raises(RevisionNotFoundError):
            api.model_info(REPO, revision="v2")
        with pytest.raises(RevisionNotFoundError):
            hf_hub_download(REPO, "config.json", revision="v2", endpoint=hub.url, token=False, cache_dir=cache)
        with pytest.raises(RemoteEntryNotFoundError):
            hf_hub_download(REPO, "absent.json", endpoint=hub.url, token=False, cache_dir=cache)


def test_a_branch_moves_while_its_old_commit_stays_readable(folder, tmp_path):
    other = write_model(tmp_path / "v2" / "Qwen2.5-0.5B-Instruct", "qwen2.5-0.5b-instruct", tokenizer=False)
    with HubServer() as hub:
        first = hub.add_repo(REPO, folder)
        second = hub.add_repo(REPO, other)
        api = HfApi(endpoint=hub.url, token=False)
        assert first != second and api.model_info(REPO).sha == second
        names = {s.rfilename for s in api.model_info(REPO, revision=first).siblings}
    assert "tokenizer.json" in names  # the first commit's files, not the branch's


def test_throttled_server_still_serves_whole_files(folder, tmp_path, cache):
    with HubServer(throttle=50_000_000) as hub:
        hub.add_repo(REPO, folder)
        path = hf_hub_download(REPO, "tokenizer.json", endpoint=hub.url, token=False, cache_dir=cache)
    assert _digest(Path(path)) == _digest(folder / "tokenizer.json")


def test_process_form_serves_a_root_and_reports_stats(folder, tmp_path, cache):
    root = tmp_path / "root"
    (root / "org").mkdir(parents=True)
    (root / "org" / folder.name).symlink_to(folder)
    proc = subprocess.Popen([sys.executable, "-m", "tests.hub_server", "--root", str(root), "--token", "tok"],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        lines = []
        while not (lines and lines[-1].startswith("hub listening on ")):
            line = proc.stdout.readline()
            assert line, f"server exited: {lines}"
            lines.append(line.strip())
        url = lines[-1].rsplit(" ", 1)[1]
        commit = HfApi(endpoint=url, token="tok").model_info(REPO).sha
        assert f"repo {REPO} main {commit}" in lines
        hf_hub_download(REPO, "config.json", endpoint=url, token="tok", cache_dir=cache)
        stats = json.load(urllib.request.urlopen(f"{url}/_stats"))
        assert stats["files"] == {f"{REPO}/config.json": (folder / "config.json").stat().st_size}
        request = urllib.request.Request(f"{url}/_repos", method="POST", data=json.dumps(
            {"repo": "org/moved", "folder": str(folder), "revision": "v1"}).encode())
        moved = json.load(urllib.request.urlopen(request))["commit"]
        assert HfApi(endpoint=url, token="tok").model_info("org/moved", revision="v1").sha == moved
        urllib.request.urlopen(urllib.request.Request(f"{url}/_stats/reset", method="POST"))
        assert json.load(urllib.request.urlopen(f"{url}/_stats"))["bytesSent"] == 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_throttle_paces_all_bodies_together(monkeypatch):
    from tests import hub_server

    clock = [100.0]
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(hub_server.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(hub_server.time, "sleep", sleep)
    throttle = hub_server.Throttle(1000)  # bytes per second
    for n in (500, 1500, 1000):  # three bodies' chunks, 3000 bytes: 3 s of fake time
        throttle.wait(n)
    assert slept == [0.5, 1.5, 1.0] and clock[0] == 103.0
    hub_server.Throttle(None).wait(10**9)  # no limit: no sleep
    assert len(slept) == 3
