"""`specdecode-worker plan` end to end on sparse published checkpoints: exit codes, the JSON on
stdout and in the termination log, the table, and one clear line for every bad input."""

import json
import math
import os
import subprocess
import sys

import pytest

from specdecode_worker.planner import plan_cli
from specdecode_worker.contract import GIB, MIB, validate_plan
from specdecode_worker.errors import InputError
from specdecode_worker.planner.plan import PlanArgs
from devtools.checkpoints import CONFIGS, write_model, write_tokenizer


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # plan against the flags, even on a GPU host


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    names = ["llama-3.1-8b-instruct", "llama-3.1-70b-instruct", "eagle3-llama-3.1-8b",
             "qwen2.5-7b-instruct", "qwen2.5-0.5b-instruct", "deepseek-v3"]
    return {n: str(write_model(root / n, n)) for n in names}


def run(capsys, *argv):
    code = plan_cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def plan_of(capsys, *argv):
    code, out, err = run(capsys, *argv)
    assert code in (0, 3), err
    return code, validate_plan(json.loads(out))


def test_llama8b_eagle3_on_h100_golden(models, capsys, tmp_path):
    log = tmp_path / "termination-log"
    code, plan = plan_of(capsys, "--target", models["llama-3.1-8b-instruct"], "--draft", models["eagle3-llama-3.1-8b"],
                         "--algorithm", "EAGLE3", "--gpu-memory-gib", 79, "--mem-fraction-static", 0.835,
                         "--termination-log", log)
    assert code == 0 and plan["fits"]
    assert plan["target"] == "llama-3.1-8b-instruct" and plan["draft"] == "eagle3-llama-3.1-8b"
    assert plan["weights"] == {"targetBytes": 16_060_522_496, "draftBytes": 849_763_584}
    kv = plan["kvCache"]
    assert (kv["targetBytesPerToken"], kv["draftBytesPerToken"], kv["draftNumLayers"]) == (131_072, 4_096, 1)
    assert kv["maxTotalNumTokens"] == 390_960  # hand: (79 GiB x 0.835 - weights - 1 GiB) / 135,168
    assert kv["contextLength"] == 131_072  # the target's max_position_embeddings
    assert plan["gpuMemoryBytes"] == 79 * GIB and plan["tensorParallelSize"] == 1
    text = log.read_text()
    assert json.loads(text) == plan and len(text.encode()) < 4096 and "\n" not in text


def test_an_eagle_head_is_priced_in_the_targets_dtype_whatever_its_config_says(models, capsys, tmp_path):
    """The worker runs an EAGLE head, and keeps its KV, in the target's dtype (``EagleRunner``): a
    float32 target's bf16-declared EAGLE3 head costs 4 bytes per K/V element and per weight
    element; its vocabulary maps (int64 d2t, bool t2d) stay as stored."""
    target = write_model(tmp_path / "llama-fp32", "llama-3.1-8b-instruct")  # sparse: a copy would read 16 GB
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    code, plan = plan_of(capsys, "--target", target, "--draft", models["eagle3-llama-3.1-8b"],
                         "--algorithm", "EAGLE3", "--gpu-memory-gib", 79)
    assert code == 0
    maps = 32_000 * 8 + 128_256  # d2t, t2d
    assert plan["weights"]["draftBytes"] == 2 * (849_763_584 - maps) + maps  # the bf16 plan's, cast
    assert plan["kvCache"]["draftBytesPerToken"] == 1 * 8 * 128 * 2 * 4  # 1 layer, 8 KV heads, K and V, fp32
    assert plan["kvCache"]["targetBytesPerToken"] == 32 * 8 * 128 * 2 * 4


