"""EAGLE-3 draft model whose parameter names are exactly the exported checkpoint keys.

Structure (matches vLLM's `Eagle3LlamaForCausalLM`, `llama_eagle3.py`, flag by flag):
  a        = cat(aux_low, aux_mid, aux_high)                # target states (step 0 only)
  a        = input_norm(a)                   if norm_before_fc   (one RMSNorm over the 3*H_t input)
  a        = cat(fc_norm[i](a_i) for i)      if fc_norm          (one RMSNorm per aux chunk)
  g        = fc(a)
  x        = cat(input_layernorm(embed(tok)), hidden_norm(h))   # width 2H
  r        = hidden_norm(h) if norm_before_residual else h      # the attention residual
  h1       = r + o_proj(attn(x))
  h2       = h1 + mlp(post_attention_layernorm(h1))        # pre-norm output, what `step` returns
  logits   = lm_head(norm(h2))                             # over the draft vocab
  next h   = norm(h2) if norm_output else h2               # `carry`: what the next draft step consumes
With every flag off this is plain EAGLE-3; fc_norm + norm_output is "EAGLE-3.1" (the training default).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    rotate_half,
)

from training.config import ARCHITECTURE_FLAGS
from training.ttt_attention import StepKVCache, cached_step_attention

EMBED_PARAM = "embed_tokens.weight"


def architecture_of(config: LlamaConfig) -> dict[str, bool]:
    """The drafter's EAGLE-3.1 flags (absent = off, as vLLM reads them with getattr)."""
    return {flag: bool(getattr(config, flag, False)) for flag in ARCHITECTURE_FLAGS}


class DraftAttention(nn.Module):
    """Llama attention whose q/k/v read the 2H-wide [embedding, hidden] concatenation."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(2 * hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        mask0: torch.Tensor | None,
        cache: StepKVCache,
        at: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Keys and values at every index of x (B, L, 2H); queries there too, or only at the indices ``at``
        (then the output is on their (1, N) layout)."""

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(*t.shape[:2], n, self.head_dim).transpose(1, 2)

        def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return t * cos.unsqueeze(1) + rotate_half(t) * sin.unsqueeze(1)

        cos, sin = cos_sin
        k = rope(heads(self.k_proj(x), self.num_kv_heads), cos, sin)
        v = heads(self.v_proj(x), self.num_kv_heads)
        if at is not None:
            x, cos, sin = x[at][None], cos[at][None], sin[at][None]
        q = rope(heads(self.q_proj(x), self.num_heads), cos, sin)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = cached_step_attention(q, k, v, cache, mask0)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], self.num_heads * self.head_dim))


class DraftDecoderLayer(nn.Module):
    """The single `midlayer`."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = DraftAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds, hidden, cos_sin, mask0, cache) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        residual = normed if self.norm_before_residual else hidden
        at = cache.query_subset()  # keys at every index, the rest at the trained ones only
        if at is not None:
            residual = residual[at][None]
        h = residual + self.self_attn(x, cos_sin, mask0, cache, at)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter. `config` is a LlamaConfig with `draft_vocab_size`, `target_hidden_size` and
    optionally the `ARCHITECTURE_FLAGS` (vLLM's field names)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * config.target_hidden_size, hidden, bias=False)
        self.midlayer = DraftDecoderLayer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(config)
        # created last and without randomness: the seeded init of the plain EAGLE-3 weights is unchanged
        arch = architecture_of(config)
        target, eps = config.target_hidden_size, config.rms_norm_eps
        self.input_norm = LlamaRMSNorm(3 * target, eps=eps) if arch["norm_before_fc"] else None
        self.fc_norm = nn.ModuleList([LlamaRMSNorm(target, eps=eps) for _ in range(3)]) if arch["fc_norm"] else None
        self.norm_output = arch["norm_output"]

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target token id of each draft-vocab entry."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Fuse the three target states (B, L, 3*H_t) into the draft width (B, L, H)."""
        if self.input_norm is not None:
            aux_hidden = self.input_norm(aux_hidden)
        if self.fc_norm is not None:
            chunks = aux_hidden.chunk(len(self.fc_norm), dim=-1)
            aux_hidden = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux_hidden)

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask0: torch.Tensor | None,
        cache: StepKVCache,
    ) -> torch.Tensor:
        """One draft step: returns the pre-norm hidden state (`carry` of it feeds the next step). `mask0`: the
        step-0 mask (``step0_mask``); None once ``cache.compact`` holds the documents' masks."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos_sin = self.rotary(hidden, position_ids)
        return self.midlayer(embeds, hidden, cos_sin, mask0, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of pre-norm hidden states (any leading shape)."""
        return self.lm_head(self.norm(hidden))

    def carry(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the next draft step consumes of a step's pre-norm output: itself, or with `norm_output`
        the final-norm state (vLLM's `aux_output`), which keeps its scale from drifting over the steps."""
        return self.norm(hidden) if self.norm_output else hidden

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen target embeddings: the export tensors."""
        return {k: v for k, v in self.state_dict().items() if k != EMBED_PARAM}


def draft_config_from_target(
    target_config: dict, draft_vocab_size: int, aux_layer_ids: list[int], architecture: Mapping[str, bool] | None = None
) -> LlamaConfig:
    """A one-layer Llama config shaped like the target (same hidden, heads, rope), with the flags of
    `architecture` (names from `ARCHITECTURE_FLAGS`) that are on."""
    hidden = int(target_config["hidden_size"])
    heads = int(target_config["num_attention_heads"])
    keep = [
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "rms_norm_eps", "hidden_act", "max_position_embeddings", "vocab_size",
        "rope_theta", "rope_scaling", "rope_parameters",
    ]
    kwargs = {k: target_config[k] for k in keep if target_config.get(k) is not None}
    kwargs.setdefault("num_key_value_heads", heads)
    config = LlamaConfig(
        **kwargs,
        num_hidden_layers=1,
        head_dim=int(target_config.get("head_dim") or hidden // heads),
        tie_word_embeddings=False,
    )
    config.draft_vocab_size = min(int(draft_vocab_size), int(target_config["vocab_size"]))
    config.target_hidden_size = hidden
    config.eagle_aux_hidden_state_layer_ids = list(aux_layer_ids)
    for flag, on in (architecture or {}).items():
        if flag not in ARCHITECTURE_FLAGS:
            raise ValueError(f"unknown drafter architecture flag {flag!r}; known: {ARCHITECTURE_FLAGS}")
        if on:
            setattr(config, flag, True)
    return config


def build_drafter(
    target_config: dict,
    embed_tokens: torch.Tensor,
    draft_vocab_size: int,
    aux_layer_ids: list[int],
    seed: int = 0,
    architecture: Mapping[str, bool] | None = None,
) -> Eagle3Drafter:
    """Create a drafter with seeded random weights and the target's frozen embeddings."""
    config = draft_config_from_target(target_config, draft_vocab_size, aux_layer_ids, architecture)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Eagle3Drafter(config)
    finally:
        torch.random.set_rng_state(gen_state)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed_tokens)
    return model
