"""The worker's HTTP API on loopback: a real uvicorn server over tiny target and draft models."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

torch = pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from specdecode_worker.serving import serve_cli  # noqa: E402
from specdecode_worker.engine.engine import Engine, EngineArgs  # noqa: E402
from specdecode_worker.serving.server import ServerState, build_app  # noqa: E402

from tests.engine_helpers import tiny_models  # noqa: E402
from tests.policy_helpers import linear_cost  # noqa: E402
from tests.server_helpers import CONTEXT, free_port, serve_argv, serving  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def server(models):
    # Fixed draft lengths: every request drafts, so the draft counters below are certain to move.
    with serving(serve_argv(models, free_port(), "--spec-policy", "fixed")) as running:
        yield running


@pytest.fixture(scope="module")
def reference(models):
    """transformers' greedy continuation of some prompts, as text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["target"])
    hf = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    prompts = ["hello world what is the", "the cat and the dog", "one two three four five", "capital of france is"]
    out = {}
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        gen = hf.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        out[p] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    return out


def _complete(base, prompt, **kw):
    body = {"model": "target", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60)


def test_health_is_503_until_phase_three(models):
    from fastapi.testclient import TestClient

    eng = Engine(EngineArgs(str(models["target"]), device_memory_bytes=64 << 20, context_len=64))
    client = TestClient(build_app(ServerState(eng, "target")))
    assert client.get("/health").status_code == 503
    assert client.post("/v1/completions", json={"prompt": [5, 6]}).status_code == 503
    eng.init_model_worker()
    assert client.get("/health").status_code == 200


def test_models_lists_the_served_model(server):
    base, _ = server
    data = httpx.get(f"{base}/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["target"]


def test_completion_equals_the_target_greedy_text(server, reference):
    base, _ = server
    for prompt, text in reference.items():
        r = _complete(base, prompt)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == text and choice["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 12


def test_draft_control_fields_keep_the_greedy_text(server, reference):
    """Drafting off, or capped, for one request: the same text, and no proposals for the first."""
    base, state = server
    prompt, text = next(iter(reference.items()))
    before = state.engine.report().stats.proposed_tokens
    r = _complete(base, prompt, speculative=False)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text
    assert state.engine.report().stats.proposed_tokens == before
    r = _complete(base, prompt, max_draft_tokens=1)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text


def test_streaming_deltas_join_to_the_same_text(server, reference):
    base, _ = server
    prompt, text = next(iter(reference.items()))
    chunks, done = [], False
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunks.append(json.loads(line[6:]))
    assert done and len(chunks) > 2
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests_each_get_their_own_answer(server, reference):
    base, _ = server
    prompts = list(reference) * 2
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: _complete(base, p), prompts))
    assert [r.json()["choices"][0]["text"] for r in results] == [reference[p] for p in prompts]


def test_chat_completion_streamed_and_not(server):
    base, _ = server
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == message["content"]


def test_sampling_with_a_seed_is_reproducible(server):
    base, _ = server

    def text(**kw):
        return _complete(base, "the cat", **kw).json()["choices"][0]["text"]

    seeded = text(temperature=0.8, seed=7)
    assert seeded == text(temperature=0.8, seed=7)
    # The seed is used: other seeds draw other text, and none of them is the greedy text.
    others = [text(temperature=0.8, seed=s) for s in (8, 9)]
    assert all(o != seeded for o in others), others
    assert text(temperature=0) not in [seeded, *others]


