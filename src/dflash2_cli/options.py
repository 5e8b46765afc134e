"""Torch-free building blocks of the ``dflash2`` sub-command parsers: argparse value types that name what is wrong,
the shared options (``--device``, ``--dtype``, ``--drafter-dtype``, ``--cpu-kernels``) and the help formatting.

Nothing here imports torch or transformers at module level, so ``dflash2 COMMAND --help`` and a bad option answer at
once; import them from here.
"""

from __future__ import annotations

import argparse

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


TARGET_ALIASES = ("gemma3-270m", "smollm2")  # the names of dflash2_hf.targets.TARGETS (a test keeps them equal)


def _looks_local(text: str) -> bool:
    """Whether ``text`` can only mean a local path (not a Hub id ``org/name``): it starts with ``.``, ``/`` or ``~``,
    has no ``/`` or more than one, or its first component is a folder here (``runs/x``)."""
    import os

    return text.startswith((".", "/", "~")) or text.count("/") != 1 or os.path.isdir(text.split("/")[0])


def target_spec(text: str) -> str:
    """argparse type of ``--target``: a bundled alias (:data:`TARGET_ALIASES`), a folder, or a Hub id (``org/name``);
    anything else (a misspelt alias, a missing folder) is refused while parsing, before the ~7 s of imports."""
    import difflib
    import os

    if text in TARGET_ALIASES or os.path.isdir(text) or not _looks_local(text):
        return text
    close = difflib.get_close_matches(text, TARGET_ALIASES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise argparse.ArgumentTypeError(
        f"unknown target {text!r}: not a bundled alias ({', '.join(TARGET_ALIASES)}), no folder there, not a Hub id "
        f"(org/name){hint}")


def adapter_spec(text: str) -> str:
    """argparse type of ``--adapter``: a missing local folder is refused while parsing; the folder's contents are
    checked before any model loads (:func:`dflash2_hf.lora.check_adapter_folder`)."""
    import os

    if not os.path.exists(text) and _looks_local(text) and text != os.path.basename(text):
        raise argparse.ArgumentTypeError(
            f"no adapter folder at {text!r}: pass a `dflash2 train --lora` output folder, the shipped adapter's name "
            "or a Hub id")
    return text


def drafter_spec(text: str) -> str:
    """argparse type of ``--drafter``: ``fresh``, a folder, a shipped drafter's name or a Hub id; a missing path that
    looks local (``./x``, ``runs/x/y``), a shipped name whose folder is not here, and a folder that is no drafter (a
    LoRA adapter, a target, no config.json or no weights: :func:`dflash2_hf.checkpoint.check_folder`) are refused
    before any model loads."""
    import os

    from dflash2_hf.hub import is_local_path  # imports torch: only when a --drafter value is checked
    from dflash2_hf.shipped import SHIPPED_DRAFTER, resolve_name_or_path

    if text == "fresh":
        return text
    try:
        path = resolve_name_or_path(text)
    except (OSError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if not os.path.exists(path) and is_local_path(path):
        raise argparse.ArgumentTypeError(f"no drafter folder at {text!r}: pass a folder, a Hub id (org/name), the "
                                         f"shipped {SHIPPED_DRAFTER!r}, or 'fresh'")
    from dflash2_hf.checkpoint import check_folder
    from dflash2_hf.errors import CheckpointError

    try:  # an adapter, a target or an incomplete folder: refused before any model loads
        check_folder(path, config_passed=False)
    except CheckpointError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def dataset_list(text: str) -> str:
    """argparse type of ``--datasets``: comma-separated ``sharegpt``, ``humaneval`` or paths of existing JSONL files."""
    import os

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in ("sharegpt", "humaneval") and not os.path.isfile(name)]
    missing = [name for name in unknown if name.endswith((".jsonl", ".json")) or os.sep in name]
    if missing:
        raise argparse.ArgumentTypeError(f"no such file: {', '.join(missing)} (a data set is sharegpt, humaneval or "
                                         "the path of an existing JSONL file)")
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


class CommandParser(argparse.ArgumentParser):
    """The ``dflash2`` parser: a ``--drafter`` value (``type=drafter_spec``: the check imports ``dflash2_hf`` and so
    torch) is checked only once every other option parsed, so ``--help`` and a mistake elsewhere answer at once.
    Use it for the top-level parser and (``parser_class``) its sub-command parsers."""

    def _get_value(self, action, arg_string):  # noqa: D401 - argparse's hook converting one value
        if action.type is drafter_spec:
            return arg_string  # checked in parse_known_args, after the rest
        return super()._get_value(action, arg_string)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        subparsers = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
        command = getattr(namespace, "command", None)
        if subparsers and command in subparsers[0].choices:  # the top level: the sub-command's drafter options
            sub = subparsers[0].choices[command]
            if extras:  # answer a mistyped option at once, with the sub-command's usage, before the drafter check
                sub.error(f"unrecognized arguments: {' '.join(extras)}")
            for action in sub._actions:  # noqa: SLF001 - argparse has no public list of a parser's actions
                value = getattr(namespace, action.dest, None)
                if action.type is drafter_spec and isinstance(value, str):
                    try:
                        drafter_spec(value)
                    except argparse.ArgumentTypeError as err:
                        sub.error(f"argument {'/'.join(action.option_strings)}: {err}")
        return namespace, extras
