"""Hidden-state extraction on the tiny target: exact capture, the vLLM layer convention, loss masks,
token batching, quarantine (too long, NaN/inf, out of memory) and the actor's stats side file."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.base.layout import RunLayout
from pipeline.hidden.extract import (
    HIDDEN_CONVENTION,
    Captured,
    HiddenStateExtractor,
    capture,
    capture_groups,
    check_layer_ids,
    extract_rows,
    load_target,
    prepare_sample,
    read_extract_stats,
    rms_norm,
    split_on_oom,
    token_batches,
    training_table,
)
from pipeline.profiles import load_profile
from training.target import NORM_KEY, read_target_tensor

AUX = [1, 2, 3]  # the tiny target has 4 layers; default_aux_layer_ids(4) spreads to these
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tiny_target):
    return load_target(str(tiny_target))[0]


def _seqs(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 120_000, n).tolist() for n in lengths]


def _padded(seqs: list[list[int]]) -> torch.Tensor:
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    for j, s in enumerate(seqs):
        ids[j, : len(s)] = torch.tensor(s)
    return ids


# ----------------------------------------------------------------------------- capture


def test_capture_equals_output_hidden_states_exactly_in_fp32(model):
    seqs = _seqs([37, 20, 5, 64])
    with torch.inference_mode():
        ref = model.model(input_ids=_padded(seqs), output_hidden_states=True)
    for j, (aux, final) in enumerate(capture(model, seqs, AUX)):
        n = len(seqs[j])
        want = torch.cat([ref.hidden_states[i][j, :n] for i in AUX], dim=-1).numpy()
        assert aux.dtype == np.float32 and aux.shape == (n, 3 * 128) and final.shape == (n, 128)
        np.testing.assert_array_equal(aux, want)
        np.testing.assert_array_equal(final, ref.last_hidden_state[j, :n].numpy())


def test_batched_capture_matches_each_sequence_alone(model):
    """Padding and grouping change nothing beyond GEMM blocking noise; the longest row is bit-exact."""
    seqs = _seqs([50, 31, 8, 3], seed=1)
    batched = capture(model, seqs, AUX)
    for j, s in enumerate(seqs):
        alone = capture(model, [s], AUX)[0]
        if j == 0:
            np.testing.assert_array_equal(batched[j][0], alone[0])
        np.testing.assert_allclose(batched[j][0], alone[0], rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(batched[j][1], alone[1], rtol=1e-5, atol=1e-4)


def test_final_state_reproduces_target_logits(model):
    seqs = _seqs([12])
    _, final = capture(model, seqs, AUX)[0]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor(seqs)).logits[0]
        recomputed = torch.from_numpy(final) @ model.lm_head.weight.T
    torch.testing.assert_close(recomputed, logits, rtol=1e-5, atol=1e-4)


def test_capture_is_what_vllm_eagle3_feeds_the_drafter(model):
    """Run vLLM's own ``LlamaModel.forward`` (installed package) over the HF layers, split into
    vLLM's (hidden, residual) form, with aux layers set through ``EagleModelMixin``.

    vLLM appends ``hidden + residual`` at layer index ``start_layer`` before the loop and at
    ``idx + 1`` after layer ``idx``: id i is the input of layer i. Our capture must equal it
    exactly, and must not equal the residual-free ``hidden`` (the MLP output alone)."""
    import vllm.model_executor.models.llama as vllm_llama
    from vllm.model_executor.models.interfaces import EagleModelMixin

    base = model.model

    class VllmShapedLayer:
        """An HF decoder layer returning (mlp_out, residual) as vLLM's layers do."""

        def __init__(self, layer):
            self.layer = layer

        def __call__(self, positions, hidden, residual):
            x = hidden if residual is None else hidden + residual
            attn, _ = self.layer.self_attn(hidden_states=self.layer.input_layernorm(x),
                                           position_embeddings=base.rotary_emb(x, positions), attention_mask=None)
            r = x + attn
            return self.layer.mlp(self.layer.post_attention_layernorm(r)), r

    mlp_only: dict[int, torch.Tensor] = {}

    class Recording(VllmShapedLayer):
        def __init__(self, layer, idx):
            super().__init__(layer)
            self.idx = idx

        def __call__(self, positions, hidden, residual):
            out = super().__call__(positions, hidden, residual)
            mlp_only[self.idx + 1] = out[0]
            return out

    class HFInVllmShape(EagleModelMixin):
        start_layer = 0

        def __init__(self):
            self.end_layer = len(base.layers)
            self.layers = [Recording(layer, i) for i, layer in enumerate(base.layers)]

        def embed_input_ids(self, ids):
            return base.embed_tokens(ids)

        def norm(self, hidden, residual):
            stream = hidden + residual
            return base.norm(stream), stream

    fake = HFInVllmShape()
    fake._set_aux_hidden_state_layers(tuple(AUX))
    seq = _seqs([23], seed=3)[0]
    ids = torch.tensor([seq])
    one_rank = SimpleNamespace(is_first_rank=True, is_last_rank=True)
    with torch.inference_mode(), mock.patch.object(vllm_llama, "get_pp_group", return_value=one_rank):
        vllm_final, vllm_aux = vllm_llama.LlamaModel.forward(fake, ids, torch.arange(len(seq))[None], None)
    aux, final = capture(model, [seq], AUX)[0]
    np.testing.assert_array_equal(aux, torch.cat(vllm_aux, dim=-1)[0].numpy())
    np.testing.assert_array_equal(final, vllm_final[0].numpy())
    for k, i in enumerate(AUX):
        assert not np.allclose(aux[:, k * 128:(k + 1) * 128], mlp_only[i][0].numpy(), atol=1e-3)
    assert HIDDEN_CONVENTION == "vllm:input_of_layer"


