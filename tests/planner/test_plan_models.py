"""``serve --plan`` serves the models the plan was made for: the plan records each model folder's
tensor bytes and a hash of its config.json, and the worker refuses another before any weight
loads (exit 2, naming the model and what to do)."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil

import pytest

from specdecode_worker.serving import serve_cli
from specdecode_worker.contract import MemoryPlan, PlanModel, PlanModels, validate_plan
from specdecode_worker.errors import InputError
from specdecode_worker.planner.model_identity import check_models, identity
from specdecode_worker.planner.plan import PlanArgs
from specdecode_worker.planner.plan_cli import make_plan
from devtools.checkpoints import write_checkpoint
from tests.planner.test_plan_dtype import CONFIG, TENSORS

TENSOR_BYTES = 330_112  # 165,056 bfloat16 elements (tests/planner/test_plan_dtype.py)


@pytest.fixture()
def planned(tmp_path):
    """A plan for a tiny NGRAM target, written where serve reads it."""
    target = write_checkpoint(tmp_path / "target", CONFIG, TENSORS)
    plan = make_plan(PlanArgs(target=str(target), algorithm="NGRAM", gpu_memory_gib=20, context_length=2048))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return target, plan, path


def _serve(target, path, *extra) -> list[str]:
    return ["--target", str(target), "--algorithm", "NGRAM", "--plan", str(path), "--device", "cpu", *extra]


def test_the_plan_records_the_target_by_hand(planned):
    target, plan, _ = planned
    config = hashlib.sha256((target / "config.json").read_bytes()).hexdigest()[:12]
    assert plan["models"] == {"target": {"bytes": TENSOR_BYTES, "config": config}}
    assert validate_plan(plan)["models"] == plan["models"]
    check_models(str(target), None, MemoryPlan.from_dict(plan).models, "plan.json")  # the planned model: accepted


def test_a_copy_of_the_planned_model_is_accepted(planned, tmp_path):
    target, plan, _ = planned
    copy = shutil.copytree(target, tmp_path / "elsewhere")
    check_models(str(copy), None, MemoryPlan.from_dict(plan).models, "plan.json")


def test_a_changed_config_is_refused_naming_the_model_and_what_to_do(planned, tmp_path, capsys):
    target, plan, path = planned
    other = shutil.copytree(target, tmp_path / "other")
    (other / "config.json").write_text(json.dumps(CONFIG | {"rope_theta": 1_000_000.0}))
    assert serve_cli.main(_serve(other, path)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"--target {other}: not the target the plan {path} was made for (config.json hash ")
    assert f"planned {plan['models']['target']['config']})" in err and "weights" not in err
    assert f"re-plan with --target {other}, or give --target the folder of the planned model" in err


def test_changed_weights_are_refused(planned, tmp_path, capsys):
    target, plan, path = planned
    wider = [(n, "F32" if "norm" in n else d, s) for n, d, s in TENSORS]  # three norms of 64 stored in float32
    other = write_checkpoint(tmp_path / "other", CONFIG, wider)
    with pytest.raises(InputError, match=rf"weights {TENSOR_BYTES + 3 * 64 * 2} bytes, planned {TENSOR_BYTES}\)"):
        check_models(str(other), None, MemoryPlan.from_dict(plan).models, str(path))
    assert serve_cli.main(_serve(other, path)) == 2
    assert "config.json" not in capsys.readouterr().err


def test_a_different_draft_is_refused_naming_the_draft(tmp_path):
    target = write_checkpoint(tmp_path / "target", CONFIG, TENSORS)
    draft = write_checkpoint(tmp_path / "draft", CONFIG, TENSORS[:-1])
    other = write_checkpoint(tmp_path / "other", CONFIG | {"vocab_size": 1000}, TENSORS[:-2] + TENSORS[-1:])
    plan = PlanModels(PlanModel(**identity(target)), PlanModel(**identity(draft)))
    check_models(str(target), str(draft), plan, "p.json")
    with pytest.raises(InputError, match=rf"^--draft {other}: not the draft the plan p.json was made for \(weights"):
        check_models(str(target), str(other), plan, "p.json")


def test_an_older_plan_without_models_is_served_with_a_warning(planned, caplog):
    target, plan, _ = planned
    old = {k: v for k, v in plan.items() if k != "models"}
    with caplog.at_level(logging.WARNING, logger="specdecode_worker.serve"):
        check_models(str(target), None, MemoryPlan.from_dict(old).models, "old.json")
    assert "the plan old.json does not record the models it was made for" in caplog.text
    assert "re-plan to have them checked" in caplog.text
