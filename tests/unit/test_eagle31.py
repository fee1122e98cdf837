"""EAGLE-3.1 structure flags (vLLM's llama_eagle3.py semantics), their export, and the acceptance-aware losses."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig

from tests.unit.test_training import EXPORT_KEYS, fake_rows, packed, small_drafter
from training.config import ARCHITECTURE_FLAGS, DraftTrainConfig
from training.export import export_draft, load_exported
from training.loss import (
    acceptance_prob,
    kl_divergence,
    reach_update,
    step_loss,
    step_view,
    total_variation,
    ttt_forward,
    unroll,
)
from training.model import Eagle3Drafter, architecture_of, build_drafter
from training.simulate import propose_all
from training.ttt_attention import StepKVCache, step0_mask

pytestmark = pytest.mark.usefixtures("one_thread")

LOSSES = ("ce", "tv", "lk_alpha", "lk_lambda")
# config.json keys of a plain export before EAGLE-3.1 existed (with a target config giving only rope_theta)
PLAIN_CONFIG_KEYS = {
    "architectures", "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "vocab_size", "draft_vocab_size",
    "target_hidden_size", "tie_word_embeddings", "attention_bias", "torch_dtype", "eagle_config",
    "aux_hidden_state_convention", "rope_theta",
}


def flagged_drafter(seed: int = 0, **flags: bool) -> Eagle3Drafter:
    """`small_drafter`'s weights and vocab in a drafter built with `flags`; its extra norms get random weights
    (all-ones norms would hide a chunk or weight mix-up)."""
    base = small_drafter(seed=seed)
    config = LlamaConfig(**base.config.to_dict())
    for flag, on in flags.items():
        setattr(config, flag, on)
    model = Eagle3Drafter(config)
    missing, _ = model.load_state_dict(base.state_dict(), strict=False)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in missing or name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    return model


# --------------------------------------------------------------------------- a hand-written vLLM forward


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama rotary embedding of x (heads, L, d) at integer positions."""
    d = x.shape[-1]
    angles = pos[:, None].float() * theta ** (-torch.arange(0, d, 2).float() / d)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def reference_first_step(m: Eagle3Drafter, tokens: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """vLLM's combine_hidden_states + LlamaModel.forward for one sequence (L,) at positions 0..L-1: the
    pre-norm state, written from the formulas."""
    c, layer = m.config, m.midlayer
    eps, arch = c.rms_norm_eps, architecture_of(c)
    if arch["norm_before_fc"]:
        aux = rms(aux, m.input_norm.weight, eps)
    if arch["fc_norm"]:
        aux = torch.cat([rms(a, n.weight, eps) for a, n in zip(aux.chunk(3, -1), m.fc_norm, strict=True)], -1)
    h = aux @ m.fc.weight.T
    normed = rms(h, layer.hidden_norm.weight, eps)
    x = torch.cat([rms(m.embed_tokens.weight[tokens], layer.input_layernorm.weight, eps), normed], -1)
    att, length, d = layer.self_attn, tokens.shape[0], c.head_dim
    theta = c.rope_parameters["rope_theta"]
    pos = torch.arange(length)
    q = rope((x @ att.q_proj.weight.T).view(length, -1, d).transpose(0, 1), pos, theta)
    k = rope((x @ att.k_proj.weight.T).view(length, -1, d).transpose(0, 1), pos, theta)
    v = (x @ att.v_proj.weight.T).view(length, -1, d).transpose(0, 1)
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = (q @ k.transpose(1, 2)) / math.sqrt(d) + torch.full((length, length), -math.inf).triu(1)
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(length, -1) @ att.o_proj.weight.T
    h1 = (normed if arch["norm_before_residual"] else h) + attn
    mlp, y = layer.mlp, rms(h1, layer.post_attention_layernorm.weight, eps)
    swiglu = torch.nn.functional.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)
    return h1 + swiglu @ mlp.down_proj.weight.T