@pytest.mark.parametrize(
    "path, body, needle",
    [
        ("/v1/completions", b"{not json", "not valid JSON"),
        ("/v1/completions", b"[1, 2]", "JSON object"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "the"}, "not served here"),
        ("/v1/completions", {"prompt": "the " * (CONTEXT + 5)}, "context length"),
        ("/v1/completions", {"prompt": "the", "max_tokens": CONTEXT}, "context length"),
        ("/v1/completions", {"prompt": "the", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "the", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "the", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "the", "top_k": -3}, "top_k"),
        ("/v1/completions", {"prompt": "the", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "the", "n": 17}, "'n' must be an integer in [1, 16]"),
        ("/v1/completions", {"prompt": "the", "stop": 5}, "stop"),
        ("/v1/completions", {"prompt": "the", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": [1, 100000]}, "token ids"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": "the", "max_draft_tokens": -1}, "max_draft_tokens"),
        ("/v1/completions", {"prompt": "the", "max_draft_tokens": 1.5}, "max_draft_tokens"),
        ("/v1/completions", {"prompt": "the", "speculative": "no"}, "speculative"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ],
)
def test_bad_requests_get_400_with_a_message(server, path, body, needle):
    base, _ = server
    if isinstance(body, bytes):
        r = httpx.post(base + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(base + path, json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_stop_string_ends_the_text(server, reference):
    base, _ = server
    prompt, text = next(iter(reference.items()))
    word = text.split()[2]
    r = _complete(base, prompt, stop=[" " + word])
    choice = r.json()["choices"][0]
    assert choice["text"] == text[: text.index(" " + word)] and choice["finish_reason"] == "stop"


def test_a_stop_string_across_tokens_is_never_sent_in_part(server, reference):
    """A stop string of two words (two tokens): the text ends before it, in a stream as without one,
    and no chunk carries its first word: text that could begin a stop string waits for the next token."""
    base, _ = server
    prompt, text = next(iter(reference.items()))
    words = text.split()
    stop = f"{words[2]} {words[3]}"
    want = text[: text.index(stop)]
    whole = _complete(base, prompt, stop=[stop]).json()["choices"][0]
    assert whole["text"] == want and whole["finish_reason"] == "stop"
    body = {"model": "target", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stop": [stop], "stream": True}
    chunks = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):])["choices"][0])
    assert "".join(c["text"] for c in chunks) == want and chunks[-1]["finish_reason"] == "stop"


def test_metrics_and_plan_report_planned_and_actual_tokens(server):
    base, state = server
    assert _complete(base, "one two three four five").status_code == 200  # tokens to count, whatever ran before
    plan = httpx.get(f"{base}/plan").json()
    planned = plan["plan"]["kvCache"]["maxTotalNumTokens"]
    assert plan["plannedMaxTotalNumTokens"] == planned == plan["actualMaxTotalNumTokens"]
    text = httpx.get(f"{base}/metrics").text
    values = {line.split()[0]: float(line.split()[1])
              for line in text.splitlines() if line and not line.startswith("#")}
    assert values["specdecode_kv_tokens_planned"] == planned == values["specdecode_kv_tokens_actual"]
    assert values["specdecode_generation_tokens_total"] > 0
    assert values["specdecode_draft_proposed_tokens_total"] > 0
    assert 0 <= values["specdecode_acceptance_rate"] <= 1
    assert values['specdecode_phase_seconds{phase="load_weights"}'] > 0
    assert values["specdecode_kv_pool_used_tokens"] == 0  # nothing running now: every slot returned


def test_metrics_report_the_speculation_policy(server):
    base, state = server
    assert _complete(base, "one two three", speculative=False).status_code == 200  # a round without drafting
    assert _complete(base, "one two three").status_code == 200
    text = httpx.get(f"{base}/metrics").text
    values = {line.split()[0]: float(line.split()[1])
              for line in text.splitlines() if line and not line.startswith("#")}
    stats = state.engine.report().stats
    assert values["specdecode_draft_length_count"] == stats.verify_rounds  # one length per request-round
    assert values['specdecode_draft_length_bucket{le="0"}'] > 0
    assert values["specdecode_draft_length_sum"] == stats.proposed_tokens  # fixed K: every length proposed
    assert 0 < values["specdecode_steps_without_speculation_total"] < values["specdecode_decode_steps_total"]
    first = values['specdecode_acceptance_by_position{position="1"}']
    assert first == stats.accepted_by_position[1] / stats.proposed_by_position[1]
    assert values["specdecode_goodput_tokens_per_second"] > 0