def test_qwen_standalone_draft_with_real_geometry(models, capsys):
    code, plan = plan_of(capsys, "--target", models["qwen2.5-7b-instruct"], "--draft", models["qwen2.5-0.5b-instruct"],
                         "--algorithm", "STANDALONE", "--gpu-memory-gib", 79, "--mem-fraction-static", 0.835)
    assert code == 0
    assert plan["weights"] == {"targetBytes": 15_231_233_024, "draftBytes": 988_065_536}
    assert plan["kvCache"]["targetBytesPerToken"] == 57_344 and plan["kvCache"]["draftBytesPerToken"] == 12_288
    assert plan["kvCache"]["draftNumLayers"] == 24
    assert plan["kvCache"]["maxTotalNumTokens"] == 768_846
    assert plan["layerRatio"] == {"maxTotalNumTokens": 502_707, "bytesPerToken": 106_496}
    # The draft's 14 heads do not split 4 ways: at --tp 4 it is replicated, whole on every GPU.
    code, plan4 = plan_of(capsys, "--target", models["qwen2.5-7b-instruct"], "--draft", models["qwen2.5-0.5b-instruct"],
                          "--algorithm", "STANDALONE", "--gpu-memory-gib", 79, "--tp", 4)
    assert code == 0 and plan4["weights"]["draftBytes"] == 988_065_536
    assert plan4["kvCache"]["draftBytesPerToken"] == 12_288
    # The target's 28 heads rule out 8 GPUs.
    code, out, err = run(capsys, "--target", models["qwen2.5-7b-instruct"], "--draft", models["qwen2.5-0.5b-instruct"],
                         "--algorithm", "STANDALONE", "--gpu-memory-gib", 79, "--tp", 8)
    assert code == 2 and "--tp 8:" in err and "28 attention heads" in err and "valid sizes: 1, 2, 4" in err


def test_llama70b_on_80gb_needs_more_than_one_gpu(models, capsys):
    code, plan = plan_of(capsys, "--target", models["llama-3.1-70b-instruct"],
                         "--draft", models["llama-3.1-8b-instruct"],
                         "--algorithm", "STANDALONE", "--gpu-product", "NVIDIA-H100-80GB-HBM3")
    assert code == 0 and plan["tensorParallelSize"] == 4 and plan["minTensorParallelSize"] == 4
    # per GPU at tp 4: 2-D tensors split 4 ways, norms whole (hand: (W - norms)/4 + norms)
    norms_70b, norms_8b = (2 * 80 + 1) * 8192 * 2, (2 * 32 + 1) * 4096 * 2
    assert plan["weights"]["targetBytes"] == (141_107_412_992 - norms_70b) // 4 + norms_70b
    assert plan["weights"]["draftBytes"] == (16_060_522_496 - norms_8b) // 4 + norms_8b
    # 80 layers x 2 KV heads per GPU x 256 x 2 bytes; draft 32 x 2 x 256 x 2
    assert plan["kvCache"]["targetBytesPerToken"] == 81_920 and plan["kvCache"]["draftBytesPerToken"] == 32_768
    code, plan1 = plan_of(capsys, "--target", models["llama-3.1-70b-instruct"],
                          "--draft", models["llama-3.1-8b-instruct"],
                          "--algorithm", "STANDALONE", "--gpu-product", "NVIDIA-H100-80GB-HBM3", "--tp", 1)
    assert code == 3 and not plan1["fits"] and plan1["kvCache"]["maxTotalNumTokens"] == 0
    assert plan1["minMemFractionStatic"] > 1 and "fits with --tp 4" in plan1["message"]
    assert plan1["shortfallBytes"] > 141_107_412_992 - (81_559 - 615) * MIB


def test_deepseek_mtp_on_h200_needs_eight_gpus(models, capsys):
    # The NextN layer shards with the target (mtp_rule), so MTP plans at the size the target needs.
    code, plan = plan_of(capsys, "--target", models["deepseek-v3"], "--algorithm", "MTP",
                         "--gpu-product", "NVIDIA-H200")
    assert code == 0 and plan["fits"] and plan["tensorParallelSize"] == 8 and plan["draft"] == "deepseek-v3"
    kv = plan["kvCache"]
    assert (kv["targetBytesPerToken"], kv["draftBytesPerToken"], kv["draftNumLayers"]) == (70_272, 1_152, 1)
    assert kv["contextLength"] == 163_840 and kv["maxTotalNumTokens"] == 721_805
    assert plan["layerRatio"]["bytesPerToken"] == 71_424
    # ~673 GB FP8 over 8 GPUs; the NextN layer's block split 8 ways, eh_proj and norms whole
    assert plan["weights"] == {"targetBytes": 85_140_130_848, "draftBytes": 1_661_047_968}
    fp8 = plan_of(capsys, "--target", models["deepseek-v3"], "--algorithm", "MTP", "--gpu-product", "NVIDIA-H200",
                  "--kv-cache-dtype", "fp8_e4m3")[1]
    assert fp8["kvCache"]["targetBytesPerToken"] == 35_136 and fp8["kvCache"]["draftBytesPerToken"] == 576
    assert fp8["kvCache"]["dtype"] == "fp8_e4m3" and fp8["tensorParallelSize"] == 8
    code, one = plan_of(capsys, "--target", models["deepseek-v3"], "--algorithm", "MTP", "--gpu-product",
                        "NVIDIA-H200", "--tp", "1")
    assert code == 3 and not one["fits"] and one["weights"]["draftBytes"] == 11_717_511_392
    assert "does not fit on 1 GPU(s)" in one["message"] and "fits with --tp 8" in one["message"]


