"""LoRA adapters for DFlash2 drafters, with ``peft``.

Which modules get LoRA and why (:data:`DEFAULT_TARGET_MODULES`):

* attention ``q_proj``/``k_proj``/``v_proj``/``o_proj`` - how block positions read the target's context features
  and each other; a new domain (code, another fine-tuned target) changes which context matters;
* MLP ``gate_proj``/``up_proj``/``down_proj`` - where the drafter stores its token-level predictions (the bulk of
  what shifts with the domain);
* ``fc`` (context fusion) and the selector's ``hidden_projection`` stay frozen by default: they map the target's
  hidden states, which a domain shift moves far less than what the drafter predicts from them; add them with
  ``target_modules`` if your target itself was fine-tuned. The selector codebooks are plain parameters (``(V, r)``
  tables, not layers), so LoRA cannot wrap them; they stay as trained (on unseen code their update in a full
  fine-tune carries none of its gain).
* the small modules (:data:`SMALL_MODULES`: local convolutions, norms, ``hidden_projection``) can be trained in full
  inside the adapter (peft ``modules_to_save``; ``dflash2 train --lora-modules-to-save``): low-rank factors cannot
  move a norm's scale or a convolution's base kernel, and on unseen code these modules carry half of a full
  fine-tune's gain.

Two ways to make an adapter: train the LoRA factors directly (``dflash2 train --lora``), or fine-tune the whole
drafter and extract the adapter from its update (:func:`extract_adapter`, ``examples/extract_adapter.py``). On the
same code data and steps the second kept all of the full fine-tune's held-out gain at rank 32 (+5.3%, 9.7% of the
drafter's parameters), the first reached about half of it (docs/training_experiments.md "Session 24").

An adapter folder is what ``PeftModel.save_pretrained`` writes plus ``dflash2_adapter.json``, a fingerprint of the
base drafter checked on load: its shapes and target binding (an adapter for another architecture fails with a clear
message instead of a wall of shape errors) and a digest of its weights (an adapter trained on another drafter of
the same shapes, e.g. an older release, would load silently and draft worse; it is refused unless
``strict=False``). The fingerprint and its checks live in :mod:`dflash2_hf.lora_fingerprint`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers.utils import logging

from .checkpoint import non_finite
from .errors import CheckpointError
from .integrity import digest_mismatch
from .lora_checks import carries_lora, check_adapter_path, check_adapter_save, check_drafter, model_in_folder
from .lora_fingerprint import (
    FINGERPRINT_FILE,
    AdapterMismatchError,
    _differing_fields,
    _fingerprint_fields,
    _stored_fingerprint,
    check_adapter_fits,
    write_fingerprint,
)
from .lora_fingerprint import base_weights_digest, drafter_fingerprint  # noqa: F401 (re-exported)
from .quantization import refuse_int8

logger = logging.get_logger(__name__)

DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The drafter's small modules, worth training in full next to the LoRA layers (``modules_to_save``): the local
# convolutions (base kernels + kernel projections), every norm, and the selector's hidden projection - 0.90M of the
# 27.3M parameters of the SmolLM2 drafter. In a full fine-tune on unseen code they carry about half of the held-out
# gain, and rank-32 factors of the projections plus these modules carry all of it (docs/training_experiments.md
# "Session 24"); no low-rank update reaches a norm's scale or a base kernel.
SMALL_MODULES = ["attention_conv", "mlp_conv", "input_layernorm", "post_attention_layernorm", "q_norm", "k_norm",
                 "norm", "hidden_norm", "hidden_projection"]


def lora_config(r: int = 16, alpha: int = 32, dropout: float = 0.0, target_modules: list[str] | None = None,
                modules_to_save: list[str] | None = None) -> LoraConfig:
    """A ``peft.LoraConfig`` for drafters (defaults: r=16, alpha=32, attention + MLP projections).

    ``modules_to_save``: module names trained in full and stored in the adapter next to the LoRA weights (e.g.
    :data:`SMALL_MODULES`); they must not overlap ``target_modules``.

    Raises:
        ValueError: a name in both lists.
    """
    targets = target_modules or DEFAULT_TARGET_MODULES
    both = sorted(set(targets) & set(modules_to_save or []))
    if both:
        raise ValueError(f"{both} are both LoRA targets and modules to train in full: name each module in one list.")
    return LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
        modules_to_save=modules_to_save or None,
    )


def add_lora(drafter, config: LoraConfig | None = None) -> PeftModel:
    """Wraps a trained drafter with a fresh LoRA adapter; only the adapter is trainable.

    The returned ``PeftModel`` works directly as ``assistant_model=`` in ``target.generate`` (unmerged), and
    ``merge_and_unload()`` gives back a plain :class:`~dflash2_hf.DFlash2DraftModel`.

    Raises:
        DrafterArgumentTypeError: ``drafter`` is no loaded :class:`~dflash2_hf.DFlash2DraftModel` (a name, a
            transformers model such as the target, a ``PeftModel`` that already carries an adapter).
        UnsupportedGenerationError: ``drafter`` is an int8 drafting copy.
    """
    check_drafter(drafter, "add_lora(drafter)", hint=" (For LoRA on a transformers model itself use "
                  "peft.get_peft_model(model, config).)" if hasattr(drafter, "get_output_embeddings") else "")
    refuse_int8(drafter, "given a LoRA adapter")
    return get_peft_model(_stock_linears(drafter), config or lora_config())


def _stock_linears(drafter):
    """``drafter`` with plain ``nn.Linear`` layers: LoRA wraps them, and a merge writes into their weights in place,
    which a prepacked copy (:func:`dflash2_hf.optimize_for_cpu`) would not see. Run ``optimize_for_cpu`` again on the
    merged drafter."""
    from .cpu_kernels import is_optimized, restore_stock_kernels

    if is_optimized(drafter):
        restore_stock_kernels(drafter)
        if getattr(drafter, "dflash2_loading", None):  # what load_drafter reported: the kernels changed since
            drafter.dflash2_loading += " -> stock CPU kernels since an adapter was added"
        logger.info("LoRA: the drafter's prepacked CPU linears are back on stock kernels (a merge writes into their "
                    "weights); call optimize_for_cpu() on the merged drafter")
    return drafter


@torch.no_grad()
def extract_adapter(base, finetuned, config: LoraConfig) -> PeftModel:
    """A LoRA adapter on ``base`` that approximates ``finetuned`` (the same drafter after a full fine-tune).

    Each LoRA target's weight difference ``W_ft - W_base`` (``(out, in)``) is cut to its best rank-``config.r``
    approximation (truncated SVD, Eckart-Young), split evenly between ``lora_B`` and ``lora_A`` with the adapter's
    ``lora_alpha / r`` scaling undone; the ``modules_to_save`` copies take ``finetuned``'s weights as they are. A
    full fine-tune followed by extraction can reach what training the low-rank factors directly does not (docs/
    training_experiments.md "Session 24": held-out code tau 2.60 from rank 32 + the small modules, as the full
    fine-tune). Source: LoRA (Hu et al., 2021, arXiv:2106.09685) for the parametrisation.

    Args:
        base: the drafter the adapter adapts (float32 or bfloat16; left unchanged apart from peft's wrapping).
        finetuned: a :class:`~dflash2_hf.DFlash2DraftModel` of the same shapes.
        config: which modules get LoRA factors (``target_modules``, rank ``r``, ``lora_alpha``) and which are copied
            in full (``modules_to_save``), e.g. :func:`lora_config`.

    Returns:
        The ``PeftModel`` around ``base`` (save it with :func:`save_adapter`).

    Raises:
        DrafterArgumentTypeError: ``base`` or ``finetuned`` is no loaded :class:`~dflash2_hf.DFlash2DraftModel`.
        AdapterMismatchError: ``finetuned`` has other shapes or target binding than ``base``.
    """
    check_drafter(base, "extract_adapter(base, finetuned, config): base")
    check_drafter(finetuned, "extract_adapter(base, finetuned, config): finetuned")
    diff = _differing_fields(_fingerprint_fields(base), _fingerprint_fields(finetuned))
    if diff:
        raise AdapterMismatchError(f"Cannot extract an adapter: the fine-tuned drafter differs from the base in {diff} "
                                   "(base, fine-tuned); pass the drafter the fine-tune started from.")
    tuned = dict(finetuned.named_modules())
    model = add_lora(base, config)
    for name, module in model.get_base_model().named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            delta = tuned[name].weight.float() - module.base_layer.weight.float()
            u, s, vh = torch.linalg.svd(delta, full_matrices=False)
            rank = module.lora_A["default"].weight.shape[0]
            root = (s[:rank] / module.scaling["default"]).sqrt()
            module.lora_B["default"].weight.copy_(u[:, :rank] * root)
            module.lora_A["default"].weight.copy_(root[:, None] * vh[:rank])
        elif hasattr(module, "modules_to_save") and "default" in module.modules_to_save:
            module.modules_to_save["default"].load_state_dict(tuned[name].state_dict())
    return model


def save_adapter(model: PeftModel, save_directory: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Saves ONLY the adapter (``adapter_model.safetensors`` + ``adapter_config.json``) and the base fingerprint.

    ``dtype``: store the adapter weights in this precision (e.g. ``torch.bfloat16``, half the bytes of float32;
    loading casts them to the drafter's precision); default: as held.

    A folder that already holds an adapter gets the new one over it (its adapter files and fingerprint are
    replaced, other files stay): how training checkpoints are updated. A folder that holds a drafter or other model
    weights is refused, so a drafter folder never ends up holding an adapter as well.

    Raises:
        DrafterArgumentTypeError: ``model`` is no ``PeftModel`` of a drafter (e.g. a plain drafter: wrap it with
            :func:`add_lora`, or save the whole drafter with ``save_pretrained``). Nothing is written.
        FolderHoldsModelError: ``save_directory`` holds a drafter (``config.json`` of a drafter) or model weights
            (``model.safetensors``, ...). Nothing is written; save into a new folder.
    """
    check_adapter_save(model, save_directory)
    state = None
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.save_pretrained(save_directory, state_dict=state, save_embedding_layers=False)  # a drafter embeds with its target
    write_fingerprint(model, save_directory)


def check_hub_adapter(repo_id: str) -> None:
    """Clear error for a Hub id that is no reachable LoRA adapter repo (before the fingerprint check warns about it).

    Raises:
        FileNotFoundError: ``adapter_config.json`` cannot be fetched (no such repo or file, offline without a cached
            copy).
    """
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(str(repo_id), "adapter_config.json")
    except Exception as err:  # RepositoryNotFoundError, EntryNotFoundError, LocalEntryNotFoundError (offline), ...
        raise FileNotFoundError(
            f"no LoRA adapter at {str(repo_id)!r}: not a local folder, and its adapter_config.json cannot be fetched "
            f"from the Hub ({type(err).__name__}). Pass the output folder of `dflash2 train --lora` or the id of a "
            "reachable adapter repo (offline: HF_HUB_OFFLINE=1 with a cached copy)."
        ) from err


def check_adapter_folder(path: str | os.PathLike) -> None:
    """Clear errors for a local adapter folder that is missing, incomplete, truncated or corrupt.

    Raises:
        FileNotFoundError: no such folder.
        CheckpointError: adapter_config.json / adapter_model.safetensors missing (a drafter folder, or another
            model's, is named as such), truncated or corrupt.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"adapter folder {str(path)!r} not found: pass the output folder of "
                                "`dflash2 train --lora` (adapter_config.json + adapter_model.safetensors) or a Hub id")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (path / name).is_file():
            held = model_in_folder(path)
            what = "" if held is None else f"; it holds {held[1]}" + (
                f": this is a drafter folder; pass it as --drafter {str(path)} / dflash2_hf.load_drafter("
                f"{str(path)!r}, target), and an adapter for it as --adapter / load_adapter(drafter, adapter_folder)"
                if held[0] else ", not an adapter")
            raise CheckpointError(f"{str(path)!r} is not a LoRA adapter folder: {name} is missing (expected the "
                                  f"output of `dflash2 train --lora` or `dflash2_hf.lora.save_adapter`){what}")
    from safetensors import safe_open

    try:
        with safe_open(str(path / "adapter_model.safetensors"), framework="pt"):
            pass  # opening validates the header against the file size: a truncated file fails here
        json.loads((path / "adapter_config.json").read_text())
    except Exception as err:
        raise CheckpointError(f"the adapter in {str(path)!r} is truncated or corrupt ({err}); copy or train it "
                              "again") from err


def load_adapter(drafter, adapter_path: str | os.PathLike, is_trainable: bool = False,
                 strict: bool = True) -> PeftModel:
    """``PeftModel.from_pretrained`` after checking the adapter was trained for this drafter.

    Args:
        drafter: the base :class:`~dflash2_hf.DFlash2DraftModel` (any dtype).
        adapter_path: a folder written by :func:`save_adapter` (or ``dflash2 train --lora``), a Hub id, or the
            shipped adapter's name (``"dflash2-smollm2-135m-instruct-code-lora"``).
        is_trainable: load the adapter for further training.
        strict: refuse an adapter whose base weights digest differs from ``drafter``'s (same shapes, other
            weights). ``False`` only logs a warning.

    Raises:
        DrafterArgumentTypeError: ``drafter`` is no loaded :class:`~dflash2_hf.DFlash2DraftModel` (a name, the
            target), or ``adapter_path`` is no folder or name (arguments swapped).
        AdapterMismatchError: the adapter's fingerprint names another drafter (the differing fields are listed),
            or (``strict``) other base weights of the same shapes, or ``drafter`` already carries LoRA layers.
        FileNotFoundError: a local adapter folder does not exist, or a Hub id has no reachable adapter_config.json.
        CheckpointError: the folder lacks the adapter files, or they (or ``dflash2_adapter.json``) are truncated or
            corrupt; the weights hold non-finite values; ``adapter_config.json`` no longer fits the weights (another
            rank) or leaves some of them without a place (renamed target modules, emptied ``modules_to_save``).
        UnsupportedGenerationError: ``drafter`` is an int8 drafting copy (merge into the float drafter, then quantize).

    An adapter without ``dflash2_adapter.json`` (saved by plain ``peft``) loads with a warning: nothing can be checked.
    """
    from .hub import is_local_path
    from .shipped import resolve_name_or_path

    check_adapter_path(adapter_path, "load_adapter(drafter, adapter_path)")
    check_drafter(drafter, "load_adapter(drafter, adapter_path)", peft_ok=True)
    refuse_int8(drafter, "given a LoRA adapter")
    adapter_path = resolve_name_or_path(adapter_path)  # a shipped adapter's name from any working directory
    path = Path(adapter_path)
    # peft injects LoRA layers into the drafter in place, so a second call on the same object would see "other
    # base weights"; say what really happened instead.
    if carries_lora(drafter):
        raise AdapterMismatchError(
            f"Cannot load {str(adapter_path)!r}: this drafter already carries a LoRA adapter (load_adapter injects "
            "its layers into the drafter in place). Load the adapter on a freshly loaded base drafter "
            "(DFlash2DraftModel.from_pretrained(...)), or call merge_and_unload() on the adapted model first.")
    local = is_local_path(adapter_path)
    if local:
        check_adapter_folder(path)
    else:
        check_hub_adapter(str(adapter_path))
    fingerprint = _stored_fingerprint(adapter_path)
    if fingerprint is None:
        logger.warning(f"{str(adapter_path)!r} has no {FINGERPRINT_FILE}: cannot check that this adapter was trained "
                       "for this drafter (save adapters with dflash2_hf.lora.save_adapter or `dflash2 train --lora`)")
    else:
        check_adapter_fits(adapter_path, drafter.config, fingerprint)  # shapes first: the weights only when they match
        expected_digest = fingerprint.get("weights_sha256_16")
        actual_digest = digest_mismatch(drafter, expected_digest, what="base drafter weights")
        if actual_digest:
            message = (f"The LoRA adapter in {str(path)!r} was trained on other base weights (base digest "
                       f"{expected_digest}, this drafter {actual_digest}; same shapes, so probably another release "
                       "or checkpoint of the drafter). Load the drafter it was trained on (adapter_config.json: "
                       "base_model_name_or_path), or accept it anyway: load_adapter(..., strict=False) in Python, "
                       "`dflash2 bench --adapter-no-strict` on the command line.")
            if strict:
                raise AdapterMismatchError(message)
            logger.warning(message)
    try:
        model = PeftModel.from_pretrained(_stock_linears(drafter), str(path), is_trainable=is_trainable)
    except RuntimeError as err:
        if "size mismatch" not in str(err):
            raise
        raise CheckpointError(
            f"The adapter weights in {str(adapter_path)!r} do not fit its own adapter_config.json (its rank or target "
            f"modules were changed after saving?): {str(err).splitlines()[-1].strip()}. Use the adapter_config.json "
            "saved with these weights, or save the adapter again.") from err
    _check_loaded_adapter(model, str(adapter_path), path if local else None)
    return model


def _check_loaded_adapter(model: PeftModel, source: str, folder: Path | None) -> None:
    """Refuses an adapter that loaded without error but drafts from garbage: non-finite values (bytes overwritten in
    place keep the file's size and header), or weights in the file that its config gave no place to (peft drops
    them silently, e.g. a module renamed in ``target_modules`` or ``modules_to_save`` emptied by hand).

    Raises:
        CheckpointError: naming the tensors.
    """
    from peft import get_peft_model_state_dict

    loaded = get_peft_model_state_dict(model, save_embedding_layers=False)  # "auto" looks the base up (Hub)
    bad = non_finite(loaded.items())
    if bad:
        raise CheckpointError(
            f"The adapter {source!r} loaded with non-finite values "
            f"in {len(bad)} tensors ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}): the weight file is "
            "corrupt. Copy or train the adapter again.")
    if folder is None:
        return
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    dropped = sorted(stored - set(loaded))
    if dropped:
        raise CheckpointError(
            f"{len(dropped)} weights of the adapter in {str(folder)!r} have no place in the model its "
            f"adapter_config.json describes ({', '.join(dropped[:3])}{', ...' if len(dropped) > 3 else ''}): "
            "target_modules / modules_to_save were changed after saving. Use the adapter_config.json saved with "
            "these weights.")


def adapter_size_bytes(path: str | os.PathLike) -> int:
    """Bytes of the adapter weights file(s) in a saved adapter folder."""
    return sum(f.stat().st_size for f in Path(path).glob("adapter_model*"))


def checkpoint_size_bytes(path: str | os.PathLike) -> int:
    """Bytes of the weight files of a saved drafter folder."""
    return sum(f.stat().st_size for f in Path(path).glob("model*.safetensors"))
