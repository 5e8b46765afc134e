"""Speculative generation with DFlash2 drafters: the decoding loop, the candidate generator, the statistics."""

from .candidate_generator import DFlash2CandidateGenerator, DraftProposal
from .decoding import dflash2_assisted_decoding
from .public import dflash2_generate
from .precision import auto_dtype_label, bf16_support, drafting_dtype, drafting_precision, has_native_bf16, target_dtype
from .routing import check_transformers_version, install, is_dflash2_drafter
from .stats import GenerationStats

__all__ = [
    "DFlash2CandidateGenerator",
    "DraftProposal",
    "GenerationStats",
    "auto_dtype_label",
    "bf16_support",
    "check_transformers_version",
    "dflash2_assisted_decoding",
    "dflash2_generate",
    "drafting_dtype",
    "drafting_precision",
    "has_native_bf16",
    "install",
    "is_dflash2_drafter",
    "target_dtype",
]
