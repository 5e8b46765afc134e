"""The drafter's building blocks: local convolution, attention over [context ; block], decoder layer, candidate
selector (DESIGN.md sections 2, 3 and 6; assembled by :mod:`.modeling_dflash2`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, rotate_half

from .configuration_dflash2 import DFlash2Config
from .masking import AttentionMasks


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` (b, heads, T, d) with ``cos``/``sin`` (b, T, d)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class GroupedDynamicCausalConv(nn.Module):
    """Two-tap grouped dynamic causal convolution around one sublayer (DFlash2 local convolution).

    Before the sublayer: ``x'_t = sum_j (K0[j] + D0_t[j]) * x_{t-j}``; after it: ``y'_t = sum_j (K1[j] + D1_t[j]) *
    y_{t-j}``, ``j = 0 .. kernel_size-1``, zero-padded at the block start. ``K0, K1`` are per-channel base kernels
    (``base_kernel``, shape ``(2, kernel_size, H)``); ``D0_t, D1_t`` are per-position corrections, one value per group
    of ``group_size`` channels, both projected from the sublayer's input. Initialised to the identity.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)

    def kernels(self, x: torch.Tensor) -> torch.Tensor:
        """Both sides' kernels ``K_s[j] + D_s,t[j]`` from the sublayer input ``x`` (n, B, H).

        Returns:
            ``(n, B, 2, groups, group_size, kernel_size)``, tap ``j`` (reading ``x_{t-j}``) at index
            ``kernel_size - 1 - j``: the order of :meth:`mix`'s sliding windows.
        """
        n, length, _ = x.shape
        dynamic = self.kernel_projection(x).view(n, length, 2, self.kernel_size, self.num_groups, 1)
        base = self.base_kernel.view(2, self.kernel_size, self.num_groups, self.group_size)
        return (base + dynamic).flip(3).permute(0, 1, 2, 4, 5, 3)

    def mix(self, x: torch.Tensor, kernels: torch.Tensor) -> torch.Tensor:
        """Applies one side's ``kernels`` (n, B, groups, group_size, kernel_size) to ``x`` (n, B, H), causal in B.

        One sliding window per position over the block left-padded with ``kernel_size - 1`` zeros (a handful of
        operators whatever the kernel size: drafting runs this 4x per layer per block).
        """
        n, length, hidden = x.shape
        padded = F.pad(x.view(n, length, self.num_groups, self.group_size), (0, 0, 0, 0, self.kernel_size - 1, 0))
        windows = padded.unfold(1, self.kernel_size, 1)  # (n, B, groups, group_size, kernel_size): x_{t-K+1} .. x_t
        return (windows * kernels).sum(-1).view(n, length, hidden)


class DFlash2Attention(nn.Module):
    """Attention whose keys/values are ``[context features ; block]`` and whose queries are the block only."""

    def __init__(self, config: DFlash2Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context, cos, sin, masks: AttentionMasks, cache: Cache | None = None):
        b, q_len, _ = hidden_states.shape
        q = self.q_norm(self.q_proj(hidden_states).view(b, q_len, -1, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([context, hidden_states], dim=1)
        kv_len = kv_in.shape[1]
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_len, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, kv_len, -1, self.head_dim).transpose(1, 2)
        q = _rotate(q, cos[:, -q_len:], sin[:, -q_len:])
        k = _rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # a windowed layer returns only its last keys
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=masks.for_layer(self.layer_idx, k.shape[2]), scale=self.scaling, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlash2DecoderLayer(nn.Module):
    """Pre-norm decoder layer; with ``use_local_conv`` each sublayer is wrapped by a :class:`GroupedDynamicCausalConv`."""

    def __init__(self, config: DFlash2Config, layer_idx: int):
        super().__init__()
        self.block_size = config.block_size
        self.self_attn = DFlash2Attention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.use_local_conv:
            self.attention_conv = GroupedDynamicCausalConv(
                config.hidden_size, config.conv_kernel_size, config.conv_group_size
            )
            self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, config.conv_kernel_size, config.conv_group_size)
        else:
            self.attention_conv = self.mlp_conv = None

    def _sublayer(self, conv: GroupedDynamicCausalConv | None, x: torch.Tensor, fn: Callable) -> torch.Tensor:
        if conv is None:
            return fn(x)
        shape = x.shape
        # the convolution mixes positions inside one block only: view the query sequence as (blocks, B, H)
        blocks = x.reshape(-1, self.block_size, shape[-1])
        kernels = conv.kernels(blocks)
        y = fn(conv.mix(blocks, kernels[:, :, 0]).view(shape))
        return conv.mix(y.reshape(blocks.shape), kernels[:, :, 1]).view(shape)

    def forward(self, hidden_states, context, cos, sin, masks: AttentionMasks, cache=None):
        x = self.input_layernorm(hidden_states)
        hidden_states = hidden_states + self._sublayer(
            self.attention_conv, x, lambda h: self.self_attn(h, context, cos, sin, masks, cache)
        )
        x = self.post_attention_layernorm(hidden_states)
        return hidden_states + self._sublayer(self.mlp_conv, x, self.mlp)


class CandidateSelector(nn.Module):
    """The parallel path selector (DFlash2; DESIGN.md section 3).

    Scores every predecessor -> successor pair among the top-k candidates of adjacent positions:
    ``S_t(a, b) = <A[a] * g_t, Bc[b]> + U_t(b)`` with ``A``/``Bc`` rows of the predecessor/successor codebooks
    (``(V, r)``), ``g_t = hidden_projection(h_t)`` (``r``) and ``U_t`` the drafter's top-k logits. The successor
    codebook starts at zero, so an untrained selector reproduces the top-1 path.
    """

    def __init__(self, config: DFlash2Config):
        super().__init__()
        self.top_k = config.selector_top_k
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, config.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, config.selector_rank))

    def pair_scores(
        self,
        hidden: torch.Tensor,
        predecessor_ids: torch.LongTensor,
        candidate_ids: torch.LongTensor,
        candidate_logits: torch.Tensor,
    ) -> torch.Tensor:
        """Pair scores ``S``.

        Args:
            hidden: drafter hidden states at the draft positions, ``(..., P, H)``.
            predecessor_ids: ``(..., P, a)`` predecessor token ids per position (``a = 1`` or ``k``).
            candidate_ids: ``(..., P, k)`` successor candidates (the position's top-k).
            candidate_logits: ``(..., P, k)`` their drafter logits (the unary term ``U``).

        Returns:
            ``(..., P, a, k)`` float scores (dtype of ``hidden``).
        """
        g = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        fused = self.predecessor_codebook[predecessor_ids] * g.unsqueeze(-2)
        successors = self.successor_codebook[candidate_ids]
        return torch.einsum("...ar,...kr->...ak", fused, successors) + candidate_logits.unsqueeze(-2).to(fused.dtype)


__all__ = ["CandidateSelector", "DFlash2Attention", "DFlash2DecoderLayer", "GroupedDynamicCausalConv"]