def test_an_adaptive_server_reports_its_timed_rounds_and_probes(models):
    """/plan shows the rounds the adaptive policy timed at start-up (plain, every request drafting
    1..K, one request drafting K, by batch size) and what it measured since; /metrics counts its
    probe rounds and reports each bucket's measured speed-up, as the policy holds them."""
    argv = serve_argv(models, free_port(), "--spec-policy", "adaptive", "--num-draft-tokens", "2",
                      "--max-running-requests", "2")
    with serving(argv, engine_in_process=True) as (base, state):  # the test sets the policy's costs
        rounds = httpx.get(f"{base}/plan").json()["speculationPolicy"]["timedRounds"]
        assert rounds["batchSizes"] == [1, 2] and set(rounds["draftingSeconds"]) == {"1", "2"}
        assert all(s > 0 for s in rounds["plainSeconds"] + rounds["oneDrafterSeconds"])
        policy = state.engine.policy
        policy.cost = linear_cost(2, plain=1.0, per_draft_token=0.01)  # drafting looks free: it drafts, probes plain
        for _ in range(3):
            assert _complete(base, "one two three one two three", max_tokens=24).status_code == 200
        view = httpx.get(f"{base}/plan").json()["speculationPolicy"]
        assert view["mode"] == "adaptive"
        assert view["probeRounds"] == policy.probes and view["measuredSpeedup"] == policy.speedups()
        assert set(policy.speedups()) == {"1"} and policy.probes >= policy.least_rounds
        text = httpx.get(f"{base}/metrics").text
        values = {line.split()[0]: float(line.split()[1])
                  for line in text.splitlines() if line and not line.startswith("#")}
        assert values["specdecode_policy_probe_rounds_total"] == policy.probes
        assert values['specdecode_policy_measured_speedup{batch="1"}'] == pytest.approx(policy.speedups()["1"])
        assert state.engine.stats.phase_seconds["time_rounds"] > 0


def test_serve_cli_refuses_bad_flags_with_exit_2(models, capsys):
    port = str(free_port())
    cases = [
        (["--algorithm", "MTP"], "'num_nextn_predict_layers' must be a positive integer for MTP"),  # a Llama draft
        (["--algorithm", "EAGLE3", "--speculative-eagle-topk", "0"], "--speculative-eagle-topk: must be positive"),
        (["--tp", "3"], "--tp 3"),  # 4 attention heads do not split over 3 GPUs
        (["--plan", "/nonexistent/plan.json"], "cannot read"),
    ]
    for extra, needle in cases:
        assert serve_cli.main(serve_argv(models, port, *extra)) == 2
        assert needle in capsys.readouterr().err
    no_budget = ["--target", str(models["target"]), "--device", "cpu", "--port", port]
    assert serve_cli.main(no_budget) == 2
    assert "--device-memory-gib" in capsys.readouterr().err


def test_sizing_flags_next_to_a_plan_must_agree_with_it(models, tmp_path, capsys):
    """The operator pins the plan's numbers next to --plan: a fraction or context the plan does not
    hold is refused, and so is a serving limit above the one its reserve was priced for."""
    from specdecode_worker.planner import plan_cli

    assert plan_cli.main(["--target", str(models["target"]), "--algorithm", "NGRAM", "--gpu-memory-gib", "1.1",
                          "--mem-fraction-static", "0.95", "--tp", "1", "--context-length", "64"]) == 0
    plan = json.loads(capsys.readouterr().out)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    base = ["--target", str(models["target"]), "--algorithm", "NGRAM", "--plan", str(path), "--device", "cpu"]
    reserve = plan["reserve"]
    agreeing = ["--mem-fraction-static", repr(plan["memFractionStatic"]), "--context-length", "64",
                "--max-running-requests", str(reserve["maxRunningRequests"]),
                "--cuda-graph-max-bs", str(reserve["cudaGraphMaxBs"]),
                "--chunked-prefill-size", str(reserve["chunkedPrefillSize"])]
    engine_args, _ = serve_cli.resolve(serve_cli.parser().parse_args(base + agreeing))
    assert engine_args.context_len == 64 and engine_args.max_running_requests == reserve["maxRunningRequests"]
    for flag, value, planned in [
        ("--mem-fraction-static", "0.5", plan["memFractionStatic"]), ("--context-length", "128", 64),
    ]:
        assert serve_cli.main(base + [flag, value]) == 2
        assert f"{flag} {value}: the plan {path} has {planned}" in capsys.readouterr().err
    for flag, key in [("--max-running-requests", "maxRunningRequests"), ("--cuda-graph-max-bs", "cudaGraphMaxBs"),
                      ("--chunked-prefill-size", "chunkedPrefillSize")]:
        assert serve_cli.main(base + [flag, str(reserve[key] + 1)]) == 2
        assert f"{flag} {reserve[key] + 1}: the plan {path} priced" in capsys.readouterr().err


