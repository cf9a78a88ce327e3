"""The demo, the README's first command: demo/run.py on a control plane of its own serves
SmolLM2-135M-Instruct through the operator, and its answer is the model's own greedy output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from devtools import smollm2  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir():
    return smollm2.smollm2_dir_or_skip()


def greedy_reply(model_dir: Path, messages: list[dict], max_tokens: int) -> str:
    """transformers' greedy continuation of the chat, up to the end-of-turn token or max_tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_demo_serves_smollm2_with_its_greedy_answer_and_a_second_run_reuses_it(cluster, model_dir, tmp_path):
    """`cluster` only guarantees the binaries: the demo starts and stops a plane of its own."""
    env = dict(os.environ, SPECDECODE_CLUSTER_DIR=str(tmp_path / "plane"), SPECDECODE_DEMO_DIR=str(tmp_path / "demo"))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    demo = [sys.executable, str(ROOT / "demo" / "run.py")]
    try:
        first = subprocess.run(demo, env=env, capture_output=True, text=True, timeout=900)
        assert first.returncode == 0, f"demo failed:\n{first.stdout[-4000:]}\n{first.stderr[-2000:]}"
        out = first.stdout
        for step in range(1, 8):
            assert f"[{step}/7]" in out
        assert "Ready        True" in out, out  # the conditions as they changed, ending Ready
        assert "Planned      True   PlanReady" in out
        assert "MemoryPlan  NGRAM" in out and "fits: yes" in out
        assert "demo/run.py down" in out
        # the operator ran on the chart ServiceAccount's token, not the admin certificate
        op_kubeconfig = yaml.safe_load((tmp_path / "demo" / "operator.kubeconfig").read_text())
        assert list(op_kubeconfig["users"][0]["user"]) == ["token"]

        record = json.loads((tmp_path / "demo" / "completion.json").read_text())
        request, choice = record["request"], record["response"]["choices"][0]
        answer = choice["message"]["content"]
        assert answer == greedy_reply(model_dir, request["messages"], request["max_tokens"])
        assert f"assistant: {answer}" in out
        # the answer quotes the prompt, so prompt-lookup drafts are accepted, and the demo says how many
        draft = record["draft"]
        assert 0 < draft["accepted"] <= draft["proposed"]
        assert f"acceptance rate {draft['acceptanceRate']:.0%}" in out

        second = subprocess.run(demo, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, f"second demo run failed:\n{second.stdout[-4000:]}"
        assert "reusing the control plane" in second.stdout
        assert "operator already running" in second.stdout and "worker already running" in second.stdout
        again = json.loads((tmp_path / "demo" / "completion.json").read_text())
        assert again["response"]["choices"][0]["message"]["content"] == answer
    finally:
        down = subprocess.run([*demo, "down"], env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    for name in ("operator", "worker"):
        assert not (tmp_path / "demo" / f"{name}.pid").exists()
    assert not (tmp_path / "plane" / "state.json").exists()
