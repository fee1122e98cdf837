"""Offline hand-off: extracted hidden-state rows in Arrow IPC shards with an index.

Why this layout:
* Arrow IPC files are memory-mapped and read zero-copy, and use plain Arrow
  types (no Ray extension types), so a shard reads anywhere pyarrow does.
* One file holds N samples and is named by a hash of its sample ids: a retried
  batch rewrites the same file instead of adding a copy.
* A shard is written under a hidden temp name, fsynced and renamed, so a
  half-written shard is never visible. ``index.json`` is derived from the
  complete shards and rebuilt whenever it disagrees with them, so a crash
  between a rename and the index update loses nothing.
* States are stored as float32 or as bfloat16 bits (uint16); readers always
  get float32. The capture convention travels in every shard's metadata, and
  shards with a different convention, layer ids or width are refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.base.layout import RunLayout, atomic_path, atomic_write_json
from pipeline.hidden.extract import capture_metadata
from training.data import as_float32, from_bf16_bits

FORMAT = "eagle3-hidden-shards/1"
INDEX = RunLayout(".").hidden_index.name
META_KEY = b"eagle3_hidden"
SHARD_COLUMNS = ("sample_id", "input_ids", "loss_mask", "aux_hidden", "final_hidden")
# Keys two shards must agree on to be read as one dataset.
COMPATIBLE_KEYS = ("format", "aux_layer_ids", "convention", "final", "hidden_size", "dtype")


def shard_meta(aux_layer_ids: list[int], hidden_size: int, dtype: str = "float32", model: str = "") -> dict[str, Any]:
    """Metadata written into every shard (see ``pipeline.hidden.extract.capture_metadata``)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"shard dtype must be float32 or bfloat16, got {dtype!r}")
    return {"format": FORMAT, **capture_metadata(aux_layer_ids, hidden_size, dtype), "model": model}


def shard_file_name(sample_ids: Iterable[str]) -> str:
    digest = hashlib.sha256("\n".join(sorted(sample_ids)).encode()).hexdigest()[:20]
    return f"shard-{digest}.arrow"


# ----------------------------------------------------------------------------- bf16 bits


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits with round-to-nearest-even (exact for values already in bf16)."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)


def _stored(a: np.ndarray, dtype: str) -> np.ndarray:
    """An extraction array (float, or bf16 bits as uint16) in the shard's storage dtype."""
    a = np.asarray(a)
    if dtype == "bfloat16":
        return a if a.dtype == np.uint16 else to_bf16_bits(a)
    return as_float32(a)


# ----------------------------------------------------------------------------- encode / decode


def _flat_list(arrays: list[np.ndarray], value_type: pa.DataType, large: bool) -> pa.Array:
    lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = np.concatenate([a.reshape(-1) for a in arrays]) if arrays else np.zeros(0)
    cls = pa.LargeListArray if large else pa.ListArray
    return cls.from_arrays(pa.array(offsets if large else offsets.astype(np.int32)),
                           pa.array(values, type=value_type))


def encode_rows(rows: list[dict[str, Any]], meta: dict[str, Any]) -> pa.Table:
    """Training rows -> one Arrow table; states flattened, their width fixed by the metadata."""
    dtype, hidden, n_aux = meta["dtype"], meta["hidden_size"], len(meta["aux_layer_ids"])
    value_type = pa.uint16() if dtype == "bfloat16" else pa.float32()
    aux = [_stored(r["aux_hidden"], dtype) for r in rows]
    final = [_stored(r["final_hidden"], dtype) for r in rows]
    for r, a, f in zip(rows, aux, final, strict=True):
        n = len(r["input_ids"])
        if a.shape != (n, n_aux * hidden) or f.shape != (n, hidden) or len(r["loss_mask"]) != n:
            raise ValueError(f"row {r['sample_id']!r}: shapes {a.shape}/{f.shape} do not match {n} tokens x {hidden}")
    cols = {
        "sample_id": pa.array([str(r["sample_id"]) for r in rows], pa.string()),
        "input_ids": _flat_list([np.asarray(r["input_ids"], np.int32) for r in rows], pa.int32(), False),
        "loss_mask": _flat_list([np.asarray(r["loss_mask"], np.int8) for r in rows], pa.int8(), False),
        "aux_hidden": _flat_list(aux, value_type, True),
        "final_hidden": _flat_list(final, value_type, True),
    }
    if rows and all(r.get("target_ids") is not None for r in rows):  # optional: training computes it when absent
        targets = [np.asarray(r["target_ids"], np.int32) for r in rows]
        if any(len(t) != len(r["input_ids"]) for t, r in zip(targets, rows, strict=True)):
            raise ValueError("target_ids and input_ids lengths differ")
        cols["target_ids"] = _flat_list(targets, pa.int32(), False)
    table = pa.table(cols)
    return table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()})


