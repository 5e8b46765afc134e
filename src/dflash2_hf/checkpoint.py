"""The checks a loaded drafter checkpoint must pass (:meth:`DFlash2DraftModel.from_pretrained`): nothing missing or
mis-shaped, no weight the config leaves unused, finite values, the recorded weights digest.

``transformers`` initialises missing or mis-shaped weights randomly and only warns; a drafter silently drafting from
random or dropped weights stays lossless but slow, so every such case is a :class:`CheckpointError` whose message
names the tensors and the fix.
"""

from __future__ import annotations

import os

import torch
from transformers.utils import logging

from .errors import CheckpointError
from .integrity import digest_mismatch

logger = logging.get_logger(__name__)


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_folder(path: str, config_passed: bool) -> None:
    """Refuses a drafter path before ``transformers`` reads it.

    Raises:
        FileNotFoundError: ``path`` looks local (not an ``org/name`` Hub id) and does not exist.
        CheckpointError: a LoRA adapter folder (``adapter_config.json``) given as a drafter; a folder without
            ``config.json`` and no ``config=`` passed (``transformers`` would fall back to a default config and then
            report every weight as mis-shaped), or one whose config is another kind of model (a Llama target, say),
            before ``transformers`` prints its load report; a drafter folder with no weight file.
    """
    from .hub import is_local_path

    if not os.path.exists(path) and is_local_path(path):
        raise FileNotFoundError(
            f"No drafter folder at {path!r}. Pass an existing folder or a Hub id (org/name), build an untrained "
            "one with DFlash2DraftModel.from_target(target) (CLI: --drafter fresh), or train one (dflash2 train)."
        )
    if not os.path.isdir(path):
        return
    config_file = os.path.join(path, "config.json")
    adapter_config = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file) and os.path.isfile(adapter_config):
        base = adapter_base_name(adapter_config)
        raise CheckpointError(
            f"{path!r} is a LoRA adapter for a drafter (adapter_config.json), not a drafter: load its base drafter "
            f"{base!r} with the adapter: dflash2_hf.load_drafter({base!r}, target, adapter={path!r}) (merged, ready "
            f"to draft) or dflash2_hf.load_adapter(drafter, {path!r}); CLI: dflash2 generate (or bench) --drafter "
            f"{base} --adapter {path}."
        )
    if not config_passed and os.path.isfile(config_file):
        _refuse_other_model(path, config_file)
    if not config_passed and not os.path.isfile(config_file):
        raise CheckpointError(
            f"No config.json in the drafter folder {path!r}: the weights cannot be read without the architecture "
            "they were saved with. Copy the config.json that came with these weights into the folder, pass "
            "config=DFlash2Config(...), or re-save the drafter with save_pretrained."
        )
    if not any(os.path.isfile(os.path.join(path, name)) for name in WEIGHT_FILES):
        raise CheckpointError(
            f"No weight file in the drafter folder {path!r} (looked for {', '.join(WEIGHT_FILES)}): copy the "
            "drafter's model.safetensors into it, or save the drafter again with save_pretrained."
        )


def adapter_base_name(adapter_config: str) -> str:
    """The base drafter an adapter folder names (``base_model_name_or_path``), or ``"BASE"`` where it names none."""
    import json

    try:
        with open(adapter_config) as f:
            base = json.load(f).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    return base if isinstance(base, str) and base else "BASE"


def _refuse_other_model(path: str, config_file: str) -> None:
    """A folder whose ``config.json`` is neither ours (``model_type: "dflash2"``) nor the published DFlash format
    (a ``dflash_config`` dict, or ``architectures`` naming a DFlash drafter) is another model: say which."""
    import json

    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return  # unreadable: transformers' own error names the file
    if not isinstance(config, dict):
        return
    architectures = config.get("architectures") or []
    if (config.get("model_type") == "dflash2" or "dflash_config" in config
            or any(str(a).startswith(("DFlash", "DFlash2")) for a in architectures)):
        return
    kind = config.get("model_type") or (architectures[0] if architectures else "unknown")
    raise CheckpointError(
        f"{path!r}: this is a {kind} model, not a dflash2 drafter (config.json: model_type "
        f"{config.get('model_type')!r}, no dflash_config). Load it as the target (AutoModelForCausalLM.from_pretrained), and pass a "
        "drafter folder here, or build one for it with DFlash2DraftModel.from_target(target)."
    )


def unreadable_weights_error(err: Exception, path: str) -> CheckpointError | None:
    """The :class:`CheckpointError` for a loading error that says the weight file is truncated or corrupt, else None."""
    from safetensors import SafetensorError

    text = str(err)
    if isinstance(err, SafetensorError) or any(
        s in text.lower() for s in ("deserializ", "header too", "incomplete metadata", "unexpected end")
    ):
        return CheckpointError(
            f"Could not read the drafter weights in {path!r}: {text}. "
            "The file is truncated or corrupt: download or save the drafter again."
        )
    return None


