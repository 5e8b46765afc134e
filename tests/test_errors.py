"""Bad input gets a clear error that names the problem and the fix."""

from __future__ import annotations

import pytest
import torch

from dflash2_hf import (
    DFlash2Config,
    DrafterTargetMismatchError,
    UnsupportedGenerationError,
    UnsupportedTransformersVersionError,
)
from dflash2_hf.generation import routing
from conftest import make_drafter, make_target

IDS = torch.tensor([[7, 8, 9, 10]])


def test_drafter_for_another_hidden_size(targets):
    drafter = make_drafter(make_target("llama", hidden_size=32))
    with pytest.raises(DrafterTargetMismatchError, match="hidden size 64 != drafter's target_hidden_size 32.*from_target"):
        targets["llama"].generate(IDS, assistant_model=drafter, max_new_tokens=4)


def test_drafter_for_another_vocabulary(targets):
    drafter = make_drafter(make_target("llama", vocab_size=128))
    # our check runs before transformers' "different tokenizers" check, so the message names the real problem
    with pytest.raises(DrafterTargetMismatchError, match="vocabulary 96 != drafter's vocab_size 128"):
        targets["llama"].generate(IDS, assistant_model=drafter, max_new_tokens=4)
    with pytest.raises(DrafterTargetMismatchError, match="vocabulary 96 != drafter's vocab_size 128"):
        drafter.check_target(targets["llama"])


def test_drafter_for_deeper_target(targets):
    drafter = make_drafter(make_target("llama", num_hidden_layers=12))
    assert max(drafter.config.target_layer_ids) >= 6
    with pytest.raises(DrafterTargetMismatchError, match="6 layers, drafter expects num_target_layers=12"):
        targets["llama"].generate(IDS, assistant_model=drafter, max_new_tokens=4)


def test_layer_ids_out_of_range_in_config():
    with pytest.raises(Exception, match=r"target_layer_ids \[7\] are outside the target's layers \[0, 6\)"):
        DFlash2Config(num_target_layers=6, target_layer_ids=[1, 7])


def test_mask_token_outside_vocabulary():
    with pytest.raises(Exception, match="mask_token_id=500 is outside the target vocabulary"):
        DFlash2Config(vocab_size=96, mask_token_id=500)


def test_batch_size_above_one(targets):
    target = targets["llama"]
    drafter = make_drafter(target)
    batch = torch.tensor([[7, 8, 9], [10, 11, 12]])
    with pytest.raises((UnsupportedGenerationError, ValueError), match="batch"):
        target.generate(batch, assistant_model=drafter, max_new_tokens=4, pad_token_id=0)


def test_batch_size_above_one_on_our_loop_directly(targets):
    from dflash2_hf.generation.inputs import validate

    with pytest.raises(UnsupportedGenerationError, match="batch size 1.*once per prompt"):
        validate(targets["llama"], torch.zeros(2, 3, dtype=torch.long), targets["llama"].generation_config, False, {})


def test_untested_transformers_version(monkeypatch, targets):
    monkeypatch.delenv(routing.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(UnsupportedTransformersVersionError, match=r"tested with transformers >=5.23.0,<5.25.0; found 5.30.0.*pip install"):
        routing.check_transformers_version("5.30.0")
    with pytest.raises(UnsupportedTransformersVersionError, match="found 5.22.2"):
        routing.check_transformers_version("5.22.2")
    routing.check_transformers_version("5.23.0")
    routing.check_transformers_version("5.24.0")
    monkeypatch.setenv(routing.ALLOW_UNTESTED_ENV, "1")
    routing.check_transformers_version("5.30.0")  # the documented escape hatch
    # and generate() itself refuses when the installed version is outside the range
    monkeypatch.delenv(routing.ALLOW_UNTESTED_ENV)
    monkeypatch.setattr(routing.transformers, "__version__", "5.40.0")
    target = targets["llama"]
    with pytest.raises(UnsupportedTransformersVersionError):
        target.generate(IDS, assistant_model=make_drafter(target), max_new_tokens=3)


def test_output_attentions_refused(targets):
    target = targets["llama"]
    with pytest.raises(UnsupportedGenerationError, match="output_attentions"):
        target.generate(IDS, assistant_model=make_drafter(target), max_new_tokens=3, return_dict_in_generate=True,
                        output_hidden_states=True)


def test_beam_search_refused(targets):
    target = targets["llama"]
    with pytest.raises(UnsupportedGenerationError, match="num_beams=2.*num_beams=1"):
        target.generate(IDS, assistant_model=make_drafter(target), max_new_tokens=3, num_beams=2)


def test_missing_local_drafter_folder_is_named_without_hub_calls(tmp_path):
    from dflash2_hf import DFlash2DraftModel

    with pytest.raises(FileNotFoundError, match="No drafter folder.*from_target"):
        DFlash2DraftModel.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="No drafter folder"):
        DFlash2DraftModel.from_pretrained("./not-here")


def test_non_finite_weights_are_refused(targets, tmp_path):
    from safetensors.torch import load_file, save_file

    from dflash2_hf import CheckpointError, DFlash2DraftModel

    make_drafter(targets["llama"]).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["layers.1.mlp.gate_proj.weight"][0, 0] = float("nan")
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="non-finite.*layers.1.mlp.gate_proj.weight"):
        DFlash2DraftModel.from_pretrained(tmp_path)


