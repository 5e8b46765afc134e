"""Hub round trip: model card on push, loading a Hub id offline from a populated cache."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from dflash2_hf import DFlash2DraftModel
from dflash2_hf.hub import build_model_card
from conftest import make_drafter, randomize_selector


def _card(drafter):
    return build_model_card(
        drafter, base_model="HuggingFaceTB/SmolLM2-135M-Instruct", repo_id="org/tiny-drafter",
        datasets=["anon8231489123/ShareGPT_Vicuna_unfiltered"], recipe="5 steps on nothing.",
        results="| tau | 1.00 |  (measured with `dflash2 bench ...`)",
    )


def test_model_card_metadata(targets):
    card = _card(make_drafter(targets["llama"]))
    meta = yaml.safe_load(str(card).split("---")[1])
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert meta["library_name"] == "transformers" and meta["license"] == "apache-2.0"
    assert meta["datasets"] == ["anon8231489123/ShareGPT_Vicuna_unfiltered"]
    assert "dflash2" in meta["tags"]
    assert "5 steps on nothing." in card.text and "| tau | 1.00 |" in card.text


def test_adapter_card_metadata():
    from dflash2_hf.hub import build_adapter_card
    from dflash2_hf.lora import lora_config

    card = build_adapter_card(lora_config(r=8), base_drafter="org/drafter", target="HuggingFaceTB/SmolLM2-135M-Instruct",
                              repo_id="org/drafter-code-lora", purpose="Adapts it to code.",
                              datasets=["anon8231489123/ShareGPT_Vicuna_unfiltered"], recipe="r.", results="| tau | 2 |")
    meta = yaml.safe_load(str(card).split("---")[1])
    assert meta["base_model"] == "org/drafter" and meta["library_name"] == "peft"
    assert {"lora", "dflash2"} <= set(meta["tags"]) and meta["license"] == "apache-2.0"
    assert 'load_adapter(draft, "org/drafter-code-lora")' in card.text
    assert "rank 8" in card.text and "`q_proj`" in card.text and "| tau | 2 |" in card.text
    assert "modules_to_save" not in card.text
    full = build_adapter_card(lora_config(r=8, modules_to_save=["mlp_conv", "hidden_norm"]), base_drafter="org/drafter",
                              target="t/t", repo_id="org/x", purpose=".", recipe="r.", results="-")
    assert "fully trained copies of `hidden_norm`, `mlp_conv`" in full.text


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """No network here: HfApi is replaced by a recorder that keeps a copy of every uploaded folder (newest last)."""
    uploads = []

    class FakeApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, private=None, exist_ok=False):
            return type("Url", (), {"repo_id": repo_id})()

        def upload_folder(self, repo_id, folder_path, **kw):
            uploads.append(Path(shutil.copytree(folder_path, tmp_path / f"upload-{len(uploads)}")))
            return "commit"

    monkeypatch.setattr("dflash2_hf.hub.HfApi", FakeApi)
    return uploads


def test_push_to_hub_uploads_weights_config_and_card(targets, fake_hub):
    drafter = randomize_selector(make_drafter(targets["llama"]))
    assert drafter.push_to_hub("org/tiny-drafter", model_card=_card(drafter)) == "commit"
    assert {"README.md", "config.json", "model.safetensors"} <= set(os.listdir(fake_hub[-1]))
    loaded = DFlash2DraftModel.from_pretrained(fake_hub[-1])
    torch.testing.assert_close(loaded.candidate_selector.successor_codebook, drafter.candidate_selector.successor_codebook)
    # a drafter loaded from a folder with a README reuses that card
    loaded.push_to_hub("org/again")
    assert "| tau | 1.00 |" in (fake_hub[-1] / "README.md").read_text()
    # a card built before the repo existed names it YOUR_ORG/<name>; the push writes the real id in
    card = build_model_card(drafter, base_model="HuggingFaceTB/SmolLM2-135M-Instruct", results="| tau | 1.00 |")
    card = type(card)(str(card) + '\nBase: [YOUR_ORG/base-drafter](https://huggingface.co/YOUR_ORG/base-drafter)\n')
    assert 'from_pretrained("YOUR_ORG/dflash2-drafter")' in str(card)
    drafter.push_to_hub("my-org/tiny", model_card=card)
    pushed = (fake_hub[-1] / "README.md").read_text()
    assert 'from_pretrained("my-org/tiny")' in pushed and "YOUR_ORG" not in pushed
    assert "[my-org/base-drafter](https://huggingface.co/my-org/base-drafter)" in pushed


def test_push_uploads_the_bench_folder_of_a_shipped_drafter(targets, fake_hub, tmp_path):
    """The shipped card cites its bench/ raw results: a push of a drafter loaded from that folder carries them."""
    drafter = make_drafter(targets["llama"])
    drafter.save_pretrained(tmp_path / "shipped")
    _card(drafter).save(tmp_path / "shipped" / "README.md")
    (tmp_path / "shipped" / "bench").mkdir()
    (tmp_path / "shipped" / "bench" / "results.json").write_text("{}")
    DFlash2DraftModel.from_pretrained(tmp_path / "shipped").push_to_hub("org/x")
    assert (fake_hub[-1] / "bench" / "results.json").read_text() == "{}"


def test_push_without_card_explains_what_to_do(targets):
    with pytest.raises(ValueError, match="build_model_card"):
        make_drafter(targets["llama"]).push_to_hub("org/x")


def _cached_hub_snapshot(tmp_path, repo_id: str) -> Path:
    """The snapshot folder of ``repo_id`` in a huggingface_hub cache under ``tmp_path / "hub"`` (write files there)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def _run_offline(tmp_path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def test_hub_id_resolves_offline_from_populated_cache(targets, tmp_path):
    """from_pretrained('org/name') goes through huggingface_hub's cache resolution with HF_HUB_OFFLINE=1."""
    drafter = randomize_selector(make_drafter(targets["qwen3"]))
    drafter.save_pretrained(_cached_hub_snapshot(tmp_path, "dflash2-test/tiny-drafter"))
    expected = drafter.candidate_selector.successor_codebook.sum().item()
    result = _run_offline(tmp_path, f"""
        import dflash2_hf
        from transformers import AutoModel
        from dflash2_hf import DFlash2DraftModel
        a = DFlash2DraftModel.from_pretrained("dflash2-test/tiny-drafter")
        b = AutoModel.from_pretrained("dflash2-test/tiny-drafter")
        assert type(b).__name__ == "DFlash2DraftModel"
        s = a.candidate_selector.successor_codebook.sum().item()
        assert abs(s - ({expected})) < 1e-3, s
        print("resolved", a.name_or_path)
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "resolved dflash2-test/tiny-drafter" in result.stdout


def test_hub_adapter_resolves_offline_from_populated_cache(targets, tmp_path):
    """load_adapter(drafter, 'org/name') checks and loads an adapter from the Hub cache (HF_HUB_OFFLINE=1)."""
    from dflash2_hf.lora import add_lora, lora_config, save_adapter

    drafter = make_drafter(targets["qwen3"])
    drafter.save_pretrained(tmp_path / "base")
    save_adapter(add_lora(DFlash2DraftModel.from_pretrained(tmp_path / "base"), lora_config(r=4)),
                 _cached_hub_snapshot(tmp_path, "dflash2-test/tiny-adapter"))
    result = _run_offline(tmp_path, f"""
        from dflash2_hf import DFlash2DraftModel
        from dflash2_hf.lora import load_adapter
        model = load_adapter(DFlash2DraftModel.from_pretrained({str(tmp_path / "base")!r}), "dflash2-test/tiny-adapter")
        print("adapter", type(model).__name__)
        try:
            load_adapter(DFlash2DraftModel.from_pretrained({str(tmp_path / "base")!r}), "dflash2-test/not-cached")
        except FileNotFoundError as err:
            print("refused:", err)
    """)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "adapter PeftModel" in result.stdout and "refused: no LoRA adapter at 'dflash2-test/not-cached'" in result.stdout


def test_bench_results_section_quotes_the_command_and_table(tmp_path):
    import json

    from dflash2_hf.hub import bench_results_section

    (tmp_path / "results.md").write_text("# DFlash2 benchmark\n\n| tau | 1.5 |\n")
    (tmp_path / "results.json").write_text(json.dumps({"meta": {"command": "dflash2 bench bench --output-dir x"}}))
    text = bench_results_section(tmp_path / "results.md")
    assert text.startswith("Measured with `dflash2 bench --output-dir x`") and text.endswith("| tau | 1.5 |\n")
    assert "\n### DFlash2 benchmark\n" in text and "\n# " not in text  # a sub-heading of the card's results section
    assert bench_results_section(None) == "No benchmark was run for this folder."


def test_copy_bench_files_replaces_an_earlier_release(tmp_path):
    from dflash2_hf.hub import copy_bench_files

    run = tmp_path / "bench-run"
    run.mkdir()
    for name in ("results.md", "results.json", "speedup.png"):
        (run / name).write_text(name)
    card = tmp_path / "card"
    (card / "bench" / "old-machine").mkdir(parents=True)
    (card / "bench" / "results.json").write_text("old")
    copy_bench_files(run / "results.md", card)
    assert sorted(p.name for p in (card / "bench").iterdir()) == ["results.json", "speedup.png"]
    assert (card / "bench" / "results.json").read_text() == "results.json"
    copy_bench_files(None, card)  # no bench run: the folder stays as it is
    assert (card / "bench" / "speedup.png").exists()
