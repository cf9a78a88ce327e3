"""Every argument list the operator renders for SGLang passes SGLang 0.5.23's own parser and checks,
for each algorithm and for TP 1, 2 and 8, and SGLang resolves them to the planned numbers (it did
not quietly replace one: under speculation it resets max_running_requests unless it is given)."""

from __future__ import annotations

import json
import subprocess

import pytest

from specdecode_operator.spec import parse_spec
from specdecode_operator.workload import engine_args
from specdecode_worker.planner.plan import PlanArgs
from specdecode_worker.planner.plan_cli import make_plan
from devtools.deepseek_models import write_tiny_deepseek
from devtools.eagle_heads import write_eagle3_head, write_eagle_head
from tests.engine_pods import ROOT, engine_venv
from tests.operator_helpers import typed
from devtools.tiny_models import write_tiny_model

pytestmark = pytest.mark.timeout(600)

WIDE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=8)
DRAFTS = {"EAGLE": "eagle", "EAGLE3": "eagle3", "STANDALONE": "draft", "MTP": None, "NGRAM": None}
CASES = [(algorithm, tp) for algorithm in DRAFTS for tp in (1, 2, 8)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-models")
    target = write_tiny_model(root / "target", "llama", **WIDE)
    write_eagle_head(root / "eagle", target)
    write_eagle3_head(root / "eagle3", target, draft_vocab=64, aux_layer_ids=[-1, 0, 1])
    write_tiny_model(root / "draft", "llama", seed=1, **{**WIDE, "num_hidden_layers": 1})
    write_tiny_deepseek(root / "deepseek", mtp=True, num_attention_heads=8, num_key_value_heads=8)
    return root


def rendered(store, algorithm, tp):
    target = "deepseek" if algorithm == "MTP" else "target"
    draft = DRAFTS[algorithm]
    plan = make_plan(PlanArgs(target=str(store / target), draft=str(store / draft) if draft else None,
                              algorithm=algorithm, tp=tp, gpu_memory_gib=80, context_length=256,
                              max_running_requests=32, engine="sglang"))
    draft_spec = {"algorithm": algorithm, **({"model": draft} if draft else {}),
                  **({"numDraftTokens": 4} if algorithm == "NGRAM" else {"numSteps": 3})}
    view = parse_spec({"metadata": {"name": "s", "namespace": "n"}, "spec": {
        "target": {"model": target}, "draft": draft_spec, "modelStore": {"pvc": {"claimName": "m"}},
        "serving": {"contextLength": 256, "maxRunningRequests": 32}, "gpu": {"memoryGiB": 80},
        "runtime": {"engine": "sglang"}}})
    return plan, [a.replace("/models/", f"{store}/") for a in engine_args(view, typed(plan))]


def test_sglang_accepts_every_rendered_command(store):
    plans, argvs = zip(*(rendered(store, algorithm, tp) for algorithm, tp in CASES))
    venv = engine_venv("sglang")
    out = subprocess.run([str(venv / "bin" / "python"), str(ROOT / "tests" / "sglang_check.py")],
                         input=json.dumps(argvs), capture_output=True, text=True, timeout=500)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line, out.stderr[-3000:]
    results = json.loads(line[len("RESULTS "):])
    failed = [(case, r["error"], r["trace"]) for case, r in zip(CASES, results) if not r["ok"]]
    assert not failed, failed
    for (algorithm, tp), plan, r in zip(CASES, plans, results):
        rt = plan["runtime"]
        assert plan["fits"] and plan["tensorParallelSize"] == tp, (algorithm, tp, plan["message"])
        assert (r["tp_size"], r["max_total_tokens"], r["page_size"]) == (tp, rt["reportedTokens"], 1), (algorithm, tp)
        assert abs(r["mem_fraction_static"] - rt["memFractionStatic"]) < 1e-9
        assert (r["context_length"], r["max_running_requests"]) == (256, 32), (algorithm, tp, r)
        assert r["speculative_num_draft_tokens"] == 4, (algorithm, tp, r)
