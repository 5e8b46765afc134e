"""`dflash2` command line: one sub-command per module in this folder.

Each sub-command module defines ``run(args) -> int``; its options are declared torch-free in
:mod:`dflash2_cli.arguments` (re-exported as the module's ``add_arguments``), so ``dflash2 COMMAND --help`` and a bad
option answer before torch loads. This file runs a parsed command and holds the helpers the ``run`` functions share
(the argparse types and shared options live in :mod:`dflash2_cli.options`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys

from dflash2_cli import SUBCOMMANDS as _COMMANDS
from dflash2_cli import build_parser  # noqa: F401 (the parser of every sub-command; tests build it from here)
from dflash2_cli.options import DRAFTER_DTYPES, DTYPES

# sub-command name -> module (relative to this package)
SUBCOMMANDS = {name: module for name, (module, _) in _COMMANDS.items()}


def warn_unused_sampling_filters(args: argparse.Namespace) -> None:
    """One warning on stderr when ``--top-p`` / ``--top-k`` are set (not off) while ``--temperature`` is 0: greedy
    decoding ignores them."""
    given = [flag for flag, value, off in (("--top-p", getattr(args, "top_p", None), 1.0),
                                           ("--top-k", getattr(args, "top_k", None), 0)) if value not in (None, off)]
    if given and not args.temperature:
        print(f"warning: {' and '.join(given)} only apply when sampling (--temperature > 0); decoding greedily",
              file=sys.stderr)


def apply_cpu_kernels(spec: str, *models) -> str:
    """Runs :func:`dflash2_hf.optimize_for_cpu` on each CPU model of ``models`` (None skipped) when ``spec`` is
    ``"optimized"``; returns one line saying what the target (the first model) runs on."""
    from ..cpu_kernels import cpu_kernels_summary, optimize_for_cpu

    models = [m for m in models if m is not None]
    for model in models:
        if spec == "optimized" and next(model.parameters()).device.type == "cpu":
            optimize_for_cpu(model)
    return cpu_kernels_summary(models[0]) if models else "stock CPU kernels"


@contextlib.contextmanager
def sigterm_as_ctrl_c():
    """Within the block, ``kill PID`` (SIGTERM) stops the command like Ctrl-C (KeyboardInterrupt), so a background
    run (a shell ignores SIGINT in its background jobs) says what it kept. Main thread only; restored after."""
    import signal
    import threading

    def terminate(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, terminate) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def resolve_device(spec: str):
    """``torch.device`` for a ``--device`` value.

    Raises:
        ValueError: ``cuda`` / ``cuda:N`` asked for but ``torch.cuda.is_available()`` is False, or GPU ``N`` does
            not exist.
    """
    import torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec}: torch {torch.__version__} sees no CUDA GPU (a CPU-only build or no "
                             "driver); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: torch sees {torch.cuda.device_count()} GPU(s), numbered from 0")
    return device


def resolve_dtype(spec: str, device) -> tuple[object, str]:
    """``(torch dtype, label for reports)`` of a ``--dtype`` / ``--drafter-dtype`` value on ``device``.

    ``auto``: :func:`dflash2_hf.target_dtype` (the same rule as :func:`dflash2_hf.drafting_dtype`), labelled with the
    reason, e.g. ``"fp32 (auto: no native bf16 on this CPU)"``; explicit values are kept (``"fp32"``, ``"bf16"``;
    ``"bf16 (explicit; no native bf16 on this CPU: emulated, slower than fp32)"`` where the device lacks it).

    Raises:
        ValueError: ``spec`` is not one of :data:`DTYPES`.
    """
    import torch

    from ..generation.precision import auto_dtype_label, resolve_drafting_precision, target_dtype

    if spec == "auto":
        return target_dtype(device), auto_dtype_label(device)
    if spec not in DTYPES:
        raise ValueError(f"unknown dtype {spec!r}; choose from {', '.join(DTYPES)}")
    if spec in ("fp32", "float32"):
        return torch.float32, "fp32"
    return torch.bfloat16, resolve_drafting_precision("bf16", device)[1]  # the same label as the drafter's


def resolve_drafter_dtype(spec: str, device) -> tuple[object, bool, str]:
    """``(torch dtype, int8, label)`` of a ``--drafter-dtype`` value on ``device``: ``int8`` = load in float32, then
    :func:`dflash2_hf.quantization.quantize_drafter`. The rule and the labels are
    :func:`dflash2_hf.generation.precision.resolve_drafting_precision`'s (the same as :func:`dflash2_hf.load_drafter`).

    Raises:
        ValueError: ``spec`` is not one of :data:`DRAFTER_DTYPES`, or ``int8`` where it cannot run (the reason).
    """
    import torch

    from ..generation.precision import resolve_drafting_precision

    if spec not in DRAFTER_DTYPES:
        raise ValueError(f"unknown --drafter-dtype {spec!r}; choose from {', '.join(DRAFTER_DTYPES)}")
    try:
        precision, label = resolve_drafting_precision(spec, device)
    except ValueError as err:
        raise ValueError(f"--drafter-dtype {spec}: {err}") from None
    return (torch.bfloat16 if precision == "bf16" else torch.float32), precision == "int8", label


def main(argv: list[str] | None = None) -> int:
    """Runs a sub-command; errors that name their fix print as one line (``DFLASH2_DEBUG=1``: full traceback)."""
    from dflash2_cli import main as parse_and_run  # parses torch-free, then calls run_parsed

    return parse_and_run(argv)


def run_parsed(args: argparse.Namespace) -> int:
    """Runs the sub-command ``args`` were parsed for (:func:`dflash2_cli.build_parser`): its module's ``run``."""
    import os

    from ..errors import DFlash2Error

    module = importlib.import_module(f"{__name__}.{SUBCOMMANDS[args.command]}")
    try:
        return int(module.run(args) or 0)
    except (DFlash2Error, OSError, ImportError, ValueError) as err:  # OSError: also a Hub id that cannot be reached
        if os.environ.get("DFLASH2_DEBUG") == "1":
            raise
        print(f"dflash2 {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
