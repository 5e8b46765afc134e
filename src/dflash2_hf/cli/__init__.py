"""`dflash2` command line: one sub-command per module in this folder.

Each sub-command module defines ``add_arguments(parser)`` and ``run(args) -> int``; this file only wires them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command name -> module (relative to this package); help text comes from the module docstring.
SUBCOMMANDS = {
    "generate": "generate",
    "demo": "demo",
    "prepare-data": "prepare_data",
    "export-data": "export_data",
    "train": "train",
    "bench": "bench",
}


def _number(text: str, ok, rule: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not ok(value):  # written so that NaN fails too
        raise argparse.ArgumentTypeError(f"must be {rule}; got {text}")
    return value


def probability(text: str) -> float:
    """argparse type of a threshold in ``[0, 1)`` (0 = off)."""
    return _number(text, lambda v: 0 <= v < 1, "a probability in [0, 1) (0 = off)")


def non_negative(text: str) -> float:
    """argparse type of a value >= 0 (a sampling temperature: 0 = greedy)."""
    return _number(text, lambda v: v >= 0, ">= 0 (0 = greedy)")


def non_negative_bound(text: str) -> float:
    """argparse type of a bound >= 0 (e.g. ``--near-tie-ulps``)."""
    return _number(text, lambda v: v >= 0, ">= 0")


def _integer(text: str, low: int, rule: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {rule}; got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type of a count >= 1 (``--max-new-tokens``, ``--num-threads``, ``--num-prompts``)."""
    return _integer(text, 1, ">= 1")


def non_negative_int(text: str) -> int:
    """argparse type of a count >= 0 where 0 means off (``--top-k``, ``--max-prompt-tokens``)."""
    return _integer(text, 0, ">= 0 (0 = off)")


def top_p(text: str) -> float:
    """argparse type of a nucleus-sampling mass in ``(0, 1]`` (1 = off)."""
    return _number(text, lambda v: 0 < v <= 1, "in (0, 1] (1 = off)")


def warn_unused_sampling_filters(args: argparse.Namespace) -> None:
    """One warning on stderr when ``--top-p`` / ``--top-k`` are set (not off) while ``--temperature`` is 0: greedy
    decoding ignores them."""
    given = [flag for flag, value, off in (("--top-p", getattr(args, "top_p", None), 1.0),
                                           ("--top-k", getattr(args, "top_k", None), 0)) if value not in (None, off)]
    if given and not args.temperature:
        print(f"warning: {' and '.join(given)} only apply when sampling (--temperature > 0); decoding greedily",
              file=sys.stderr)


def drafter_spec(text: str) -> str:
    """argparse type of ``--drafter``: ``fresh``, a folder, a shipped drafter's name or a Hub id; a missing path that
    looks local (``./x``, ``runs/x/y``) or a shipped name whose folder is not here is refused before any model loads."""
    import os

    from ..hub import is_local_path
    from ..shipped import SHIPPED_DRAFTER, resolve_name_or_path

    if text == "fresh":
        return text
    try:
        path = resolve_name_or_path(text)
    except (OSError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not os.path.exists(path) and is_local_path(path):
        raise argparse.ArgumentTypeError(f"no drafter folder at {text!r}: pass a folder, a Hub id (org/name), the "
                                         f"shipped {SHIPPED_DRAFTER!r}, or 'fresh'")
    return text


def dataset_list(text: str) -> str:
    """argparse type of ``--datasets``: comma-separated ``sharegpt``, ``humaneval`` or paths of existing JSONL files."""
    import os

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ("sharegpt", "humaneval") and not os.path.isfile(name)]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown data set(s) {unknown or [text]}: use sharegpt, humaneval or paths "
                                         "of JSONL files, comma-separated")
    return text


