"""dflash2-hf: DFlash2 speculative decoding as a first-class Hugging Face citizen.

``import dflash2_hf`` registers the drafter with ``AutoConfig``/``AutoModel`` (``model_type: "dflash2"``) and routes
``target.generate(..., assistant_model=draft)`` to the DFlash2 decoding loop when ``draft`` is a
:class:`DFlash2DraftModel`.
"""

from transformers import AutoConfig, AutoModel

from . import generation
from .configuration_dflash2 import DFlash2Config, default_target_layer_ids
from .errors import (
    CheckpointError,
    DFlash2Error,
    DrafterTargetMismatchError,
    TargetConfigError,
    UnsupportedGenerationError,
    UnsupportedTransformersVersionError,
)
from .generation import GenerationStats, drafting_dtype, drafting_precision, target_dtype
from .modeling_dflash2 import CandidateSelector, DFlash2DraftModel, GroupedDynamicCausalConv

__version__ = "0.1.0"

AutoConfig.register(DFlash2Config.model_type, DFlash2Config, exist_ok=True)
AutoModel.register(DFlash2Config, DFlash2DraftModel, exist_ok=True)
generation.install()

__all__ = [
    "CandidateSelector",
    "CheckpointError",
    "DFlash2Config",
    "DFlash2DraftModel",
    "DFlash2Error",
    "DrafterTargetMismatchError",
    "GenerationStats",
    "GroupedDynamicCausalConv",
    "TargetConfigError",
    "UnsupportedGenerationError",
    "UnsupportedTransformersVersionError",
    "default_target_layer_ids",
    "drafting_dtype",
    "drafting_precision",
    "target_dtype",
]