def first_step(m: Eagle3Drafter, tokens: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    doc = torch.zeros(1, tokens.shape[0], dtype=torch.long)
    pos = torch.arange(tokens.shape[0])[None]
    with torch.no_grad():
        return m.step(tokens[None], m.project(aux[None]), pos, step0_mask(doc), StepKVCache())[0]


@pytest.mark.parametrize("flags", [
    {}, {"fc_norm": True}, {"norm_before_fc": True}, {"norm_before_residual": True},
    {"fc_norm": True, "norm_before_fc": True}, dict.fromkeys(ARCHITECTURE_FLAGS, True),
])
def test_each_flag_changes_the_forward_exactly_as_vllm_computes_it(flags):
    gen = torch.Generator().manual_seed(3)
    tokens, aux = torch.randint(0, 50, (9,), generator=gen), 3 * torch.randn(9, 96, generator=gen)
    model = flagged_drafter(**flags)
    with torch.no_grad():
        want = reference_first_step(model, tokens, aux)
    got = first_step(model, tokens, aux)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if flags.keys() - {"norm_output"}:  # each structural flag has an effect on the first step
        assert not torch.allclose(got, first_step(flagged_drafter(), tokens, aux), atol=1e-3)


def test_norm_output_feeds_the_post_norm_state_to_the_next_step():
    batch = packed(fake_rows([12, 10]), row_len=24)
    in_draft = torch.ones_like(batch.doc_ids, dtype=torch.bool)
    plain, normed = flagged_drafter(), flagged_drafter(norm_output=True)
    with torch.no_grad():
        got = [h for _, h in unroll(normed, batch, in_draft, 2)]
        mask0, cache = step0_mask(batch.doc_ids), StepKVCache()
        views = [step_view(batch, in_draft, k) for k in range(2)]
        h0 = normed.step(views[0].tokens, normed.project(batch.aux_hidden), views[0].position_ids, mask0, cache)
        h1 = normed.step(views[1].tokens, normed.norm(h0), views[1].position_ids, mask0, cache)
        base = [h for _, h in unroll(plain, batch, in_draft, 2)]
    kept = views[0].trained | views[1].trained  # the unroll computes the indices some step trains only
    torch.testing.assert_close(got[0][kept], h0[kept], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1][kept], h1[kept], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], base[0], rtol=0, atol=0)  # the first step is not affected
    assert not torch.allclose(got[1][kept], base[1][kept], atol=1e-3)
    assert torch.equal(normed.carry(h0), normed.norm(h0)) and torch.equal(plain.carry(h0), h0)


def test_propose_all_feeds_the_carried_state_like_vllm():
    model = flagged_drafter(fc_norm=True, norm_output=True).eval()
    gen = torch.Generator().manual_seed(4)
    ids, aux = torch.randint(0, 50, (16,), generator=gen), torch.randn(16, 96, generator=gen)
    got = propose_all(model, ids, aux, k=2)
    tokens0 = torch.cat([ids[1:], ids[-1:]])[None]
    doc, pos = torch.zeros(1, 16, dtype=torch.long), torch.arange(16)[None]
    with torch.no_grad():
        chains = {}
        for fed in ("carried", "pre-norm"):
            cache = StepKVCache()
            h0 = model.step(tokens0, model.project(aux[None]), pos, step0_mask(doc), cache)
            t1 = model.draft_to_target[model.logits(h0).argmax(-1)]
            h1 = model.step(t1, model.carry(h0) if fed == "carried" else h0, pos + 1, step0_mask(doc), cache)
            chains[fed] = torch.stack([t1[0], model.draft_to_target[model.logits(h1).argmax(-1)][0]])
    assert torch.equal(got, chains["carried"])
    assert not torch.equal(chains["carried"][1], chains["pre-norm"][1])  # the test can tell the two apart


def test_build_drafter_takes_the_config_flags_and_keeps_the_seeded_plain_weights():
    cfg = DraftTrainConfig()  # the default is EAGLE-3.1 with the ce loss (chosen by bench/bench_choices.py)
    assert cfg.architecture() == {**dict.fromkeys(ARCHITECTURE_FLAGS, False), "fc_norm": True, "norm_output": True}
    assert cfg.loss == "ce"
    assert DraftTrainConfig(fc_norm=False, norm_output=False).architecture() == dict.fromkeys(ARCHITECTURE_FLAGS, False)
    target = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                  vocab_size=50, rms_norm_eps=1e-6, rope_theta=10000.0)
    embed = torch.randn(50, 32)
    plain = build_drafter(target, embed, 20, [1, 2, 3], seed=5)
    new = build_drafter(target, embed, 20, [1, 2, 3], seed=5, architecture=cfg.architecture())
    assert plain.fc_norm is None and plain.input_norm is None and not plain.norm_output
    assert len(new.fc_norm) == 3 and new.input_norm is None and new.norm_output
    for name, t in plain.state_dict().items():
        assert torch.equal(t, new.state_dict()[name]), name
    with pytest.raises(ValueError, match="unknown drafter architecture flag"):
        build_drafter(target, embed, 20, [1, 2, 3], architecture={"fc_norms": True})
    with pytest.raises(ValueError):
        DraftTrainConfig(loss="kl")


# --------------------------------------------------------------------------- export


