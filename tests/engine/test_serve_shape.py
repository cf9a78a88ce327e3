"""`serve --plan` checks its speculative shape and serving limits against the ones the plan's
dynamic reserve was priced for: wider is refused before any weight loads, narrower is served."""

from __future__ import annotations

import itertools
import json
import logging

import pytest

from specdecode_worker.serving import serve_cli
from specdecode_worker.contract import GIB, MemoryPlan, to_json, validate_plan
from specdecode_worker.planner.plan import Candidate, ForwardGeometry, PlanRequest, build_plan, dynamic_reserve_bytes
from specdecode_worker.serving.serve_shape import check_against_plan, fill_from_plan

TARGET = ForwardGeometry(4096, 14336, 32, 8, 128, 128, 128_256, 2)
HEAD = ForwardGeometry(4096, 14336, 32, 8, 128, 128, 32_000, 2)
TREE = dict(verify_tokens=8, tree_topk=4, tree_steps=3)  # 7 nodes below the root, 4 branches, 3 deep


def _plan(algorithm="EAGLE3", **shape) -> dict:
    req = PlanRequest(
        algorithm=algorithm, target_name="t", draft_name=None if algorithm == "NGRAM" else "d",
        gpu_memory_bytes=80 * GIB, gpu_total_bytes=80 * GIB, gpu_source="override", gpu_name="g",
        kv_cache_dtype="bfloat16", draft_num_layers=1, target_num_layers=32, target_vocab_size=128_256,
        min_tokens=8192, context_length=8192, max_running_requests=64, cuda_graph_max_bs=32,
        chunked_prefill_size=4096, target_geometry=TARGET, draft_geometry=None if algorithm == "NGRAM" else HEAD,
        **shape)
    plan = build_plan(req, {1: Candidate(1, 16 * GIB, GIB, 131_072, 4_096)}, [1])
    assert plan["fits"], plan["message"]
    return plan


def _argv(path, algorithm="EAGLE3", *extra) -> list[str]:
    """serve's arguments against the plan at ``path`` on cpu (a later --device in ``extra`` wins)."""
    draft = [] if algorithm in ("NGRAM", "NONE", "MTP") else ["--draft", "/models/d"]
    return ["--target", "/models/t", *draft, "--algorithm", algorithm, "--plan", str(path), "--device", "cpu",
            *extra]


@pytest.fixture
def plan_file(tmp_path):
    def write(plan: dict, name="plan.json"):
        path = tmp_path / name
        path.write_text(to_json(plan))
        return path
    return write


def test_the_plan_records_the_shape_it_priced_and_reads_back():
    plan = validate_plan(json.loads(to_json(_plan(**TREE))))
    reserve = plan["reserve"]
    assert (reserve["verifyTokens"], reserve["treeTopk"], reserve["treeSteps"]) == (8, 4, 3)
    assert (reserve["cudaGraphMaxBs"], reserve["chunkedPrefillSize"], reserve["maxRunningRequests"]) == (32, 4096, 64)
    read = MemoryPlan.from_dict(plan).reserve
    assert (read.verify_tokens, read.tree_topk, read.tree_steps, read.dtype_bytes) == (8, 4, 3, 2)
    from specdecode_worker.planner.plan_cli import render_table

    table = render_table(MemoryPlan.from_dict(plan))
    assert "reserve priced for: 8 verify tokens per request (a tree of top-k 4, 3 steps deep)" in table
    assert "of it cuBLAS workspaces       0.12 GiB" in table  # four of 32 MiB
    chain = validate_plan(json.loads(to_json(_plan("NGRAM", verify_tokens=9))))["reserve"]
    assert (chain["verifyTokens"], chain["treeTopk"], chain["dtypeBytes"]) == (9, 1, 2)
    # the recorded shape is the one the reserve was priced at
    assert plan["reserve"]["dynamicBytes"] == dynamic_reserve_bytes(
        "EAGLE3", TARGET, HEAD, 1, 4096, 32, 64, 8, 4, 3) + plan["reserve"]["blasWorkspaceBytes"]


