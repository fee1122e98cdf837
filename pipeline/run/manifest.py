"""Run manifest: what an output folder's samples were made with, checked before a run resumes there.

A resumed run skips every sample id already written. Sample ids hash the prompt, not the model,
so resuming into a folder written with another target, tokenizer, chat profile, sampling or
thinking setting would silently mix two distributions in one training set. The manifest records
those facts on the first run; a later run into the same folder must match them or stop.

Scaling, budgets, routing shares, checks and training settings may change between attempts:
they do not change what a finished sample means.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pipeline.base.config import UnreadableFile
from pipeline.base.layout import RunLayout, atomic_write_json
from pipeline.run.config import RunConfig

MANIFEST_FILE = RunLayout(".").manifest.name
FULL_HASH_LIMIT = 256 * 2**20  # weight files up to this total size are hashed; larger ones by name and size
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json",
                   "merges.txt", "chat_template.jinja", "generation_config.json")


class ManifestMismatch(ValueError):
    """The output folder holds samples made with different settings; the message lists each difference."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_fingerprint(model_dir: str | None) -> dict[str, Any]:
    """Digests of a model folder: config, tokenizer files and weights (hashed when small, else
    file names and sizes: hashing hundreds of GB on every start would cost minutes)."""
    if model_dir is None:
        return {"path": None}
    root = Path(model_dir)
    files = {p.name: p for p in sorted(root.iterdir()) if p.is_file()} if root.is_dir() else {}
    weights = [p for name, p in files.items() if name.endswith((".safetensors", ".bin", ".index.json"))]
    total = sum(p.stat().st_size for p in weights)
    hash_all = total <= FULL_HASH_LIMIT
    return {
        "config": _sha256(files["config.json"]) if "config.json" in files else None,
        "tokenizer": {n: _sha256(files[n]) for n in TOKENIZER_FILES if n in files},
        "weights": {p.name: _sha256(p) if hash_all or p.name.endswith(".json") else p.stat().st_size
                    for p in weights},
    }


def run_manifest(cfg: RunConfig) -> dict[str, Any]:
    """The settings that decide what a finished sample holds."""
    from pipeline.generate.sources.registry import source_kind

    sources = []
    for s in cfg.sources:
        fields = s.model_dump(include=set(source_kind(s).manifest))
        sources.append({"name": s.name, "kind": s.kind, **{k: fields.get(k) for k in source_kind(s).manifest}})
    return {
        "profile": cfg.model.profile,
        "model": model_fingerprint(cfg.model.path),
        "sampling": cfg.sampling.model_dump(),
        "thinking": {d.name: d.thinking for d in cfg.datasets},
        "sources": sources,
        "extraction": {"aux_layer_ids": cfg.extraction.aux_layer_ids, "max_len": cfg.extraction.max_len,
                       "too_long": cfg.extraction.too_long},
    }


def differences(old: Any, new: Any, prefix: str = "", *, lenient: bool = False) -> list[str]:
    """Dotted paths where two manifests differ, with both values. Keys present in only one side count
    as differences except under `thinking`, where adding a dataset is allowed, and among one source's own
    fields (``lenient``), where a field one version of the pipeline records and another does not (e.g. a
    transport address once recorded) says nothing about the samples. Below a field they count again: a key
    added to or taken from a source's ``extra_body`` changes what was asked for."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            path = f"{prefix}.{key}" if prefix else key
            if key not in old or key not in new:
                if prefix == "thinking" or lenient:
                    continue
                out.append(f"{path}: {old.get(key, '<absent>')!r} -> {new.get(key, '<absent>')!r}")
                continue
            out += differences(old[key], new[key], path)
        return out
    if prefix == "sources" and isinstance(old, list) and isinstance(new, list):
        old_by, new_by = {s["name"]: s for s in old}, {s["name"]: s for s in new}
        return [d for name in sorted(set(old_by) & set(new_by))
                for d in differences(old_by[name], new_by[name], f"sources.{name}", lenient=True)]
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


def check_or_write_manifest(cfg: RunConfig, out: Path, has_samples: bool) -> dict[str, Any]:
    """Write the manifest on a fresh folder; on resume, raise ManifestMismatch when settings differ.

    A folder with samples but no manifest (written before manifests existed) gets one written now:
    nothing is known to compare against."""
    manifest = run_manifest(cfg)
    path = RunLayout(out).manifest
    if path.exists() and has_samples:
        old = read_manifest(path)
        diffs = differences(old, manifest)
        if diffs:
            listing = "\n".join(f"  {d}" for d in diffs)
            raise ManifestMismatch(
                f"{out} holds samples made with other settings; resuming would mix them:\n{listing}\n"
                f"Use a new output_dir, or delete {path} if the existing samples are still what you want."
            )
    atomic_write_json(path, manifest, sort_keys=True)
    return manifest


def read_manifest(path: Path) -> dict[str, Any]:
    """A written manifest; one that cannot be read is an ``UnreadableFile`` saying what to do (never
    ignored: resuming without it would skip the check that the samples were made with these settings)."""
    what = None
    try:
        old = json.loads(path.read_bytes().decode("utf-8"))
        if not isinstance(old, dict):
            what = f"a JSON {type(old).__name__}, not an object"
    except OSError as e:
        what = f"cannot be read ({e.strerror})"
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        what = f"not valid JSON ({e})"
    if what is not None:
        raise UnreadableFile(f"{path}: {what}. It records what the samples in {path.parent} were made with; "
                             f"move it aside (the next run writes a new one from this config: only do that if "
                             "the samples were made with these settings), or use a new output_dir")
    return old