def table_meta(schema: pa.Schema) -> dict[str, Any]:
    raw = (schema.metadata or {}).get(META_KEY)
    if raw is None:
        raise ValueError("not a hidden-state shard (no eagle3_hidden metadata)")
    return json.loads(raw)


def decode_table(table: pa.Table) -> Iterator[dict[str, Any]]:
    """Rows in the training contract (float32 states), read zero-copy where the dtype allows."""
    meta = table_meta(table.schema)
    hidden, n_aux, bf16 = meta["hidden_size"], len(meta["aux_layer_ids"]), meta["dtype"] == "bfloat16"
    keys = ["input_ids", "loss_mask", "aux_hidden", "final_hidden"]
    keys += ["target_ids"] if "target_ids" in table.column_names else []
    cols = {k: table.column(k).combine_chunks() for k in keys}
    flat = {k: (c.offsets.to_numpy(), c.values.to_numpy(zero_copy_only=False)) for k, c in cols.items()}
    ids = table.column("sample_id").to_pylist()

    def cut(key: str, j: int, width: int | None) -> np.ndarray:
        off, vals = flat[key]
        a = vals[off[j]: off[j + 1]]
        if width is None:
            return a
        a = a.reshape(-1, width)
        return from_bf16_bits(a) if bf16 else a

    for j, sid in enumerate(ids):
        row = {"sample_id": sid, "input_ids": cut("input_ids", j, None).astype(np.int64),
               "loss_mask": cut("loss_mask", j, None), "aux_hidden": cut("aux_hidden", j, n_aux * hidden),
               "final_hidden": cut("final_hidden", j, hidden)}
        if "target_ids" in cols:
            row["target_ids"] = cut("target_ids", j, None)
        yield row


def unreadable_shard(path: Path, why: str) -> Exception:
    """The one-line error for a file in the shard folder that does not read: it names the file and the way out."""
    from pipeline.base.config import UnreadableFile

    return UnreadableFile(f"{path}: {why}; move it away or delete it (a resumed extraction extracts its samples "
                          "again)")


def open_shard(path: str | Path) -> tuple[dict[str, Any], pa.Table]:
    """(metadata, table) of one shard, read zero-copy. A file that is not a whole hidden-state shard (cut short,
    another Arrow file under a shard's name) is ``UnreadableFile`` naming it, never a raw Arrow error."""
    path = Path(path)
    try:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_file(source).read_all()
        table.validate()
    except (pa.ArrowException, OSError) as e:
        raise unreadable_shard(path, f"not a readable Arrow shard ({' '.join(str(e).split())})") from None
    missing = [c for c in SHARD_COLUMNS if c not in table.column_names]
    try:
        meta = table_meta(table.schema)
    except ValueError:  # no metadata, or metadata that is not JSON
        meta = None
    if missing or not isinstance(meta, dict) or meta.get("format") != FORMAT:
        why = f"lacks the columns {missing}" if missing else "has no eagle3_hidden metadata of this format"
        raise unreadable_shard(path, f"not a hidden-state shard (it {why})")
    return meta, table


def read_shard(path: str | Path) -> pa.Table:
    """One shard's table (``open_shard``)."""
    return open_shard(path)[1]


