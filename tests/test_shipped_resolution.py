"""The shipped drafter resolves from any working directory; a missing local-looking path fails at once (issue 40)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dflash2_hf import DFlash2DraftModel, shipped_drafter_path
from dflash2_hf.errors import ShippedDrafterNotFoundError
from dflash2_hf.hub import is_local_path
from dflash2_hf.shipped import MODEL_CARDS_ENV, SHIPPED_ADAPTER, SHIPPED_DRAFTER, resolve_name_or_path
from conftest import make_drafter, make_target

REPO_CARDS = Path(__file__).resolve().parents[1] / "model_cards"


def test_shipped_path_is_the_repository_folder():
    assert Path(shipped_drafter_path()) == REPO_CARDS / SHIPPED_DRAFTER
    assert Path(shipped_drafter_path(SHIPPED_ADAPTER)) == REPO_CARDS / SHIPPED_ADAPTER
    with pytest.raises(ValueError, match="not a shipped drafter"):
        shipped_drafter_path("dflash2-llama-70b")


@pytest.mark.parametrize("name", [SHIPPED_DRAFTER, f"model_cards/{SHIPPED_DRAFTER}", f"./model_cards/{SHIPPED_DRAFTER}/"])
def test_shipped_drafter_loads_from_another_folder(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    drafter = DFlash2DraftModel.from_pretrained(name)
    assert drafter.config.block_size == 8 and drafter.config.hidden_size == 576


def test_an_existing_relative_folder_wins_over_the_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_drafter(make_target("llama")).save_pretrained(SHIPPED_DRAFTER)  # a folder of that name here
    assert resolve_name_or_path(SHIPPED_DRAFTER) == SHIPPED_DRAFTER
    assert DFlash2DraftModel.from_pretrained(SHIPPED_DRAFTER).config.hidden_size == 64


@pytest.mark.parametrize("path", ["./missing", "../missing/drafter", "/no/such/drafter", "~/no-such-drafter",
                                  "runs/a/b", "a\\b", "runs/"])
def test_missing_local_looking_paths_fail_at_once(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # no offline shortcut: the check itself must not reach out
    assert is_local_path(path)
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError, match="No drafter folder at"):
        DFlash2DraftModel.from_pretrained(path)
    assert time.perf_counter() - start < 1.0


def test_hub_ids_stay_hub_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for hub_id in ("org/name", "gpt2", "my-org/dflash2-smollm2-135m-instruct"):
        assert not is_local_path(hub_id) and resolve_name_or_path(hub_id) == hub_id


def test_without_model_cards_the_error_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(MODEL_CARDS_ENV, str(tmp_path / "empty"))
    with pytest.raises(ShippedDrafterNotFoundError, match=f"pip install -e .*{MODEL_CARDS_ENV}") as err:
        DFlash2DraftModel.from_pretrained(SHIPPED_DRAFTER)
    assert isinstance(err.value, FileNotFoundError)


def test_model_cards_env_points_elsewhere(tmp_path, monkeypatch):
    make_drafter(make_target("llama")).save_pretrained(tmp_path / SHIPPED_DRAFTER)
    monkeypatch.setenv(MODEL_CARDS_ENV, str(tmp_path))
    assert shipped_drafter_path() == str(tmp_path / SHIPPED_DRAFTER)


def test_cli_default_drafter_resolves_from_any_folder(tmp_path, monkeypatch):
    from dflash2_hf.cli import build_parser

    monkeypatch.chdir(tmp_path)
    for command in (["demo"], ["generate", "--prompt", "hi"]):
        args = build_parser().parse_args(command)
        assert Path(resolve_name_or_path(args.drafter)) == REPO_CARDS / SHIPPED_DRAFTER


def test_non_editable_install_says_what_to_do(tmp_path, monkeypatch):
    from dflash2_hf import shipped

    monkeypatch.delenv(MODEL_CARDS_ENV, raising=False)
    site = tmp_path / "lib" / "python3.11" / "site-packages" / "dflash2_hf"
    site.mkdir(parents=True)
    monkeypatch.setattr(shipped, "__file__", str(site / "shipped.py"))  # as installed without the repository
    assert shipped.model_cards_dir() is None
    with pytest.raises(ShippedDrafterNotFoundError, match="non-editable install.*pip install -e"):
        shipped_drafter_path()


def test_a_near_miss_of_a_shipped_name_is_refused_at_once():
    import time

    from dflash2_hf import DFlash2DraftModel

    start = time.perf_counter()
    with pytest.raises(ValueError, match="did you mean 'dflash2-smollm2-135m-instruct'"):
        DFlash2DraftModel.from_pretrained("dflash2-smollm2")
    assert time.perf_counter() - start < 5  # no Hub lookup, no retries


@pytest.mark.parametrize("argv", [["generate", "--drafter", "someorg/some-drafter", "--prompt", "hi"],
                                  ["bench", "--drafter", "fresh", "--previous-drafter", "someorg/some-drafter",
                                   "--output-dir", "o"]])
def test_a_hub_id_without_the_hub_fails_before_the_target_loads(tmp_path, monkeypatch, capsys, argv):
    import dflash2_hf.hub
    import dflash2_hf.targets
    from dflash2_hf.cli import main

    monkeypatch.chdir(tmp_path)
    probes = []
    monkeypatch.setattr(dflash2_hf.hub, "hub_unreachable_reason", lambda *a: probes.append(1) or "no network (test)")
    monkeypatch.setattr(dflash2_hf.targets, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("'someorg/some-drafter' is not a local folder and the Hugging Face Hub is unreachable (no "
                        f"network (test)): pass a local drafter folder or the shipped name '{SHIPPED_DRAFTER}'"), err
    assert probes == [1]  # one probe, however many ids


def test_hub_probe_is_skipped_for_local_and_shipped_drafters_and_honours_offline(tmp_path, monkeypatch):
    import dflash2_hf.hub
    from dflash2_hf.hub import check_hub_ids_reachable, hub_unreachable_reason

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    monkeypatch.setattr(dflash2_hf.hub, "hub_unreachable_reason", lambda *a: pytest.fail("probed"))
    check_hub_ids_reachable(SHIPPED_DRAFTER, "mine", "fresh", None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub_unreachable_reason() == "HF_HUB_OFFLINE is set"  # the real probe, answered without the network