def device_spec(text: str) -> str:
    """argparse type of a ``--device`` value: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N (a GPU index); got {text!r}")


def add_device_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--device", default="auto", type=device_spec, metavar="{auto,cpu,cuda,cuda:N}",
                        help=f"where {what} run{'s' if ' and ' not in what else ''} (default auto: the GPU when torch "
                             "sees one, else the CPU)")


def add_cpu_kernels_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-kernels", default="optimized", choices=("optimized", "stock"),
                        help="on a CPU, run the target's and the drafter's linears on weights prepacked once for "
                             "oneDNN (dflash2_hf.optimize_for_cpu: on a 2-core AVX2 EPYC with 2 threads, verifying 8 "
                             "tokens costs 97 ms instead of 144; one extra copy of the weights in memory), or on stock "
                             "PyTorch kernels (default: optimized; ignored on GPUs)")


def apply_cpu_kernels(spec: str, *models) -> str:
    """Runs :func:`dflash2_hf.optimize_for_cpu` on each CPU model of ``models`` (None skipped) when ``spec`` is
    ``"optimized"``; returns one line saying what the target (the first model) runs on."""
    from ..cpu_kernels import cpu_kernels_summary, optimize_for_cpu

    models = [m for m in models if m is not None]
    for model in models:
        if spec == "optimized" and next(model.parameters()).device.type == "cpu":
            optimize_for_cpu(model)
    return cpu_kernels_summary(models[0]) if models else "stock CPU kernels"


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


DTYPES = ("auto", "bf16", "bfloat16", "fp32", "float32")
DRAFTER_DTYPES = (*DTYPES, "int8")  # --drafter-dtype also drafts with dynamic int8 linears (dflash2_hf.quantization)


def add_dtype_argument(parser: argparse.ArgumentParser, default: str, what: str = "target") -> None:
    """``--dtype`` of the target (``auto`` / ``bf16`` / ``fp32``); ``what`` names what it sets in the help text."""
    parser.add_argument("--dtype", default=default, choices=DTYPES,
                        help=f"{what} dtype (default {default}). auto = bf16 where the device computes it natively "
                             "(GPUs with bf16, CPUs with AVX512-BF16/AMX), else fp32; plain generate() runs in the same "
                             "dtype. fp32: greedy output identical to plain greedy token for token; bf16: identical up "
                             "to near-ties (docs/bench.md)")


def add_drafter_dtype_argument(parser: argparse.ArgumentParser, default: str | None, default_text: str) -> None:
    parser.add_argument("--drafter-dtype", default=default, choices=DRAFTER_DTYPES,
                        help=f"drafter dtype (default {default_text}). Lossless either way: only the target's "
                             "verification decides. auto = int8 on x86 CPUs (dynamic int8 linears: drafting reads weights, "
                             "and int8 has the fewest bytes: a cycle's drafting 1.6x cheaper than bf16 on an AVX512-BF16 CPU, "
                             "1.7x cheaper than fp32 on an AVX2 one), else bf16 where the device computes it natively "
                             "(GPUs with bf16), else fp32")


def resolve_dtype(spec: str, device) -> tuple[object, str]:
    """``(torch dtype, label for reports)`` of a ``--dtype`` / ``--drafter-dtype`` value on ``device``.

    ``auto``: :func:`dflash2_hf.target_dtype` (the same rule as :func:`dflash2_hf.drafting_dtype`), labelled with the
    reason, e.g. ``"fp32 (auto: no native bf16 on this CPU)"``; explicit values are kept (``"fp32"``, ``"bf16"``;
    ``"bf16 (explicit; no native bf16 on this CPU: emulated, slower than fp32)"`` where the device lacks it).

    Raises:
        ValueError: ``spec`` is not one of :data:`DTYPES`.
    """
    import torch

    from ..generation.precision import auto_dtype_label, bf16_support, target_dtype

    if spec == "auto":
        return target_dtype(device), auto_dtype_label(device)
    if spec not in DTYPES:
        raise ValueError(f"unknown dtype {spec!r}; choose from {', '.join(DTYPES)}")
    if spec in ("fp32", "float32"):
        return torch.float32, "fp32"
    native, reason = bf16_support(device)
    return torch.bfloat16, "bf16" if native else f"bf16 (explicit; {reason}: emulated, slower than fp32)"


def resolve_drafter_dtype(spec: str, device) -> tuple[object, bool, str]:
    """``(torch dtype, int8, label)`` of a ``--drafter-dtype`` value on ``device``: ``int8`` = load in float32, then
    :func:`dflash2_hf.quantization.quantize_drafter`.

    ``auto``: :func:`dflash2_hf.generation.precision.drafting_precision` (int8 on x86 CPUs, bf16 where the device
    computes it natively, else fp32); the label says which and why. Other values as :func:`resolve_dtype`.

    Raises:
        ValueError: ``spec`` is not one of :data:`DRAFTER_DTYPES`, or ``int8`` where it cannot run (the reason).
    """
    import torch

    from ..generation.precision import drafting_precision
    from ..quantization import int8_support

    if spec == "int8":
        supported, reason = int8_support(device)
        if not supported:
            raise ValueError(f"--drafter-dtype int8: {reason}; use fp32 or bf16")
        return torch.float32, True, "int8"
    if spec != "auto":
        dtype, label = resolve_dtype(spec, device)
        return dtype, False, label
    precision, reason = drafting_precision(device)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return dtype, precision == "int8", f"{precision} (auto: {reason})"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and shows every option's default (``--help``), unless its help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text.lower() or action.default in (None, False, argparse.SUPPRESS)
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Options declared without help text still show their default in ``--help`` (argparse skips an empty help)."""
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of a parser's actions
        if action.option_strings and not action.help and action.default not in (None, False, argparse.SUPPRESS):
            action.help = "(default: %(default)s)"