def test_cli_prints_one_line_errors(capsys, tmp_path):
    from dflash2_hf.cli import main

    with pytest.raises(SystemExit) as done:  # refused by argparse, before the target loads
        main(["generate", "--target", "smollm2", "--drafter", str(tmp_path / "missing"), "--prompt", "hi"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "dflash2 generate: error: argument --drafter: no drafter folder" in err and "Traceback" not in err


def test_cli_missing_local_target_and_unreachable_hub_ids_are_one_line_errors(capsys, monkeypatch, tmp_path):
    from dflash2_hf.cli import main

    with pytest.raises(SystemExit) as done:  # refused while parsing, before any import of the models
        main(["generate", "--target", str(tmp_path / "nonexistent"), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and "unknown target" in err and "Traceback" not in err

    def unreachable(args):  # what huggingface_hub raises for a Hub id it cannot reach
        raise OSError("We couldn't connect to the Hub to load someorg/none")

    import dflash2_hf.cli.generate as generate_cli

    monkeypatch.setattr(generate_cli, "run", unreachable)
    assert main(["generate", "--prompt", "hi"]) == 2
    assert "dflash2 generate: error: We couldn't connect" in capsys.readouterr().err


def test_cli_refuses_a_negative_temperature(capsys):
    from dflash2_hf.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--prompt", "hi", "--temperature", "-1"])
    assert "must be >= 0" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("command", [["prepare-data", "--output-dir", "unused"], ["train", "--data", "unused", "--output-dir", "unused"],
                                     ["generate", "--prompt", "hi"], ["demo", "--output-dir", "unused"],
                                     ["bench", "--drafter", "fresh", "--output-dir", "unused"]])
def test_device_cuda_without_gpu_is_refused_before_any_work(command, capsys, tmp_path, monkeypatch):
    from dflash2_hf.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(command + ["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda" in err and "use --device cpu" in err
    assert not any(tmp_path.iterdir())  # nothing written


def test_device_values(monkeypatch):
    import argparse

    from dflash2_cli.options import device_spec
    from dflash2_hf.cli import resolve_device

    assert [device_spec(v) for v in ("auto", "cpu", "cuda", "cuda:1")] == ["auto", "cpu", "cuda", "cuda:1"]
    for bad in ("gpu", "cuda:x", "cuda:"):
        with pytest.raises(argparse.ArgumentTypeError, match="auto, cpu, cuda or cuda:N"):
            device_spec(bad)
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match="sees 2 GPU"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda:1: .* sees no CUDA GPU"):
        resolve_device("cuda:1")


def test_adapter_folder_and_folder_without_weights_are_named(targets, tmp_path, capsys):
    """A LoRA adapter folder given as a drafter, and a drafter folder whose weight file is missing, are refused with
    what they are and the fix (in Python and on the command line, before any model loads)."""
    from dflash2_hf import CheckpointError, DFlash2DraftModel
    from dflash2_hf.cli import main

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    with pytest.raises(CheckpointError, match="LoRA adapter.*load_adapter"):
        DFlash2DraftModel.from_pretrained(adapter)
    no_weights = tmp_path / "no-weights"
    make_drafter(targets["llama"]).save_pretrained(no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="No weight file.*model.safetensors"):
        DFlash2DraftModel.from_pretrained(no_weights)
    for folder, message in ((adapter, "LoRA adapter"), (no_weights, "No weight file")):
        with pytest.raises(SystemExit):  # argparse refuses it: the (missing) target is never reached
            main(["generate", "--target", "no-such/target", "--drafter", str(folder), "--prompt", "hi"])
        err = capsys.readouterr().err
        assert "dflash2 generate: error: argument --drafter:" in err and message in err


def test_unreachable_hub_id_fails_fast_in_python(monkeypatch):
    """from_pretrained('org/name') with no Hub: one probe and a message naming the fix, not transformers' retries."""
    import dflash2_hf.hub
    from dflash2_hf import DFlash2DraftModel
    from dflash2_hf.errors import HubUnreachableError

    monkeypatch.setattr(dflash2_hf.hub, "hub_unreachable_reason", lambda *a: "no network (test)")
    with pytest.raises(HubUnreachableError, match="someorg/some-drafter.*unreachable.*no network"):
        DFlash2DraftModel.from_pretrained("someorg/some-drafter")


def test_a_drafter_does_not_generate_on_its_own(targets):
    from dflash2_hf import UnsupportedGenerationError

    with pytest.raises(UnsupportedGenerationError, match="target.generate\\(input_ids, assistant_model=draft"):
        make_drafter(targets["llama"]).generate(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "hi", "--frobnicate"], "dflash2 generate: error: unrecognized arguments: --frobnicate"),
    (["bench", "--methods", "plain,bogus"], "dflash2 bench: error: argument --methods: unknown method(s) ['bogus']"),
    (["demo", "--datasets", "/tmp/no-such-file.jsonl"], "no such file: /tmp/no-such-file.jsonl"),
    (["train", "--data", "x", "--output-dir", "o", "--num-threads", "0"], "--num-threads must be >= 1"),
])
def test_cli_option_mistakes_name_the_option(argv, message, capsys):
    from dflash2_hf.cli import main

    try:
        code = main(argv)
    except SystemExit as done:
        code = done.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_generate_adapter_that_is_no_adapter_is_refused_before_the_target_loads(capsys, monkeypatch, tmp_path):
    import dflash2_hf.targets
    from dflash2_hf.cli import main
    from dflash2_hf.shipped import shipped_drafter_path

    monkeypatch.setattr(dflash2_hf.targets, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    with pytest.raises(SystemExit):  # a missing folder: refused while parsing
        main(["generate", "--prompt", "hi", "--adapter", str(tmp_path / "missing")])
    assert "argument --adapter: no adapter folder" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--adapter", shipped_drafter_path()]) == 2  # a drafter, not an adapter
    assert "is not a LoRA adapter folder: adapter_config.json is missing" in capsys.readouterr().err
