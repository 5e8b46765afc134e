"""The DFlash2 drafter: a block-diffusion transformer conditioned on the target's hidden states.

Source: DFlash (arXiv 2602.06036) for the drafter, the DFlash2 blog/spec for the local convolution and the parallel
path selector; ``DESIGN.md`` sections 2, 3 and 6 are the exact specification implemented here.

One forward pass fills a whole block ``[anchor, MASK x (B-1)]``:

* the target's hidden states of ``target_layer_ids`` (the *context features*) are fused by ``fc`` + ``hidden_norm``
  and injected as extra keys/values into every drafter layer (queries come from the block only);
* the block attends to all cached context and bidirectionally to itself, unless the config makes layers causal
  and/or gives them a sliding window (``layer_types``, ``sliding_window``, ``is_causal``; :mod:`.masking`);
* a two-tap grouped dynamic causal convolution wraps each sublayer (``attention_conv``, ``mlp_conv``);
* the final hidden state goes through the TARGET's LM head (the drafter owns no embedding table nor LM head), and
  the :class:`CandidateSelector` turns the top-k candidates per position into one path.

Weight names match the published DFlash / DFlash2 checkpoints (no prefix), so those folders load unchanged.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from transformers import GenerationConfig, PreTrainedModel, initialization as init
from transformers.cache_utils import Cache
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding
from transformers.utils import ModelOutput

from .checkpoint import check_folder, check_loaded, unreadable_weights_error
from .configuration_dflash2 import DFlash2Config
from .errors import CheckpointError, DrafterTargetMismatchError, UnsupportedGenerationError
from .hub import check_hub_ids_reachable
from .integrity import weights_digest
from .masking import AttentionMasks, drafter_cache, layer_attention
from .modeling_layers import CandidateSelector, DFlash2DecoderLayer, GroupedDynamicCausalConv  # noqa: F401
from .quantization import is_quantized_linear, refuse_int8
from .shipped import resolve_name_or_path
from .target_config import check_from_target_arguments, drafter_fields_for_target, target_mismatches


@dataclass
class DFlash2DrafterOutput(ModelOutput):
    """Output of :meth:`DFlash2DraftModel.forward`.

    Attributes:
        last_hidden_state: ``(batch, Q, H)`` block hidden states after the final norm (feed them to the target LM head).
        cache: the drafter KV cache (holds context keys/values, plus the block's until the caller crops them).
    """

    last_hidden_state: torch.Tensor | None = None
    cache: Cache | None = None


class DFlash2PreTrainedModel(PreTrainedModel):
    config_class = DFlash2Config
    config: DFlash2Config
    base_model_prefix = "drafter"
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DFlash2DecoderLayer"]
    _supports_sdpa = True

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Always False (no activation checkpointing here). ``peft`` still reads this deprecated alias, whose
        ``transformers`` version warns on every ``PeftModel.from_pretrained`` / ``get_peft_model``."""
        return False

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, GroupedDynamicCausalConv):
            # identity: tap 0 passes the input through, every other tap and the dynamic part are zero
            init.zeros_(module.base_kernel)
            init.ones_(module.base_kernel[:, 0])
            init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, CandidateSelector):
            init.normal_(module.predecessor_codebook, mean=0.0, std=1.0 / math.sqrt(module.predecessor_codebook.shape[1]))
            init.zeros_(module.successor_codebook)


