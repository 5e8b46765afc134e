"""Hugging Face Hub integration: model cards for drafters and ``push_to_hub``.

Loading from the Hub needs nothing of ours: ``DFlash2DraftModel.from_pretrained("org/name")`` resolves through
``huggingface_hub`` (and offline, with ``HF_HUB_OFFLINE=1``, from a populated cache). Pushing uploads the drafter
folder with a complete model card: metadata (base model, library, datasets, license, tags), the recipe, and the
measured numbers. The card of a shipped folder (its ``README.md``) is reused as is, so numbers measured for it travel
with it; a drafter without one gets a card built from its config that says no numbers were measured.

Cards name their repos ``YOUR_ORG/<name>`` (:data:`HUB_ORG_PLACEHOLDER`) until they are pushed:
:func:`push_drafter_to_hub` writes the repo it uploads to in their place. Upload of the shipped drafter
folder from the command line (``huggingface_hub`` CLI) after filling in the org yourself::

    sed -i 's#YOUR_ORG/#my-org/#g' model_cards/dflash2-smollm2-135m-instruct/README.md
    hf upload my-org/dflash2-smollm2-135m-instruct model_cards/dflash2-smollm2-135m-instruct .

LoRA adapters (:mod:`dflash2_hf.lora`) get their own card (:func:`build_adapter_card`, metadata ``library_name:
peft`` and ``base_model`` = the drafter's Hub id) and are uploaded the same way, or with ``PeftModel.push_to_hub``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import HfApi, ModelCard, ModelCardData

from .quantization import refuse_int8

CARD_TAGS = ["dflash2", "speculative-decoding", "drafter", "block-diffusion"]
# Stands for the Hub organisation in cards built before the repo exists; replaced on push (fill_hub_ids).
HUB_ORG_PLACEHOLDER = "YOUR_ORG"


def is_local_path(name_or_path: str | os.PathLike) -> bool:
    """True when ``name_or_path`` names a local folder rather than a Hub id: it exists, starts with ``.``, ``/`` or
    ``~``, its first component is an existing folder (``runs/x`` with a ``runs/`` folder here), or it is no valid Hub
    id (``a/b/c``, a trailing ``/``, a backslash). A missing local folder can then fail at once with a clear message
    instead of a Hub lookup (and its retries when offline)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    path = os.fspath(name_or_path)
    first = path.split("/")[0]
    if os.path.exists(path) or path.startswith((".", "/", "~")) or (first != path and os.path.isdir(first)):
        return True
    try:
        validate_repo_id(path)
    except HFValidationError:
        return True
    return False


HUB_PROBE_TIMEOUT_S = 3.0  # one TCP connection to the Hub endpoint, instead of a from_pretrained retry loop per file


