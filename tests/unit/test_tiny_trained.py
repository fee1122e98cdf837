"""The trained tiny target's parts, without the minutes of training: the corpus, the tied softmax, the forward.

The full build (and its held-out scores) is tests/integration/test_tiny_trained.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.base.config import ChecksConfig
from pipeline.checks.validate import check_roundtrip, check_structure
from pipeline.demo.tiny_domain import conversations, prompt_rows
from pipeline.demo.tiny_trained import (
    CONST_CHANNEL,
    CONST_VALUE,
    Shape,
    Vocab,
    _init,
    assemble,
    encode,
    forward,
    tied_log_probs,
    train,
)
from pipeline.profiles.deepseek import load_deepseek_profile

SMALL = Shape(hidden=32, layers=2, heads=2, head_dim=16, intermediate=48, vocab=129_280)


def test_corpus_is_seeded_and_in_the_chat_format():
    profile = load_deepseek_profile()
    convs = conversations(60, seed=7)
    assert convs == conversations(60, seed=7) and convs != conversations(60, seed=8)
    assert {c.thinking for c in convs} == {True, False}
    for c in convs:
        ids, start = encode(c, profile)
        prompt, out = ids[:start], ids[start:]
        assert prompt[-1] == (profile.think_start_id if c.thinking else profile.think_end_id)
        assert out.count(profile.think_end_id) == int(c.thinking) and out[-1] == profile.eot_id
        sample = {"output_ids": out, "prompt_ids": prompt, "thinking": c.thinking, "finish_reason": "stop"}
        assert check_structure(sample, profile, ChecksConfig()) is None
        assert check_roundtrip(sample, profile, ChecksConfig()) is None  # the canonical tokenization


def test_shipped_prompts_are_the_generators():
    """data/prompts/shop.jsonl is what `python -m pipeline.demo.tiny_domain` writes (held out from training)."""
    from pipeline.demo.tiny_domain import PROMPTS_ROWS, PROMPTS_SEED

    path = Path(__file__).resolve().parents[2] / "data" / "prompts" / "shop.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == prompt_rows(PROMPTS_ROWS, PROMPTS_SEED)


def test_tied_softmax_is_the_full_softmax():
    gen = torch.Generator().manual_seed(0)
    vocab, used = 50, torch.tensor([3, 7, 8, 20, 41])
    h = torch.randn(6, 16, generator=gen)
    head, unused = torch.randn(len(used), 16, generator=gen), torch.randn(16, generator=gen)
    full = unused.repeat(vocab, 1)
    full[used] = head
    want = torch.log_softmax(h @ full.T, -1)
    logp, rest = tied_log_probs(h, head, unused, vocab - len(used))
    torch.testing.assert_close(logp, want[:, used])
    torch.testing.assert_close(rest.exp(), 1 - want[:, used].exp().sum(-1))


def test_forward_is_the_checkpoints_llama():
    """The training forward and transformers' Llama on the assembled checkpoint give the same logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = Shape(hidden=32, layers=2, heads=2, head_dim=16, intermediate=48, vocab=300)
    vocab = Vocab(torch.arange(0, 300, 3), torch.arange(1, 300, 5), s.vocab)
    w = _init(s, len(vocab.inputs), len(vocab.outputs), torch.Generator().manual_seed(1))
    with torch.no_grad():
        for k, t in w.items():  # away from the init (unit norms, zero unused row) so every tensor matters
            t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(len(k))) * 0.1)
    full = assemble(w, vocab)
    cfg = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                      num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.heads,
                      head_dim=s.head_dim, rms_norm_eps=s.eps, rope_theta=s.rope_theta, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(full, strict=True)
    ids = vocab.inputs[torch.randint(0, len(vocab.inputs), (2, 9), generator=torch.Generator().manual_seed(2))]
    with torch.no_grad():
        want = model(ids).logits
        got = forward(full, ids, s) @ full["lm_head.weight"].T
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_assembled_checkpoint_ties_every_unused_row_and_pins_the_constant_channel():
    s = Shape(hidden=32, layers=2, heads=2, head_dim=16, intermediate=48, vocab=100)
    vocab = Vocab(torch.tensor([0, 5, 9, 40]), torch.tensor([5, 40]), s.vocab)
    w = _init(s, 4, 2, torch.Generator().manual_seed(0))
    full = assemble(w, vocab)
    head, embed = full["lm_head.weight"], full["model.embed_tokens.weight"]
    assert head.shape == embed.shape == (100, 32)
    rest = [i for i in range(100) if i not in (5, 40)]
    assert torch.equal(head[rest], w["unused"].repeat(len(rest), 1))
    assert torch.equal(head[[5, 40]], w["head"]) and torch.equal(embed[[0, 5, 9, 40]], w["model.embed_tokens.weight"])
    assert bool((embed[:, CONST_CHANNEL] == CONST_VALUE).all())
    for i in range(s.layers):
        assert not full[f"model.layers.{i}.self_attn.o_proj.weight"][CONST_CHANNEL].any()
        assert not full[f"model.layers.{i}.mlp.down_proj.weight"][CONST_CHANNEL].any()


def test_training_is_deterministic_and_learns():
    """Two short runs give bit-identical weights; the loss falls; the unused ids end far below."""
    profile = load_deepseek_profile()
    a = train(profile, SMALL, steps=20, batch=8, heldout=16)
    b = train(profile, SMALL, steps=20, batch=8, heldout=16)
    assert a.weights.keys() == b.weights.keys()
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert a.losses == b.losses and a.losses[-1] < a.losses[0] - 0.4
    assert a.heldout.tokens > 100 and a.heldout.unused_mass < 1e-6


@pytest.mark.parametrize("seed", [0, 1])
def test_prompt_rows_are_messages_rows(seed):
    rows = prompt_rows(5, seed)
    assert all(set(r) == {"messages"} and r["messages"][-1]["role"] == "user" for r in rows)
