"""Drafter training: TTT masks and alignment, vocab mapping, export, in-process resume (Ray Train: integration/)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig

from tests.helpers.training import AUX_IDS, small_cfg
from training.checkpoint import LocalCheckpoints
from training.config import DraftTrainConfig, default_aux_layer_ids, resolve_aux_layer_ids
from training.data import Batch, batches, collate, pack_rows, to_sample
from training.export import export_draft, load_exported
from training.loss import distill_cross_entropy, shift_left, step_view, ttt_forward, unroll
from training.model import Eagle3Drafter
from training.simulate import response_start, row_counts, walk_acceptance
from training.target import greedy_ids
from training.train import cosine_with_warmup, prepare_drafter, train_loop
from training.ttt_attention import StepKVCache, cached_step_attention, step0_mask
from training.vocab import build_vocab_mapping, count_loss_masked_tokens, mapping_from_ids, select_draft_ids

EXPORT_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")),
}


pytestmark = pytest.mark.usefixtures("one_thread")


def small_drafter(vocab: int = 50, draft_vocab: int = 20, hidden: int = 32, seed: int = 0) -> Eagle3Drafter:
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, num_hidden_layers=1)
    config.draft_vocab_size, config.target_hidden_size = draft_vocab, hidden
    config.eagle_aux_hidden_state_layer_ids = AUX_IDS
    torch.manual_seed(seed)
    model = Eagle3Drafter(config)
    ids = torch.arange(0, 2 * draft_vocab, 2) if 2 * draft_vocab <= vocab else torch.arange(draft_vocab)
    model.d2t.copy_(ids - torch.arange(draft_vocab))
    model.t2d.zero_()
    model.t2d[ids] = True
    return model


def fake_rows(lengths: list[int], vocab: int = 50, hidden: int = 32, prompt: int = 3, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i, n in enumerate(lengths):
        ids = rng.integers(0, vocab, n)
        rows.append(dict(sample_id=f"r{i}", input_ids=ids, loss_mask=(np.arange(n) >= prompt).astype(np.int8),
                         aux_hidden=rng.standard_normal((n, 3 * hidden)).astype(np.float32),
                         final_hidden=rng.standard_normal((n, hidden)).astype(np.float32),
                         target_ids=rng.integers(0, vocab, n)))
    return rows


def packed(rows: list[dict], row_len: int, num_rows: int = 1) -> Batch:
    samples = [to_sample(r, row_len) for r in rows]
    return collate(list(pack_rows(samples, row_len)), num_rows, row_len)


# --------------------------------------------------------------------------- config


def test_aux_layer_defaults_and_validation():
    assert default_aux_layer_ids(32) == [2, 16, 29]
    assert default_aux_layer_ids(4) == [1, 2, 3]  # [2, 2, 1] collides on 4 layers
    assert resolve_aux_layer_ids(DraftTrainConfig(), 32) == [2, 16, 29]
    with pytest.raises(ValueError):
        DraftTrainConfig(aux_layer_ids=[3, 2, 1])  # vLLM sorts ids: order must match
    with pytest.raises(ValueError):
        resolve_aux_layer_ids(DraftTrainConfig(aux_layer_ids=[1, 2, 4]), 4)  # id L is post-norm in HF
    with pytest.raises(ValueError):
        DraftTrainConfig(bogus=1)


def test_cosine_schedule_warms_up_then_decays_to_zero():
    f = cosine_with_warmup(10, 110)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.5)
    assert f(110) == pytest.approx(0.0, abs=1e-12)


# --------------------------------------------------------------------------- TTT attention


def test_step0_mask_is_causal_within_documents():
    docs = torch.tensor([[0, 0, 0, 1, 1, -1, -1]])
    m = step0_mask(docs)[0, 0]
    assert m[2].tolist() == [True, True, True, False, False, False, False]
    assert m[4].tolist() == [False, False, False, True, True, False, False]
    assert m[0].tolist() == [True, False, False, False, False, False, False]
    assert m[6].tolist() == [False] * 6 + [True]  # padding sees only itself, not the padding before it


def naive_ttt_attention(qs, ks, vs, mask0):
    """Reference: attention over all (k+1)*L keys with the explicit TTT mask."""
    length = qs[0].shape[-2]
    outs = []
    for k, q in enumerate(qs):
        keys = torch.cat(ks[: k + 1], dim=-2)
        values = torch.cat(vs[: k + 1], dim=-2)
        eye = torch.eye(length, dtype=torch.bool).expand(mask0.shape[0], 1, length, length)
        mask = torch.cat([mask0] + [eye] * k, dim=-1)
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        outs.append(torch.softmax(scores.masked_fill(~mask, -torch.inf), -1) @ values)
    return outs


def test_cached_attention_equals_explicit_ttt_mask():
    torch.manual_seed(0)
    b, h, length, d, steps = 2, 3, 7, 8, 4
    qs, ks, vs = ([torch.randn(b, h, length, d) for _ in range(steps)] for _ in range(3))
    mask0 = step0_mask(torch.tensor([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, -1]]))
    cache = StepKVCache()
    got = [cached_step_attention(q, k, v, cache, mask0) for q, k, v in zip(qs, ks, vs, strict=True)]
    for g, want in zip(got, naive_ttt_attention(qs, ks, vs, mask0), strict=True):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
    # the step-2 query at t=3 must ignore step-1/2 keys at other indices
    assert len(cache) == steps


def test_chunked_attention_over_a_long_packed_row_equals_the_explicit_mask():
    """Many short documents in one row: queries go in span-sized chunks (values and gradients unchanged)."""
    from training.ttt_attention import attention_span, first_visible

    torch.manual_seed(1)
    docs = torch.tensor([[0] * 5 + [1] * 3 + [2] * 6 + [3] * 4 + [4] * 2 + [-1] * 4,
                         [0] * 6 + [1] * 6 + [2] * 6 + [3] * 6])
    mask0 = step0_mask(docs)
    assert attention_span(first_visible(mask0)) == 6  # the longest document
    b, h, length, d, steps = 2, 2, docs.shape[1], 8, 3
    qs, ks, vs = ([torch.randn(b, h, length, d, requires_grad=True) for _ in range(steps)] for _ in range(3))
    cache = StepKVCache()
    got = [cached_step_attention(q, k, v, cache, mask0) for q, k, v in zip(qs, ks, vs, strict=True)]
    want = naive_ttt_attention(qs, ks, vs, mask0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(sum(g.square().sum() for g in got), [*qs, *ks, *vs])
    ref = torch.autograd.grad(sum(w.square().sum() for w in want), [*qs, *ks, *vs])
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- alignment and loss


def test_step_view_alignment_two_documents():
    row_a = dict(input_ids=np.array([10, 11, 12, 13, 14]), loss_mask=np.array([0, 0, 1, 1, 1]))
    row_b = dict(input_ids=np.array([20, 21, 22]), loss_mask=np.array([0, 1, 1]))
    rows = [{**r, "aux_hidden": np.zeros((len(r["input_ids"]), 6), np.float32),
             "final_hidden": np.zeros((len(r["input_ids"]), 2), np.float32),
             "target_ids": np.zeros(len(r["input_ids"]), np.int64)} for r in (row_a, row_b)]
    batch = packed(rows, row_len=10)
    in_draft = torch.ones_like(batch.doc_ids, dtype=torch.bool)
    v0 = step_view(batch, in_draft, 0)
    # step 0: index t reads token t+1 and predicts token t+2 (a loss-masked token of its own doc)
    assert v0.tokens[0, :8].tolist() == [11, 12, 13, 14, 20, 21, 22, 0]
    assert v0.position_ids[0, :8].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert v0.trained[0].tolist() == [True, True, True, False, False, True, False, False, False, False]
    v1 = step_view(batch, in_draft, 1)
    assert v1.tokens[0, :3].tolist() == [12, 13, 14]
    assert v1.position_ids[0, :2].tolist() == [1, 2]
    assert v1.trained[0].tolist() == [True, True, False, False, False, False, False, False, False, False]
    # a target argmax outside the draft vocab removes the position from the loss only
    in_draft[0, 2] = False  # target position 2 is what step 0 at t=1 is taught with
    v0b = step_view(batch, in_draft, 0)
    assert v0b.valid[0, :3].tolist() == [True, False, True] and v0b.trained[0, 1]


def test_shift_left_pads_with_fill():
    x = torch.tensor([[1, 2, 3, 4]])
    assert shift_left(x, 0, 9).tolist() == [[1, 2, 3, 4]]
    assert shift_left(x, 2, 9).tolist() == [[3, 4, 9, 9]]


def test_distill_cross_entropy_value_and_gradient_match_autograd():
    torch.manual_seed(0)
    draft = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(5, 11, dtype=torch.float64)
    got = distill_cross_entropy(draft, teacher)
    ref_draft = draft.detach().clone().requires_grad_(True)
    want = -(torch.softmax(teacher, -1) * torch.log_softmax(ref_draft, -1)).sum(-1).mean()
    torch.testing.assert_close(got, want)
    got.backward()
    want.backward()
    torch.testing.assert_close(draft.grad, ref_draft.grad)
    # a sharp teacher reduces it to ordinary cross-entropy on the teacher's argmax
    labels = torch.tensor([1, 5, 0, 2, 10])
    sharp = torch.nn.functional.one_hot(labels, 11).double() * 200
    torch.testing.assert_close(distill_cross_entropy(draft, sharp), torch.nn.functional.cross_entropy(draft, labels))
    assert distill_cross_entropy(draft[:0], teacher[:0]).item() == 0


def test_packed_documents_do_not_leak_into_each_other():
    model = small_drafter().eval()
    rows = fake_rows([9, 6])
    alone = packed(rows[:1], row_len=9)
    both = packed(rows, row_len=16)
    both_changed = packed([rows[0], fake_rows([6], seed=5)[0]], row_len=16)
    in_draft = lambda b: torch.ones_like(b.doc_ids, dtype=torch.bool)  # noqa: E731
    with torch.no_grad():
        a, b, c = ([model.logits(h) for _, h in unroll(model, x, in_draft(x), 3)] for x in (alone, both, both_changed))
    for k in range(3):
        n = 9 - (k + 1)  # indices whose step-k input token is still inside document A
        torch.testing.assert_close(a[k][0, :n], b[k][0, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b[k][0, :n], c[k][0, :n], rtol=0, atol=0)


def test_ttt_loss_weights_steps_and_backpropagates_through_the_unroll():
    model = small_drafter()
    batch = packed(fake_rows([12, 10]), row_len=24)
    lm_head_draft = torch.randn(20, 32)
    out = ttt_forward(model, batch, lm_head_draft, ttt_steps=3, step_decay=0.5)
    assert out.loss.item() == pytest.approx(sum(0.5**k * lk for k, lk in enumerate(out.step_losses)), rel=1e-5)
    assert out.step_counts[0] >= out.step_counts[1] > out.step_counts[2] > 0  # later steps run off the end
    # the last step's loss reaches fc only through the fed-back hidden states of earlier steps
    model.zero_grad()
    in_draft = torch.ones_like(batch.doc_ids, dtype=torch.bool)
    views = list(unroll(model, batch, in_draft, 3))
    model.logits(views[2][1]).sum().backward()
    assert model.fc.weight.grad.abs().sum() > 0
    assert model.embed_tokens.weight.grad is None  # frozen target embeddings


def full_width_step_losses(model, batch, lm_head_draft, ttt_steps, step_decay):
    """Reference: every TTT step on every index of the (B, L) batch (no compact layout), the `ce` loss."""
    in_draft = model.t2d[batch.target_ids] & (batch.doc_ids >= 0)
    mask0, cache = step0_mask(batch.doc_ids), StepKVCache()
    hidden, total, losses = model.project(batch.aux_hidden), 0.0, []
    for k in range(ttt_steps):
        view = step_view(batch, in_draft, k)
        out = model.step(view.tokens, hidden, view.position_ids, mask0, cache)
        rows, cols = view.valid.nonzero(as_tuple=True)
        teacher = batch.final_hidden[rows, cols + k + 1] @ lm_head_draft.T
        loss_k = distill_cross_entropy(model.logits(out[rows, cols]), teacher)
        total, hidden = total + step_decay**k * loss_k, model.carry(out)
        losses.append(float(loss_k.detach()))
    return total, losses


@pytest.mark.parametrize("row_len", [24, 64])  # 64: a row of several segments; 24: whole-row attention
def test_steps_on_the_trained_indices_only_equal_every_index_unrolled(row_len):
    """Queries only at the indices some step trains (the prompts give keys only): loss and gradients as
    when every step runs on every index, over two rows of packed documents with padding."""
    model = small_drafter()
    rows = fake_rows([12, 10, 7, 14, 9, 11, 5, 8], prompt=4)
    batch = collate(list(pack_rows([to_sample(r, row_len) for r in rows], row_len))[:2], 2, row_len)
    lm_head_draft = torch.randn(20, 32)
    params = [p for p in model.parameters() if p.requires_grad]
    out = ttt_forward(model, batch, lm_head_draft, ttt_steps=4, step_decay=0.8)
    got = torch.autograd.grad(out.loss, params)
    want_loss, want_steps = full_width_step_losses(model, batch, lm_head_draft, 4, 0.8)
    want = torch.autograd.grad(want_loss, params)
    assert out.step_losses == pytest.approx(want_steps, rel=1e-5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    # the steps really ran on fewer indices: each document's prompt is left out
    in_draft = model.t2d[batch.target_ids] & (batch.doc_ids >= 0)
    views = list(unroll(model, batch, in_draft, 4))
    kept = torch.stack([v.trained for v, _ in views]).any(0)
    assert 0 < int(kept.sum()) < int((batch.doc_ids >= 0).sum())
    assert all(bool((h[~kept] == 0).all()) for _, h in views)


def test_teacher_temperature_sharpens_the_target_distribution():
    model = small_drafter()
    batch = packed(fake_rows([12, 10]), row_len=24)
    lm_head_draft = torch.randn(20, 32)
    plain = ttt_forward(model, batch, lm_head_draft, ttt_steps=2)
    sharp = ttt_forward(model, batch, lm_head_draft, ttt_steps=2, teacher_temperature=0.25)
    same = ttt_forward(model, batch, lm_head_draft * 4, ttt_steps=2)  # T = 1/4 == logits x 4
    assert sharp.step_losses == pytest.approx(same.step_losses, rel=1e-5)
    assert sharp.step_losses != pytest.approx(plain.step_losses, rel=1e-3)
    assert sharp.step_accs == plain.step_accs  # accuracy is about argmax, which T does not move
    with pytest.raises(ValueError):
        DraftTrainConfig(teacher_temperature=0)


def test_rows_may_carry_states_as_bfloat16_bits():
    """Extraction can stream bf16 states as uint16 bit patterns; the loop reads them as the exact floats."""
    row = fake_rows([9])[0]
    aux = torch.from_numpy(np.asarray(row["aux_hidden"], np.float32)).bfloat16()
    final = torch.from_numpy(np.asarray(row["final_hidden"], np.float32)).bfloat16()
    packed_row = {**row, "aux_hidden": aux.view(torch.int16).numpy().view(np.uint16),
                  "final_hidden": final.view(torch.int16).numpy().view(np.uint16)}
    sample = to_sample(packed_row, 64, lambda f: np.zeros(len(f), np.int64))
    assert sample.aux_hidden.dtype == np.float32
    np.testing.assert_array_equal(sample.aux_hidden, aux.float().numpy())
    np.testing.assert_array_equal(sample.final_hidden, final.float().numpy())


# --------------------------------------------------------------------------- vocab


def test_vocab_counts_only_loss_masked_tokens_and_breaks_ties_by_id():
    rows = [dict(input_ids=np.array([5, 5, 7, 7, 7, 9, 3, 3]), loss_mask=np.array([0, 0, 1, 1, 1, 1, 1, 1]))]
    counts = count_loss_masked_tokens(rows, 12)
    assert counts[5] == 0 and counts[7] == 3 and counts[3] == 2 and counts[9] == 1
    assert select_draft_ids(counts, 2).tolist() == [3, 7]
    assert select_draft_ids(counts, 3).tolist() == [3, 7, 9]
    # fewer distinct tokens than the draft vocab: fill with the lowest unseen ids
    assert select_draft_ids(counts, 5).tolist() == [0, 1, 3, 7, 9]
    assert select_draft_ids(counts, 50).tolist() == list(range(12))


def test_vocab_mapping_d2t_t2d_roundtrip():
    m = build_vocab_mapping([dict(input_ids=np.array([4, 4, 8, 1]), loss_mask=np.ones(4))], 10, 3)
    assert m.d2t.dtype == torch.int64 and m.t2d.dtype == torch.bool
    assert m.draft_ids.tolist() == [1, 4, 8]
    assert m.d2t.tolist() == [1, 3, 6]  # target_id(i) - i
    assert torch.nonzero(m.t2d).flatten().tolist() == [1, 4, 8]
    with pytest.raises(ValueError):
        mapping_from_ids(np.array([4, 1]), 10)


# --------------------------------------------------------------------------- data


def test_rows_are_validated_truncated_and_packed():
    rows = fake_rows([5, 7, 3, 9])
    with pytest.raises(ValueError, match="lengths differ"):
        to_sample({**rows[0], "loss_mask": np.ones(4)}, 16)
    with pytest.raises(KeyError):
        to_sample({"input_ids": np.ones(3)}, 16)
    s = to_sample(rows[3], 6)
    assert len(s) == 6 and s.aux_hidden.shape == (6, 96)
    out = list(batches((to_sample(r, 8) for r in rows), batch_tokens=16, row_len=8))
    assert [b.input_ids.shape for b in out] == [(2, 8), (2, 8)]
    assert sum(b.num_tokens for b in out) == 5 + 7 + 3 + 8
    assert out[0].position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]


# --------------------------------------------------------------------------- target-backed tests


def test_generated_rows_follow_the_contract(tiny_rows, target_parts):
    row = tiny_rows[0]
    t = len(row["input_ids"])
    h = target_parts.hidden_size
    assert row["aux_hidden"].shape == (t, 3 * h) and row["final_hidden"].shape == (t, h)
    # final_hidden is post-norm: its logits reproduce the greedy continuation
    nxt = greedy_ids(torch.from_numpy(row["final_hidden"]), target_parts.lm_head).numpy()
    m = row["loss_mask"].astype(bool)
    assert (nxt[:-1][m[1:]] == row["input_ids"][1:][m[1:]]).mean() > 0.95


def test_export_load_roundtrip(tmp_path, tiny_target, target_parts, tiny_rows):
    cfg = DraftTrainConfig(draft_vocab_size=512, aux_layer_ids=AUX_IDS)
    vocab = build_vocab_mapping(tiny_rows, target_parts.vocab_size, cfg.draft_vocab_size)
    drafter = prepare_drafter(cfg, target_parts, vocab)
    with torch.no_grad():
        drafter.fc.weight.normal_()
    out = export_draft(drafter, tmp_path / "export", target_config=target_parts.config)
    with safe_open(str(out / "model.safetensors"), "pt") as fh:  # the default drafter is EAGLE-3.1
        assert set(fh.keys()) == EXPORT_KEYS | {f"fc_norm.{i}.weight" for i in range(3)}
        assert fh.get_tensor("d2t").dtype == torch.int64 and fh.get_tensor("t2d").dtype == torch.bool
    config = json.loads((out / "config.json").read_text())
    assert config["fc_norm"] is True and config["norm_output"] is True
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": AUX_IDS, "use_aux_hidden_state": True}
    assert config["draft_vocab_size"] == 512 and config["vocab_size"] == target_parts.vocab_size
    assert config["target_hidden_size"] == target_parts.hidden_size
    assert config["rope_theta"] == target_parts.config["rope_theta"]
    assert "input of target decoder layer" in config["aux_hidden_state_convention"]
    back = load_exported(out, tiny_target)
    want, got = drafter.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k


def test_full_vocab_export_omits_identity_mapping(tmp_path):
    model = small_drafter(vocab=20, draft_vocab=20)
    model.d2t.zero_()
    model.t2d.fill_(True)
    out = export_draft(model, tmp_path / "full", target_config={"rope_theta": 10000.0}, dtype=torch.bfloat16)
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert set(fh.keys()) == EXPORT_KEYS - {"d2t", "t2d"}  # vLLM rejects d2t without a reduced vocab
        assert fh.get_tensor("fc.weight").dtype == torch.bfloat16
    back = load_exported(out)
    assert torch.equal(back.d2t, model.d2t) and torch.equal(back.t2d, model.t2d)
    torch.testing.assert_close(back.fc.weight, model.fc.weight.to(torch.bfloat16).float())


def test_a_killed_re_export_leaves_no_old_config_beside_new_weights(tmp_path, monkeypatch):
    """config.json marks a whole export (``pipeline status``): a kill while a re-export writes its weights must
    not leave the old config beside them."""
    import training.export as export

    out = export_draft(small_drafter(seed=0), tmp_path / "export", target_config={})

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "save_file", killed)
    with pytest.raises(KeyboardInterrupt):
        export_draft(small_drafter(seed=1), out, target_config={})
    assert not (out / "config.json").exists()
    monkeypatch.undo()
    export_draft(small_drafter(seed=1), out, target_config={})
    torch.testing.assert_close(load_exported(out).fc.weight, small_drafter(seed=1).fc.weight, rtol=0, atol=0)


def test_response_start_is_where_the_last_masked_run_begins():
    assert response_start(np.array([0, 0, 1, 1])) == 2
    assert response_start(np.array([0, 1, 1, 0, 0, 1, 1, 1], np.int8)) == 5  # an earlier assistant turn first
    assert response_start(np.array([1, 1, 0, 1])) == 3
    assert response_start(np.array([1, 1, 1])) == 0


def test_simulated_decoding_of_a_multi_turn_row_starts_at_the_last_prompt_token():
    """The loss mask of a multi-turn sample also covers the prompt's earlier assistant turns; decoding the
    response starts after the whole prompt, so the row drafts as if only the response were masked."""
    drafter = small_drafter()
    row = fake_rows([40], prompt=30)[0]  # response 30..39
    multi_turn = row["loss_mask"].copy()
    multi_turn[10:18] = 1  # an earlier assistant turn in the prompt
    lm_head = torch.randn(50, 32)
    want = row_counts(drafter, [row], lm_head, k=3)
    assert want[0].drafts <= 9
    assert row_counts(drafter, [dict(row, loss_mask=multi_turn)], lm_head, k=3) == want


def test_walk_acceptance_counts_like_greedy_verification():
    target_next = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    prop = np.zeros((2, 10), np.int64)
    prop[0, 0], prop[1, 0] = 2, 3  # from t=0 both drafts right -> next start t=3
    prop[0, 3], prop[1, 3] = 5, 0  # from t=3 first right only -> t=5
    prop[0, 5] = 99  # miss -> t=6; then t=6, t=7 misses; t=8 cannot draft 2 more
    drafts, accepted = walk_acceptance(prop, target_next, start=0)
    assert drafts == 5 and accepted == [2, 1]


def test_walk_acceptance_counts_the_tail_like_vllm():
    """vLLM drafts k tokens every round until the request ends, and counts a draft past the end as
    accepted when the target's argmax there agrees: the last rounds count, with what the row can check."""
    target_next = np.arange(1, 11)  # 10 tokens; target_next[9] is the target's guess after the last one
    prop = np.zeros((3, 10), np.int64)
    prop[:, 5] = [7, 8, 0]  # t=5: two right -> t=8, whose verified token 9 is the last: the request ended
    drafts, accepted = walk_acceptance(prop, target_next, start=5)
    assert drafts == 1 and accepted == [1, 1, 0]
    prop[:, 5] = [7, 0, 0]  # t=5: one right -> t=7, which still drafts although only one token is left
    prop[:, 7] = [9, 10, 11]  # the second is checked against the guess after the last token; the third can't be
    drafts, accepted = walk_acceptance(prop, target_next, start=5)
    assert drafts == 2 and accepted == [2, 1, 0]
    assert walk_acceptance(prop, target_next, start=8) == (0, [0, 0, 0])  # nothing left to draft