@pytest.mark.parametrize("plan_shape,algorithm,flags,planned", [
    ({}, "EAGLE3", ["--num-draft-tokens", "4", "--speculative-num-steps", "4"], "--num-draft-tokens 3"),
    ({"verify_tokens": 9}, "NGRAM", ["--num-draft-tokens", "9"], "--num-draft-tokens 8"),
    ({"verify_tokens": 3}, "MTP", ["--num-draft-tokens", "3"], "--num-draft-tokens 2"),
    ({}, "STANDALONE", ["--num-draft-tokens", "5"], "--num-draft-tokens 3"),
    ({}, "EAGLE3", ["--speculative-eagle-topk", "2", "--speculative-num-steps", "2"], "--speculative-eagle-topk 1"),
    (TREE, "EAGLE3", ["--speculative-eagle-topk", "5"], "--speculative-eagle-topk 4"),
    (TREE, "EAGLE", ["--speculative-num-steps", "4"], "--speculative-num-steps 3"),
    (TREE, "EAGLE3", ["--num-draft-tokens", "8"], "--num-draft-tokens 7"),
    ({}, "EAGLE3", ["--cuda-graph-max-bs", "33"], "--cuda-graph-max-bs 32"),
    ({}, "NGRAM", ["--chunked-prefill-size", "8192"], "--chunked-prefill-size 4096"),
    ({}, "EAGLE3", ["--max-running-requests", "65"], "--max-running-requests 64"),
    ({}, "NONE", ["--cuda-graph-max-bs", "64"], "--cuda-graph-max-bs 32"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_wider_flag_is_refused_in_one_line_naming_the_flag_and_the_planned_value(
        plan_file, capsys, plan_shape, algorithm, flags, planned):
    path = plan_file(_plan("NGRAM" if algorithm == "NONE" else algorithm, **plan_shape))
    assert serve_cli.main(_argv(path, algorithm, *flags)) == 2  # before any model folder is read
    err = capsys.readouterr().err.strip()
    flag = planned.split()[0]
    given = flags[flags.index(flag) + 1]
    assert "\n" not in err and err.startswith(f"{flag} {given}: the plan {path} ")
    assert f"({planned})" in err and f"re-plan with {flag} {given}" in err
    if "a chain" in err:
        assert "--speculative-eagle-topk 1" in err
    else:
        assert f"give {planned} or less" in err


@pytest.mark.parametrize("plan_shape,algorithm,flags,served", [
    ({}, "EAGLE3", ["--num-draft-tokens", "2"], dict(num_draft_tokens=2, speculative_eagle_topk=1)),
    (TREE, "EAGLE3", ["--speculative-eagle-topk", "2", "--speculative-num-steps", "2", "--num-draft-tokens", "5"],
     dict(num_draft_tokens=5, speculative_eagle_topk=2, speculative_num_steps=2)),
    (TREE, "EAGLE3", ["--speculative-eagle-topk", "1"], dict(num_draft_tokens=7, speculative_eagle_topk=1,
                                                              speculative_num_steps=None)),
    ({"verify_tokens": 9}, "NGRAM", ["--num-draft-tokens", "4", "--cuda-graph-max-bs", "8",
                                     "--chunked-prefill-size", "1024", "--max-running-requests", "16"],
     dict(num_draft_tokens=4, cuda_graph_max_bs=8, chunked_prefill_size=1024, max_running_requests=16)),
    ({}, "NONE", ["--num-draft-tokens", "9"], dict(cuda_graph_max_bs=32)),  # the target alone verifies nothing
], ids=["fewer-drafts", "smaller-tree", "chain-under-tree", "ngram-limits", "none"])
def test_a_narrower_shape_fits_and_is_served_with_an_info_line(plan_file, caplog, plan_shape, algorithm, flags,
                                                               served):
    path = plan_file(_plan("NGRAM" if algorithm == "NONE" else algorithm, **plan_shape))
    with caplog.at_level(logging.INFO, logger="specdecode_worker.serve"):
        engine_args, _ = serve_cli.resolve(serve_cli.parser().parse_args(_argv(path, algorithm, *flags)))
    for name, value in served.items():
        assert getattr(engine_args, name) == value, name
    if algorithm != "NONE":
        assert "serving below the plan" in caplog.text


@pytest.mark.parametrize("plan_shape,algorithm", [({}, "EAGLE3"), (TREE, "EAGLE3"), ({"verify_tokens": 9}, "NGRAM")])
def test_flags_left_out_serve_the_plans_shape(plan_file, caplog, plan_shape, algorithm):
    plan = _plan(algorithm, **plan_shape)
    with caplog.at_level(logging.INFO, logger="specdecode_worker.serve"):
        engine_args, _ = serve_cli.resolve(serve_cli.parser().parse_args(_argv(plan_file(plan), algorithm)))
    reserve = plan["reserve"]
    assert engine_args.num_draft_tokens + 1 == reserve["verifyTokens"]
    assert engine_args.speculative_eagle_topk == reserve["treeTopk"]
    assert engine_args.speculative_num_steps == (reserve["treeSteps"] if reserve["treeTopk"] > 1 else None)
    assert (engine_args.cuda_graph_max_bs, engine_args.chunked_prefill_size, engine_args.max_running_requests) == \
        (reserve["cudaGraphMaxBs"], reserve["chunkedPrefillSize"], reserve["maxRunningRequests"])
    assert "serving below the plan" not in caplog.text and "speculative shape" not in caplog.text


def test_an_older_plan_without_the_shape_is_served_with_a_warning(plan_file, caplog):
    plan = _plan()
    for key in ("verifyTokens", "treeTopk", "treeSteps"):
        del plan["reserve"][key]
    path = plan_file(validate_plan(plan))
    with caplog.at_level(logging.INFO, logger="specdecode_worker.serve"):
        engine_args, _ = serve_cli.resolve(serve_cli.parser().parse_args(
            _argv(path, "EAGLE3", "--num-draft-tokens", "6")))
    assert engine_args.num_draft_tokens == 6
    # (these synthetic plans record no model folders either: test_plan_models.py checks that warning)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "speculative shape" in r.getMessage()]
    assert len(warnings) == 1 and "could not be checked" in warnings[0].getMessage()
    assert str(path) in warnings[0].getMessage() and "re-plan" in warnings[0].getMessage()
    # without the fields and without the flag, the worker's own default as before
    engine_args, _ = serve_cli.resolve(serve_cli.parser().parse_args(_argv(path, "EAGLE3")))
    assert engine_args.num_draft_tokens == 4
    # the limits every plan has always recorded are still checked
    with pytest.raises(serve_cli.InputError, match="--cuda-graph-max-bs 64: the plan"):
        serve_cli.resolve(serve_cli.parser().parse_args(_argv(path, "EAGLE3", "--cuda-graph-max-bs", "64")))


@pytest.mark.parametrize("algorithm", ["EAGLE3", "MTP", "STANDALONE", "NGRAM"])
def test_every_shape_the_check_accepts_is_priced_within_the_plan(algorithm):
    """Against the reserve formula itself: whatever shape passes the check against a plan costs no
    more than the plan's dynamic bytes (a chain under a tree's plan included)."""
    import argparse

    head = None if algorithm == "NGRAM" else HEAD
    planned_shapes = [dict(verify_tokens=4), dict(verify_tokens=2)]
    if algorithm == "EAGLE3":
        planned_shapes += [TREE, dict(verify_tokens=4, tree_topk=2, tree_steps=2)]
    accepted = 0
    for planned in planned_shapes:
        plan = _plan(algorithm, **planned)
        typed = MemoryPlan.from_dict(plan)
        for k, topk, steps, bs, chunk in itertools.product((1, 3, 7, 8), (1, 2, 4), (1, 2, 3), (16, 32, 64),
                                                           (2048, 4096)):
            if topk > 1 and algorithm != "EAGLE3":
                continue
            flags = argparse.Namespace(algorithm=algorithm, num_draft_tokens=k, speculative_eagle_topk=topk,
                                       speculative_num_steps=steps if topk > 1 else None, max_running_requests=None,
                                       cuda_graph_max_bs=bs, chunked_prefill_size=chunk)
            try:
                check_against_plan(flags, typed, "plan.json")
            except serve_cli.InputError:
                continue
            accepted += 1
            tree = dict(tree_topk=topk, tree_steps=steps) if topk > 1 else {}
            cost = dynamic_reserve_bytes(algorithm, TARGET, head, 1, chunk, bs, 64, k + 1, **tree)
            assert cost <= plan["reserve"]["dynamicBytes"], (planned, k, topk, steps, bs, chunk)
    assert accepted > 10


def test_fill_from_plan_without_a_plan_keeps_the_workers_defaults():
    flags = serve_cli.parser().parse_args(["--target", "/models/t"])
    fill_from_plan(flags, None)
    assert (flags.num_draft_tokens, flags.speculative_eagle_topk, flags.speculative_num_steps) == (4, 1, None)


def test_a_wider_compute_dtype_is_refused_on_a_gpu(plan_file, capsys):
    """The plan prices the checkpoint's dtype (2 bytes here); --dtype float32 would double every
    activation and weight. On CPU the engine computes in float32 whatever the plan priced."""
    path = plan_file(_plan())
    assert serve_cli.main(_argv(path, "EAGLE3", "--dtype", "float32", "--device", "cuda")) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"--dtype float32: the plan {path} priced weights and activations at 2 bytes")
    assert "give --dtype auto" in err
    for dtype in ("auto", "bfloat16", "float16"):
        engine_args, _ = serve_cli.resolve(serve_cli.parser().parse_args(
            _argv(path, "EAGLE3", "--dtype", dtype, "--device", "cuda")))
        assert engine_args.dtype == (None if dtype == "auto" else dtype)
    engine_args, _ = serve_cli.resolve(serve_cli.parser().parse_args(_argv(path, "EAGLE3", "--dtype", "float32")))
    assert engine_args.device == "cpu" and engine_args.dtype == "float32"
