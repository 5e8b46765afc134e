"""What a training run trains: the drafter (resumed, ``init`` or fresh, from a :class:`~.config.DrafterArguments`), its
draft vocabulary, and the LoRA wrapping (a :class:`~.config.LoraArguments`)."""

from __future__ import annotations

import logging

from ..errors import CheckpointError

logger = logging.getLogger(__name__)


def check_init(init: str | None) -> None:
    """A local ``--init`` must be a drafter folder (checked before the target loads), with the training fix named:
    a missing folder (leave out ``--init`` for a fresh drafter), a LoRA adapter (``--init BASE --lora --lora-init
    ADAPTER`` goes on training it), a target or other model folder, an incomplete one.

    Raises:
        ValueError: what the folder is and the option to use instead.
    """
    import os

    from ..checkpoint import adapter_base_name, check_folder
    from ..hub import is_local_path
    from ..shipped import resolve_name_or_path

    if not init:
        return
    try:
        path = resolve_name_or_path(init)
    except (OSError, ValueError) as err:
        raise ValueError(f"--init {init}: {err}") from err
    if not is_local_path(path):
        return  # a Hub id: from_pretrained resolves it (and says so when the Hub cannot be reached)
    if not os.path.exists(path):
        raise ValueError(f"--init {init}: no drafter folder there. Leave out --init to train a fresh drafter sized for "
                         "the target, or name a trained drafter's folder.")
    adapter_config = os.path.join(path, "adapter_config.json")
    if os.path.isfile(adapter_config) and not os.path.isfile(os.path.join(path, "config.json")):
        base = adapter_base_name(adapter_config)
        raise ValueError(f"--init {init}: is a LoRA adapter, not a drafter. To go on training it: --init {base} "
                         f"--lora --lora-init {init}")
    try:
        check_folder(path, config_passed=False)
    except CheckpointError as err:
        raise ValueError(f"--init {init}: {err} (--init takes a trained drafter; leave it out to train a fresh one "
                         "for the target)") from err


def check_lora_init(lora, init: str | None = None) -> None:
    """A local ``lora_init`` folder must hold an adapter of the ``init`` drafter (when that is a local folder, its
    config is compared with the adapter's fingerprint); checked before any expensive work.

    Raises:
        ValueError: ``dflash2_hf.lora.check_adapter_folder``'s or ``check_adapter_fits``' message.
    """
    if not (lora.lora and lora.lora_init):
        return
    from ..hub import is_local_path
    from ..lora import AdapterMismatchError, check_adapter_fits, check_adapter_folder

    if is_local_path(lora.lora_init):
        try:
            check_adapter_folder(lora.lora_init)
            config = _local_drafter_config(init)
            if config is not None:
                check_adapter_fits(lora.lora_init, config)
        except (FileNotFoundError, CheckpointError, AdapterMismatchError) as err:
            raise ValueError(f"--lora-init: {err}") from err


def _local_drafter_config(init: str | None):
    """The DFlash2Config of a local (or shipped) ``--init`` drafter, or None where it cannot be read cheaply (a Hub
    id, another format): the adapter is then checked against the loaded drafter, after the target loads."""
    import os

    from ..shipped import resolve_name_or_path

    try:
        path = resolve_name_or_path(init) if init else None
        if path is None or not os.path.isfile(os.path.join(path, "config.json")):
            return None
        from ..configuration_dflash2 import DFlash2Config

        return DFlash2Config.from_pretrained(path)
    except Exception:  # noqa: BLE001 - the full check after loading names any problem
        return None


def wrap_model(drafter, args):
    """The module the Trainer optimizes: the drafter, or (``args.lora``, a :class:`~.config.LoraArguments`) a PEFT
    LoRA model around it."""
    if not args.lora:
        return drafter
    from ..lora import add_lora, lora_config

    if args.lora_init:  # go on training an existing adapter (its own rank, targets and modules to save)
        from ..lora import load_adapter

        return load_adapter(drafter, args.lora_init, is_trainable=True)
    modules = args.lora_target_modules.split(",") if args.lora_target_modules else None
    full = args.lora_modules_to_save.split(",") if args.lora_modules_to_save else None
    return add_lora(drafter, lora_config(args.lora_r, args.lora_alpha, args.lora_dropout, modules, full))