def test_resume_after_interruption_matches_uninterrupted(tmp_path, tiny_target, target_parts, tiny_rows):
    rows = tiny_rows
    cfg = small_cfg()
    vocab = build_vocab_mapping(rows, target_parts.vocab_size, cfg.draft_vocab_size)
    full, _ = train_loop(cfg, tiny_target, tmp_path / "full", lambda e: rows, vocab)

    class Killed(Exception):
        pass

    def kill_at_5(step: int) -> None:
        if step == 5:
            raise Killed

    with pytest.raises(Killed):
        train_loop(cfg, tiny_target, tmp_path / "cut", lambda e: rows, vocab, after_step=kill_at_5)
    latest = LocalCheckpoints(tmp_path / "cut" / "checkpoints", cfg.keep_checkpoints).latest()
    assert latest is not None and latest.name == "step_0000003"
    resumed, _ = train_loop(cfg, tiny_target, tmp_path / "cut", lambda e: rows, vocab, resume_from=latest)
    for k, v in full.trainable_state_dict().items():
        assert torch.equal(v, resumed.trainable_state_dict()[k]), k
    logs = [(tmp_path / d / "metrics.jsonl").read_text().splitlines() for d in ("full", "cut")]
    steps = [[json.loads(ln)["step"] for ln in log] for log in logs]
    assert steps[0] == steps[1] == list(range(1, 9))
    losses = [[json.loads(ln)["loss"] for ln in log] for log in logs]
    assert losses[0] == losses[1]
    records = [json.loads(ln) for ln in logs[0]]
    # fill: real tokens over the batch's slots, so a user sees rows too short for their samples
    assert all(0 < r["fill"] <= 1 and r["tokens"] > 0 for r in records)
    assert records[0]["fill"] == pytest.approx(records[0]["tokens"] / cfg.batch_tokens)