def test_mtp_without_nextn_layers_is_bad_input(models, capsys):
    code, out, err = run(capsys, "--target", models["llama-3.1-8b-instruct"], "--algorithm", "MTP",
                         "--gpu-memory-gib", 70)
    assert code == 2 and "field 'num_nextn_predict_layers' must be a positive integer for MTP" in err


def test_ngram_plans_target_only(models, capsys):
    code, plan = plan_of(capsys, "--target", models["llama-3.1-8b-instruct"], "--algorithm", "NGRAM",
                         "--gpu-product", "NVIDIA-A100-SXM4-80GB")
    assert plan["draft"] is None and plan["weights"]["draftBytes"] == 0 and plan["kvCache"]["draftBytesPerToken"] == 0


def test_overrides_max_total_tokens_and_kv_cache_memory(models, capsys):
    base = ["--target", models["llama-3.1-8b-instruct"], "--draft", models["eagle3-llama-3.1-8b"],
            "--algorithm", "EAGLE3", "--gpu-product", "NVIDIA-H100-80GB-HBM3"]
    capped = plan_of(capsys, *base, "--max-total-tokens", 200_000)[1]
    assert capped["kvCache"]["maxTotalNumTokens"] == 200_000
    direct = plan_of(capsys, *base, "--kv-cache-memory-gib", 20)[1]
    assert direct["kvCache"]["maxTotalNumTokens"] == 20 * GIB // 135_168
    code, out, err = run(capsys, *base, "--kv-cache-memory-gib", 20, "--mem-fraction-static", 0.8)
    assert code == 2 and "give one" in err


def test_misfit_exits_3_and_still_writes_the_plan(models, capsys, tmp_path):
    log = tmp_path / "log"
    code, out, err = run(capsys, "--target", models["llama-3.1-8b-instruct"], "--draft", models["eagle3-llama-3.1-8b"],
                         "--algorithm", "EAGLE3", "--gpu-product", "NVIDIA-L4", "--tp", 1, "--context-length", 32768,
                         "--chunked-prefill-size", 32768, "--termination-log", log)
    assert code == 3 and err == ""  # a 32k-token chunk's activations leave too little for the KV floor
    plan = validate_plan(json.loads(out))
    assert not plan["fits"] and plan["minTensorParallelSize"] == 2 and plan["shortfallBytes"] > 0
    assert json.loads(log.read_text()) == plan
    g = (23_034 - 615) * MIB  # L4 total minus the driver's reservation
    assert plan["gpuMemoryBytes"] == g and plan["gpu"]["totalBytes"] == 23_034 * MIB
    need = 32768 * 135_168 + 16_060_522_496 + 849_763_584 + GIB
    assert plan["minMemFractionStatic"] == math.ceil(need / g * 1000) / 1000