def attention_overrides(args) -> dict:
    """``layer_types`` / ``sliding_window`` / ``is_causal`` of a fresh drafter from ``--layer-types``,
    ``--sliding-window`` and ``--causal`` (only those given); raises ValueError for bad layer types."""
    from ..masking import parse_layer_types

    out = {"layer_types": parse_layer_types(args.layer_types, args.num_layers)} if args.layer_types else {}
    if args.sliding_window is not None:
        out["sliding_window"] = args.sliding_window
    if args.causal != "auto":
        out["is_causal"] = args.causal == "yes"
    return out


def build_drafter(args, target, resume_from: str | None, lora: bool = False):
    """The drafter to train (``args``: a :class:`~.config.DrafterArguments`): the resumed checkpoint's, ``init``'s, or
    a fresh one sized for the target."""
    import torch

    from .. import DFlash2DraftModel

    if resume_from and not lora:  # a LoRA checkpoint holds the adapter only: the base comes from --init
        drafter = DFlash2DraftModel.from_pretrained(resume_from)
    elif args.init:
        drafter = DFlash2DraftModel.from_pretrained(args.init)
        apply_selector_options(drafter, args.selector_rank, args.selector_top_k)
        if getattr(args, "grow_layers", None):
            from .init import grow_layers

            grown = grow_layers(drafter, args.grow_layers)
            logger.info("--grow-layers %d: new layers at %s of %d (identity at start)", args.grow_layers, grown,
                        len(drafter.layers))
    else:
        overrides = dict(num_hidden_layers=args.num_layers, block_size=args.block_size)
        if args.target_layer_ids:
            overrides["target_layer_ids"] = [int(x) for x in args.target_layer_ids.split(",")]
        if args.mask_token_id is not None:
            overrides["mask_token_id"] = args.mask_token_id
        if args.selector_top_k is not None:
            overrides["selector_top_k"] = args.selector_top_k
        if args.selector_rank is not None:
            overrides["selector_rank"] = args.selector_rank
        if args.no_conv:
            overrides["use_local_conv"] = False
        if args.no_selector:
            overrides["use_candidate_selector"] = False
        overrides.update(attention_overrides(args))
        drafter = DFlash2DraftModel.from_target(target, **overrides)
        from .init import initialize_from_target

        initialize_from_target(drafter, target, layers=args.init_layers_from_target,
                               final_norm=args.init_norm_from_target)
        if args.init_norm is not None:
            with torch.no_grad():
                drafter.norm.weight.fill_(args.init_norm)
    drafter.check_target(target)
    train_only = getattr(args, "train_only", "all")
    if train_only == "selector":
        freeze_all_but_selector(drafter)
    elif train_only == "new-layers":  # also on resume: the checkpoint holds the grown stack
        from .init import freeze_all_but, grown_layer_indices

        if resume_from:
            check_grown_checkpoint(drafter, args.init, args.grow_layers)
        freeze_all_but(drafter, grown_layer_indices(len(drafter.layers), args.grow_layers))
    return drafter.float().train()


def check_grown_checkpoint(drafter, init: str, grow: int) -> None:
    """A resumed ``--grow-layers N --train-only new-layers`` run: the checkpoint must hold the ``--init`` drafter's
    layers + N (the new layers are found by position, so another N would train the wrong ones).

    Raises:
        ValueError: the layer counts disagree.
    """
    config = _local_drafter_config(init)
    if config is None:  # a Hub id: nothing to compare against without a download
        return
    base = config.num_hidden_layers
    if len(drafter.layers) != base + grow:
        raise ValueError(f"--grow-layers {grow} on resume: the checkpoint has {len(drafter.layers)} layers, the --init "
                         f"drafter {base}; resume with --grow-layers {len(drafter.layers) - base} (the N the run "
                         "started with)")


