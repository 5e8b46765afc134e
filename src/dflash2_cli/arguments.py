"""The options of each ``dflash2`` sub-command, declared without importing torch or transformers (``dflash2 COMMAND
--help`` and a bad option answer at once); what each command does with them is in :mod:`dflash2_hf.cli` (its module's
``run``). ``train``'s options are the fields of its typed configs and need transformers' HfArgumentParser.
"""

from __future__ import annotations

import argparse

from .options import (
    DRAFTER_DTYPES,
    adapter_spec,
    add_cpu_kernels_argument,
    add_device_argument,
    add_drafter_dtype_argument,
    add_dtype_argument,
    dataset_list,
    drafter_spec,
    non_negative,
    non_negative_bound,
    non_negative_int,
    positive_int,
    probability,
    target_spec,
    top_p,
)

DEFAULT_DRAFTER = "dflash2-smollm2-135m-instruct"  # the shipped drafter, found from any folder (dflash2_hf.shipped)
# dflash2 bench's methods (dflash2_hf.bench.runner runs them; its METHODS is this tuple)
BENCH_METHODS = ("plain", "plain_optimized", "prompt_lookup", "builtin_dflash", "dflash2_top1", "dflash2",
                 "dflash2_no_lookup", "dflash2_dynamic", "dflash2_cost", "dflash2_adapter", "dflash2_previous")
OWN_DRAFTER_METHODS = ("dflash2_adapter", "dflash2_previous")  # methods that run another drafter than --drafter
# prepare-data --dtype spellings -> torch dtype names
GENERATION_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                     "float16": "float16", "fp16": "float16"}


