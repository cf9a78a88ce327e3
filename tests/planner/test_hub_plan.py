"""`specdecode-worker plan --model-source hub` against the local hub: the same plan as from a folder,
headers-only traffic (asserted on the server's byte counters), the commit it read, and one clear
line for a missing token, repository or revision."""

import json
import re

import pytest

from specdecode_worker.planner import plan_cli
from specdecode_worker.contract import TERMINATION_LOG_LIMIT, ExitCode, validate_plan
from specdecode_worker.planner.hub import MAX_PARTS, HubClient, HubFile
from specdecode_worker.planner.model_identity import identity
from devtools.checkpoints import write_model
from tests.hub_server import HubServer

TOKEN = "hf_plan_token_0123456789"
# repo -> the sparse published checkpoint it holds (the folder is named as the repo, so plans name it alike)
MODELS = {
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b-instruct",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b-instruct",
    "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B": "eagle3-llama-3.1-8b",
    "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b-instruct",
    "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b-instruct",
}
SIZING = ["--gpu-memory-gib", "80", "--mem-fraction-static", "0.85"]


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-models")
    return {repo: write_model(root / repo, model) for repo, model in MODELS.items()}


@pytest.fixture
def hub(folders, monkeypatch):
    with HubServer(token=TOKEN) as server:
        server.commits = {repo: server.add_repo(repo, folder) for repo, folder in folders.items()}
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        yield server


def run(capsys, *argv):
    code = plan_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def hub_plan(capsys, tmp_path, *argv):
    log = tmp_path / "termination-log"
    code, out, err = run(capsys, "--model-source", "hub", "--termination-log", log, *argv)
    assert code == ExitCode.OK, err
    text = log.read_text()
    assert TOKEN not in out + err + text
    assert len(text.encode()) < TERMINATION_LOG_LIMIT and json.loads(text) == json.loads(out)
    return validate_plan(json.loads(out))


def folder_plan(capsys, *argv):
    code, out, err = run(capsys, *argv)
    assert code == ExitCode.OK, err
    return validate_plan(json.loads(out))


def model_bytes(folder):
    return sum(p.stat().st_size for p in folder.iterdir())  # every file of these folders is a model file


@pytest.mark.parametrize("algorithm,target,draft", [
    ("EAGLE3", "meta-llama/Llama-3.1-8B-Instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"),
    ("STANDALONE", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),  # reads both tokenizer.json
    ("NGRAM", "meta-llama/Llama-3.1-70B-Instruct", None),
    ("STANDALONE", "Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),  # one repo, read once
])
def test_hub_plan_equals_folder_plan(hub, folders, capsys, tmp_path, algorithm, target, draft):
    hub_args = ["--algorithm", algorithm, "--target", target, *(["--draft", draft] if draft else []), *SIZING]
    plan = hub_plan(capsys, tmp_path, *hub_args)
    path_args = ["--algorithm", algorithm, "--target", folders[target],
                 *(["--draft", folders[draft]] if draft else []), *SIZING]
    sources = plan.pop("sources")
    assert plan == folder_plan(capsys, *path_args)
    for role, repo in (("target", target), ("draft", draft)):
        if repo is None:
            assert role not in sources
            continue
        source = sources[role]
        assert (source["repo"], source["revision"], source["commit"]) == (repo, "main", hub.commits[repo])
        assert source["bytes"] == sum(source["partBytes"]) == model_bytes(folders[repo])
        assert len(source["partBytes"]) == min(MAX_PARTS, len(list(folders[repo].iterdir())))


def test_70b_plans_from_headers_only(hub, folders, capsys, tmp_path):
    repo = "meta-llama/Llama-3.1-70B-Instruct"
    folder = folders[repo]
    plan = hub_plan(capsys, tmp_path, "--algorithm", "NGRAM", "--target", repo, *SIZING)
    assert plan["sources"]["target"]["commit"] == hub.commits[repo]
    assert plan["sources"]["target"]["bytes"] == model_bytes(folder) > 140e9
    served = hub.stats.as_json()["files"]
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) == 30
    for name in shards:  # each shard: its 8-byte length and its JSON header, nothing of the data
        with open(folder / name, "rb") as fh:
            assert served.pop(f"{repo}/{name}") == 8 + int.from_bytes(fh.read(8), "little")
    small = {f"{repo}/{n}": (folder / n).stat().st_size for n in ("config.json", "model.safetensors.index.json")}
    assert served == small  # no other file touched; the tokenizer only for STANDALONE
    assert hub.bytes_sent < 200_000  # headers, two small files and the API's JSON


