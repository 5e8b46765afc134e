"""Argument and folder checks of :mod:`dflash2_hf.lora`: what its functions refuse before anything loads or is
written (a target or a name where a loaded drafter belongs, swapped arguments, an adapter saved into a drafter
folder), each with what was given and the call that fixes it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from peft import PeftModel

from .checkpoint import WEIGHT_FILES
from .errors import DrafterArgumentTypeError, FolderHoldsModelError

LOAD_HINT = 'dflash2_hf.load_drafter({name}, target, precision="fp32") (or "bf16"; an int8 drafter drafts only)'


def carries_lora(drafter) -> bool:
    """Whether ``drafter`` is a ``PeftModel`` or holds LoRA layers that peft injected into it in place."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(drafter, PeftModel) or any(isinstance(m, BaseTunerLayer) for m in drafter.modules())


def _given(obj) -> str:
    from transformers import PreTrainedModel

    from .modeling_dflash2 import DFlash2DraftModel

    if isinstance(obj, DFlash2DraftModel):
        return "a DFlash2DraftModel (a drafter)"
    if isinstance(obj, (str, os.PathLike)):
        return f"the name or path {os.fspath(obj)!r}, not a loaded model"
    if isinstance(obj, PeftModel):
        return f"a PeftModel around {_given(obj.get_base_model())}"
    if isinstance(obj, PreTrainedModel):
        return f"a {type(obj).__name__} (a transformers model: the target?)"
    return f"a {type(obj).__name__}"


def check_drafter(drafter, call: str, peft_ok: bool = False, hint: str = "") -> None:
    """Refuses what is no loaded :class:`~dflash2_hf.DFlash2DraftModel` (``peft_ok``: a ``PeftModel`` around one
    passes too). ``call`` names the call and argument in the message, ``hint`` is appended to it.

    Raises:
        DrafterArgumentTypeError: naming what was given and how to load a drafter.
    """
    from .modeling_dflash2 import DFlash2DraftModel

    base = drafter.get_base_model() if isinstance(drafter, PeftModel) else drafter
    if isinstance(base, DFlash2DraftModel) and (peft_ok or base is drafter):
        return
    if isinstance(base, DFlash2DraftModel):  # a PeftModel where a plain drafter belongs: say that first
        raise DrafterArgumentTypeError(
            f"{call}: this drafter already carries a LoRA adapter (a PeftModel): use it as it is, or call "
            f"merge_and_unload() first for a plain drafter.{hint}")
    name = repr(os.fspath(drafter)) if isinstance(drafter, (str, os.PathLike)) else "name"
    raise DrafterArgumentTypeError(
        f"{call}: the drafter must be a loaded DFlash2 drafter (DFlash2DraftModel), got {_given(drafter)}. Load it "
        f"first: drafter = {LOAD_HINT.format(name=name)}.{hint}")


def check_adapter_path(adapter_path, call: str) -> None:
    """Refuses an ``adapter_path`` that is no folder or name, e.g. the drafter when the arguments were swapped.

    Raises:
        DrafterArgumentTypeError: naming what was given.
    """
    if isinstance(adapter_path, (str, os.PathLike)):
        return
    swapped = " (arguments swapped? the drafter comes first)" if hasattr(adapter_path, "modules") else ""
    raise DrafterArgumentTypeError(
        f"{call}: adapter_path must be an adapter folder, a Hub id or a shipped adapter's name, got "
        f"{_given(adapter_path)}{swapped}. Call it as {call.split('(')[0]}(drafter, \"path/to/adapter\").")


def model_in_folder(path: str | os.PathLike) -> tuple[bool, str] | None:
    """``(is_drafter, description)`` of a model other than an adapter that the folder ``path`` holds: a drafter's
    config.json (``model_type`` ``"dflash2"``, or the published format's ``dflash_config``), or model weight files
    (``model.safetensors``, shards, ``pytorch_model.bin``); None when it holds neither."""
    path = Path(path)
    if not path.is_dir():
        return None
    weights = ([n for n in WEIGHT_FILES if (path / n).is_file()]
               or sorted(p.name for p in path.glob("model-*.safetensors")))
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    drafter = model_type == "dflash2" or (isinstance(config, dict) and "dflash_config" in config)
    if not (drafter or weights):
        return None
    parts = ([f"config.json with model_type {model_type!r}"] if model_type else []) + weights[:1]
    return drafter, f"{'a drafter' if drafter else 'model weights'} ({', '.join(parts)})"


def check_adapter_save(model, save_directory: str | os.PathLike) -> None:
    """Refuses, before anything is written, a ``model`` that is no ``PeftModel`` of a drafter and a folder that holds
    a drafter or other model weights (see :func:`dflash2_hf.lora.save_adapter`)."""
    from .modeling_dflash2 import DFlash2DraftModel

    call = "save_adapter(model, save_directory)"
    if isinstance(model, (str, os.PathLike)) and hasattr(save_directory, "modules"):
        raise DrafterArgumentTypeError(f"{call}: got a path first and a model second (arguments swapped?); nothing "
                                       f"was written. Call it as save_adapter(peft_model, {os.fspath(model)!r}).")
    if isinstance(model, DFlash2DraftModel):
        injected = (" This one holds LoRA layers that load_adapter injected in place: pass the PeftModel it returned."
                    if carries_lora(model) else "")
        raise DrafterArgumentTypeError(
            f"{call}: model must be a drafter with a LoRA adapter (the PeftModel that add_lora, load_adapter or "
            f"extract_adapter returned), got a plain DFlash2DraftModel; nothing was written.{injected} Wrap it "
            "first: model = dflash2_hf.lora.add_lora(drafter); to save the whole drafter: "
            "drafter.save_pretrained(folder).")
    check_drafter(model, call, peft_ok=True)
    held = model_in_folder(save_directory)
    if held:
        folder = os.fspath(save_directory).rstrip("/")
        raise FolderHoldsModelError(
            f"Cannot save the LoRA adapter into {folder!r}: the folder holds {held[1]}, and an adapter written next "
            "to it would leave a folder that loads as neither (from_pretrained fails on the adapter weights; "
            "`dflash2 generate --drafter` sees LoRA layers). Save the adapter into a new folder, e.g. "
            f"{folder + '-lora'!r}.")