# ----------------------------------------------------------------------------- write


def write_shard(rows: list[dict[str, Any]], out_dir: str | Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Write one complete shard atomically (hidden temp file, fsync, rename); return its index entry."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = encode_rows(rows, meta)
    name = shard_file_name(table.column("sample_id").to_pylist())
    with atomic_path(out / name) as tmp, open(tmp, "wb") as fh, pa.ipc.new_file(fh, table.schema) as writer:
        writer.write_table(table)
    return {"file": name, "samples": table.num_rows, "tokens": _n_tokens(table), "bytes": (out / name).stat().st_size}


def _n_tokens(table: pa.Table) -> int:
    return sum(len(c.flatten()) for c in table.column("input_ids").chunks)


def write_shards(rows: Iterable[dict[str, Any]], out_dir: str | Path, meta: dict[str, Any],
                 samples_per_shard: int = 64) -> dict[str, Any]:
    """Write rows in shards of ``samples_per_shard``, skipping samples already in complete shards."""
    done = completed_sample_ids(out_dir)
    pending: list[dict[str, Any]] = []
    for r in rows:
        if r["sample_id"] in done:
            continue
        pending.append(r)
        if len(pending) == samples_per_shard:
            write_shard(pending, out_dir, meta)
            pending = []
    if pending:
        write_shard(pending, out_dir, meta)
    return build_index(out_dir)


# ----------------------------------------------------------------------------- index and resume


def shard_files(out_dir: str | Path) -> list[Path]:
    """Complete shards only: temp files are hidden (leading dot) until renamed."""
    return sorted(Path(out_dir).glob("shard-*.arrow"))


def build_index(out_dir: str | Path) -> dict[str, Any]:
    """Scan the complete shards, check they agree, and (re)write ``index.json`` atomically.

    A sample found in more than one shard (a retried batch grouped differently)
    is listed under its later shards' ``skip`` so every reader yields it once.
    """
    out = Path(out_dir)
    entries, seen, meta = [], set(), None
    for f in shard_files(out):
        m, t = open_shard(f)
        if meta is None:
            meta = m
        elif any(m.get(k) != meta.get(k) for k in COMPATIBLE_KEYS):
            raise unreadable_shard(f, f"a shard of another extraction: its metadata {m} does not match {meta}")
        ids = t.column("sample_id").to_pylist()
        skip = sorted(set(ids) & seen)
        seen.update(ids)
        entries.append({"file": f.name, "samples": len(ids), "tokens": _n_tokens(t), "bytes": f.stat().st_size,
                        "target_ids": "target_ids" in t.column_names, **({"skip": skip} if skip else {})})
    tokens = sum(e["tokens"] for e in entries)
    size = sum(e["bytes"] for e in entries)
    index = {"format": FORMAT, "meta": meta, "shards": entries, "samples": len(seen), "tokens": tokens, "bytes": size,
             "bytes_per_token": round(size / tokens, 1) if tokens else None}
    if entries:
        atomic_write_json(out / INDEX, index, indent=1)
    return index


def read_index(path: Path) -> dict[str, Any] | None:
    """``index.json`` at ``path``; None when it is absent, does not read or is not an index of this format (it is
    derived from the shards, so such a file is rebuilt, not reported)."""
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(index, dict) or index.get("format") != FORMAT or "meta" not in index:
        return None
    entries = index.get("shards")
    ok = isinstance(entries, list) and all(
        isinstance(e, dict) and isinstance(e.get("file"), str) and isinstance(e.get("bytes"), int) for e in entries)
    return index if ok else None


def load_index(out_dir: str | Path) -> dict[str, Any]:
    """``index.json`` when it lists exactly the complete shards on disk, else a rebuilt one."""
    index = read_index(Path(out_dir) / INDEX)
    if index is not None:
        listed = {(e["file"], e["bytes"]) for e in index["shards"]}
        if listed == {(f.name, f.stat().st_size) for f in shard_files(out_dir)}:
            return index
    return build_index(out_dir)


def completed_sample_ids(out_dir: str | Path) -> set[str]:
    """Samples already in complete shards (a restarted extraction skips them)."""
    ids: set[str] = set()
    for f in shard_files(out_dir):
        ids.update(read_shard(f).column("sample_id").to_pylist())
    return ids


def quarantined_ids(quarantine_dir: str | Path, stage: str = "extract") -> set[str]:
    """Samples an earlier extraction already quarantined (a resumed run does not retry them). A quarantine
    file that does not read is ``UnreadableFile`` naming it (``pipeline.base.records.read_rows``)."""
    from pipeline.base.records import read_rows

    return {r["sample_id"] for r in read_rows(Path(quarantine_dir), ["sample_id", "stage"]) if r["stage"] == stage}


def remove_stale_temps(out_dir: str | Path) -> int:
    """Delete temp files left by a killed writer (call only while no writer runs): hidden
    ``.shard-*.arrow.*`` names, from ``pipeline.base.layout.temp_path`` (or the older ``.tmpPID`` suffix)."""
    stale = list(Path(out_dir).glob(".shard-*.arrow.*"))
    for f in stale:
        f.unlink()
    return len(stale)


# ----------------------------------------------------------------------------- read


def read_hidden_shards(out_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Every stored sample once, as a training row (``training/data.py`` contract, float32 states)."""
    out = Path(out_dir)
    for e in load_index(out)["shards"]:
        skip = set(e.get("skip", ()))
        for row in decode_table(read_shard(out / e["file"])):
            if row["sample_id"] not in skip:
                yield row


def _load_shard_block(batch: dict[str, np.ndarray]) -> pa.Table:
    from pipeline.hidden.extract import training_table

    rows = []
    for path, skip in zip(batch["path"], batch["skip"], strict=True):
        drop = set(json.loads(skip))
        rows += [r for r in decode_table(read_shard(path)) if r["sample_id"] not in drop]
    return training_table(rows, target_ids=bool(batch["target_ids"][0]))


def hidden_shards_dataset(out_dir: str | Path):
    """A Ray Dataset of the shards' training rows, one block per shard, read lazily by Ray tasks.

    ``training.train.train_drafter`` accepts it as is (it takes a Dataset).
    """
    import ray.data

    out = Path(out_dir).resolve()
    shards = load_index(out)["shards"]
    if not shards:
        raise FileNotFoundError(f"no hidden-state shards in {out}")
    # one schema for every block: the target_ids column only when every shard has it (shards written before
    # extraction stored it, or with extraction.target_ids false, leave it to the training workers)
    uniform = all(e.get("target_ids", False) for e in shards)
    items = [{"path": str(out / e["file"]), "skip": json.dumps(e.get("skip", [])), "target_ids": uniform}
             for e in shards]
    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _load_shard_block, batch_size=1, batch_format="numpy")


# ----------------------------------------------------------------------------- Ray adapters


def _rows_from_batch(batch: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    keys = ("sample_id", "input_ids", "loss_mask", "aux_hidden", "final_hidden", "target_ids")
    keys = tuple(k for k in keys if k in batch)
    return [dict(zip(keys, vals, strict=True)) for vals in zip(*(batch[k] for k in keys), strict=True)]


class WriteHiddenShards:
    """Ray Data actor: each batch of extraction rows becomes one shard; returns one summary row per sample."""

    def __init__(self, out_dir: str, meta: dict[str, Any]) -> None:
        self.out_dir, self.meta = out_dir, meta

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        rows = _rows_from_batch(batch)
        if not rows:
            return pa.table({"sample_id": pa.array([], pa.string()), "shard": pa.array([], pa.string()),
                             "tokens": pa.array([], pa.int64())})
        entry = write_shard(rows, self.out_dir, self.meta)
        return pa.table({"sample_id": [r["sample_id"] for r in rows], "shard": [entry["file"]] * len(rows),
                         "tokens": [len(r["input_ids"]) for r in rows]})


SAMPLE_COLUMNS = ["sample_id", "dataset", "row_index", "source", "prompt_ids", "prompt_assistant_mask", "output_ids"]


def extract_to_shards(samples_dir: str | Path, out_dir: str | Path, *, model_dir: str, aux_layer_ids: list[int],
                      max_len: int, too_long: str, batch_tokens: int, layout: RunLayout,
                      samples_per_shard: int = 64, rows_per_call: int = 64, dtype: str = "float32",
                      num_actors: int = 1, num_cpus: float = 1.0, num_gpus: float = 0.0,
                      extractor_kwargs: dict[str, Any] | None = None,
                      ray_resources: dict[str, Any] | None = None) -> dict[str, Any]:
    """Samples parquet -> extraction actors -> shard writer; resumable. Returns the index summary.

    Samples already in complete shards, or quarantined by an earlier extraction (in ``layout.quarantine``,
    where this extraction quarantines too), are filtered out before the target runs.
    ``dtype=bfloat16`` halves the bytes (lossless for states captured in bf16 on GPU).
    ``ray_resources`` (``map_batches`` resource arguments, e.g. a TP engine's placement group; see
    pipeline.hidden.handoff.extraction_resources) replace ``num_cpus``/``num_gpus`` when given.
    """
    import pyarrow.compute as pc
    import ray.data

    from pipeline.hidden.extract import HiddenStateExtractor
    from training.target import read_target_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    done = completed_sample_ids(out)
    skipped = quarantined_ids(layout.quarantine) - done
    hidden = read_target_config(model_dir)["hidden_size"]
    meta = shard_meta(aux_layer_ids, hidden, dtype, model=str(model_dir))
    existing = load_index(out)["meta"]
    if existing and any(existing.get(k) != meta.get(k) for k in COMPATIBLE_KEYS):
        raise ValueError(f"{out} holds shards with {existing}, not {meta}: use another directory")
    done_ids = pa.array(sorted(done | skipped), pa.string())

    def not_done(t: pa.Table) -> pa.Table:
        return t.filter(pc.invert(pc.is_in(t["sample_id"], value_set=done_ids)))

    from pipeline.base.records import read_samples, read_samples_dataset

    def summary(written: int) -> dict[str, Any]:
        index = build_index(out)
        return {**{k: v for k, v in index.items() if k != "shards"}, "shards": len(index["shards"]),
                "resumed_done": len(done), "resumed_quarantined": len(skipped), "written_now": written}

    if all(r["sample_id"] in done or r["sample_id"] in skipped
           for r in read_samples(Path(samples_dir), ["sample_id"])[0]):
        return summary(0)  # every sample is in a shard or quarantined: no extraction actor is started
    kwargs = {"out_dtype": "bfloat16" if dtype == "bfloat16" else "float32", **(extractor_kwargs or {})}

    samples, _ = read_samples_dataset(Path(samples_dir), SAMPLE_COLUMNS)  # one row per sample id
    ds = samples.map_batches(not_done, batch_format="pyarrow")
    ds = ds.map_batches(
        HiddenStateExtractor,
        fn_constructor_args=(model_dir, aux_layer_ids, max_len, too_long, batch_tokens, layout),
        fn_constructor_kwargs=kwargs, batch_format="pyarrow", batch_size=rows_per_call,
        compute=ray.data.ActorPoolStrategy(size=num_actors),
        **(ray_resources or {"num_cpus": num_cpus, "num_gpus": num_gpus}),
    )
    ds = ds.map_batches(WriteHiddenShards, fn_constructor_args=(str(out), meta), batch_size=samples_per_shard,
                        batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0)
    return summary(sum(b.num_rows for b in ds.iter_batches(batch_format="pyarrow", batch_size=None)))


__all__ = [
    "WriteHiddenShards", "build_index", "completed_sample_ids", "extract_to_shards", "hidden_shards_dataset",
    "load_index", "read_hidden_shards", "shard_meta", "write_shard", "write_shards",
]