def test_a_node_that_declares_its_cpu_wins_over_device_cuda_and_sets_the_budget(models, tmp_path, capsys,
                                                                                monkeypatch):
    """A node whose pods request GPUs but run on its CPU says so in SPECDECODE_DEVICE (and the memory
    it gives them in SPECDECODE_DEVICE_MEMORY_GIB): the operator's --device cuda then serves on cpu,
    with that budget rather than the plan's; --device-memory-gib still wins over the node."""
    from specdecode_worker.planner import plan_cli

    assert plan_cli.main(["--target", str(models["target"]), "--algorithm", "NGRAM", "--gpu-memory-gib", "1.1",
                          "--mem-fraction-static", "0.95", "--tp", "1", "--context-length", "64"]) == 0
    path = tmp_path / "plan.json"
    path.write_text(capsys.readouterr().out)
    base = ["--target", str(models["target"]), "--algorithm", "NGRAM", "--plan", str(path), "--device", "cuda"]
    monkeypatch.setenv("SPECDECODE_DEVICE", "cpu")
    engine_args, plan = serve_cli.resolve(serve_cli.parser().parse_args(base))
    assert engine_args.device == "cpu" and engine_args.device_memory_bytes == plan.gpu_memory_bytes
    monkeypatch.setenv("SPECDECODE_DEVICE_MEMORY_GIB", "1.5")
    engine_args, _ = serve_cli.resolve(serve_cli.parser().parse_args(base))
    assert engine_args.device_memory_bytes == int(1.5 * 2**30)
    engine_args, _ = serve_cli.resolve(serve_cli.parser().parse_args(base + ["--device-memory-gib", "1.25"]))
    assert engine_args.device_memory_bytes == int(1.25 * 2**30)
    for name, value in [("SPECDECODE_DEVICE", "tpu"), ("SPECDECODE_DEVICE_MEMORY_GIB", "-1")]:
        with monkeypatch.context() as m:
            m.setenv(name, value)
            with pytest.raises(serve_cli.InputError, match=f"{name}={value}"):
                serve_cli.resolve(serve_cli.parser().parse_args(base))