def test_eagle31_export_roundtrips_flags_keys_and_outputs(tmp_path):
    flags = dict.fromkeys(ARCHITECTURE_FLAGS, True)
    model = flagged_drafter(**flags)
    out = export_draft(model, tmp_path / "e31", target_config={"rope_theta": 10000.0})
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        # vLLM prefixes "model." to these: model.input_norm.weight, model.fc_norm.{i}.weight
        assert set(fh.keys()) == EXPORT_KEYS | {"input_norm.weight", *(f"fc_norm.{i}.weight" for i in range(3))}
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ARCHITECTURE_FLAGS} == flags  # top-level, where vLLM reads each of them
    assert set(config) == PLAIN_CONFIG_KEYS | set(ARCHITECTURE_FLAGS)
    back = load_exported(out)
    assert architecture_of(back.config) == flags
    with torch.no_grad():
        back.embed_tokens.weight.copy_(model.embed_tokens.weight)  # the target's, not in the export
    want, got = model.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
    batch = packed(fake_rows([12, 10]), row_len=24)
    in_draft = torch.ones_like(batch.doc_ids, dtype=torch.bool)
    with torch.no_grad():
        for (_, a), (_, b) in zip(unroll(model, batch, in_draft, 3), unroll(back, batch, in_draft, 3), strict=True):
            assert torch.equal(a, b)


def test_plain_export_has_exactly_the_old_keys_and_reads_back_plain(tmp_path):
    out = export_draft(small_drafter(), tmp_path / "plain", target_config={"rope_theta": 10000.0})
    config = json.loads((out / "config.json").read_text())
    assert set(config) == PLAIN_CONFIG_KEYS  # nothing new: older vLLM builds load it as before
    assert set(config["eagle_config"]) == {"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state"}
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert set(fh.keys()) == EXPORT_KEYS
    assert architecture_of(load_exported(out).config) == dict.fromkeys(ARCHITECTURE_FLAGS, False)


def test_load_exported_reads_norm_before_fc_from_eagle_config_like_vllm(tmp_path):
    model = flagged_drafter(norm_before_fc=True)
    out = export_draft(model, tmp_path / "nbf", target_config={})
    config = json.loads((out / "config.json").read_text())
    config["eagle_config"]["norm_before_fc"] = config.pop("norm_before_fc")
    (out / "config.json").write_text(json.dumps(config))
    back = load_exported(out)
    assert back.input_norm is not None and torch.equal(back.input_norm.weight, model.input_norm.weight)


# --------------------------------------------------------------------------- losses on hand-made distributions