def test_vllm_backend_final_norm_matches_the_target(model, tiny_target):
    """The vLLM backend captures id L (pre-norm stream) and applies the final norm itself."""
    seq = _seqs([17])[0]
    with torch.inference_mode():
        out = model.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
        pre_norm = {}
        handle = model.model.norm.register_forward_pre_hook(lambda m, a: pre_norm.setdefault("x", a[0]))
        model.model(input_ids=torch.tensor([seq]))
        handle.remove()
    normed = rms_norm(pre_norm["x"], read_target_tensor(tiny_target, NORM_KEY), model.config.rms_norm_eps)
    torch.testing.assert_close(normed, out.last_hidden_state, rtol=0, atol=0)


def test_layer_ids_are_checked():
    assert check_layer_ids([1, 2, 3], 4) == [1, 2, 3]
    for bad in ([2, 1, 3], [1, 1, 3], [1, 2, 4], [-1, 2, 3], []):
        with pytest.raises(ValueError):
            check_layer_ids(bad, 4)


# ----------------------------------------------------------------------------- loss mask


def _conversations() -> list[dict]:
    rows = [json.loads(line) for name in ("chat", "tools") for line in (REPO / f"data/prompts/{name}.jsonl").open()]
    return [r for r in rows if any(m["role"] == "assistant" for m in r["messages"])]


@pytest.mark.parametrize("template", [False, True], ids=["builtin", "model-template"])
def test_loss_mask_covers_every_assistant_turn_through_end_of_turn(template, tiny_target):
    profile = load_profile("deepseek", str(tiny_target) if template else None)
    eot, header = profile.eot_id, profile.encode("<｜Assistant｜>")[-1]
    convs = _conversations()
    assert sum(any(m.get("tool_calls") for m in c["messages"]) for c in convs) >= 5, "needs tool-call turns"
    for conv in convs:
        rendered = profile.render_prompt(conv["messages"], conv.get("tools"), True)
        response = profile.encode("Let me think.</think>Here it is." + profile.eot_text)
        ids, mask = prepare_sample(rendered.ids, rendered.assistant_mask, response, 10_000, "truncate")
        p = len(rendered.ids)
        assert ids == rendered.ids + response
        assert mask[p:].all() and ids[-1] == eot, "the whole response, end-of-turn included"
        spans = _spans(mask[:p])
        turns = [m for m in conv["messages"] if m["role"] == "assistant"]
        assert len(spans) == len(turns)
        for (a, b), turn in zip(spans, turns, strict=True):
            assert ids[a - 1] == header and ids[b - 1] == eot and not mask[b]
            body = turn.get("content") or ""
            if turn.get("tool_calls"):
                body += profile.render_tool_calls(turn["tool_calls"])
            assert profile.decode(ids[a:b]) == "</think>" + body + profile.eot_text
        assert not mask[p - 2: p].any(), "the opened assistant header of the prompt is not trained on"