def test_worker_below_the_plan_floor_exits_3(models, tmp_path, capsys):
    """A plan made for the small draft as target leaves no room once the real target is loaded."""
    from specdecode_worker.planner import plan_cli

    # G x f - R = 1 MiB for the KV pool: 7869 tokens of the draft's 128 B cell after its 41 kB of
    # weights, but only 1309 of the target's 512 B cell after its 378 kB.
    floor = 4096
    assert plan_cli.main(["--target", str(models["draft"]), "--algorithm", "NGRAM", "--gpu-memory-gib", "2.001953125",
                          "--mem-fraction-static", "0.5", "--tp", "1", "--context-length", "64",
                          "--min-kv-tokens", str(floor)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kvCache"]["maxTotalNumTokens"] >= floor
    # A plan that names its model is refused for another before loading (test_plan_models.py); one
    # from an older planner, which does not, is caught by the measured pool at start-up.
    del plan["models"]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    argv = ["--target", str(models["target"]), "--algorithm", "NGRAM", "--plan", str(path), "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(free_port()), "--log-level", "warning"]
    assert serve_cli.main(argv) == 3
    assert "KV token slots fit" in capsys.readouterr().err


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_eagle3_head_serves_the_target_greedy_text(models, reference, tmp_path, tree):
    """`serve --algorithm EAGLE3` with a head checkpoint: the same text as the target alone."""
    from devtools.eagle_heads import write_eagle3_head

    vocab = json.loads((models["target"] / "config.json").read_text())["vocab_size"]
    # The 2-layer target is too shallow for the default layers (2, L//2, L-3): name them.
    head = write_eagle3_head(tmp_path / "eagle3", models["target"], draft_vocab=vocab - 4, seed=3,
                             aux_layer_ids=[-1, 0, 1])
    shape = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--num-draft-tokens", "5"] if tree \
        else ["--num-draft-tokens", "3"]
    argv = serve_argv(models, free_port(), *shape)
    argv[argv.index("--draft") + 1] = str(head)
    argv[argv.index("--algorithm") + 1] = "EAGLE3"
    with serving(argv) as (base, state):
        for prompt, text in reference.items():
            r = _complete(base, prompt)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text
        assert state.engine.report().stats.verify_rounds > 0


@pytest.mark.parametrize(
    "path,body,needle",
    [
        ("/v1/completions", {"prompt": "the", "frobnicate": 1}, "unknown parameter 'frobnicate'"),
        ("/v1/completions", {"prompt": "the", "logit_bias": {"x": 1}}, "'logit_bias' keys must be token ids"),
        ("/v1/completions", {"prompt": "the", "logit_bias": {"5": 200}}, "numbers in [-100, 100]"),
        ("/v1/completions", {"prompt": "the", "logit_bias": {"9999": 1}}, "logit_bias token ids must be in [0, 160)"),
        ("/v1/completions", {"prompt": "the", "min_tokens": 99}, "min_tokens must be an integer in [0, max_tokens]"),
        ("/v1/completions", {"prompt": "the", "presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
        ("/v1/completions", {"prompt": "the", "repetition_penalty": "x"}, "'repetition_penalty' must be a number"),
        ("/v1/completions", {"prompt": "the", "logprobs": 21}, "top logprobs must be an integer in [0, 20]"),
        ("/v1/completions", {"prompt": "the", "logprobs": True}, "'logprobs' must be an integer in [0, 20]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True},
         "'echo' is not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "response_format": {"type": "json_object"}},
         "no token of this model's vocabulary can begin such an output"),
        ("/v1/completions", {"prompt": "the", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "bogus"}}}}, "Invalid type: bogus"),
        ("/v1/completions", {"prompt": "the", "response_format": "json"}, "'response_format' must be"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "tools": [{"type": "function", "function": {"name": "f"}}]},
         "this model's chat template takes no tools"),
        ("/v1/completions", {"prompt": "the", "tools": [{"type": "function", "function": {"name": "f"}}]},
         "'tools' is not supported"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role 'wizard'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "text": "x"}]}]}, "type 'text'"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]},
         "this model's chat template takes no tools"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "a user message needs 'content'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "audio": {}}]}, "messages"),
    ],
)
def test_unknown_and_unimplemented_parameters_get_400_naming_them(server, path, body, needle):
    """Nothing a client asks for is silently ignored: an unknown parameter, or an OpenAI feature
    this server does not implement asked for (echo on chat, tools on completions), tools or a JSON format
    the model cannot produce, or a chat role or content part it does not serve, is a 400 that names it."""
    base, _ = server
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()


def test_what_clients_send_by_default_is_accepted(server, reference):
    """The neutral values of the unimplemented parameters (what a client sends with the feature
    off), the parameters accepted and ignored, and text parts in a chat message are served: the
    text is the one without them."""
    base, _ = server
    prompt, text = next(iter(reference.items()))
    neutral = {"presence_penalty": 0.0, "frequency_penalty": 0, "logprobs": None, "echo": False, "best_of": 1,
               "logit_bias": {}, "user": "someone", "stream_options": {"include_usage": True}, "suffix": None}
    r = _complete(base, prompt, **neutral)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == text
    parts = [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]
    chat = {"messages": [{"role": "system", "content": parts}, {"role": "user", "content": "hello", "name": "me"}],
            "max_tokens": 4, "temperature": 0, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "parallel_tool_calls": True}
    joined = {**chat, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello",
                                                                                 "name": "me"}]}
    a = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60)
    b = httpx.post(f"{base}/v1/chat/completions", json=joined, timeout=60)
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.json()["choices"][0]["message"] == b.json()["choices"][0]["message"]


def test_penalties_reach_the_engine(server, reference):
    """A frequency penalty on a greedy request changes the text the unpenalised request gets."""
    base, _ = server
    prompt, text = next(iter(reference.items()))
    r = _complete(base, prompt, frequency_penalty=2.0, presence_penalty=2.0, repetition_penalty=3.0)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] != text
