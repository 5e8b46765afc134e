"""Drafting dtype and device: bf16 only where the device computes it natively; clear warnings where drafting is slow."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_drafter
from transformers.utils import logging as hf_logging

from dflash2_hf.cli import build_parser, resolve_dtype
from dflash2_hf.generation import drafting_dtype, has_native_bf16
from dflash2_hf.generation.precision import warn_if_emulated_bf16


@pytest.fixture
def cpu_bf16(monkeypatch):
    """Sets what torch reports about the CPU's bf16 instructions."""

    def set_native(native: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)

    return set_native


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_drafting_dtype_follows_the_cpu(cpu_bf16, native, expected):
    cpu_bf16(native)
    assert has_native_bf16("cpu") is native
    assert drafting_dtype(torch.device("cpu")) == expected
    reason = "AVX512-BF16 on this CPU" if native else "no native bf16 on this CPU"
    assert resolve_dtype("auto", "cpu") == (expected, f"{'bf16' if native else 'fp32'} (auto: {reason})")


def test_amx_alone_counts_as_native(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert drafting_dtype("cpu") == torch.bfloat16


def test_explicit_drafter_dtypes_are_kept(cpu_bf16):
    cpu_bf16(False)  # an explicit choice wins over the hardware probe, and the label says it is emulated
    assert resolve_dtype("bf16", "cpu") == (torch.bfloat16, "bf16 (explicit; no native bf16 on this CPU: emulated, "
                                                            "slower than fp32)")
    assert resolve_dtype("float32", "cpu") == (torch.float32, "fp32")
    cpu_bf16(True)
    assert resolve_dtype("bfloat16", "cpu") == (torch.bfloat16, "bf16")


@pytest.mark.parametrize("command", ["demo", "generate", "bench"])
def test_cli_accepts_auto_drafter_dtype(command):
    extra = {"generate": ["--prompt", "hi"], "bench": ["--drafter", "fresh", "--output-dir", "unused"]}.get(command, [])
    args = build_parser().parse_args([command, *extra, "--drafter-dtype", "auto"])
    assert args.drafter_dtype == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, *extra, "--drafter-dtype", "fp16"])


def test_emulated_bf16_drafter_warns_once_with_the_fix(targets, cpu_bf16, caplog):
    drafter = make_drafter(targets["llama"])
    logging.Logger.warning_once.cache_clear()
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            cpu_bf16(True)
            warn_if_emulated_bf16(drafter.to(torch.bfloat16))  # native bf16: no warning
            cpu_bf16(False)
            warn_if_emulated_bf16(drafter.float())  # fp32: no warning
            assert "bf16 instructions" not in caplog.text
            warn_if_emulated_bf16(drafter.to(torch.bfloat16))
    finally:
        hf_logging.disable_propagation()
        logging.Logger.warning_once.cache_clear()
    assert "bf16 instructions" in caplog.text and "dtype=torch.float32" in caplog.text


@pytest.mark.parametrize("capability, native", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_cuda_bf16_needs_ampere_on_that_very_gpu(monkeypatch, capability, native):
    # torch.cuda.is_bf16_supported() would say yes for emulated bf16 (T4, V100) and check only the current GPU
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: asked.append(i) or capability)
    monkeypatch.setattr(torch.version, "hip", None)
    assert has_native_bf16("cuda:1") is native and asked == [1]
    assert drafting_dtype(torch.device("cuda")) == (torch.bfloat16 if native else torch.float32) and asked[-1] == 0


def test_no_cuda_means_no_cuda_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert has_native_bf16("cuda") is False


def test_cpu_drafter_next_to_an_accelerator_target_warns(targets, caplog):
    from dflash2_hf.generation.decoding import _warn_cpu_drafter

    drafter = make_drafter(targets["llama"])
    logging.Logger.warning_once.cache_clear()
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            _warn_cpu_drafter(drafter, torch.zeros(1, 3, dtype=torch.long))  # both on the CPU: fine
            assert "draft.to(target.device)" not in caplog.text
            _warn_cpu_drafter(drafter, torch.zeros(1, 3, dtype=torch.long, device="meta"))  # stands in for a GPU
    finally:
        hf_logging.disable_propagation()
        logging.Logger.warning_once.cache_clear()
    assert "drafter is on the CPU" in caplog.text and "draft.to(target.device)" in caplog.text


def test_bf16_drafters_of_the_cli_keep_fp32_rotary_frequencies(targets, tmp_path):
    from dflash2_hf.bench import load_drafter

    target = targets["llama"]
    make_drafter(target).save_pretrained(tmp_path)
    reference = make_drafter(target).rotary_emb.inv_freq
    for spec in ("fresh", str(tmp_path)):
        drafter = load_drafter(spec, target, dtype=torch.bfloat16)
        assert drafter.dtype == torch.bfloat16 and drafter.rotary_emb.inv_freq.dtype == torch.float32, spec
        assert torch.equal(drafter.rotary_emb.inv_freq, reference), spec


