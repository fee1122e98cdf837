"""EAGLE-3 draft model whose parameter names are exactly the exported checkpoint keys.

Structure (matches vLLM's `Eagle3LlamaForCausalLM` with default flags):
  g        = fc(cat(aux_low, aux_mid, aux_high))          # only for target states (step 0)
  x        = cat(input_layernorm(embed(tok)), hidden_norm(h))   # width 2H
  h1       = h + o_proj(attn(x))                           # residual is the un-normed h
  h2       = h1 + mlp(post_attention_layernorm(h1))        # pre-norm output, fed to the next step
  logits   = lm_head(norm(h2))                             # over the draft vocab
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from training.ttt_attention import StepKVCache, cached_step_attention

EMBED_PARAM = "embed_tokens.weight"


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
        mask0: torch.Tensor,
        cache: StepKVCache,
    ) -> torch.Tensor:
        b, length, _ = x.shape

        def heads(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.view(b, length, n, self.head_dim).transpose(1, 2)

        q = heads(self.q_proj(x), self.num_heads)
        k = heads(self.k_proj(x), self.num_kv_heads)
        v = heads(self.v_proj(x), self.num_kv_heads)
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = cached_step_attention(q, k, v, cache, mask0)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


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

    def forward(self, embeds, hidden, cos_sin, mask0, cache) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        h = hidden + self.self_attn(x, cos_sin, mask0, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter. `config` is a LlamaConfig with `draft_vocab_size`, `target_hidden_size`."""

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

    @property
    def draft_to_target(self) -> torch.Tensor:
        """Target token id of each draft-vocab entry."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def project(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Fuse the three target states (B, L, 3*H_t) into the draft width (B, L, H)."""
        return self.fc(aux_hidden)

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        mask0: torch.Tensor,
        cache: StepKVCache,
    ) -> torch.Tensor:
        """One draft step: returns the pre-norm hidden state, which the next step consumes."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos_sin = self.rotary(hidden, position_ids)
        return self.midlayer(embeds, hidden, cos_sin, mask0, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of pre-norm hidden states (any leading shape)."""
        return self.lm_head(self.norm(hidden))

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen target embeddings: the export tensors."""
        return {k: v for k, v in self.state_dict().items() if k != EMBED_PARAM}


def draft_config_from_target(
    target_config: dict, draft_vocab_size: int, aux_layer_ids: list[int]
) -> LlamaConfig:
    """A one-layer Llama config shaped like the target (same hidden, heads, rope)."""
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
    return config


def build_drafter(
    target_config: dict,
    embed_tokens: torch.Tensor,
    draft_vocab_size: int,
    aux_layer_ids: list[int],
    seed: int = 0,
) -> Eagle3Drafter:
    """Create a drafter with seeded random weights and the target's frozen embeddings."""
    config = draft_config_from_target(target_config, draft_vocab_size, aux_layer_ids)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Eagle3Drafter(config)
    finally:
        torch.random.set_rng_state(gen_state)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed_tokens)
    return model