def test_two_sources_of_a_30_shard_target_fit_the_termination_log(hub, capsys, tmp_path):
    plan = hub_plan(capsys, tmp_path, "--algorithm", "STANDALONE", "--target", "meta-llama/Llama-3.1-70B-Instruct",
                    "--draft", "meta-llama/Llama-3.1-8B-Instruct", "--gpu-memory-gib", "80", "--tp", "4")
    assert set(plan["sources"]) == {"target", "draft"}
    assert len(plan["sources"]["target"]["partBytes"]) == MAX_PARTS
    assert len(plan["sources"]["draft"]["partBytes"]) == 6  # 4 shards, their index and config.json


def test_revision_is_pinned_to_the_commit_it_named_when_planned(hub, folders, capsys, tmp_path):
    repo = "Qwen/Qwen2.5-0.5B-Instruct"
    v2 = write_model(tmp_path / "v2" / repo, "qwen2.5-0.5b-instruct", tokenizer=False)
    first = hub.commits[repo]
    second = hub.add_repo(repo, v2)  # main moves on
    hub.add_repo(repo, folders[repo], revision="v1")  # a tag on the first folder
    args = ["--algorithm", "NGRAM", "--target", repo, *SIZING]
    assert hub_plan(capsys, tmp_path, *args)["sources"]["target"]["commit"] == second
    tagged = hub_plan(capsys, tmp_path, *args, "--target-revision", "v1")["sources"]["target"]
    assert (tagged["revision"], tagged["commit"]) == ("v1", first)
    by_sha = hub_plan(capsys, tmp_path, *args, "--target-revision", first)["sources"]["target"]
    assert by_sha["commit"] == first and by_sha["bytes"] == model_bytes(folders[repo])


@pytest.mark.parametrize("argv,token,expected", [
    (["--target", "meta-llama/Absent"], TOKEN, "repository meta-llama/Absent not found on"),
    (["--target", "Qwen/Qwen2.5-0.5B-Instruct", "--target-revision", "v9"], TOKEN,
     "revision 'v9' not found in Qwen/Qwen2.5-0.5B-Instruct"),
    (["--target", "Qwen/Qwen2.5-0.5B-Instruct"], None, "no token was given: set HF_TOKEN"),
    (["--target", "Qwen/Qwen2.5-0.5B-Instruct"], "hf_wrong_token_987", "the token given (HF_TOKEN"),
])
def test_hub_errors_are_one_line_saying_what_to_change(hub, capsys, tmp_path, monkeypatch, argv, token, expected):
    if token is None:
        monkeypatch.delenv("HF_TOKEN")
        monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))  # nor a file
    else:
        monkeypatch.setenv("HF_TOKEN", token)
    log = tmp_path / "log"
    code, out, err = run(capsys, "--model-source", "hub", "--algorithm", "NGRAM", *argv, *SIZING,
                         "--termination-log", log)
    assert code == ExitCode.BAD_INPUT and out == ""
    assert expected in err and err.count("\n") == 1 and log.read_text() == err.strip()
    for secret in (TOKEN, "hf_wrong_token_987"):
        assert secret not in err


def test_unreachable_hub_is_retryable(capsys, monkeypatch, tmp_path):
    with HubServer() as closed:
        url = closed.url  # a port nothing listens on once the server stops
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    code, out, err = run(capsys, "--model-source", "hub", "--algorithm", "NGRAM", "--target", "a/b", *SIZING)
    assert code == ExitCode.HUB_UNAVAILABLE and f"cannot reach the hub at {url}" in err and TOKEN not in err