def test_heldout_split_is_a_stable_nested_partition():
    import pyarrow as pa

    from training.heldout import heldout_mask, select_heldout

    ids = [f"chat:{i}:{i * 7919 % 10007:04x}" for i in range(20_000)]
    mask = heldout_mask(ids, 0.05)
    assert abs(mask.mean() - 0.05) < 0.006
    assert (heldout_mask(ids, 0.05) == mask).all() and not heldout_mask(ids, 0.0).any()
    assert (mask <= heldout_mask(ids, 0.1)).all()  # raising the fraction only adds held-out samples
    table = pa.table({"sample_id": ids[:500], "x": list(range(500))})
    kept, dropped = select_heldout(table, 0.2, keep=True), select_heldout(table, 0.2, keep=False)
    assert kept.num_rows > 0 and kept.num_rows + dropped.num_rows == 500
    assert set(kept["sample_id"].to_pylist()).isdisjoint(dropped["sample_id"].to_pylist())



def test_stored_target_ids_spare_the_worker_its_lm_head_pass(tiny_rows, target_parts):
    """Rows that carry the extraction's argmax train on exactly the ids a worker would compute, and the
    worker's full-vocab pass (the first epoch's main cost on a CPU) never runs for them."""
    from training.train import TargetIdsCache

    worker = TargetIdsCache(target_parts.lm_head, torch.device("cpu"))
    computed = [worker.sample(r, 512) for r in tiny_rows[:6]]
    assert len(worker.cache) == 6
    stored = [{**r, "target_ids": s.target_ids.astype(np.int32)} for r, s in zip(tiny_rows[:6], computed, strict=True)]
    fresh = TargetIdsCache(target_parts.lm_head, torch.device("cpu"))
    again = [fresh.sample(r, 512) for r in stored]
    assert not fresh.cache and "lm_head" not in vars(fresh)  # no device copy of the full lm_head either
    for a, b in zip(computed, again, strict=True):
        np.testing.assert_array_equal(a.target_ids, b.target_ids)
        assert b.target_ids.dtype == np.int64
    with pytest.raises(ValueError, match="5 target_ids for"):
        to_sample({**stored[0], "target_ids": stored[0]["target_ids"][:5]}, 512)


