"""The ``dflash2`` command's entry point, free of torch and transformers: ``dflash2 --help`` and ``dflash2 --version``
answer at once (importing ``dflash2_hf`` loads torch and transformers, seconds on a CPU machine).

A command line that names a sub-command is parsed here too (its options are declared torch-free in
:mod:`dflash2_cli.arguments`), then runs in :func:`dflash2_hf.cli.run_parsed`, which imports that sub-command's module
only. The one-line help of each sub-command is the first line of its module's docstring (a test keeps them equal).
"""

from __future__ import annotations

import argparse
import sys

# sub-command -> (module of dflash2_hf.cli, one-line help)
SUBCOMMANDS = {
    "generate": ("generate", "Generate text from a prompt with a DFlash2 drafter (streams the text, prints tau and the "
                             "time split)."),
    "demo": ("demo", "The main job: the shipped drafter on the bundled real target, real prompts, text + tau + speedup."),
    "prepare-data": ("prepare_data", "Regenerate ShareGPT assistant turns with the target (training data for the "
                                     "drafter)."),
    "export-data": ("export_data", "Convert a JSONL folder of an older prepare-data into a Hub-style dataset folder "
                                   "(Parquet shards + dataset card)."),
    "train": ("train", "Train a DFlash2 drafter on target-regenerated data (cached or online target features; torchrun "
                       "/ accelerate DDP)."),
    "bench": ("bench", "Benchmark DFlash2 speculative decoding against plain generate() and the other baselines."),
}
DESCRIPTION = ("DFlash2 speculative decoding for transformers. `dflash2 COMMAND --help` lists a command's options "
               "with their defaults.")


def version() -> str:
    """The installed dflash2-hf version (from the package metadata; no torch import)."""
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("dflash2-hf")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def add_top_level_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"dflash2 {version()}")


def command_description(module: str) -> str | None:
    """The docstring of ``dflash2_hf.cli.<module>`` (a sub-command's ``--help`` description), read from its source
    without importing it (importing ``dflash2_hf`` loads torch)."""
    import ast
    from importlib.util import find_spec
    from pathlib import Path

    package = find_spec("dflash2_hf")  # locates the package; runs none of it
    source = Path(package.submodule_search_locations[0]) / "cli" / f"{module}.py"
    return ast.get_docstring(ast.parse(source.read_text(encoding="utf-8")), clean=False)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``dflash2`` parser with every sub-command's options, or only ``command``'s (the others listed by name).
    Torch-free except ``train``'s options (transformers' HfArgumentParser) and the check of a ``--drafter`` value,
    which runs once every other option parsed (:class:`~dflash2_cli.options.CommandParser`)."""
    from .arguments import ADD_ARGUMENTS
    from .options import CommandParser, HelpFormatter, refuse_old_spellings, show_defaults

    parser = CommandParser(prog="dflash2", description=DESCRIPTION, formatter_class=HelpFormatter)
    add_top_level_arguments(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    for name, (module, help_line) in SUBCOMMANDS.items():
        if command is not None and name != command:
            sub.add_parser(name, help=help_line, add_help=False)
            continue
        p = sub.add_parser(name, help=help_line, description=command_description(module), formatter_class=HelpFormatter)
        ADD_ARGUMENTS[name](p)
        show_defaults(p)
        refuse_old_spellings(p)
    return parser


def light_parser() -> argparse.ArgumentParser:
    """The top-level parser with one entry per sub-command and no sub-command options (those load with it)."""
    parser = argparse.ArgumentParser(prog="dflash2", description=DESCRIPTION)
    add_top_level_arguments(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_line) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``dflash2 [--help | --version | COMMAND ...]``: the command line is parsed here, torch-free, so a
    sub-command's ``--help`` or a bad option answers at once; a valid one runs in :mod:`dflash2_hf.cli`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command in SUBCOMMANDS:
        args = build_parser(command).parse_args(argv)  # --help and errors exit here
        from dflash2_hf.cli import run_parsed

        return run_parsed(args)
    light_parser().parse_args(argv)  # prints help / version / the error, and exits
    return 2