def bench_methods(text: str) -> str:
    """argparse type of ``dflash2 bench --methods``: a comma-separated subset of :data:`BENCH_METHODS`."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in BENCH_METHODS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown method(s) {unknown or [text]}; choose from {','.join(BENCH_METHODS)}")
    return text


def default_bench_methods() -> str:
    """``dflash2 bench --methods``' default: every method that needs no second drafter."""
    return ",".join(m for m in BENCH_METHODS if m not in OWN_DRAFTER_METHODS)


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``dflash2 generate`` (run: :mod:`dflash2_hf.cli.generate`)."""
    parser.add_argument("--target", default="smollm2", type=target_spec, help="target alias (smollm2, gemma3-270m) or path / Hub id")
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER, type=drafter_spec,
                        help="drafter folder, Hub id or shipped drafter name, or 'fresh' for an untrained drafter "
                             "sized for the target (its drafts almost never accepted: a plumbing check)")
    parser.add_argument("--prompt", required=True, help="user message (rendered with the target's chat template)")
    parser.add_argument("--adapter", default=None, type=adapter_spec,
                        help="a LoRA adapter folder for --drafter (dflash2 train --lora; the shipped one: "
                             "dflash2-smollm2-135m-instruct-code-lora), merged into the drafter before drafting")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--temperature", type=non_negative, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=top_p, default=None, help="nucleus sampling with --temperature > 0")
    parser.add_argument("--top-k", type=non_negative_int, default=None, help="top-k filter with --temperature > 0")
    parser.add_argument("--no-selector", action="store_true", help="top-1 path instead of the candidate selector")
    parser.add_argument("--confidence-threshold", type=probability, default=0.0,
                        help="dynamic draft length: cut each drafted path after its first draft whose probability "
                             "(selector, or top-k softmax with --no-selector) is below this value "
                             "(drafter.generation_config.assistant_confidence_threshold; default 0 = full blocks). "
                             "Saves verification work where it grows with the block (CPUs)")
    parser.add_argument("--cost-schedule", action="store_true",
                        help="draft length from the measured verification cost curve and the calibrated selector "
                             "probabilities (drafter.generation_config.num_assistant_tokens_schedule='cost'; the curve "
                             "is measured once, ~4 s on a CPU, before the first cycle)")
    add_dtype_argument(parser, "auto")
    add_drafter_dtype_argument(parser, "auto", "auto")
    add_device_argument(parser, "the target and the drafter")
    add_cpu_kernels_argument(parser)
    parser.add_argument("--num-threads", type=positive_int, default=None, help="torch CPU threads (default: torch's default)")
    parser.add_argument("--compare", action="store_true",
                        help="also run plain generate() (after a short warm-up of both) and print the speedup in "
                             "tokens/s and (greedy) whether outputs match; for side-by-side numbers over many prompts "
                             "use dflash2 bench")


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``dflash2 demo`` (run: :mod:`dflash2_hf.cli.demo`)."""
    parser.add_argument("--target", default="smollm2", type=target_spec)
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER, type=drafter_spec,
                        help="folder, Hub id, shipped drafter name, or 'fresh' (untrained: its drafts almost never accepted)")
    parser.add_argument("--num-prompts", type=positive_int, default=3, help="per data set")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--datasets", default="sharegpt,humaneval", type=dataset_list)
    parser.add_argument("--output-dir", default="runs/main", help="where results.json / results.md / plots go")
    add_dtype_argument(parser, "auto")
    add_drafter_dtype_argument(parser, "auto", "auto")
    add_device_argument(parser, "the target and the drafter")
    add_cpu_kernels_argument(parser)
    parser.add_argument("--confidence-threshold", type=probability, default=0.0,
                        help="also runs dflash2 with a confidence-cut draft length: each path cut after its first "
                             "draft whose selector probability is below this value (default 0 = skip that run)")
    parser.add_argument("--no-cost-schedule", action="store_true",
                        help="skip the run whose draft length comes from the measured cost curve")
    parser.add_argument("--num-threads", type=positive_int, default=None,
                        help="torch CPU threads (use 1 on a busy machine: oversubscribed cores make timings noisy)")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``dflash2 bench`` (run: :mod:`dflash2_hf.cli.bench`)."""
    parser.add_argument("--target", default="smollm2", type=target_spec,
                        help="target alias (smollm2, gemma3-270m) or a local transformers folder (default: smollm2)")
    parser.add_argument("--drafter", required=True, type=drafter_spec,
                        help="drafter folder or Hub id, or 'fresh' for an untrained drafter built for the target "
                             "(its drafts almost never accepted: only for trying the harness)")
    parser.add_argument("--adapter", default=None, type=adapter_spec,
                        help="a LoRA adapter folder for --drafter (dflash2 train --lora): adds the method "
                             "dflash2_adapter (drafter + adapter, merged) next to the others, measured in the same run")
    parser.add_argument("--previous-drafter", default=None, metavar="DRAFTER", type=drafter_spec,
                        help="another drafter for the same target (folder or Hub id), e.g. the previous release: adds "
                             "the method dflash2_previous (full blocks, selector on) measured in the same run, so "
                             "tau, per-position acceptance and speedup of both are compared side by side")
    parser.add_argument("--previous-drafter-dtype", default=None, choices=DRAFTER_DTYPES,
                        help="drafting precision of --previous-drafter (default: --drafter-dtype's). Give the same "
                             "folder as --drafter and another precision to compare drafting precisions side by side "
                             "in one run, e.g. --drafter-dtype int8 --previous-drafter-dtype fp32")
    parser.add_argument("--adapter-no-strict", action="store_true",
                        help="load --adapter even if it was trained on other weights of a same-shaped drafter "
                             "(default: refuse)")
    parser.add_argument("--datasets", default="sharegpt,humaneval", type=dataset_list,
                        help="comma-separated: 'sharegpt' (ShareGPT dev records 16000-16999, first human turn), "
                             "'humaneval', or paths of JSONL files with a 'prompt' string or a chat 'messages' list "
                             "per line (default: sharegpt,humaneval)")
    parser.add_argument("--num-prompts", type=positive_int, default=10, help="prompts per data set (default 10)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="new tokens per generation (default 128)")
    parser.add_argument("--max-prompt-tokens", type=non_negative_int, default=1024,
                        help="skip prompts longer than this after the chat template (default 1024; 0 = no limit)")
    add_dtype_argument(parser, "fp32", "target")
    add_drafter_dtype_argument(parser, "auto", "auto, as in demo and generate")
    parser.add_argument("--near-tie-ulps", type=non_negative_bound, default=None,
                        help="greedy in bf16: a divergence from plain greedy is a near-tie when plain's margin there is "
                             "at most this many bf16 ulps of its largest score, else a bug (default "
                             "dflash2_hf.bench.fidelity.NEAR_TIE_ULPS = 8; docs/bench.md)")
    parser.add_argument("--calibrate-fp32", action="store_true",
                        help="greedy with a bf16 target: also run plain greedy with the target in fp32 on the same "
                             "prompts (untimed) and report how often plain bf16 parts from plain fp32 and where")
    parser.add_argument("--temperature", type=non_negative, default=0.0, help="0 = greedy (default); > 0 samples")
    parser.add_argument("--top-p", type=top_p, default=1.0, help="nucleus sampling (default 1.0 = off)")
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="top-k sampling filter (default 0 = off)")
    parser.add_argument("--methods", default=default_bench_methods(), type=bench_methods,
                        help=f"comma-separated subset of {','.join(BENCH_METHODS)} (plain is always run: it is the "
                             "reference of the speedup and of the identity check; --adapter adds dflash2_adapter, "
                             "--previous-drafter dflash2_previous)")
    parser.add_argument("--prompt-lookup-tokens", type=positive_int, default=10,
                        help="prompt_lookup_num_tokens of the prompt_lookup baseline (default 10)")
    parser.add_argument("--confidence-threshold", type=probability, default=0.7,
                        help="assistant_confidence_threshold of the dflash2_dynamic method: each drafted path is cut "
                             "after its first draft whose selector probability is below this value (default 0.7)")
    parser.add_argument("--raw-prompts", action="store_true",
                        help="JSONL 'prompt' strings are fed as raw text instead of one user chat message")
    parser.add_argument("--output-dir", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--num-threads", type=positive_int, default=None, help="torch CPU threads (default: torch's default)")
    add_device_argument(parser, "the target and the drafter")
    add_cpu_kernels_argument(parser)
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generations")
    parser.add_argument("--no-plots", action="store_true", help="do not write the PNG plots")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def add_prepare_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``dflash2 prepare-data`` (run: :mod:`dflash2_hf.cli.prepare_data`)."""
    parser.add_argument("--target", default="smollm2", type=target_spec,
                        help="target alias (smollm2, gemma3-270m) or a local transformers folder (default: smollm2)")
    parser.add_argument("--output-dir", required=True,
                        help="the dataset folder (continued if it already holds data of the same settings)")
    parser.add_argument("--split", default="train", choices=["train", "dev"],
                        help="split the shards belong to (default train; dev: evaluation data, e.g. ShareGPT "
                             "[16000, 17000) or a validation --source)")
    parser.add_argument("--source", default=None,
                        help="a ShareGPT-format JSON array or JSON Lines file (your own conversations: {\"id\", "
                             "\"conversations\": [{\"from\": \"human\"|\"gpt\"|\"system\", \"value\"}]}) instead of the "
                             "packaged ShareGPT; chat-style records {\"messages\": [{\"role\", \"content\"}]} work too; record ids "
                             "are the indexes in the file")
    parser.add_argument("--start", type=non_negative_int, default=None,
                        help="first record (default: the split's first: train 0, dev 16000; with --source 0)")
    parser.add_argument("--stop", type=positive_int, default=None,
                        help="end of the record range, exclusive (default: the split's end: train 16000, dev 17000; "
                             "with --source 16000). Records from 17000 on are held out: never read from here")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--max-new-tokens", type=positive_int, default=256, help="cap per regenerated assistant turn")
    parser.add_argument("--max-prompt-tokens", type=positive_int, default=512,
                        help="records with a longer first prompt are skipped (default 512)")
    parser.add_argument("--max-turns", type=positive_int, default=1, help="assistant turns regenerated per conversation")
    parser.add_argument("--dtype", default="float32", choices=sorted(GENERATION_DTYPES),
                        help="target dtype while generating (default float32: bf16 is faster but its greedy output "
                             "differs from fp32 serving)")
    parser.add_argument("--num-threads", type=positive_int, default=None, help="torch CPU threads")
    parser.add_argument("--shard-size", type=positive_int, default=256,
                        help="conversations per Parquet shard (default 256); a shard is written once complete, so an "
                             "interruption loses at most the one being filled")
    parser.add_argument("--sort-window", type=positive_int, default=8,
                        help="batches' worth of records read ahead and sorted by length (less padding)")
    parser.add_argument("--max-batches", type=positive_int, default=None, help="stop after N batches (benchmarking)")
    parser.add_argument("--cache-implementation", default="static", choices=["static", "dynamic"],
                        help="KV cache used by generate (static: default, ~1.8x faster on CPU, same tokens)")
    parser.add_argument("--only-code", action="store_true",
                        help="keep only conversations whose first human turn or its original answer holds a fenced "
                             "code block (a code-domain set, e.g. for a LoRA adapter); others are skipped as "
                             "filtered_out")
    parser.add_argument("--skip-records-in", action="append", default=[], metavar="DATASET",
                        help="another dataset folder of the same settings (e.g. a committed one): its records, kept or "
                             "skipped, are not regenerated again (repeatable)")
    parser.add_argument("--original-answers", action="store_true",
                        help="keep ShareGPT's own assistant turns instead of regenerating them (no generation: seconds "
                             "for thousands of records); conversations are cut at --max-prompt-tokens tokens. Train on "
                             "them with `dflash2 train --target-labels` (labels = the target's own greedy tokens)")
    parser.add_argument("--note", default=None, help="free text stored in the folder's provenance and card")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    add_device_argument(parser, "the target's regeneration")


def add_export_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``dflash2 export-data`` (run: :mod:`dflash2_hf.cli.export_data`)."""
    parser.add_argument("--data", required=True, help="a JSONL folder of an older `dflash2 prepare-data`")
    parser.add_argument("--output-dir", required=True, help="the dataset folder (created if missing)")
    parser.add_argument("--split", default="train", choices=["train", "dev"],
                        help="train: ShareGPT [0, 16000); dev: [16000, 17000)")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``dflash2 train`` (run: :mod:`dflash2_hf.cli.train`)."""
    from dflash2_hf.training.parser import add_train_arguments as add  # HfArgumentParser: imports transformers

    add(parser)


# sub-command -> the function that declares its options
ADD_ARGUMENTS = {"generate": add_generate_arguments, "demo": add_demo_arguments, "bench": add_bench_arguments,
                 "prepare-data": add_prepare_data_arguments, "export-data": add_export_data_arguments,
                 "train": add_train_arguments}
