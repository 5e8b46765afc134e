"""Command line and config files of a training run: ``HfArgumentParser`` over the five configs of :mod:`.config`.

``dflash2 train`` (and :class:`TrainArgumentParser` from Python) accepts every field of :class:`~.config.DataArguments`,
:class:`~.config.FeatureArguments`, :class:`~.config.DrafterArguments`, :class:`~.config.LoraArguments` and
:class:`~.config.DFlash2TrainingArguments` (so every ``transformers.TrainingArguments`` field, by its transformers
name: ``--output-dir``, ``--learning-rate``, ``--per-device-train-batch-size``, ...), plus one optional positional
``.yaml`` / ``.json`` file of the same flat field names: its values replace the defaults, the command line wins.
The recipe's defaults (:data:`~.config.RECIPE_DEFAULTS`) are the parser's defaults.

Options renamed to their transformers name are refused under their old spelling with a message naming the new
one (:data:`RENAMED`). ``--bf16 auto`` (bfloat16 autocast where the device computes it natively) is resolved here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import NamedTuple, get_type_hints

from transformers import HfArgumentParser

from . import config
from .config import DataArguments, DFlash2TrainingArguments, DrafterArguments, FeatureArguments, LoraArguments

CONFIG_TYPES = (DataArguments, FeatureArguments, DrafterArguments, LoraArguments, DFlash2TrainingArguments)

# options of earlier releases -> their name now (transformers' name where the option is a TrainingArguments field)
RENAMED = {
    "--output": "--output-dir",
    "--lr": "--learning-rate",
    "--warmup": "--warmup-steps (a ratio of the steps below 1)",
    "--batch-size": "--per-device-train-batch-size",
    "--grad-accum": "--gradient-accumulation-steps",
    "--epochs": "--num-train-epochs",
    "--resume": "--resume-from-checkpoint last (or a checkpoint folder)",
    "--no-progress": "--disable-tqdm",
    "--selector-no-detach": "--no-selector-detach",
}


class TrainConfig(NamedTuple):
    """The five configs of one run, in :data:`CONFIG_TYPES` order (``train(**cfg._asdict())`` runs it)."""

    data: DataArguments
    features: FeatureArguments
    drafter: DrafterArguments
    lora: LoraArguments
    training_args: DFlash2TrainingArguments


class _Renamed(argparse.Action):
    def __init__(self, option_strings, dest, new, **kwargs):
        self.new = new
        super().__init__(option_strings, dest=argparse.SUPPRESS, nargs="?", default=argparse.SUPPRESS,
                         help=argparse.SUPPRESS)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {self.new} (the transformers.TrainingArguments name where it is one)")


def _bool_or_auto(text: str):
    if str(text).lower() == "auto":
        return "auto"
    from transformers.hf_argparser import string_to_bool

    return string_to_bool(text)


def _add_extras(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if action.dest == "target":  # a misspelt alias or a missing folder: refused while parsing, did-you-mean
            from dflash2_cli.options import target_spec

            action.type = target_spec
        if action.dest == "resume_from_checkpoint":
            action.help = ("continue a run: `last` = the newest complete checkpoint-N in --output-dir, or a "
                           "checkpoint folder")
        if action.dest == "output_dir":
            action.help = "where the drafter (or adapter) and its checkpoints are written (required; a new or empty " \
                          "folder unless resuming or --overwrite-output-dir)"
        if action.dest == "bf16":
            action.type = _bool_or_auto
            action.help = "bfloat16 autocast of the training step (fp32 master weights); auto = where the device " \
                          "computes bf16 natively"
    for old, new in RENAMED.items():
        parser.add_argument(old, action=_Renamed, new=new)
    parser.add_argument("config", nargs="?", default=None, metavar="CONFIG.yaml|json",
                        help="a file of these options by field name (flat); the command line wins")
    parser.set_defaults(**config.RECIPE_DEFAULTS, disable_tqdm=not sys.stderr.isatty())  # no bars in log files


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds every field of :data:`CONFIG_TYPES` (the way ``HfArgumentParser`` does), the refused old spellings and
    the optional config file to ``parser`` (e.g. the ``dflash2 train`` sub-parser)."""
    for dtype in CONFIG_TYPES:
        group = parser.add_argument_group(getattr(dtype, "_argument_group_name", "optimisation: "
                                                  "transformers.TrainingArguments (+ the drafter loss)"))
        hints = get_type_hints(dtype)
        for field in dataclasses.fields(dtype):
            if field.init:
                field.type = hints[field.name]
                HfArgumentParser._parse_dataclass_field(group, field)
    _add_extras(parser)