def test_segments_are_whole_documents_within_the_width():
    """Rows cut at document starts only; documents share a segment while it stays within the width."""
    from training.ttt_attention import first_visible, segments

    docs = torch.tensor([[0] * 3 + [1] * 2 + [2] * 4 + [3] * 1 + [-1] * 2,
                         [0] * 12])
    cuts = segments(first_visible(step0_mask(docs)), width=5)
    assert cuts == [(0, 0, 5), (0, 5, 10), (0, 10, 12), (1, 0, 12)]  # a lone wider document stays whole


def test_document_starts_are_the_step0_masks_first_visible_keys():
    """The compact path's O(L) document starts give the same first key, span and segments as the (L, L) mask,
    over packed rows with padding (padding sees only itself)."""
    from training.ttt_attention import attention_span, doc_starts, first_visible, segments

    rng = np.random.default_rng(3)
    for _ in range(20):
        rows = []
        for _ in range(3):
            lengths = rng.integers(1, 9, rng.integers(1, 6))
            ids = np.concatenate([np.full(n, d) for d, n in enumerate(lengths)])
            rows.append(np.concatenate([ids, np.full(40 - len(ids), -1)])[:40])
        docs = torch.tensor(np.stack(rows))
        first = first_visible(step0_mask(docs))
        assert torch.equal(doc_starts(docs), first)
        assert attention_span(doc_starts(docs)) == attention_span(first)
        assert segments(doc_starts(docs), 7) == segments(first, 7)


