"""What ``dflash2_hf`` exports: what users call, not internals (issue 40)."""

from __future__ import annotations

import dflash2_hf


def test_all_lists_what_users_call():
    expected = {"DFlash2DraftModel", "DFlash2Config", "load_target", "quantize_drafter", "add_lora", "load_adapter",
                "load_adapted_drafter", "AdapterMismatchError", "errors", "drafting_dtype", "drafting_precision",
                "target_dtype", "GenerationStats", "dflash2_generate", "shipped_drafter_path", "__version__"}
    assert expected <= set(dflash2_hf.__all__)
    for name in dflash2_hf.__all__:
        assert getattr(dflash2_hf, name) is not None, name  # every listed name resolves (lazy ones too)


def test_internals_stay_out_of_all_but_importable_from_their_modules():
    from dflash2_hf.configuration_dflash2 import default_target_layer_ids
    from dflash2_hf.modeling_dflash2 import CandidateSelector, GroupedDynamicCausalConv

    assert callable(default_target_layer_ids) and CandidateSelector and GroupedDynamicCausalConv
    assert not {"CandidateSelector", "GroupedDynamicCausalConv", "default_target_layer_ids"} & set(dflash2_hf.__all__)


def test_lazy_names_are_the_modules_objects():
    from dflash2_hf.lora import AdapterMismatchError, load_adapter
    from dflash2_hf.targets import load_target

    assert dflash2_hf.load_adapter is load_adapter and dflash2_hf.load_target is load_target
    assert issubclass(AdapterMismatchError, dflash2_hf.errors.DFlash2Error)
    assert issubclass(dflash2_hf.errors.DrafterConfigError, ValueError)
    assert issubclass(dflash2_hf.errors.DrafterArgumentTypeError, TypeError)