def _spans(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def test_too_long_samples_are_truncated_or_quarantined():
    prompt, amask, out = [5] * 6, [0, 0, 1, 1, 0, 0], [7] * 10
    ids, mask = prepare_sample(prompt, amask, out, 8, "truncate")
    assert len(ids) == 8 and mask.tolist() == [0, 0, 1, 1, 0, 0, 1, 1]
    assert prepare_sample(prompt, amask, out, 8, "quarantine").startswith("too_long: 16 tokens")
    assert prepare_sample(prompt, [0] * 6, out, 4, "truncate") == (
        "no_assistant_tokens: no assistant token left to train on after truncation to extraction.max_len 4")
    # nothing cut: an empty answer and no earlier assistant turn (the reason said "after truncation" here too)
    assert prepare_sample(prompt, [0] * 6, [], 99, "truncate") == (
        "no_assistant_tokens: the sample holds no assistant token (an empty answer)")
    assert prepare_sample(prompt, [0] * 5, out, 99, "truncate").startswith("mask_mismatch")


# ----------------------------------------------------------------------------- batching


def test_token_batches_respect_the_budget_and_sort_by_length():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 700, 300).tolist() + [900, 1500]
    groups = token_batches(lengths, 1024)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert len(g) * longest <= 1024 or len(g) == 1
        assert [lengths[i] for i in g] == sorted((lengths[i] for i in g), reverse=True)
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    assert padded < 1.05 * sum(lengths), "sorting and cutting where it pays keep padding small"
    few = rng.integers(32, 768, 64).tolist()
    fill = _greedy_fill(few, 4096)
    assert _padded_tokens(few, token_batches(few, 4096)) < _padded_tokens(few, fill)
    assert token_batches([5, 5, 5], 15, group_cost=0) == [[0, 1, 2]]
    assert token_batches([], 64) == []


def _padded_tokens(lengths, groups):
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


def _greedy_fill(lengths, budget):
    """The simplest token batching: sorted, each group filled up to the budget."""
    groups = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


# ----------------------------------------------------------------------------- quarantine


def _sample_rows(lengths: list[int], seed: int = 0) -> list[dict]:
    return [{"sample_id": f"s{j}", "dataset": "d", "row_index": j, "source": "t", "prompt_ids": s[:2],
             "prompt_assistant_mask": [0, 0], "output_ids": s[2:]} for j, s in enumerate(_seqs(lengths, seed))]


def test_nan_states_are_quarantined_and_other_rows_kept(tiny_target):
    poisoned, _, _ = load_target(str(tiny_target))
    bad_token = 4242
    with torch.no_grad():
        poisoned.model.embed_tokens.weight[bad_token] = float("nan")
    rows = _sample_rows([30, 12, 40, 9])
    rows[1]["output_ids"][3] = bad_token
    out, bad, n = extract_rows(rows, lambda s, g: capture_groups(poisoned, s, g, AUX), max_len=64,
                               too_long="truncate", batch_tokens=256, hidden=128, n_aux=3)
    assert [r["sample_id"] for r, _ in bad] == ["s1"] and bad[0][1].startswith("non_finite")
    assert sorted(r["sample_id"] for r in out) == ["s0", "s2", "s3"]
    assert all(np.isfinite(r["aux_hidden"]).all() for r in out)
    assert n.quarantined == {"non_finite": 1} and n.samples == 3


def test_out_of_memory_splits_the_group_then_quarantines_what_cannot_fit(model):
    """A launch that runs out of memory above 100 padded tokens: groups are halved until they fit,
    and a sample too large alone is quarantined instead of crashing the actor."""
    rows = _sample_rows([120, 40, 40, 30, 20])
    calls: list[int] = []

    def capture_fn(seqs, groups):
        for group in groups:
            def launch(idx):
                cost = len(idx) * max(len(seqs[i]) for i in idx)
                calls.append(cost)
                if cost > 100:
                    raise torch.OutOfMemoryError("simulated: CUDA out of memory")
                return next(capture_groups(model, seqs, [idx], AUX))
            yield from split_on_oom(launch, group, [len(seqs[i]) for i in group])

    out, bad, n = extract_rows(rows, capture_fn, max_len=200, too_long="truncate", batch_tokens=1000,
                               hidden=128, n_aux=3)
    assert [(r["sample_id"], reason) for r, reason in bad] == [("s0", "out_of_memory: 120 tokens do not fit alone")]
    assert sorted(r["sample_id"] for r in out) == ["s1", "s2", "s3", "s4"]
    reference = dict(zip(["s1", "s2", "s3", "s4"], capture(model, [r["prompt_ids"] + r["output_ids"]
                                                                   for r in rows[1:]], AUX), strict=True))
    for r in out:
        np.testing.assert_allclose(r["aux_hidden"], reference[r["sample_id"]][0], rtol=1e-5, atol=1e-4)
    assert max(c for c in calls if c <= 100) <= 100 and len(calls) > 3