def test_a_bad_model_names_the_hub_file_not_a_temporary_copy(hub, folders, capsys, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((folders["Qwen/Qwen2.5-0.5B-Instruct"] / "config.json").read_text())
    del config["hidden_size"]
    (broken / "config.json").write_text(json.dumps(config))
    (broken / "model.safetensors").symlink_to(folders["Qwen/Qwen2.5-0.5B-Instruct"] / "model.safetensors")
    hub.add_repo("org/broken", broken)
    code, out, err = run(capsys, "--model-source", "hub", "--algorithm", "NGRAM", "--target", "org/broken", *SIZING)
    assert code == ExitCode.BAD_INPUT and err.startswith("org/broken/config.json: ") and "specdecode-plan-" not in err


def test_revisions_need_the_hub_source(folders, capsys):
    code, _, err = run(capsys, "--algorithm", "NGRAM", "--target", folders["Qwen/Qwen2.5-0.5B-Instruct"],
                       "--target-revision", "main", *SIZING)
    assert code == ExitCode.BAD_INPUT and "add --model-source hub" in err


def test_resolve_lists_the_files_a_worker_loads(tmp_path):
    folder = write_model(tmp_path / "org" / "m", "qwen2.5-7b-instruct")
    (folder / "consolidated.safetensors").write_bytes(b"x" * 100)  # not in the index: not loaded
    (folder / "README.md").write_text("# m")
    (folder / "original").mkdir()
    (folder / "original" / "params.json").write_text("{}")
    with HubServer() as server:
        commit = server.add_repo("org/m", folder)
        model = HubClient(endpoint=server.url, token="").resolve("org/m")
    assert model.commit == commit
    expected = {p.name for p in folder.iterdir() if p.is_file()} - {"consolidated.safetensors", "README.md"}
    assert {f.path for f in model.files} == expected
    assert HubFile("config.json", (folder / "config.json").stat().st_size) in model.files


def _http_error(status: int, url: str = "http://hub.test/org/m/resolve/main/config.json"):
    import importlib

    from huggingface_hub.utils import get_session, hf_raise_for_status

    http = importlib.import_module(type(get_session()).__module__.split(".")[0])  # the client's HTTP library
    response = http.Response(status, request=http.Request("GET", url))
    try:
        hf_raise_for_status(response)
    except Exception as exc:
        return exc
    raise AssertionError(f"{status} raised nothing")


@pytest.mark.parametrize("status,kind,words", [
    (403, "auth", "403 Forbidden: the hub refuses org/m on http://hub.test to this token"),
    (500, "hub", "the hub at http://hub.test answered 500 for org/m@main config.json; try again later"),
    (503, "hub", "answered 503"),
])
def test_other_hub_answers(status, kind, words):
    error = HubClient(endpoint="http://hub.test", token=TOKEN).explain(_http_error(status), "org/m", "main",
                                                                       "config.json")
    assert error.kind == kind and words in str(error) and TOKEN not in str(error)
    assert error.retryable == (kind == "hub")


def test_the_contract_checks_sources(folders, capsys):
    from specdecode_worker.contract import MemoryPlan

    plan = folder_plan(capsys, "--algorithm", "NGRAM", "--target", folders["Qwen/Qwen2.5-0.5B-Instruct"], *SIZING)
    source = {"repo": "o/n", "revision": "main", "commit": "a" * 40, "bytes": 10, "partBytes": [6, 4]}
    assert MemoryPlan.from_dict(plan | {"sources": {"target": source}}).sources.target.part_bytes == [6, 4]
    assert MemoryPlan.from_dict(plan).sources is None  # a plan of folders has none
    for broken, message in (({"commit": "main"}, "must be 40 hex digits"),
                            ({"partBytes": [6, 5]}, "must be non-empty and add up to bytes 10"),
                            ({"partBytes": []}, "must be non-empty"),
                            ({"partBytes": "6,4"}, "must be a list"),
                            ({"partBytes": [6, -4]}, "sources.target.partBytes[1]' must be a non-negative")):
        with pytest.raises(ValueError, match=re.escape(message)):
            MemoryPlan.from_dict(plan | {"sources": {"target": source | broken}})
    with pytest.raises(ValueError, match="missing required key 'sources.target.revision'"):
        MemoryPlan.from_dict(plan | {"sources": {"target": {"repo": "o/n"}}})


@pytest.mark.slow
def test_a_163_shard_target_and_its_draft_in_32_parts_each_fit_the_termination_log(capsys, tmp_path, monkeypatch):
    repo = "deepseek-ai/DeepSeek-V3"
    folder = write_model(tmp_path / "hub" / repo, "deepseek-v3")
    assert len(list(folder.glob("*.safetensors"))) == 163
    with HubServer() as server:
        server.add_repo(repo, folder)
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        # MTP naming its target as the draft: two sources of the same 163 shards
        plan = hub_plan(capsys, tmp_path, "--algorithm", "MTP", "--target", repo, "--draft", repo,
                        "--gpu-memory-gib", "141", "--tp", "8")  # hub_plan asserts the log's limit
    assert plan["fits"]
    # the models serve --plan checks: the one folder once (the draft is the target's own repo)
    assert plan["models"] == {"target": identity(folder)}
    for role in ("target", "draft"):
        parts = plan["sources"][role]["partBytes"]
        assert len(parts) == MAX_PARTS == 32 and sum(parts) == model_bytes(folder)
    # Headroom: with every part 12 digits wide (parts up to 1 TB: models of 32 TB) it still fits.
    size = len((tmp_path / "termination-log").read_bytes())
    widest = size + sum(12 - len(str(b)) for role in ("target", "draft") for b in plan["sources"][role]["partBytes"])
    print(f"termination log: {size} bytes; with 12-digit parts: {widest}")
    assert widest < TERMINATION_LOG_LIMIT