def test_table_output(models, capsys):
    code, out, err = run(capsys, "--target", models["llama-3.1-8b-instruct"], "--draft", models["eagle3-llama-3.1-8b"],
                         "--algorithm", "EAGLE3", "--gpu-memory-gib", 79, "--mem-fraction-static", 0.835,
                         "--output", "table")
    assert code == 0
    assert "target weights                 14.96 GiB" in out
    assert "draft weights                   0.79 GiB" in out
    assert "KV tokens: 390960" in out
    assert "legacy (target-only profile)" in out and "layer ratio (scaled cell)" in out
    # the planner's defaults for an 80 GB GPU, and its default width of 3 proposals + 1
    assert ("reserve priced for: 4 verify tokens per request (a chain), 256 running requests, CUDA graphs up to "
            "batch 256, prefill chunks of 8192 tokens, 2-byte activations (the checkpoint dtype)") in out
    code, out, _ = run(capsys, "--target", models["llama-3.1-8b-instruct"], "--algorithm", "NGRAM",
                       "--gpu-memory-gib", 79, "--dtype", "float32", "--output", "table")
    assert code == 0 and "4-byte activations (float32)" in out
    assert "target weights                 29.92 GiB" in out  # 8.03 B parameters at 4 bytes


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", ["missing", "malformed", "field", "corrupt", "truncated", "absurd", "dtype", "bin"])
def test_bad_target_inputs_exit_2_with_one_line(models, capsys, tmp_path, case):
    folder = tmp_path / "bad"
    if case == "missing":
        folder.mkdir()
        expect = "config.json: missing"
    else:
        _write(folder / "config.json", json.dumps(CONFIGS["llama-3.1-8b-instruct"]))
        expect = {
            "malformed": "config.json: not valid JSON",
            "field": "config.json: field 'num_attention_heads' must be a positive integer",
            "corrupt": "model.safetensors: corrupt safetensors header",
            "truncated": "model.safetensors: truncated safetensors header",
            "absurd": "model.safetensors: header length",
            "dtype": "tensor 'w': field 'dtype' has unknown value 'Q4'",
            "bin": "no *.safetensors; the planner reads safetensors headers only",
        }[case]
        st = folder / "model.safetensors"
        if case == "malformed":
            _write(folder / "config.json", '{"hidden_size": 4096,')
        elif case == "field":
            _write(folder / "config.json", json.dumps({**CONFIGS["llama-3.1-8b-instruct"], "num_attention_heads": 0}))
        elif case == "corrupt":
            st.write_bytes((6).to_bytes(8, "little") + b"{oops}")
        elif case == "truncated":
            st.write_bytes((4096).to_bytes(8, "little") + b"{}")
        elif case == "absurd":
            st.write_bytes((2**60).to_bytes(8, "little") + b"{}")
        elif case == "dtype":
            header = json.dumps({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 1]}}).encode()
            st.write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
        elif case == "bin":
            (folder / "pytorch_model.bin").write_bytes(b"PK")
    code, out, err = run(capsys, "--target", folder, "--algorithm", "NGRAM", "--gpu-memory-gib", 80)
    assert code == 2 and out == ""
    assert expect in err and str(folder) in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_standalone_vocabulary_mismatch(models, capsys, tmp_path):
    # Llama's 128,256-token vocabulary cannot draft for Qwen (config vocab sizes compared without tokenizers)
    code, out, err = run(capsys, "--target", models["qwen2.5-7b-instruct"], "--draft", models["llama-3.1-8b-instruct"],
                         "--algorithm", "STANDALONE", "--gpu-memory-gib", 80)
    assert code == 2 and err.count("\n") == 1
    assert "llama-3.1-8b-instruct/config.json: field 'vocab_size' is 128256" in err and "152064" in err
    # same family, different padding (152064 vs 151936) but the same tokenizer: fine (tested above);
    # a tokenizer with other tokens is refused
    other = write_model(tmp_path / "qwen-other", "qwen2.5-0.5b-instruct")
    write_tokenizer(other, 151643, 30)
    code, out, err = run(capsys, "--target", models["qwen2.5-7b-instruct"], "--draft", other,
                         "--algorithm", "STANDALONE", "--gpu-memory-gib", 80)
    assert code == 2 and "qwen-other/tokenizer.json: defines 151673 token ids but the target's" in err