def logits_of(*probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_acceptance_and_total_variation_on_hand_made_distributions():
    p = logits_of([0.5, 0.5, 0.0], [0.2, 0.3, 0.5])
    q = logits_of([0.25, 0.25, 0.5], [0.2, 0.3, 0.5])
    torch.testing.assert_close(acceptance_prob(q, p), torch.tensor([0.5, 1.0], dtype=torch.float64))
    torch.testing.assert_close(total_variation(q, p), torch.tensor([0.5, 0.0], dtype=torch.float64))
    # TV is half the L1 distance, and symmetric
    half_l1 = 0.5 * (p.exp() - q.exp()).abs().sum(-1)
    torch.testing.assert_close(total_variation(q, p), half_l1)
    torch.testing.assert_close(total_variation(p, q), half_l1)
    # KL(p || q) of the first row: 0.5 log 2 + 0.5 log 2
    torch.testing.assert_close(kl_divergence(q, p), torch.tensor([math.log(2), 0.0], dtype=torch.float64))
    assert step_loss("tv", q, p).item() == pytest.approx(0.25)
    assert step_loss("lk_alpha", q, p).item() == pytest.approx(-(math.log(0.5) + math.log(1.0)) / 2)


def test_lk_lambda_blends_kl_and_tv_by_the_mean_acceptance():
    torch.manual_seed(0)
    draft, teacher = torch.randn(6, 9, dtype=torch.float64), torch.randn(6, 9, dtype=torch.float64)
    kl, tv = kl_divergence(draft, teacher).mean(), total_variation(draft, teacher).mean()
    lam = math.exp(-3.0 * acceptance_prob(draft, teacher).mean().item())
    assert step_loss("lk_lambda", draft, teacher, lk_eta=3.0).item() == pytest.approx(lam * kl + (1 - lam) * tv)
    assert step_loss("lk_lambda", draft, teacher, lk_eta=0.0).item() == pytest.approx(kl.item())  # plain KL
    assert step_loss("lk_lambda", draft, teacher, lk_eta=1e4).item() == pytest.approx(tv.item())  # plain TV
    # the blend weight is a constant for the gradient
    d = draft.clone().requires_grad_(True)
    step_loss("lk_lambda", d, teacher).backward()
    d_kl, d_tv = draft.clone().requires_grad_(True), draft.clone().requires_grad_(True)
    kl_divergence(d_kl, teacher).mean().backward()
    total_variation(d_tv, teacher).mean().backward()
    torch.testing.assert_close(d.grad, lam * d_kl.grad + (1 - lam) * d_tv.grad)


@pytest.mark.parametrize("name", LOSSES)
def test_each_loss_is_zero_or_minimal_at_the_target_and_its_gradient_pushes_toward_it(name):
    torch.manual_seed(1)
    teacher = 2 * torch.randn(4, 7, dtype=torch.float64)
    if name == "tv" or name == "lk_alpha":
        assert step_loss(name, teacher.clone(), teacher).item() == pytest.approx(0.0, abs=1e-12)
    draft = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    before = total_variation(draft, teacher).mean().item()
    step_loss(name, draft, teacher).backward()
    with torch.no_grad():
        moved = draft - 0.05 * draft.grad / draft.grad.norm()
    assert total_variation(moved, teacher).mean().item() < before
    assert step_loss(name, moved, teacher).item() < step_loss(name, draft.detach(), teacher).item()
    assert step_loss(name, draft[:0], teacher[:0]).item() == 0


def test_row_weights_of_one_give_the_unweighted_loss():
    torch.manual_seed(2)
    draft, teacher = torch.randn(5, 8), torch.randn(5, 8)
    for name in LOSSES:
        plain = step_loss(name, draft, teacher)
        assert torch.equal(step_loss(name, draft, teacher, torch.ones(5)), plain)
        assert step_loss(name, draft, teacher, torch.full((5,), 0.5)).item() == pytest.approx(0.5 * plain.item())


def test_reach_multiplies_earlier_acceptance_and_is_one_when_everything_was_accepted():
    batch = packed(fake_rows([8]), row_len=10)
    in_draft = torch.ones_like(batch.doc_ids, dtype=torch.bool)
    in_draft[0, 5] = False  # the target's choice after index 5 lies outside the draft vocab
    view = step_view(batch, in_draft, 0)
    rows, cols = view.valid.nonzero(as_tuple=True)
    ones = torch.ones(batch.doc_ids.shape)
    all_in = step_view(batch, torch.ones_like(in_draft), 0)
    r_all, c_all = all_in.valid.nonzero(as_tuple=True)
    assert torch.equal(reach_update(ones, all_in, r_all, c_all, torch.ones(r_all.numel())), ones)  # plain weighting
    alpha = torch.linspace(0.1, 0.9, rows.numel())
    got = reach_update(ones, view, rows, cols, alpha)
    assert torch.equal(got[rows, cols], alpha)
    assert got[0, 4] == 0  # trained, but its target token is never drafted: the chain stops there
    untrained = ~view.trained
    assert untrained.any() and torch.equal(got[untrained], ones[untrained])


def test_acceptance_weighting_keeps_step_zero_and_shrinks_later_steps():
    model = flagged_drafter()
    batch = packed(fake_rows([12, 10]), row_len=24)
    lm_head_draft = torch.randn(20, 32)
    for name in LOSSES:
        plain = ttt_forward(model, batch, lm_head_draft, ttt_steps=3, loss=name)
        weighted = ttt_forward(model, batch, lm_head_draft, ttt_steps=3, loss=name, acceptance_weighting=True)
        assert weighted.step_losses[0] == pytest.approx(plain.step_losses[0], rel=1e-6)
        assert all(w < p for w, p in zip(weighted.step_losses[1:], plain.step_losses[1:], strict=True))
    default = ttt_forward(model, batch, lm_head_draft, ttt_steps=3)
    assert default.step_losses == ttt_forward(model, batch, lm_head_draft, ttt_steps=3, loss="ce").step_losses


@pytest.mark.parametrize("name", LOSSES)
def test_a_few_training_steps_reduce_each_loss_on_an_eagle31_drafter(name):
    model = flagged_drafter(fc_norm=True, norm_output=True)
    batch = packed(fake_rows([12, 10]), row_len=24)
    lm_head_draft = torch.randn(20, 32, generator=torch.Generator().manual_seed(6))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        out = ttt_forward(model, batch, lm_head_draft, ttt_steps=3, loss=name, acceptance_weighting=True)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.95 * losses[0], losses
    assert model.fc_norm[0].weight.grad.abs().sum() > 0  # the new norms are trained