def non_finite(named_tensors) -> list[str]:
    """Names of the floating-point tensors among ``(name, tensor)`` pairs that hold a NaN or an inf."""
    return [name for name, t in named_tensors if t.is_floating_point() and not torch.isfinite(t).all()]


def check_loaded(model, info: dict, path: str, overridden: bool, config_passed: bool) -> None:
    """Raises :class:`CheckpointError` unless ``model`` (just loaded from ``path`` with ``output_loading_info``
    ``info``) is complete and intact.

    Args:
        overridden: the caller passed ``config=`` or config fields (weights they leave unused only warn then).
        config_passed: the caller passed ``config=`` (the digest is then compared with that config's).
    """
    missing = [k for k in info.get("missing_keys", []) if not k.startswith("rotary_emb")]
    mismatched = sorted(info.get("mismatched_keys", []), key=str)
    if missing or mismatched:
        raise CheckpointError(
            f"The drafter checkpoint {path!r} does not match its config: "
            f"missing weights {sorted(missing)[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"wrong shapes {[tuple(map(str, m)) for m in mismatched[:4]]}. Re-save it with "
            "DFlash2DraftModel.save_pretrained, or fix config.json (use_local_conv / use_candidate_selector / "
            f"sizes) to match the weights.{_fc_hint(model.config, mismatched)}"
        )
    unused = sorted(info.get("unexpected_keys", []))
    if unused and not overridden:  # the file's own config drops them: the drafter would draft without them
        raise CheckpointError(
            f"The drafter checkpoint {path!r} holds weights its config does not use: {unused[:8]}"
            f"{' ...' if len(unused) > 8 else ''}. {_unused_hint(unused)} To drop them on purpose, say so in "
            "from_pretrained (e.g. use_local_conv=False / use_candidate_selector=False)."
        )
    if unused:
        logger.warning(f"Ignoring drafter weights the config overrides leave unused: {unused[:8]}")
    bad = non_finite(model.named_parameters())
    if bad:
        raise CheckpointError(
            f"The drafter checkpoint {path!r} holds non-finite values (NaN/inf) in {bad[:4]}: the file is corrupt "
            "(or training diverged). Download or save the drafter again."
        )
    # The digest covers every saved tensor: a config override that left some unused cannot be compared.
    expected = None if unused else model.config.weights_sha256
    actual = digest_mismatch(model, expected, what=f"drafter weights in {path!r}")
    if actual:
        source = "the config= you passed" if config_passed else "its config.json"
        raise CheckpointError(
            f"The drafter weights in {path!r} are not the ones recorded in {source} (weights digest {actual} "
            f"!= weights_sha256 {expected}): the weight file is corrupt or was replaced. Download or save the "
            "drafter again; if you replaced the weights on purpose, re-save them with save_pretrained, or set "
            "weights_sha256 to null in the config."
        )


def _unused_hint(unused: list[str]) -> str:
    """Which config field would use checkpoint tensors the config left out (a weight silently dropped drafts worse)."""
    hints = []
    if any(".attention_conv." in k or ".mlp_conv." in k for k in unused):
        hints.append("The local-convolution weights need it enabled: in a published config architectures "
                     "[\"DFlash2DraftModel\"] with dflash_config.conv_kernel_size (and conv_group_size); in ours "
                     "use_local_conv: true.")
    if any(k.startswith("candidate_selector.") for k in unused):
        hints.append("The path-selector weights need it enabled: in a published config architectures "
                     "[\"DFlash2DraftModel\"] with dflash_config.selector_rank (and selector_top_k); in ours "
                     "use_candidate_selector: true.")
    return " ".join(hints) or "Fix config.json to match the weights, or re-save the drafter with save_pretrained."


def _fc_hint(config, mismatched) -> str:
    """For a mis-shaped ``fc.weight``: the ``target_layer_ids`` that set its width, and the rule a published config
    without them gets (the usual cause)."""
    fc = next((m for m in mismatched if m[0] == "fc.weight"), None)
    if fc is None:
        return ""
    ids, width = config.target_layer_ids, config.target_hidden_size
    return (
        f" fc.weight reads len(target_layer_ids) x target_hidden_size inputs: target_layer_ids={ids} gives "
        f"{len(ids)} x {width}, the file's reads {fc[1][-1]} ({fc[1][-1] / width:g} layers). A published config "
        "without target_layer_ids gets the reference's rule ([L // 2] for one drafter layer, else "
        f"round(1 + i * (L - 4) / (n - 1)); here L={config.num_target_layers}, n={config.num_hidden_layers}): set "
        "dflash_config.target_layer_ids (target_layer_ids in our format) to the target layers the drafter was "
        "trained on."
    )


__all__ = ["adapter_base_name", "check_folder", "check_loaded", "non_finite", "unreadable_weights_error"]
