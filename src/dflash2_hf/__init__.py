"""dflash2-hf: DFlash2 speculative decoding as a first-class Hugging Face citizen.

``import dflash2_hf`` registers the drafter with ``AutoConfig``/``AutoModel`` (``model_type: "dflash2"``) and routes
``target.generate(..., assistant_model=draft)`` to the DFlash2 decoding loop when ``draft`` is a
:class:`DFlash2DraftModel`. The same loop through transformers' public hook, with no private method involved:
``target.generate(..., custom_generate=dflash2_generate, drafter=draft)``. Guides: README.md and docs/.
"""

from transformers import AutoConfig, AutoModel

from . import errors, generation
from .configuration_dflash2 import DFlash2Config
from .cpu_kernels import optimize_for_cpu, restore_stock_kernels
from .errors import (
    CheckpointError,
    DFlash2Error,
    DrafterArgumentTypeError,
    DrafterConfigError,
    DrafterTargetMismatchError,
    ShippedDrafterNotFoundError,
    TargetConfigError,
    UnsupportedGenerationError,
    UnsupportedTransformersVersionError,
)
from .generation import GenerationStats, dflash2_generate, drafting_dtype, drafting_precision, target_dtype
from .modeling_dflash2 import DFlash2DraftModel
from .shipped import shipped_drafter_path

__version__ = "0.1.0"

AutoConfig.register(DFlash2Config.model_type, DFlash2Config, exist_ok=True)
AutoModel.register(DFlash2Config, DFlash2DraftModel, exist_ok=True)
generation.install()

# What users call. Internals (CandidateSelector, GroupedDynamicCausalConv, default_target_layer_ids, ...) stay
# importable from their modules. Names below the line load on first use (peft, the bundled targets): `import
# dflash2_hf` stays as cheap as the registration allows.
_LAZY = {
    "AdapterMismatchError": "lora",
    "add_lora": "lora",
    "load_adapter": "lora",
    "save_adapter": "lora",
    "load_adapted_drafter": "bench",
    "load_drafter": "loading",
    "quantize_drafter": "quantization",
    "load_target": "targets",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AdapterMismatchError",
    "CheckpointError",
    "DFlash2Config",
    "DFlash2DraftModel",
    "DFlash2Error",
    "DrafterArgumentTypeError",
    "DrafterConfigError",
    "DrafterTargetMismatchError",
    "GenerationStats",
    "ShippedDrafterNotFoundError",
    "TargetConfigError",
    "UnsupportedGenerationError",
    "UnsupportedTransformersVersionError",
    "__version__",
    "add_lora",
    "dflash2_generate",
    "drafting_dtype",
    "drafting_precision",
    "errors",
    "load_adapted_drafter",
    "load_adapter",
    "load_drafter",
    "load_target",
    "optimize_for_cpu",
    "quantize_drafter",
    "restore_stock_kernels",
    "save_adapter",
    "shipped_drafter_path",
    "target_dtype",
]
