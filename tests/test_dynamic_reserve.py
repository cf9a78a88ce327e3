"""The dynamic reserve on CPU: a tiny model serves in a 2 GiB budget with every flag at its default."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specdecode_worker import serve_cli  # noqa: E402
from specdecode_worker.contract import MIB  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.engine.engine import Engine  # noqa: E402
from specdecode_worker.plan import ForwardGeometry, dynamic_reserve_bytes  # noqa: E402

from tests.engine_helpers import run_all, tiny_models  # noqa: E402


def test_tiny_model_starts_in_a_2_gib_budget_with_defaults(tmp_path):
    models = tiny_models(tmp_path)
    args = serve_cli.parser().parse_args([
        "--target", str(models["target"]), "--draft", str(models["draft"]), "--algorithm", "STANDALONE",
        "--device", "cpu", "--device-memory-gib", "2",
    ])
    engine_args, plan = serve_cli.resolve(args)
    assert plan["fits"], plan["message"]
    # the reserve follows the tiny geometry (hidden 64, vocabulary of the tiny tokenizer), not a GPU's
    assert plan["reserve"]["dynamicBytes"] < 64 * MIB
    assert plan["memFractionStatic"] > 0.9
    eng = Engine(engine_args)
    eng.init_model_worker()
    (req,) = run_all(eng, [Request([3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))])
    assert len(req.output_ids) == 4


def test_reserve_grows_with_the_geometry_and_the_sizes():
    small = ForwardGeometry(64, 128, 4, 2, 16, 16, 1000, 2)
    large = ForwardGeometry(4096, 14336, 32, 8, 128, 128, 128_256, 2)
    base = dynamic_reserve_bytes("NGRAM", small, None, 1, 2048, 8, 8)
    assert dynamic_reserve_bytes("NGRAM", large, None, 1, 2048, 8, 8) > 50 * base
    assert dynamic_reserve_bytes("NGRAM", small, None, 1, 4096, 8, 8) > base
    assert dynamic_reserve_bytes("NGRAM", small, None, 1, 2048, 64, 8) > base
    assert dynamic_reserve_bytes("NGRAM", small, None, 1, 2048, 8, 8, verify_tokens=1024) > base
    # STANDALONE and NGRAM capture verify graphs; an EAGLE head verifies eagerly
    verify_graphs = dynamic_reserve_bytes("NGRAM", large, None, 1, 8192, 256, 256, verify_tokens=8)
    assert verify_graphs > dynamic_reserve_bytes("NGRAM", large, None, 1, 8192, 256, 256, verify_tokens=4)


def test_serve_prices_its_own_verify_width(tmp_path):
    from specdecode_worker.plan_cli import plan_args

    argv = ["--target", str(tmp_path), "--algorithm", "NGRAM", "--device", "cpu", "--device-memory-gib", "2"]
    assert plan_args(serve_cli.parser().parse_args(argv)).verify_tokens == 5  # the default 4 proposals + 1
    assert plan_args(serve_cli.parser().parse_args(argv + ["--num-draft-tokens", "7"])).verify_tokens == 8