def test_a_captured_shape_error_is_quarantined():
    rows = _sample_rows([6])
    wrong = Captured([0], [6], torch.zeros(1, 6, 100), torch.ones(1, dtype=torch.bool))
    out, bad, _ = extract_rows(rows, lambda s, g: iter([wrong]), max_len=64, too_long="truncate",
                               batch_tokens=64, hidden=128, n_aux=3)
    assert not out and bad[0][1].startswith("shape: hidden states (6, 100)")


# ----------------------------------------------------------------------------- the actor


def test_extractor_actor_rows_quarantine_and_stats(tiny_target, tmp_path):
    rows = _sample_rows([30, 12, 70, 9])
    batch = pa.Table.from_pylist(rows)
    actor = HiddenStateExtractor(str(tiny_target), AUX, 64, "quarantine", 128, RunLayout(tmp_path),
                                 stats_dir=str(tmp_path / "stats"))
    table = actor(batch)
    assert table.column("sample_id").to_pylist() == ["s0", "s1", "s3"]  # longest first within a call
    got = {r["sample_id"]: r for r in table.to_pylist()}
    aux, final = capture(actor.capture_fn.model, [rows[0]["prompt_ids"] + rows[0]["output_ids"]], AUX)[0]
    np.testing.assert_allclose(np.asarray(got["s0"]["aux_hidden"]), aux, rtol=1e-5, atol=1e-5)
    assert np.asarray(got["s0"]["loss_mask"]).tolist() == [0, 0] + [1] * 28
    # the target's own greedy choice at every position, from its full forward (logits included)
    seq = rows[0]["prompt_ids"] + rows[0]["output_ids"]
    with torch.no_grad():
        logits = actor.capture_fn.model(torch.tensor([seq])).logits[0]
    assert np.asarray(got["s0"]["target_ids"]).tolist() == logits.argmax(-1).tolist()
    quarantined = pq.read_table(tmp_path / "quarantine").to_pylist()
    assert [(q["sample_id"], q["stage"]) for q in quarantined] == [("s2", "extract")]
    assert quarantined[0]["reason"] == "too_long: 70 tokens exceed extraction.max_len 64"
    stats = read_extract_stats(tmp_path / "stats")
    assert stats["samples"] == 3 and stats["tokens"] == 30 + 12 + 9 and stats["quarantined"] == {"too_long": 1}
    assert stats["peak_rss_mb"] > 100 and stats["convention"] == HIDDEN_CONVENTION
    assert stats["aux_layer_ids"] == AUX and stats["bytes_per_token"] == 4 * 128 * 4 and stats["device"] == "cpu"
    empty = actor(pa.Table.from_pylist([rows[2]]))
    assert empty.num_rows == 0 and empty.schema == training_table([], target_ids=True).schema == table.schema
    assert read_extract_stats(tmp_path / "stats")["quarantined"] == {"too_long": 2}


def test_statistics_files_that_do_not_read_are_counted_apart_not_raised(tmp_path):
    """The report reads them after training: a damaged one (by hand or a disk fault; they are written atomically)
    raised there, and the run's trained drafter was never reported."""
    from pipeline.report.summary import format_report
    from tests.unit.test_heldout_datasets import BASE as REPORT_BASE  # the fields every report has

    good = {"samples": 3, "tokens": 40, "busy_s": 2.0, "peak_rss_mb": 900.0, "bytes_per_token": 2048,
            "quarantined": {"too_long": 1}, "aux_layer_ids": [1, 2, 3]}
    (tmp_path / "extract-h-1.json").write_text(json.dumps(good))
    (tmp_path / "extract-h-2.json").write_text('{"samples": 3, "tok')
    (tmp_path / "extract-h-3.json").write_text(json.dumps(dict(good, quarantined={"too_long": "1"})))
    stats = read_extract_stats(tmp_path)
    assert stats["samples"] == 3 and stats["quarantined"] == {"too_long": 1} and stats["unreadable_files"] == 2
    (tmp_path / "extract-h-1.json").unlink()
    assert read_extract_stats(tmp_path) == {"unreadable_files": 2}
    text = format_report({**REPORT_BASE, "training": {"extraction": {"unreadable_files": 2}}}, tmp_path)
    assert "2 statistics files in extract_stats/ did not read" in text and "None samples" not in text