class TrainArgumentParser(HfArgumentParser):
    """``HfArgumentParser`` of a training run: ``TrainArgumentParser().parse(argv)`` -> :class:`TrainConfig`."""

    def __init__(self, **kwargs):
        kwargs.setdefault("prog", "dflash2 train")
        super().__init__(CONFIG_TYPES, **kwargs)
        _add_extras(self)

    def parse(self, argv: list[str] | None = None) -> TrainConfig:
        return configs_from_namespace(self.parse_args(argv))


def load_config_file(path: str) -> dict:
    """The flat mapping of field names in a ``.yaml`` / ``.yml`` / ``.json`` file.

    Raises:
        ValueError: another extension, not a mapping, or a name no config has.
    """
    ext = os.path.splitext(path)[1].lower()
    with open(path) as f:
        if ext in (".yaml", ".yml"):
            import yaml

            values = yaml.safe_load(f) or {}
        elif ext == ".json":
            values = json.load(f)
        else:
            raise ValueError(f"config file {path!r}: expected .yaml, .yml or .json")
    if not isinstance(values, dict):
        raise ValueError(f"config file {path!r}: expected a mapping of option names to values")
    values = {k.replace("-", "_"): v for k, v in values.items()}
    known = {f.name for t in CONFIG_TYPES for f in dataclasses.fields(t) if f.init}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"config file {path!r}: unknown option(s) {', '.join(unknown)}")
    return values


def _resolve_auto_bf16(values: dict) -> None:
    if values.get("bf16") != "auto":
        return
    import torch

    from ..generation.precision import bf16_support

    gpu = torch.cuda.is_available() and not values.get("use_cpu") and values.get("device") != "cpu"
    values["bf16"] = bf16_support(torch.device("cuda" if gpu else "cpu"))[0]


def configs_from_namespace(ns: argparse.Namespace) -> TrainConfig:
    """The five configs from a namespace of :func:`add_train_arguments` options (a config file's values fill what
    the command line left at its default).

    Raises:
        ValueError: a value the configs refuse (their message), or a config file that cannot be used.
    """
    values = dict(vars(ns))
    path = values.pop("config", None)
    if path:
        reference = argparse.ArgumentParser()
        add_train_arguments(reference)
        for k, v in load_config_file(path).items():
            if values.get(k) == reference.get_default(k):
                values[k] = v
    if values.get("device") not in (None, "auto"):  # the CPU: the Trainer's use_cpu; a GPU: must exist
        from ..cli import resolve_device

        device = resolve_device(values["device"])
        if device.type == "cpu":
            values["use_cpu"] = True
        elif device.index not in (None, 0):
            raise ValueError(f"--device {values['device']}: pick the GPU with CUDA_VISIBLE_DEVICES={device.index} "
                             "(the Trainer trains on cuda:0, or one GPU per rank under torchrun)")
    _resolve_auto_bf16(values)
    out = []
    for dtype in CONFIG_TYPES:
        names = {f.name for f in dataclasses.fields(dtype) if f.init}
        out.append(dtype(**{k: v for k, v in values.items() if k in names}))
    return TrainConfig(*out)


__all__ = ["CONFIG_TYPES", "RENAMED", "TrainArgumentParser", "TrainConfig", "add_train_arguments",
           "configs_from_namespace", "load_config_file"]