def apply_selector_options(drafter, rank: int | None, top_k: int | None) -> None:
    """``--selector-rank`` / ``--selector-top-k`` on a trained (``--init``) drafter, in place.

    A rank other than the drafter's (or a drafter without a selector) gets a NEW selector of that rank, initialised
    like a fresh one: its successor codebook is zero, so until trained it drafts the top-1 path. ``top_k`` only
    changes how many candidates per position the selector chooses among (no weights depend on it).

    Raises:
        ValueError: ``top_k`` above the number of token ids the drafter can propose.
    """
    from ..modeling_layers import CandidateSelector

    cfg = drafter.config
    if top_k is not None:
        proposable = cfg.draft_vocab_size or cfg.vocab_size
        if top_k > proposable:
            raise ValueError(f"--selector-top-k {top_k}: this drafter proposes {proposable} token ids (its "
                             f"{'draft ' if cfg.draft_vocab_size else ''}vocabulary); choose at most that many")
        cfg.selector_top_k = top_k
        if drafter.candidate_selector is not None:
            drafter.candidate_selector.top_k = top_k
    if rank is None or (cfg.use_candidate_selector and rank == cfg.selector_rank):
        return
    old = f"rank {cfg.selector_rank}" if cfg.use_candidate_selector else "none"
    cfg.selector_rank, cfg.use_candidate_selector = rank, True
    selector = CandidateSelector(cfg)
    selector.apply(drafter._init_weights)
    drafter.candidate_selector = selector.to(drafter.fc.weight.device, drafter.fc.weight.dtype)
    logger.info("--selector-rank %d: a new candidate selector (was %s); it drafts the top-1 path until trained",
                rank, old)


def freeze_all_but_selector(drafter) -> None:
    """``--train-only selector``: every drafter parameter frozen except the candidate selector's.

    Raises:
        ValueError: the drafter has no candidate selector (name ``--selector-rank R`` to add one).
    """
    if drafter.candidate_selector is None:
        raise ValueError("--train-only selector: this drafter has no candidate selector; add a new one with "
                         "--selector-rank R (e.g. 72)")
    from .init import freeze_all_but

    freeze_all_but(drafter, [])
    n = sum(p.numel() for p in drafter.candidate_selector.parameters())
    logger.info("--train-only selector: training the candidate selector's %.2fM parameters, the rest of the "
                "drafter frozen", n / 1e6)


def check_draft_vocab(n: int | None, drafter) -> None:
    """Validates a ``draft_vocab`` size before any feature is computed (see :func:`choose_draft_vocab`)."""
    if n is not None and not 1 <= n <= drafter.config.vocab_size:
        raise ValueError(f"--draft-vocab must be in [1, {drafter.config.vocab_size}] (the target vocabulary), got {n}")


def choose_draft_vocab(n: int, drafter, records: list[dict]) -> None:
    """Restricts ``drafter`` to the ``n`` most frequent response tokens of ``records`` (+ EOS).

    Raises:
        ValueError: ``n`` outside [1, vocab size].
    """
    from .draft_vocab import draft_vocab_coverage, draft_vocab_from_records, eos_ids

    check_draft_vocab(n, drafter)
    old = drafter.draft_vocab_ids
    ids, coverage = draft_vocab_from_records(records, n, always=eos_ids(drafter.config))
    before = 1.0 if old is None else draft_vocab_coverage(old.tolist(), records)
    drafter.set_draft_vocab(ids)
    logger.info("--draft-vocab %d: covers %.4f of the training data's response tokens (was %s: %.4f)", ids.numel(),
                coverage, "the whole vocabulary" if old is None else f"{old.numel()} ids", before)
