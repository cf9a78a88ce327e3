"""Three-phase initialisation: order, pool sharing, and pool sizes against the planner."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from specdecode_worker.planner import plan_cli  # noqa: E402
from specdecode_worker.engine.speculation import wiring  # noqa: E402
from specdecode_worker.engine.model_runner import ModelRunner  # noqa: E402
from specdecode_worker.engine.phases import PhaseError  # noqa: E402
from specdecode_worker.engine.memory.pools import MemoryPoolConfig  # noqa: E402
from specdecode_worker.engine.engine import Engine, EngineArgs, StartupError  # noqa: E402
from specdecode_worker.errors import InputError  # noqa: E402

from tests.engine_helpers import engine, tiny_models  # noqa: E402

from specdecode_worker.contract import GIB  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("init"))


def test_runner_refuses_steps_out_of_order(models):
    runner = ModelRunner(models["target"])
    cfg = MemoryPoolConfig(64, 2, 32)
    with pytest.raises(PhaseError, match=r"phase 1 \(load weights\)"):
        runner.alloc_memory_pool(cfg)
    runner.load_weights()
    with pytest.raises(PhaseError, match=r"phase 2 \(allocate KV pools\)"):
        runner.init_backends()
    runner.alloc_memory_pool(cfg)
    with pytest.raises(PhaseError, match=r"phase 3"):
        runner.forward(None, last_only=True)


def test_engine_allocates_only_with_every_weight_resident(models):
    eng = Engine(EngineArgs(str(models["target"]), str(models["draft"]), "STANDALONE", device_memory_bytes=64 << 20))
    eng.create_runners()
    eng.target_runner.load_weights()  # the draft is not loaded yet
    with pytest.raises(PhaseError, match=r"phase 2 .*phase 1 \(load weights\)"):
        eng.init_memory_pools()
    with pytest.raises(PhaseError, match=r"phase 3 .*phase 2"):
        eng.init_backends()


def test_init_model_worker_orders_the_phases(models, monkeypatch):
    events = []

    def spy(name, fn):
        def wrapped(self, *a, **kw):
            events.append((name, self.name))
            return fn(self, *a, **kw)
        return wrapped

    for name in ("load_weights", "alloc_memory_pool", "init_backends"):
        monkeypatch.setattr(ModelRunner, name, spy(name, getattr(ModelRunner, name)))
    real_load_shape = wiring.load_shape  # the engine reads every config through its wiring
    monkeypatch.setattr(wiring, "load_shape",
                        lambda d: events.append(("read_config", str(d))) or real_load_shape(d))
    engine(models["target"], "STANDALONE", models["draft"])
    assert events == [
        ("read_config", str(models["target"])), ("read_config", str(models["draft"])),
        ("load_weights", "target"), ("load_weights", "draft"),
        ("alloc_memory_pool", "target"), ("alloc_memory_pool", "draft"),
        ("init_backends", "target"), ("init_backends", "draft"),
    ]


def test_draft_adopts_the_target_request_pool_and_allocator(models):
    eng = engine(models["target"], "STANDALONE", models["draft"])
    t, d = eng.target_runner, eng.draft_runner
    assert d.req_to_token_pool is t.req_to_token_pool
    assert d.token_to_kv_pool_allocator is t.token_to_kv_pool_allocator
    assert d.token_to_kv_pool is not t.token_to_kv_pool
    # Own K/V with the draft's geometry: 1 layer, 1 KV head of dim 16 (hidden 32 / 2 heads).
    assert len(d.token_to_kv_pool.k_buffer) == 1 and len(t.token_to_kv_pool.k_buffer) == 2
    assert d.token_to_kv_pool.k_buffer[0].shape == (t.token_to_kv_pool.size + 1, 1, 16)


def _plan(models, *extra):
    argv = ["--target", str(models["target"]), "--algorithm", "STANDALONE", "--draft", str(models["draft"]),
            "--gpu-memory-gib", "1.1", "--mem-fraction-static", "0.95", "--context-length", "64", *extra]
    return argv


def test_cpu_pools_hold_exactly_the_planned_tokens(models, capsys):
    assert plan_cli.main(_plan(models)) == 0
    plan = json.loads(capsys.readouterr().out)
    eng = engine(models["target"], "STANDALONE", models["draft"], device_memory_bytes=int(1.1 * GIB),
                   mem_fraction_static=0.95, runtime_bytes=plan["reserve"]["runtimeBytes"], context_len=64)
    # Hand count: target 2 layers x 2 KV heads x (16 + 16) x 4 bytes = 512; draft 1 x 1 x 32 x 4 = 128.
    assert plan["kvCache"]["targetBytesPerToken"] == 512 and plan["kvCache"]["draftBytesPerToken"] == 128
    t, d = eng.target_runner, eng.draft_runner
    assert (t.kv_cell_bytes, d.kv_cell_bytes) == (512, 128)
    assert t.weight_bytes == plan["weights"]["targetBytes"] and d.weight_bytes == plan["weights"]["draftBytes"]
    planned = plan["kvCache"]["maxTotalNumTokens"]
    assert eng.memory_profile.max_total_num_tokens == planned
    assert t.token_to_kv_pool_allocator.size == planned
    assert t.token_to_kv_pool.bytes_per_token() == 512 and d.token_to_kv_pool.bytes_per_token() == 128
    assert t.token_to_kv_pool.k_buffer[0].shape[0] == planned + 1  # plus the padding slot 0


def test_below_the_floor_the_worker_stops_before_serving(models):
    with pytest.raises(StartupError, match="KV token slots fit"):
        engine(models["target"], "STANDALONE", models["draft"], device_memory_bytes=1 << 20, min_kv_tokens=4096)


def test_a_standalone_draft_with_mtp_layers_is_refused_before_any_weight_loads(models, tmp_path, monkeypatch):
    from devtools.tiny_models import write_tiny_model

    mtp = write_tiny_model(tmp_path / "mtp", num_nextn_predict_layers=1)
    loads = []
    monkeypatch.setattr(ModelRunner, "load_weights", lambda self: loads.append(self.name))
    eng = Engine(EngineArgs(str(models["target"]), str(mtp), "STANDALONE", device_memory_bytes=64 << 20))
    with pytest.raises(InputError, match="has MTP layers.*--algorithm MTP"):
        eng.init_model_worker()
    assert loads == []


def test_a_weight_source_given_to_the_engine_fills_every_model_it_loads(models):
    """Phase 1 reads weights through the source the engine was given (benchmarks make theirs on the
    device): the target and the draft, each from its own folder; the same values give the same output."""
    from specdecode_worker.engine.models.loader import load_safetensors
    from specdecode_worker.engine.request import SamplingParams

    read = []

    def recorded(model, model_dir, device, dtype):
        read.append(str(model_dir))
        load_safetensors(model, model_dir, device, dtype)

    args = EngineArgs(str(models["target"]), str(models["draft"]), "STANDALONE", device_memory_bytes=64 << 20,
                      runtime_bytes=0, context_len=128, max_running_requests=2, num_draft_tokens=3)
    given, served = Engine(args, weights=recorded), Engine(args)
    for eng in (given, served):
        eng.init_model_worker()
    assert read == [str(models["target"]), str(models["draft"])]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert given.generate([5, 6, 7], params).output_ids == served.generate([5, 6, 7], params).output_ids
