"""Shared set-up for tensor-parallel engine tests on CPU (gloo): the prompts and budgets, the engine
arguments per t, the function each spawned rank runs, and one launch per t shared by a module's tests."""

from __future__ import annotations

import torch

from specdecode_worker.contract import GIB
from specdecode_worker.engine.parallel.distributed import launch
from specdecode_worker.engine.engine import EngineArgs
from specdecode_worker.engine.request import Request, SamplingParams
from specdecode_worker.planner.plan import runtime_reserve_bytes

from tests.engine_helpers import run_all

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [20, 21, 22], list(range(30, 50))]
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
# Per t: a budget whose KV area after the planner's runtime reserve (1 GiB + t x 128 MiB) is ~0.1 GiB.
BUDGET_GIB = {1: 1.2, 2: 1.45, 4: 1.7}
FRACTION = 0.95
CONTEXT = 64
WALL_S = 240  # no rank may hang: the supervisor ends the run after this


def _describe(eng) -> dict:
    t = eng.target_runner
    d = eng.draft_runner if eng.draft_runner else None
    info = {
        "target_weight_bytes": t.weight_bytes, "target_kv_cell": t.kv_cell_bytes,
        "target_kv_heads": t.token_to_kv_pool.k_buffer[0].shape[1],
        "profiled_tokens": eng.memory_profile.max_total_num_tokens,
        "allocated_tokens": t.token_to_kv_pool_allocator.size, "kv_rows": t.token_to_kv_pool.k_buffer[0].shape[0],
    }
    if d is not None:
        info.update(draft_weight_bytes=d.weight_bytes, draft_kv_cell=d.kv_cell_bytes, draft_tp=d.tp.size,
                    draft_kv_rows=d.token_to_kv_pool.k_buffer[0].shape[0])
    return info


def _lead(eng) -> dict:
    reqs = run_all(eng, [Request(list(p), GREEDY) for p in PROMPTS])
    return {**_describe(eng), "outputs": [r.output_ids for r in reqs], "proposed": eng.stats.proposed_tokens}


def tp_rank(engine_kws: dict[str, dict], bad_target: dict | None = None) -> dict:
    """Runs inside each rank process (spawned): per algorithm one engine, init, then lead or follow."""
    from specdecode_worker.engine.parallel.distributed import get_tp
    from specdecode_worker.engine.parallel.tp_engine import run_rank

    torch.set_num_threads(1)
    out = {}
    for algorithm, engine_kw in engine_kws.items():
        kw = dict(engine_kw)
        if bad_target and get_tp().rank in bad_target:
            kw["target"] = bad_target[get_tp().rank]
        out[algorithm] = run_rank(EngineArgs(**kw), _lead, _describe)
    return out


def tp_sizing(tp: int) -> dict:
    """Engine arguments that size t ranks as the planner prices them: BUDGET_GIB[t] per GPU, its
    runtime reserve, FRACTION and CONTEXT."""
    return dict(device_memory_bytes=int(BUDGET_GIB[tp] * GIB), mem_fraction_static=FRACTION,
                runtime_bytes=runtime_reserve_bytes(tp), context_len=CONTEXT)


def engine_kwargs(models, tp: int, algorithm: str) -> dict:
    return dict(target=str(models["target"]), draft=str(models["draft"]) if algorithm == "STANDALONE" else None,
                algorithm=algorithm, **tp_sizing(tp), max_running_requests=4, num_draft_tokens=3)


def launches(rank_fn, kwargs_of, wall_s: float = WALL_S):
    """``get(t)``: each rank's result of ``rank_fn(kwargs_of(t))`` on t ranks, launched once per t
    (a module's tests share the launch)."""
    cache: dict[int, list] = {}

    def get(tp: int) -> list:
        if tp not in cache:
            cache[tp] = launch(tp, rank_fn, (kwargs_of(tp),), wall_timeout_s=wall_s)
        return cache[tp]

    return get


def serve_tp2_argv(models, port: int, device_memory_gib: float, *extra: str) -> list[str]:
    """The command of ``specdecode-worker serve --tp 2`` on CPU over the tiny STANDALONE pair."""
    import sys

    return [sys.executable, "-m", "specdecode_worker", "serve", "--tp", "2", "--target", str(models["target"]),
            "--draft", str(models["draft"]), "--algorithm", "STANDALONE", "--device", "cpu",
            "--device-memory-gib", str(device_memory_gib), "--mem-fraction-static", str(FRACTION),
            "--context-length", str(CONTEXT), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            "--served-model-name", "target", *extra]


def assert_serves_greedy_text(base: str, model_dir, prompts: list[str], max_tokens: int) -> None:
    """Each prompt's completion from the server at ``base`` (temperature 0, EOS ignored) is
    transformers' greedy text for it: the independent reference."""
    import httpx
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        want = tok.decode(hf.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                      do_sample=False)[0, ids.shape[1]:], skip_special_tokens=True)
        body = {"model": "target", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