def test_a_batch_with_nothing_to_train_unrolls_to_a_zero_loss():
    """Every token a prompt (no compact query at all): the unroll still runs, every hidden state is zero and
    the loss is a zero that keeps the graph (DDP expects every gradient)."""
    model = small_drafter()
    batch = packed(fake_rows([9, 7], prompt=20), row_len=24)
    out = ttt_forward(model, batch, torch.randn(20, 32), ttt_steps=3, step_decay=0.8)
    assert out.loss.item() == 0 and out.step_accs == [0.0, 0.0, 0.0]
    out.loss.backward()
    assert model.lm_head.weight.grad is not None and float(model.lm_head.weight.grad.abs().sum()) == 0


def test_precision_decides_the_autocast_per_device(tmp_path, tiny_target, target_parts, tiny_rows):
    """`auto` is bf16 where the device computes it natively; the step's record says which one ran, and a bf16
    step trains the same fp32 weights (no weight is left in bf16)."""
    from training.train import uses_bf16

    native = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    cpu = torch.device("cpu")
    assert uses_bf16("auto", cpu) is native
    assert uses_bf16("bf16", cpu) and not uses_bf16("fp32", cpu)
    assert uses_bf16("auto", torch.device("cuda", 0))
    vocab = build_vocab_mapping(tiny_rows, target_parts.vocab_size, small_cfg().draft_vocab_size)
    finals = {}
    for precision in ("fp32", "bf16"):
        cfg = small_cfg().model_copy(update={"precision": precision, "steps": 3})
        drafter, metrics = train_loop(cfg, tiny_target, tmp_path / precision, lambda e: tiny_rows, vocab)
        assert metrics["bf16"] == float(precision == "bf16")
        assert all(v.dtype == torch.float32 for v in drafter.trainable_state_dict().values() if v.is_floating_point())
        finals[precision] = metrics["loss"]
    # the same batches and start: bf16 rounding moves the loss a little, not a lot
    assert finals["bf16"] == pytest.approx(finals["fp32"], rel=0.05)