# ------------------------------------------------------------------ target dtype (--dtype auto)
@pytest.mark.parametrize("avx512_bf16, amx, expected, reason", [
    (False, False, torch.float32, "no native bf16 on this CPU"),  # AVX2 only (the AMD EPYC)
    (True, False, torch.bfloat16, "AVX512-BF16 on this CPU"),
    (False, True, torch.bfloat16, "AMX on this CPU"),
    (True, True, torch.bfloat16, "AMX on this CPU"),  # the Intel Xeon
])
def test_target_dtype_follows_the_cpu_flags(monkeypatch, avx512_bf16, amx, expected, reason):
    import dflash2_hf
    from dflash2_hf.generation import auto_dtype_label, bf16_support

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert dflash2_hf.target_dtype("cpu") == expected == dflash2_hf.drafting_dtype("cpu")  # one rule, one probe
    assert bf16_support(torch.device("cpu")) == (expected == torch.bfloat16, reason)
    label = f"{'bf16' if expected == torch.bfloat16 else 'fp32'} (auto: {reason})"
    assert auto_dtype_label("cpu") == label and resolve_dtype("auto", "cpu") == (expected, label)


def test_a_torch_without_cpu_probes_means_fp32(monkeypatch):
    import dflash2_hf

    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert dflash2_hf.target_dtype("cpu") == torch.float32
    assert "cannot tell" in resolve_dtype("auto", "cpu")[1]


@pytest.mark.parametrize("capability, expected", [((7, 5), "fp32 (auto: no native bf16 on Tesla T4, compute capability "
                                                          "7.5 < 8.0)"),
                                                  ((9, 0), "bf16 (auto: native bf16 on Tesla T4, compute capability 9.0)")])
def test_auto_dtype_on_cuda_names_the_gpu(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Tesla T4")
    monkeypatch.setattr(torch.version, "hip", None)
    assert resolve_dtype("auto", "cuda")[1] == expected


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown dtype 'fp16'; choose from auto"):
        resolve_dtype("fp16", "cpu")


@pytest.mark.parametrize("command, default", [("demo", "auto"), ("generate", "auto"), ("bench", "fp32")])
def test_cli_dtype_choices_and_defaults(command, default):
    extra = {"generate": ["--prompt", "hi"], "bench": ["--drafter", "fresh", "--output-dir", "unused"]}.get(command, [])
    assert build_parser().parse_args([command, *extra]).dtype == default
    for value in ("auto", "bf16", "fp32"):
        assert build_parser().parse_args([command, *extra, "--dtype", value]).dtype == value
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, *extra, "--dtype", "fp16"])


class _Loaded(Exception):
    pass


@pytest.mark.parametrize("command", ["demo", "generate", "bench"])
@pytest.mark.parametrize("amx, expected", [(False, torch.float32), (True, torch.bfloat16)])
def test_dtype_auto_loads_the_target_in_the_faster_dtype(monkeypatch, capsys, command, amx, expected):
    """--dtype auto on the CPU: fp32 without bf16 instructions (AVX2), bf16 with AMX; the output says which and why."""
    from dflash2_hf import targets
    from dflash2_hf.cli import main

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    loaded = []

    def fake_load(name, dtype=torch.float32, device="cpu"):
        loaded.append(dtype)
        raise _Loaded

    monkeypatch.setattr(targets, "load_target", fake_load)
    extra = {"generate": ["--prompt", "hi"], "bench": ["--drafter", "fresh", "--output-dir", "unused"]}.get(command, [])
    with pytest.raises(_Loaded):
        main([command, *extra, "--dtype", "auto", "--device", "cpu"])
    assert loaded == [expected]
    captured = capsys.readouterr()
    reason = "AMX on this CPU" if amx else "no native bf16 on this CPU"
    assert f"target dtype: {'bf16' if amx else 'fp32'} (auto: {reason})" in captured.out + captured.err


@pytest.mark.parametrize("native", [True, False])
def test_train_precision_auto_follows_the_cpu(cpu_bf16, native):
    """`train --feature-dtype auto --bf16 auto`: bf16 features and autocast only where the CPU computes bf16."""
    from dflash2_hf.training.parser import configs_from_namespace
    from dflash2_hf.training.pipeline import _setup

    def configs(*argv):
        return build_parser().parse_args(["train", "--data", "d", "--output-dir", "o", "--use-cpu", *argv])

    cpu_bf16(native)
    cfg = configs_from_namespace(configs("--feature-dtype", "auto", "--bf16", "auto"))
    _setup(cfg.data, cfg.features, cfg.training_args)
    assert cfg.features.feature_dtype == ("bfloat16" if native else "float32") and cfg.training_args.bf16 is native
    explicit = configs_from_namespace(configs("--bf16"))
    assert explicit.training_args.bf16 is True and explicit.features.feature_dtype == "float32"  # the serving dtype
    assert configs_from_namespace(configs()).training_args.bf16 is False
