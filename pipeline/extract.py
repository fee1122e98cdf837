"""Capture what EAGLE-3 trains on: three auxiliary hidden states, the final state, the loss mask.

Convention (recorded with the data): aux layer id ``i`` names the *input* of
decoder layer ``i``, as vLLM's EAGLE-3 path captures it; in transformers that
is ``output_hidden_states[i]`` (index 0 = embeddings). The final state is the
last hidden state *after* the final norm, so target logits are
``final_hidden @ lm_head.T`` and need not be stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.records import QUARANTINE_SCHEMA, quarantine_row
from pipeline.stages import _atomic_write, batch_to_rows, rows_to_table, shard_name

HIDDEN_CONVENTION = "vllm:input_of_layer"


def loss_mask(prompt_assistant_mask: list[int], n_output: int) -> np.ndarray:
    """Assistant tokens only: earlier assistant turns in the prompt plus the whole response."""
    return np.concatenate([np.asarray(prompt_assistant_mask, dtype=np.int8), np.ones(n_output, dtype=np.int8)])


def token_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group indices so each padded group (count x longest) stays within ``batch_tokens``.

    Sorting by length keeps padding small; a single over-budget sample still gets a group.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def capture(model: Any, seqs: list[list[int]], aux_layer_ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(aux (T, 3H), final (T, H)) per sequence from one right-padded forward pass."""
    import torch

    device = next(model.parameters()).device
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    attn = torch.zeros(len(seqs), longest, dtype=torch.long)
    for j, s in enumerate(seqs):
        ids[j, : len(s)] = torch.tensor(s)
        attn[j, : len(s)] = 1
    with torch.inference_mode():
        out = model.model(input_ids=ids.to(device), attention_mask=attn.to(device), output_hidden_states=True)
    hs = out.hidden_states
    aux = torch.cat([hs[i] for i in aux_layer_ids], dim=-1).float().cpu().numpy()
    final = out.last_hidden_state.float().cpu().numpy()
    return [(aux[j, : len(s)], final[j, : len(s)]) for j, s in enumerate(seqs)]


def tensor_column(arrays: list[np.ndarray]) -> pa.Array:
    from ray.data.extensions import ArrowVariableShapedTensorArray

    return ArrowVariableShapedTensorArray.from_numpy(arrays)


class HiddenStateExtractor:
    """Ray Data actor: load the target once, turn sample rows into training rows.

    Rows that cannot be used (too long under ``too_long=quarantine``, NaN/inf
    states, shape errors) are written to the quarantine directory with a reason.
    """

    def __init__(self, model_dir: str, aux_layer_ids: list[int], max_len: int, too_long: str,
                 batch_tokens: int, quarantine_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        gpu = torch.cuda.is_available()
        dtype = torch.bfloat16 if gpu else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        if gpu:
            self.model = self.model.cuda()
        self.aux_layer_ids = aux_layer_ids
        self.max_len = max_len
        self.too_long = too_long
        self.batch_tokens = batch_tokens
        self.quarantine_dir = Path(quarantine_dir)
        self.hidden = self.model.config.hidden_size

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch_to_rows(batch)
        good, bad = [], []
        for r in rows:
            ids = list(r["prompt_ids"]) + list(r["output_ids"])
            mask = loss_mask(r["prompt_assistant_mask"], len(r["output_ids"]))
            if len(ids) > self.max_len:
                if self.too_long == "quarantine":
                    bad.append(quarantine_row(r, "extract", f"{len(ids)} tokens exceed extraction.max_len "
                                                            f"{self.max_len}"))
                    continue
                ids, mask = ids[: self.max_len], mask[: self.max_len]
            if not mask.any():
                bad.append(quarantine_row(r, "extract", "no assistant token left to train on after truncation"))
                continue
            good.append((r, ids, mask))
        out: list[dict[str, Any]] = []
        for group in token_batches([len(g[1]) for g in good], self.batch_tokens):
            states = capture(self.model, [good[i][1] for i in group], self.aux_layer_ids)
            for i, (aux, final) in zip(group, states, strict=True):
                r, ids, mask = good[i]
                problem = _state_problem(aux, final, len(ids), self.hidden, len(self.aux_layer_ids))
                if problem:
                    bad.append(quarantine_row(r, "extract", problem))
                    continue
                out.append({"sample_id": r["sample_id"], "input_ids": np.asarray(ids, dtype=np.int64),
                            "loss_mask": mask, "aux_hidden": aux, "final_hidden": final})
        if bad:
            _atomic_write(rows_to_table(bad, QUARANTINE_SCHEMA),
                          self.quarantine_dir / shard_name([b["sample_id"] for b in bad]))
        return training_table(out)


def training_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Rows in the training contract as an Arrow table with variable-shaped tensor columns."""
    if not rows:
        return pa.table({"sample_id": pa.array([], pa.string())})
    return pa.table({
        "sample_id": pa.array([r["sample_id"] for r in rows], pa.string()),
        "input_ids": tensor_column([r["input_ids"] for r in rows]),
        "loss_mask": tensor_column([r["loss_mask"] for r in rows]),
        "aux_hidden": tensor_column([r["aux_hidden"] for r in rows]),
        "final_hidden": tensor_column([r["final_hidden"] for r in rows]),
    })


def _state_problem(aux: np.ndarray, final: np.ndarray, n: int, hidden: int, n_aux: int) -> str | None:
    if aux.shape != (n, n_aux * hidden) or final.shape != (n, hidden):
        return f"hidden-state shapes {aux.shape}/{final.shape} do not match {n} tokens x {hidden}"
    if not (np.isfinite(aux).all() and np.isfinite(final).all()):
        return "NaN or inf in captured hidden states"
    return None


def bytes_per_token(hidden: int, n_aux: int = 3, itemsize: int = 4) -> int:
    """Storage per token of the captured states (ids and mask are negligible)."""
    return (n_aux + 1) * hidden * itemsize


def describe_capture(aux_layer_ids: list[int], hidden: int) -> str:
    return json.dumps({"aux_layer_ids": aux_layer_ids, "convention": HIDDEN_CONVENTION,
                       "final": "post_norm", "bytes_per_token_fp32": bytes_per_token(hidden, len(aux_layer_ids))})


__all__ = ["HiddenStateExtractor", "capture", "loss_mask", "token_batches", "bytes_per_token"]