@pytest.mark.parametrize(
    "extra, expect",
    [
        (["--gpu-product", "NVIDIA-X9"], "--gpu-product: unknown GPU product 'NVIDIA-X9'"),
        ([], "no GPU visible: give the GPU with --gpu-product"),
        (["--gpu-memory-gib", "80", "--mem-fraction-static", "1.2"],
         "--mem-fraction-static: must be auto or a number in (0, 1)"),
        (["--gpu-memory-gib", "80", "--tp", "three"], "--tp: must be auto or a positive integer"),
        (["--gpu-memory-gib", "-1"], "--gpu-memory-gib: must be a positive number"),
        (["--gpu-memory-gib", "80", "--max-total-tokens", "0"], "--max-total-tokens: must be positive"),
        (["--gpu-memory-gib", "80", "--kv-cache-dtype", "int4"], "argument --kv-cache-dtype: invalid choice"),
        (["--gpu-memory-gib", "80", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_flags(models, capsys, extra, expect):
    code, out, err = run(capsys, "--target", models["llama-3.1-8b-instruct"], "--draft", models["eagle3-llama-3.1-8b"],
                         "--algorithm", "EAGLE3", *extra)
    assert code == 2 and expect in err and err.count("\n") == 1


def test_draft_flag_rules(models, capsys):
    code, out, err = run(capsys, "--target", models["llama-3.1-8b-instruct"], "--draft", models["eagle3-llama-3.1-8b"],
                         "--algorithm", "NGRAM", "--gpu-memory-gib", 80)
    assert code == 2 and "--draft: NGRAM drafts from the prompt" in err
    code, out, err = run(capsys, "--target", models["llama-3.1-8b-instruct"], "--algorithm", "EAGLE",
                         "--gpu-memory-gib", 80)
    assert code == 2 and "--draft: EAGLE needs the draft model folder" in err


def test_internal_error_exits_1(models, capsys, monkeypatch, tmp_path):
    def boom(args):
        raise RuntimeError("bug")

    monkeypatch.setattr(plan_cli, "make_plan", boom)
    log = tmp_path / "log"
    code, out, err = run(capsys, "--target", models["llama-3.1-8b-instruct"], "--algorithm", "NGRAM",
                         "--gpu-memory-gib", 80, "--termination-log", log)
    assert code == 1 and "RuntimeError: bug" in err
    assert log.read_text() == "internal error: RuntimeError: bug"


def test_bad_input_reaches_the_termination_log(capsys, tmp_path):
    log = tmp_path / "log"
    code, out, err = run(capsys, "--target", tmp_path / "nowhere", "--algorithm", "NGRAM", "--gpu-memory-gib", 80,
                         "--termination-log", log)
    assert code == 2 and log.read_text() == err.strip()


def test_console_entry_point(models):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "specdecode_worker", "plan",
                           "--target", models["llama-3.1-8b-instruct"],
                           "--algorithm", "NGRAM", "--gpu-product", "NVIDIA-H100-80GB-HBM3"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert validate_plan(json.loads(proc.stdout))["fits"]


def test_make_plan_takes_the_typed_request_the_flags_become(models, capsys):
    flags = ["--target", models["llama-3.1-8b-instruct"], "--algorithm", "NGRAM", "--gpu-memory-gib", "79",
             "--mem-fraction-static", "0.8", "--tp", "2"]
    args = plan_cli.plan_args(plan_cli.parser().parse_args(flags))
    assert args == PlanArgs(target=models["llama-3.1-8b-instruct"], algorithm="NGRAM", gpu_memory_gib=79.0,
                            mem_fraction_static=0.8, tp=2)
    assert plan_cli.plan_args(plan_cli.parser().parse_args(flags[:6])).tp is None  # --tp auto
    code, out, err = run(capsys, *flags)
    assert code == 0 and json.loads(out) == plan_cli.make_plan(args)
    with pytest.raises(InputError, match=r"--tp: must be auto or a positive integer, got 'two'"):
        plan_cli.plan_args(plan_cli.parser().parse_args(flags[:-1] + ["two"]))


def test_the_entry_point_hands_the_rest_of_the_line_to_the_subcommand(models, capsys):
    from specdecode_worker import cli

    argv = ["--target", models["qwen2.5-0.5b-instruct"], "--algorithm", "NGRAM", "--gpu-memory-gib", "20", "--tp", "1"]
    assert cli.main(["plan", *argv]) == 0
    via_entry = json.loads(capsys.readouterr().out)
    assert plan_cli.main(argv) == 0
    assert via_entry == json.loads(capsys.readouterr().out)
    assert cli.main(["plan", "--help"]) == 0 and "--termination-log" in capsys.readouterr().out
    assert cli.main(["bogus"]) == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err
    assert cli.main([]) == 2