def hub_unreachable_reason(timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """None when the Hugging Face Hub (``HF_ENDPOINT``, default huggingface.co) accepts a connection within
    ``timeout`` seconds, else why not (``HF_HUB_OFFLINE`` set, or the connection's error). One quick probe; never
    raises."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (80 if url.scheme == "http" else 443)), timeout).close()
    except OSError as err:
        return f"{url.hostname}: {err or type(err).__name__}"
    return None


def check_hub_ids_reachable(*names_or_paths: str | os.PathLike | None) -> None:
    """Fails fast, before any model loads, when one of ``names_or_paths`` (drafters or adapters; None and
    ``"fresh"`` skipped) is a Hub id that is neither a local folder, a shipped name, nor in the local Hub cache
    while the Hub cannot be reached: probed once (:func:`hub_unreachable_reason`), however many ids.

    Raises:
        HubUnreachableError: the first such id, what to pass instead, and why the Hub is out of reach.
    """
    from huggingface_hub import try_to_load_from_cache

    from .errors import HubUnreachableError
    from .shipped import SHIPPED_DRAFTER, resolve_name_or_path

    remote = [os.fspath(n) for n in names_or_paths if n not in (None, "fresh")
              and not is_local_path(resolve_name_or_path(n))]
    remote = [n for n in remote if not isinstance(try_to_load_from_cache(n, "config.json"), str)
              and not isinstance(try_to_load_from_cache(n, "adapter_config.json"), str)]
    reason = hub_unreachable_reason() if remote else None
    if reason:
        raise HubUnreachableError(f"{remote[0]!r} is not a local folder and the Hugging Face Hub is unreachable "
                                  f"({reason}): pass a local drafter folder or the shipped name {SHIPPED_DRAFTER!r}")


_TEMPLATE = """
# {title}

A **DFlash2 drafter** for [{base_model}](https://huggingface.co/{base_model}): a {layers}-layer block-diffusion
transformer that drafts {drafts} tokens per target forward pass from the target's hidden states (layers
{layer_ids}), with {extras}. Use it with [`dflash2-hf`](https://pypi.org/project/dflash2-hf/):

```python
import dflash2_hf
from dflash2_hf import DFlash2DraftModel
draft = DFlash2DraftModel.from_pretrained("{repo_id}")
out = target.generate(input_ids, assistant_model=draft, max_new_tokens=128)
print(draft.generation_stats.tau)
```

Outputs are identical to the target's own greedy decoding (sampling follows the target's distribution exactly).

## Training recipe
{recipe}

## Measured results
{results}
"""


def build_model_card(
    drafter,
    *,
    base_model: str,
    repo_id: str = f"{HUB_ORG_PLACEHOLDER}/dflash2-drafter",
    datasets: list[str] | None = None,
    license: str = "apache-2.0",
    recipe: str = "Not recorded.",
    results: str = "No numbers were measured for this drafter yet: run `dflash2 bench` and add them.",
) -> ModelCard:
    """A model card for ``drafter``: YAML metadata + description, usage, recipe and results.

    Args:
        base_model: Hub id of the target the drafter serves (card metadata ``base_model``).
        repo_id: where the drafter will live (used in the usage snippet).
        datasets: Hub ids of the training data sets.
        recipe, results: Markdown; ``results`` must hold numbers you measured, with the command that produced them.
    """
    c = drafter.config
    extras = []
    if c.use_local_conv:
        extras.append(f"local convolutions (kernel {c.conv_kernel_size}, groups of {c.conv_group_size})")
    if c.use_candidate_selector:
        extras.append(f"a parallel path selector (top-{c.selector_top_k}, rank {c.selector_rank})")
    text = _TEMPLATE.format(
        title=f"DFlash2 drafter for {base_model.split('/')[-1]}",
        base_model=base_model,
        layers=c.num_hidden_layers,
        drafts=c.block_size - 1,
        layer_ids=list(c.target_layer_ids),
        extras=" and ".join(extras) or "neither local convolution nor selector (DFlash v1)",
        repo_id=repo_id,
        recipe=recipe,
        results=results,
    )
    return _compose_card(text, base_model, "transformers", datasets, license, CARD_TAGS)


_ADAPTER_TEMPLATE = """
# {title}

A **LoRA adapter** (`peft`) for the DFlash2 drafter [{base_drafter}](https://huggingface.co/{base_drafter}), which
drafts for [{target}](https://huggingface.co/{target}). {purpose} Only the adapter is stored ({modules}, rank {r});
load it on top of the base drafter with [`dflash2-hf`](https://pypi.org/project/dflash2-hf/):

```python
import dflash2_hf
from dflash2_hf import DFlash2DraftModel
from dflash2_hf.lora import load_adapter
draft = DFlash2DraftModel.from_pretrained("{base_drafter}")
draft = load_adapter(draft, "{repo_id}").merge_and_unload()   # or keep it unmerged
out = target.generate(input_ids, assistant_model=draft, max_new_tokens=128)
```

`load_adapter` checks `dflash2_adapter.json` (base drafter shapes and a digest of its weights) and refuses an adapter
trained for another drafter. Outputs stay identical to the target's own greedy decoding: only the drafts change.

## Training recipe
{recipe}

## Measured results
{results}
"""


def build_adapter_card(
    peft_config,
    *,
    base_drafter: str,
    target: str,
    repo_id: str = f"{HUB_ORG_PLACEHOLDER}/dflash2-drafter-lora",
    purpose: str = "",
    datasets: list[str] | None = None,
    license: str = "apache-2.0",
    recipe: str = "Not recorded.",
    results: str = "No numbers were measured for this adapter yet: run `dflash2 bench --adapter` and add them.",
) -> ModelCard:
    """A model card for a drafter's LoRA adapter: YAML metadata (``library_name: peft``, ``base_model`` = the base
    drafter's Hub id, datasets, license, tags) + usage, recipe and results.

    Args:
        peft_config: the adapter's ``peft.LoraConfig`` (rank and target modules are printed).
        base_drafter: Hub id of the drafter the adapter was trained on.
        target: Hub id of the target that drafter serves.
        purpose: one sentence on what the adapter is for (e.g. the domain).
        recipe, results: Markdown; ``results`` must hold numbers you measured, with the command that produced them.
    """
    modules = sorted(peft_config.target_modules) if peft_config.target_modules else []
    described = "LoRA on " + ", ".join(f"`{m}`" for m in modules) if modules else "LoRA"
    if peft_config.modules_to_save:
        full = ", ".join(f"`{m}`" for m in sorted(peft_config.modules_to_save))
        described += f" plus fully trained copies of {full} (peft `modules_to_save`)"
    text = _ADAPTER_TEMPLATE.format(
        title=f"LoRA adapter for {base_drafter.split('/')[-1]}",
        base_drafter=base_drafter,
        target=target,
        purpose=purpose,
        modules=described,
        r=peft_config.r,
        repo_id=repo_id,
        recipe=recipe,
        results=results,
    )
    return _compose_card(text, base_drafter, "peft", datasets, license, CARD_TAGS + ["lora", "peft"])


def _compose_card(text: str, base_model: str, library_name: str, datasets: list[str] | None, license: str,
                  tags: list[str]) -> ModelCard:
    """YAML metadata (``ModelCardData``) + Markdown body as one ``ModelCard``."""
    data = ModelCardData(base_model=base_model, library_name=library_name, datasets=datasets or None, license=license,
                         tags=tags, pipeline_tag="text-generation")
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{text}")


# options of earlier releases that took no value -> the value today's spelling of them takes ("" = still none)
_OLD_FLAG_VALUES = {"--no-progress": "true", "--resume": "last", "--selector-no-detach": ""}


def current_spelling(argv: list[str]) -> list[str]:
    """A recorded ``dflash2 COMMAND ...`` argv (``argv[0]`` the program) with every renamed option in today's
    spelling, so the command a card shows runs as written: an output folder's ``--out`` / ``--output`` ->
    ``--output-dir`` (:data:`dflash2_cli.options.OLD_OUTPUT_SPELLINGS`) and train's options of
    :data:`dflash2_hf.training.parser.RENAMED` (``--lr`` -> ``--learning-rate``, ``--no-progress`` ->
    ``--disable-tqdm true``, ...); values are kept."""
    from dflash2_cli.options import OLD_OUTPUT_SPELLINGS

    renamed = dict.fromkeys(OLD_OUTPUT_SPELLINGS, "--output-dir")
    if argv[1:2] == ["train"]:
        from .training.parser import RENAMED

        renamed.update({old: new.split()[0] for old, new in RENAMED.items()})  # "--warmup-steps (a ratio ...)"
    out = list(argv[:2])
    for arg in argv[2:]:
        name, eq, value = arg.partition("=")
        if name not in renamed:
            out.append(arg)
        elif eq:
            out.append(f"{renamed[name]}={value}")
        else:  # the value follows unchanged, or the old flag gets the value its new spelling takes
            flag_value = _OLD_FLAG_VALUES.get(name, "")
            out += [renamed[name], flag_value] if flag_value else [renamed[name]]
    return out


def bench_results_section(results_md: str | os.PathLike | None, missing: str = "No benchmark was run for this "
                          "folder.") -> str:
    """Card text of a ``dflash2 bench`` run: the command that produced it (from the ``results.json`` next to
    ``results_md``) and its ``results.md`` table, verbatim, so a card's numbers are never typed in by hand."""
    if not results_md:
        return missing
    bench_json = Path(results_md).with_name("results.json")
    command = json.loads(bench_json.read_text())["meta"].get("command") if bench_json.exists() else None
    command = command.replace("dflash2 bench bench", "dflash2 bench") if command else None  # runs before the fix
    command = " ".join(current_spelling(command.split(" "))) if command else None
    # the report's own title becomes a sub-heading of the card's "Measured results" section
    table = re.sub(r"^# ", "### ", Path(results_md).read_text(), count=1, flags=re.MULTILINE)
    return (f"Measured with `{command}` (this repository, on the CPU machine described below).\n\n"
            if command else "") + table


def copy_bench_files(results_md: str | os.PathLike | None, folder: str | os.PathLike) -> None:
    """Ships a ``dflash2 bench`` run's raw files with a card: its ``results.json`` and plots, into ``folder/bench/``
    (replacing what an earlier release left there), so every number in the card can be recomputed."""
    if not results_md:
        return
    dest = Path(folder) / "bench"
    if dest.is_dir():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in [Path(results_md).with_name("results.json"), *Path(results_md).parent.glob("*.png")]:
        shutil.copy2(f, dest / f.name)


def resolve_model_card(drafter, model_card: ModelCard | str | os.PathLike | None) -> ModelCard:
    """The card to publish: the one given, else the ``README.md`` of the folder the drafter was loaded from."""
    if isinstance(model_card, ModelCard):
        return model_card
    if model_card is not None:
        return ModelCard.load(model_card) if Path(model_card).exists() else ModelCard(str(model_card))
    folder = str(getattr(drafter, "name_or_path", "") or "")
    if folder and Path(folder).is_dir() and (Path(folder) / "README.md").is_file():
        return ModelCard.load(Path(folder) / "README.md")
    raise ValueError(
        "No model card for this drafter: pass model_card=build_model_card(drafter, base_model=..., datasets=..., "
        "recipe=..., results=...) with the numbers you measured, or push a folder that has a README.md."
    )


def fill_hub_ids(card: ModelCard, repo_id: str) -> ModelCard:
    """``card`` for a drafter pushed to ``repo_id``: its own ``from_pretrained("YOUR_ORG/<name>")`` becomes
    ``repo_id``, every other ``YOUR_ORG/`` (e.g. a base drafter's id) becomes the org of ``repo_id``."""
    text = re.sub(rf'(DFlash2DraftModel\.from_pretrained\()"{HUB_ORG_PLACEHOLDER}/[^"]*"', rf'\1"{repo_id}"', str(card))
    return ModelCard(text.replace(f"{HUB_ORG_PLACEHOLDER}/", f"{repo_id.split('/')[0]}/"))


def push_drafter_to_hub(
    drafter,
    repo_id: str,
    *,
    model_card: ModelCard | str | os.PathLike | None = None,
    commit_message: str = "Upload DFlash2 drafter",
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
):
    """Creates ``repo_id`` if needed and uploads weights, config, the model card (its ``YOUR_ORG/`` placeholders
    filled in by :func:`fill_hub_ids`) and, for a drafter loaded from a folder with one, its ``bench/`` folder in one
    commit.

    Returns:
        the ``huggingface_hub`` ``CommitInfo``.

    Raises:
        ValueError: no model card is available (see :func:`resolve_model_card`).
        UnsupportedGenerationError: the drafter is an int8 drafting copy (nothing is created on the Hub).
    """
    refuse_int8(drafter, "pushed to the Hub")
    card = resolve_model_card(drafter, model_card)
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    card = fill_hub_ids(card, repo_id)
    with tempfile.TemporaryDirectory() as tmp:
        drafter.save_pretrained(tmp)
        card.save(os.path.join(tmp, "README.md"))
        bench = Path(str(getattr(drafter, "name_or_path", "") or ""), "bench")
        if bench.is_dir():  # the raw measurement the card's numbers come from (see examples/ship_drafter.py)
            shutil.copytree(bench, os.path.join(tmp, "bench"))
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=tmp,
            commit_message=commit_message,
            revision=revision,
            create_pr=create_pr,
        )