class DFlash2DraftModel(DFlash2PreTrainedModel):
    """The DFlash2 drafter (block-diffusion drafter + local convolution + parallel path selector).

    Typical use::

        import dflash2_hf  # registers AutoConfig/AutoModel and the generate() routing
        draft = DFlash2DraftModel.from_pretrained("model_cards/dflash2-smollm2-135m-instruct")
        out = target.generate(input_ids, assistant_model=draft, max_new_tokens=128)
        draft.generation_stats.tau

    Attributes:
        generation_stats (:class:`~dflash2_hf.generation.GenerationStats` or None): acceptance statistics of the
            last ``generate()`` call that used this drafter.
        use_selector (bool): True (default) walks the candidate selector's best path; False drafts the top-1 path
            (the selector's measured baseline). Read at every ``generate()`` call, not saved.
        use_prompt_lookup (bool): copy from the context (default True; :mod:`dflash2_hf.generation.prompt_lookup`):
            where the sequence's last 2 or 3 tokens occur earlier, the tokens that followed them (up to 15) are
            verified without a drafter pass; else, where the drafter's first draft equals the first token that
            followed the last token's earlier occurrence, that continuation replaces the rest of its path.
            Lossless (greedy and sampling); read at every ``generate()`` call, not saved.
        generation_config (``transformers.GenerationConfig``): the assistant knobs ``transformers`` defines, read by
            the DFlash2 loop at every ``generate()`` call: ``num_assistant_tokens`` caps the drafts per cycle (at
            most ``block_size - 1``), ``assistant_confidence_threshold`` cuts each proposed path after its first
            draft whose selector probability is below it (dynamic draft length: fewer wasted verification
            positions where verifying costs grow with the block, e.g. CPUs). Both ``None`` (default): full blocks,
            as in the DFlash2 paper. Output stays lossless either way; not saved with the weights.
    """

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        n_ctx = len(config.target_layer_ids)
        self.fc = nn.Linear(n_ctx * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlash2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.layer_rules = layer_attention(config)  # causal / sliding-window rule per layer (dflash2_hf.masking)
        self.candidate_selector = CandidateSelector(config) if config.use_candidate_selector else None
        if config.draft_vocab_size:
            self.register_buffer("draft_vocab_ids", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.draft_vocab_ids = None
        self.generation_stats = None
        self.use_selector = True
        self.use_prompt_lookup = True
        self.post_init()
        self.generation_config = GenerationConfig(num_assistant_tokens=None, assistant_confidence_threshold=None)

    def generate(self, *args, **kwargs):
        """Raises :class:`UnsupportedGenerationError`, naming the call to make: a drafter drafts inside its target's ``generate()``."""
        raise UnsupportedGenerationError(
            "A DFlash2 drafter does not generate text on its own: it drafts blocks for its target. Call the target: "
            "target.generate(input_ids, assistant_model=draft, max_new_tokens=...) (or custom_generate="
            "dflash2_hf.dflash2_generate, drafter=draft)."
        )

    # transformers asks drafters for their embeddings in a few places; ours are the target's.
    def get_input_embeddings(self):
        return None

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> DFlash2DrafterOutput:
        """One drafter pass over one or more blocks.

        Also answers the ``transformers`` built-in DFlash call (``DFlashTokenCandidateGenerator``): 5.24 passes
        ``cache=``, 5.23 ``past_key_values=``.

        Args:
            noise_embeds: ``(batch, Q, H)`` block input embeddings (anchor + mask tokens, raw target embedding lookup
                times ``input_embedding_scale``); ``Q`` is a multiple of ``block_size``.
            context_hidden_states: ``(batch, C, n * H_t)`` NEW target hidden states of ``target_layer_ids``,
                concatenated on the last dim (``C`` may be 0 or None when the cache already holds every context).
            position_ids: ``(batch, C + Q)`` absolute positions of the new context then the block; defaults to
                ``past .. past + C + Q - 1``.
            attention_mask: optional; a boolean ``(batch, 1, Q, K)`` mask (True = attend) over all keys ``K`` (cached
                + new context + block), used for training many blocks per sequence, or a 2-D ``(batch, K)`` padding
                mask of 0/1. Either is combined with each layer's causal / sliding-window rule
                (:mod:`dflash2_hf.masking`), which reads the absolute ``position_ids``.
            cache: a ``transformers`` ``Cache`` holding the positions right before the new ones (for windowed layers
                use :func:`dflash2_hf.masking.drafter_cache`, which can roll back across the window edge); the new
                context and the block keys/values are appended (the caller crops the ``Q`` block entries after the
                pass). ``use_cache=True`` without one creates it.

        Returns:
            :class:`DFlash2DrafterOutput` with ``last_hidden_state`` ``(batch, Q, H)`` (after the final norm), in
            ``noise_embeds``' dtype (the drafter itself may run in a lower precision).

        Raises:
            ValueError: ``noise_embeds`` is not a 3-D float tensor (e.g. token ids), ``Q`` is not a multiple of
                ``block_size`` while the convolution is on, or the feature width does not match
                ``len(target_layer_ids) * target_hidden_size``.
        """
        cache = cache if cache is not None else past_key_values
        if use_cache and cache is None:
            cache = drafter_cache(self.config)
        if noise_embeds.dim() != 3 or not noise_embeds.is_floating_point():
            raise ValueError(
                f"forward takes block embeddings (batch, Q, hidden) in floating point, got a {noise_embeds.dtype} tensor "
                f"of shape {tuple(noise_embeds.shape)}: a drafter drafts inside its target's generate(), "
                "target.generate(input_ids, assistant_model=draft); embed_block(ids, embedding_weight) makes the input."
            )
        b, q_len, _ = noise_embeds.shape
        if self.config.use_local_conv and q_len % self.config.block_size:
            raise ValueError(f"The block length {q_len} is not a multiple of block_size={self.config.block_size}.")
        if context_hidden_states is None:
            context_hidden_states = noise_embeds.new_zeros(b, 0, self.fc.in_features)
        if context_hidden_states.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"context_hidden_states has width {context_hidden_states.shape[-1]}, expected "
                f"{len(self.config.target_layer_ids)} layers x {self.config.target_hidden_size} = {self.fc.in_features}: "
                "pass the target's hidden states of config.target_layer_ids concatenated on the last dim."
            )
        compute_dtype = self.norm.weight.dtype  # the norm's: the linears of an int8 drafting copy (dflash2_hf.quantization) have no float weight
        context = self.hidden_norm(self.fc(context_hidden_states.to(compute_dtype)))
        n_new = context.shape[1] + q_len
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + n_new, device=noise_embeds.device).expand(b, -1)
        hidden = noise_embeds.to(compute_dtype)  # the target may run in another precision
        cos, sin = self.rotary_emb(hidden, position_ids)
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = None if bool(attention_mask.all()) else attention_mask[:, None, None, :].bool()
        masks = AttentionMasks(self.layer_rules, position_ids.to(hidden.device), q_len, attention_mask)
        for layer in self.layers:
            hidden = layer(hidden, context, cos, sin, masks, cache)
        # hand back the caller's dtype: transformers' built-in DFlash path feeds it straight into the target LM head
        return DFlash2DrafterOutput(last_hidden_state=self.norm(hidden).to(noise_embeds.dtype), cache=cache)

    # ------------------------------------------------------------------ target-facing helpers
    def embed_block(self, input_ids: torch.LongTensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        """Raw target-embedding lookup times ``input_embedding_scale``: ``(batch, Q)`` ids -> ``(batch, Q, H_t)``."""
        embeds = F.embedding(input_ids, embedding_weight)
        scale = self.config.input_embedding_scale
        return embeds if scale == 1.0 else embeds * scale

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module | torch.Tensor) -> torch.Tensor:
        """Target LM head on drafter hidden states, times ``output_multiplier``, soft-capped if configured.

        Args:
            hidden: ``(…, H)`` drafter hidden states.
            lm_head: the target's output embedding module, or its ``(V, H)`` weight (e.g. a lower-precision copy).

        Returns:
            ``(…, V)`` logits in the LM head's dtype, on the LM head's device.
        """
        # a 2-D input: oneDNN picks a ~20x slower bf16 kernel for some 3-D views (a sliced block, batch 1)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if is_quantized_linear(lm_head):  # an int8 draft head (dflash2_hf.quantization): float32 CPU inputs
            flat = flat.to(device="cpu", dtype=torch.float32)
        else:
            weight = lm_head if isinstance(lm_head, torch.Tensor) else lm_head.weight
            flat = flat.to(device=weight.device, dtype=weight.dtype)  # the head may sit on another GPU (device_map)
        logits = F.linear(flat, lm_head) if isinstance(lm_head, torch.Tensor) else lm_head(flat)
        logits = logits.view(*hidden.shape[:-1], logits.shape[-1])
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = cap * torch.tanh(logits / cap)
        return logits

    def set_draft_vocab(self, token_ids: torch.LongTensor | list[int]) -> None:
        """Restricts drafting to ``token_ids`` (e.g. the most frequent response tokens of the training data).

        Drafting then applies only those rows of the target LM head (``(N, H)`` instead of ``(V, H)``: on CPUs the
        LM head dominates a drafter pass). Output stays lossless: the target verifies as always; a token outside the
        list simply cannot be drafted. Saved with the drafter (``draft_vocab_ids`` buffer).

        Raises:
            ValueError: ids outside the target vocabulary, duplicates, or an empty list.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if ids.numel() == 0 or ids.min() < 0 or ids.max() >= self.config.vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(
                f"draft vocabulary must be non-empty, unique ids in [0, {self.config.vocab_size}); got {ids.numel()} ids."
            )
        self.config.draft_vocab_size = int(ids.numel())
        if "draft_vocab_ids" in self._buffers:
            self._buffers["draft_vocab_ids"] = ids.to(self.device)
        else:
            del self.draft_vocab_ids  # the plain None attribute of a drafter without a draft vocabulary
            self.register_buffer("draft_vocab_ids", ids.to(self.device), persistent=True)

    def check_target(self, target: PreTrainedModel) -> None:
        """Raises :class:`DrafterTargetMismatchError` if this drafter was built for another target.

        Checks the hidden size, vocabulary size and layer count of ``target`` against the drafter config.
        """
        problems = target_mismatches(self.config, target)
        if problems:
            raise DrafterTargetMismatchError(
                f"This drafter was built for another target: the target {type(target).__name__} has "
                + "; ".join(problems)
                + ". Use a drafter trained for this target, or train one (docs/training.md: `dflash2 train --target ...`; "
                "DFlash2DraftModel.from_target(target) gives an untrained one to start from)."
            )

    @classmethod
    def from_target(cls, target: PreTrainedModel, *, dtype: torch.dtype | None = None, **overrides) -> "DFlash2DraftModel":
        """A freshly initialised drafter sized for ``target``.

        Copies the target's hidden size, heads, head dim, MLP width, vocabulary, rope and norm settings; spreads
        ``target_layer_ids`` as in DESIGN.md section 2; picks a ``mask_token_id`` inside the target vocabulary
        (pad, else unk, unless it is an EOS id; else the last id); matches the target's embedding scale and logit soft-capping. Convolutions
        start at the identity, the successor codebook at zero. ``overrides`` set any :class:`DFlash2Config` field
        (e.g. ``num_hidden_layers=5``, ``block_size=16``, ``use_candidate_selector=False``).

        Sizes are read under each architecture's own config names (GPT-2's ``n_inner``, OPT's ``ffn_dim``, ...; see
        :mod:`dflash2_hf.target_config`), with defaults where one is sensible (MLP width ``4 * H``, no position limit
        for ALiBi targets); ``overrides`` win over what the target's config says.

        Args:
            dtype: the drafter's dtype (default: the target's), a torch.dtype or a name (``"bfloat16"``, ``"bf16"``,
                ``"float32"``, ...); its rotary frequencies stay float32 whatever it is,
                as ``from_pretrained(..., dtype=...)`` leaves them.

        Returns:
            a drafter on the target's device.

        Raises:
            DrafterArgumentTypeError: ``target`` is not a loaded model (a Hub id, a config) or ``dtype`` no dtype.
            DrafterConfigError: an override that is not a DFlash2Config field, or a value out of range
                (``num_hidden_layers=-1``).
            TargetConfigError: a base model without an LM head, or the target's config names no attention-head or layer count (pass
                ``num_attention_heads=`` / ``num_target_layers=``), or its LM head reads another width than its
                embeddings give.
            UnsupportedGenerationError: a stateful (recurrent) target (Mamba, RWKV, RecurrentGemma, Jamba, ...),
                which assisted decoding cannot serve.
        """
        dtype = check_from_target_arguments(target, dtype, overrides)  # also refuses stateful targets
        drafter = cls(DFlash2Config(**drafter_fields_for_target(target, overrides)))
        param = next(target.parameters())
        rotary = dict(drafter.rotary_emb.named_buffers())  # float32: a cast to bf16 would round them
        drafter.to(device=param.device, dtype=dtype or param.dtype)
        for name, value in rotary.items():
            setattr(drafter.rotary_emb, name, value.to(param.device))
        return drafter

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs) -> None:
        """``PreTrainedModel.save_pretrained`` that also records the weights' digest in ``config.weights_sha256``.

        :meth:`from_pretrained` compares it after loading, so a weight file whose bytes were overwritten (it still
        parses and holds finite numbers) is refused instead of drafting garbage. Honours a ``state_dict`` argument
        (as passed by ``Trainer``).
        """
        refuse_int8(self, "saved")
        state_dict = kwargs.get("state_dict")
        self.config.weights_sha256 = weights_digest(state_dict if state_dict is not None else self.state_dict())
        super().save_pretrained(save_directory, *args, **kwargs)

    def save_pretrained_published(self, save_directory: str | os.PathLike, **kwargs) -> None:
        """Saves in the published DFlash/DFlash2 format (Qwen3 config + ``dflash_config``; DESIGN.md section 6).

        Same safetensors weights as :meth:`save_pretrained`; only ``config.json`` differs. Loads back with
        :meth:`from_pretrained` (not with ``AutoModel``, since the folder says ``model_type: "qwen3"``).
        """
        self.save_pretrained(save_directory, **kwargs)
        with open(os.path.join(save_directory, "config.json"), "w") as f:
            json.dump(self.config.to_published_dict(), f, indent=2, sort_keys=True)

    def push_to_hub(self, repo_id: str, *, model_card=None, **kwargs):
        """Uploads the drafter with a complete model card (see :func:`dflash2_hf.hub.push_drafter_to_hub`).

        ``model_card``: a ``huggingface_hub.ModelCard``, a path to a README.md, or None to reuse the README.md of
        the folder this drafter was loaded from. Other keyword arguments: ``commit_message``, ``private``,
        ``token``, ``revision``, ``create_pr``.
        """
        from .hub import push_drafter_to_hub

        return push_drafter_to_hub(self, repo_id, model_card=model_card, **kwargs)

    # ------------------------------------------------------------------ loading that never degrades silently
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """``PreTrainedModel.from_pretrained`` that refuses incomplete or corrupt checkpoints.

        Loads our format (``model_type: "dflash2"``) and the published DFlash/DFlash2 format (Qwen3 config with
        ``dflash_config``), from a local folder, a shipped drafter's name (``"dflash2-smollm2-135m-instruct"``, from
        any working directory: :mod:`dflash2_hf.shipped`) or a Hub id (resolved by ``huggingface_hub``; offline with
        ``HF_HUB_OFFLINE=1`` and a populated cache). A missing path that looks local (``./x``, ``/x``, ``~/x``,
        ``runs/x`` with a ``runs/`` folder here, ``a/b/c``) is refused at once, without a Hub lookup.

        Raises:
            CheckpointError: a weight file is truncated or corrupt (unreadable, non-finite values, or weights that
                do not match the digest ``config.weights_sha256`` recorded by :meth:`save_pretrained`), weights are
                missing / of the wrong shape (``transformers`` would otherwise initialise them randomly and only
                warn; a mis-shaped ``fc.weight`` names ``target_layer_ids`` and the rule that chose them), the file
                holds weights its own config does not use (e.g. convolution or selector tensors under a config
                without ``conv_kernel_size`` / ``selector_rank``; the message names the field; a config override
                passed here that leaves them unused is the caller's choice and only warns), or a local folder has
                no ``config.json``, or its config is another model's (``this is a llama model, not a dflash2
                drafter``).
            FileNotFoundError: a missing local-looking path; :class:`ShippedDrafterNotFoundError` for a shipped name
                when the repository's ``model_cards/`` is not on this machine.
            HubUnreachableError: a Hub id that is not in the local Hub cache while the Hub cannot be reached (one
                3-second probe; ``HF_HUB_OFFLINE=1`` counts as unreachable).
        """
        path = pretrained_model_name_or_path = resolve_name_or_path(pretrained_model_name_or_path)
        check_folder(path, config_passed=kwargs.get("config") is not None)
        if not os.path.exists(path) and not kwargs.get("local_files_only"):  # one quick probe, not a minute of retries
            check_hub_ids_reachable(path)
        want_info = kwargs.pop("output_loading_info", False)
        kwargs["ignore_mismatched_sizes"] = True  # report mismatches by name below (refused whatever this says)
        try:
            model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        except (SafetensorError, OSError, ValueError, RuntimeError) as err:
            if isinstance(err, (DrafterTargetMismatchError, CheckpointError)):
                raise
            error = unreadable_weights_error(err, path)
            if error is None:
                raise
            raise error from err
        check_loaded(model, info, path, overridden=kwargs.get("config") is not None or any(
            k in DFlash2Config.__dataclass_fields__ for k in kwargs), config_passed=kwargs.get("config") is not None)
        return (model, info) if want_info else model


__all__ = ["DFlash2DraftModel", "DFlash2PreTrainedModel", "CandidateSelector", "GroupedDynamicCausalConv"]
