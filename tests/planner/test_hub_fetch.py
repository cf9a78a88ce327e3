"""`specdecode-worker fetch` against the local hub: parts that add up to the model, byte-identical
files, nothing downloaded twice, the pinned commit after the branch moved, one clear line for every
failure, and the token in no output."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdecode_worker.planner import fetch_cli, plan_cli
from specdecode_worker.serving import serve_cli
from specdecode_worker.planner.model_identity import check_models
from specdecode_worker.contract import ExitCode, MemoryPlan
from specdecode_worker.planner.hub import HubClient, HubFile, partition
from tests.hub_server import HubServer
from devtools.tiny_models import write_tiny_model

REPO = "org/tiny-llama"
TOKEN = "hf_fetch_token_abcdef123456"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return write_tiny_model(root / "v1" / "tiny-llama", seed=0), write_tiny_model(root / "v2" / "tiny-llama", seed=1)


@pytest.fixture
def hub(models, monkeypatch, tmp_path):
    with HubServer(token=TOKEN) as server:
        server.commit = server.add_repo(REPO, models[0])
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        yield server


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.is_file()}


def served_files(hub: HubServer) -> dict[str, int]:
    return dict(hub.stats.as_json()["files"])


def fetch(capsys, *argv):
    code = fetch_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert TOKEN not in out + err
    return code, out, err


def test_parts_add_up_to_the_model_and_a_rerun_downloads_nothing(hub, models, capsys, tmp_path):
    dest = tmp_path / "models" / REPO / hub.commit
    parts = 3
    for part in range(parts):
        code, out, err = fetch(capsys, "--repo", REPO, "--commit", hub.commit, "--dest", dest,
                               "--parts", parts, "--part", part)
        assert code == ExitCode.OK, err
    assert digests(dest) == digests(models[0])  # weights, config and tokenizer files, byte for byte
    first = served_files(hub)
    assert first == {f"{REPO}/{p.name}": p.stat().st_size for p in models[0].iterdir()}  # each file once
    code, out, _ = fetch(capsys, "--repo", REPO, "--commit", hub.commit, "--dest", dest)
    assert code == ExitCode.OK and "6 complete already" in out
    assert served_files(hub) == first  # the rerun served no file byte


def test_fetch_gets_the_planned_commit_after_the_branch_moved(hub, models, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert plan_cli.main(["--model-source", "hub", "--target", REPO, "--algorithm", "NGRAM",
                          "--gpu-memory-gib", "8"]) == ExitCode.OK
    plan = json.loads(capsys.readouterr().out)
    planned = plan["sources"]["target"]["commit"]
    moved = hub.add_repo(REPO, models[1])  # main now points at other weights
    assert moved != planned
    dest = tmp_path / planned
    code, _, err = fetch(capsys, "--repo", REPO, "--commit", planned, "--dest", dest)
    assert code == ExitCode.OK, err
    assert digests(dest) == digests(models[0]) != digests(models[1])
    # the model planned from headers is the one fetched
    check_models(str(dest), None, MemoryPlan.from_dict(plan).models, "plan.json")


def test_the_fetched_folder_is_what_serve_and_plan_load(hub, models, capsys, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    dest = tmp_path / "models" / REPO / hub.commit  # the cache layout the operator mounts
    assert fetch(capsys, "--repo", REPO, "--commit", hub.commit, "--dest", dest)[0] == ExitCode.OK
    served = serve_cli.http_options(serve_cli.parser().parse_args(["--target", str(dest), "--algorithm", "NONE"]))
    assert served.model_name == "tiny-llama"  # the API names the model, not its commit
    tok, ref = AutoTokenizer.from_pretrained(dest), AutoTokenizer.from_pretrained(models[0])
    assert tok("hello world").input_ids == ref("hello world").input_ids
    assert tok.chat_template == ref.chat_template
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    plans = []
    for folder in (dest, models[0]):
        assert plan_cli.main(["--target", str(folder), "--algorithm", "NGRAM", "--gpu-memory-gib", "8"]) == 0
        plan = json.loads(capsys.readouterr().out)
        plans.append(plan)
    assert plans[0] == plans[1]  # "target" too: the cache folder is named as the model


def test_part_from_the_job_completion_index(hub, capsys, tmp_path, monkeypatch):
    model = HubClient().resolve(REPO, hub.commit)
    expected = partition(model.files, 4)[2]
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    code, _, err = fetch(capsys, "--repo", REPO, "--commit", hub.commit, "--dest", tmp_path / "d",
                         "--parts", 4, "--part", "env")
    assert code == ExitCode.OK, err
    assert sorted(p.name for p in (tmp_path / "d").iterdir() if p.is_file()) == [f.path for f in expected]


def test_disk_full_is_refused_before_downloading(hub, models, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(fetch_cli, "free_bytes", lambda folder: 1000)
    log = tmp_path / "log"
    code, out, err = fetch(capsys, "--repo", REPO, "--commit", hub.commit, "--dest", tmp_path / "d",
                           "--termination-log", log)
    assert code == ExitCode.BAD_INPUT
    total = sum(p.stat().st_size for p in models[0].iterdir())  # about 385 kB
    assert f"disk full: {tmp_path / 'd'} needs {total / 1e3:.2f} kB more but its filesystem has 1.00 kB free" in err
    assert "modelStore.hub.cache" in err
    assert log.read_text() == err.strip() and served_files(hub) == {}


@pytest.mark.parametrize("flags,message", [
    (["--part", "3", "--parts", "3"], "--part: must be in 0..2 for --parts 3, got 3"),
    (["--part", "env"], "$JOB_COMPLETION_INDEX is not set"),
    (["--parts", "0"], "--parts: must be >= 1"),
])
def test_bad_part_flags(hub, capsys, tmp_path, monkeypatch, flags, message):
    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    code, _, err = fetch(capsys, "--repo", REPO, "--commit", hub.commit, "--dest", tmp_path, *flags)
    assert code == ExitCode.BAD_INPUT and message in err


def test_a_branch_name_is_not_a_pin(hub, capsys, tmp_path):
    code, _, err = fetch(capsys, "--repo", REPO, "--commit", "main", "--dest", tmp_path)
    assert code == ExitCode.BAD_INPUT and f"resolves it to {hub.commit}" in err


def _run_process(env: dict, *argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdecode_worker", "fetch", *map(str, argv)], env=env,
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_failures_say_what_to_change_and_never_show_the_token(hub, tmp_path):
    base = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    base.update(PYTHONPATH=os.pathsep.join([str(ROOT / "worker"), str(ROOT)]), HF_HOME=str(tmp_path / "home"))
    wrong = "hf_wrong_token_zyx987"
    cases = [  # (token, repo, commit, exit code, words in the one line)
        (None, REPO, hub.commit, ExitCode.BAD_INPUT, ["401", "no token was given", "modelStore.hub.tokenSecret"]),
        (wrong, REPO, hub.commit, ExitCode.BAD_INPUT, ["401", "token given", "was refused"]),
        (TOKEN, "org/absent", hub.commit, ExitCode.BAD_INPUT, ["repository org/absent not found"]),
        (TOKEN, REPO, "0" * 40, ExitCode.BAD_INPUT, [f"revision '{'0' * 40}' not found in {REPO}"]),
        (TOKEN, REPO, hub.commit, ExitCode.OK, ["done, 6 files"]),
    ]
    for token, repo, commit, exit_code, words in cases:
        env = dict(base, **({"HF_TOKEN": token} if token else {}))
        log = tmp_path / "termination-log"
        result = _run_process(env, "--repo", repo, "--commit", commit, "--dest", tmp_path / "dest",
                              "--termination-log", log)
        shown = result.stdout + result.stderr + log.read_text()
        assert result.returncode == exit_code, shown
        assert all(w in shown for w in words), shown
        assert TOKEN not in shown and wrong not in shown
        if exit_code != ExitCode.OK:
            assert result.stderr.count("\n") == 1 and log.read_text() == result.stderr.strip()


def test_partition_is_deterministic_complete_and_balanced():
    files = [HubFile(f"model-{i:05d}.safetensors", size) for i, size in
             enumerate([5_000, 4_900, 4_900, 3_000, 2_500, 2_500, 700, 10, 10, 1])]
    for parts in range(1, len(files) + 3):
        groups = partition(files, parts)
        assert groups == partition(list(reversed(files)), parts)  # the order given does not matter
        assert len(groups) == parts
        assert sorted((f for g in groups for f in g), key=lambda f: f.path) == files  # each file exactly once
        loads = [sum(f.size for f in g) for g in groups]
        if parts <= len(files):
            assert all(groups)  # no empty part while there are files for each
            # greedy largest-first: no part exceeds another by more than one file
            assert max(loads) - min(loads) <= max(f.size for f in files)
    assert partition(files, 1) == [files]
    with pytest.raises(ValueError):
        partition(files, 0)


def test_a_file_of_the_wrong_size_is_downloaded_again(hub, models, capsys, tmp_path):
    dest = tmp_path / "d"
    assert fetch(capsys, "--repo", REPO, "--commit", hub.commit, "--dest", dest)[0] == ExitCode.OK
    weights = dest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # cut short after the client recorded it complete
    before = hub.bytes_for(REPO, "model.safetensors")
    code, out, err = fetch(capsys, "--repo", REPO, "--commit", hub.commit, "--dest", dest)
    assert code == ExitCode.OK, err
    assert "5 complete already" in out and digests(dest) == digests(models[0])
    assert hub.bytes_for(REPO, "model.safetensors") == 2 * before


def test_disk_full_while_downloading(hub, capsys, tmp_path, monkeypatch):
    import errno

    import huggingface_hub

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", full)
    code, _, err = fetch(capsys, "--repo", REPO, "--commit", hub.commit, "--dest", tmp_path / "d")
    assert code == ExitCode.BAD_INPUT and err.startswith(f"disk full: {tmp_path / 'd'} needs ")


def test_unreachable_hub_is_retryable(capsys, monkeypatch, tmp_path):
    with HubServer() as closed:
        url = closed.url  # nothing listens there once the server stopped
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    code, _, err = fetch(capsys, "--repo", REPO, "--commit", "a" * 40, "--dest", tmp_path)
    assert code == ExitCode.HUB_UNAVAILABLE and err.startswith(f"cannot reach the hub at {url} (")


def test_an_unforeseen_error_holding_the_token_is_masked(hub, capsys, tmp_path, monkeypatch):
    def leaky(*args, **kwargs):
        raise RuntimeError(f"request failed with headers {{'authorization': 'Bearer {TOKEN}'}}")

    monkeypatch.setattr(fetch_cli, "fetch", leaky)
    log = tmp_path / "log"
    code, _, err = fetch(capsys, "--repo", REPO, "--commit", hub.commit, "--dest", tmp_path, "--termination-log", log)
    assert code == ExitCode.INTERNAL_ERROR and "Traceback" in err and "Bearer ***" in err
    expected = "internal error: RuntimeError: request failed with headers {'authorization': 'Bearer ***'}"
    assert log.read_text() == expected


def test_a_killed_downloads_leftover_is_removed_and_no_other(hub, capsys, tmp_path):
    from huggingface_hub._local_folder import get_local_download_paths

    dest = tmp_path / "d"

    def leftover(name: str, etag: str) -> Path:  # where the client writes, with its per-attempt suffix
        path = get_local_download_paths(dest, name).incomplete_path(etag)
        path = path.with_name(f"{path.stem}.0123abcd.incomplete")
        path.write_bytes(b"x" * 1000)
        return path

    stale = leftover("model.safetensors", "ab" * 32)
    other = leftover("other.safetensors", "cd" * 32)  # not a file of this model: kept
    code, _, err = fetch(capsys, "--repo", REPO, "--commit", hub.commit, "--dest", dest)
    assert code == ExitCode.OK, err
    assert not stale.exists() and other.exists()