class _Renamed(argparse.Action):
    """An old spelling of an option, refused with the new one's name (hidden from ``--help``)."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is spelled {self.new} in this command: {self.new} {values or 'FOLDER'}")


OLD_OUTPUT_SPELLINGS = ("--out", "--output")


def refuse_old_spellings(parser: argparse.ArgumentParser) -> None:
    """Every command with an output folder names it ``--output-dir`` (train's, after transformers'
    TrainingArguments): the old spellings ``--out`` / ``--output`` are refused with a message naming it (train
    refuses ``--output`` itself, :data:`dflash2_hf.training.parser.RENAMED`)."""
    options = parser._option_string_actions  # noqa: SLF001 - argparse has no public "has option" query
    if "--output-dir" in options:
        for old in OLD_OUTPUT_SPELLINGS:
            if old not in options:
                parser.add_argument(old, action=_Renamed, new="--output-dir", dest=f"_renamed_{old[2:]}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``dflash2`` parser. ``command``: import only that sub-command's module (the others are listed by name),
    so running one command never imports, or trips over, another."""
    from dflash2_cli import DESCRIPTION, SUBCOMMANDS as HELP_LINES, add_top_level_arguments

    parser = argparse.ArgumentParser(prog="dflash2", description=DESCRIPTION, formatter_class=HelpFormatter)
    add_top_level_arguments(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        if command is not None and name != command:
            sub.add_parser(name, help=HELP_LINES[name][1], add_help=False)
            continue
        try:
            module = importlib.import_module(f"{__name__}.{module_name}")
        except ModuleNotFoundError as err:  # a sub-command whose module is not written yet
            if err.name != f"{__name__}.{module_name}":
                raise
            continue
        doc = (module.__doc__ or "").strip().splitlines()
        p = sub.add_parser(name, help=doc[0] if doc else None, description=module.__doc__,
                           formatter_class=HelpFormatter)
        module.add_arguments(p)
        show_defaults(p)
        refuse_old_spellings(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs a sub-command; errors that name their fix print as one line (``DFLASH2_DEBUG=1``: full traceback)."""
    import os

    from ..errors import DFlash2Error

    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(command if command in SUBCOMMANDS else None).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (DFlash2Error, OSError, ImportError, ValueError) as err:  # OSError: also a Hub id that cannot be reached
        if os.environ.get("DFLASH2_DEBUG") == "1":
            raise
        print(f"dflash2 {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
