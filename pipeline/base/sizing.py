"""Can the extraction backend hold the target? A check made before Ray starts (``load_config``, ``check``).

The target's weights are read off its model folder (``model.safetensors.index.json`` ->
``metadata.total_size``, else the sum of the ``*.safetensors`` files); where the folder cannot be
read (a cluster config checked away from its cluster: ``check --no-paths``), ``model.weights_gb``
stands in. Neither: the check is skipped (``sizing_note`` says so).

What the extraction actor can hold, in GB (10^9 bytes), ``extraction.gpu_memory_gb`` per GPU:

- ``backend: vllm``: ``tensor_parallel_size`` GPUs (the engine shards the weights over its TP workers);
- ``backend: transformers`` with ``device_map`` (e.g. ``auto``): every GPU the actor holds (``num_gpus``);
- ``backend: transformers`` without one: one GPU (the model is moved whole to ``cuda``).

It is a necessary condition, not a sufficient one: KV cache, activations and the captured states
need room on top. CPU extraction (``num_gpus: 0``) is not checked. Pure stdlib: the schema layer
(pipeline.run.config) imports this module, so it imports nothing of the runtime.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

GB = 1e9
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_bytes(folder: str | Path) -> tuple[int, str] | None:
    """(bytes, where from) of a safetensors checkpoint folder, or None when it holds neither an index
    with ``metadata.total_size`` nor any ``*.safetensors`` file (or cannot be read)."""
    folder = Path(folder)
    try:
        index = folder / INDEX_FILE
        if index.is_file():
            total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
            if isinstance(total, int | float) and total > 0:
                return int(total), f"{index.name} metadata.total_size"
        files = sorted(folder.glob("*.safetensors"))
        if files:
            return sum(f.stat().st_size for f in files), f"{len(files)} *.safetensors files"
    except (OSError, ValueError):
        return None
    return None


def target_weights_gb(model: Any) -> tuple[float, str] | None:
    """(GB, where from): the model folder when it can be read, else ``model.weights_gb``, else None."""
    if model.path and Path(model.path).is_dir():
        found = checkpoint_bytes(model.path)
        if found is not None:
            return found[0] / GB, f"{found[1]} in {model.path}"
    if getattr(model, "weights_gb", None):
        return float(model.weights_gb), "model.weights_gb"
    return None


def extraction_gpus(ex: Any) -> tuple[float, str]:
    """(GPUs the extraction engine spreads the weights over, why) for an ``extraction:`` block."""
    return ex.backend_facts.gpus(ex)


def _gpus(n: float) -> str:
    return f"{n:g} GPU" + ("" if n == 1 else "s")


def extraction_misfit(model: Any, ex: Any) -> str | None:
    """Why the extraction actor cannot hold the target's weights, or None (fits, CPU, or size unknown)."""
    if ex.num_gpus <= 0:
        return None
    weights = target_weights_gb(model)
    if weights is None:
        return None
    gb, source = weights
    gpus, why = extraction_gpus(ex)
    capacity = gpus * ex.gpu_memory_gb
    if gb <= capacity:
        return None
    need = math.ceil(gb / ex.gpu_memory_gb)
    tp = 2 ** math.ceil(math.log2(need))  # TP must divide the attention heads: a power of two in practice
    return (f"extraction cannot hold the target: weights {gb:,.1f} GB ({source}) > {_gpus(gpus)} × "
            f"{ex.gpu_memory_gb:g} GB = {capacity:,.0f} GB ({why}). It needs at least {need} GPUs of "
            f"{ex.gpu_memory_gb:g} GB: extraction.backend vllm with tensor_parallel_size {tp} (and num_gpus > 0), "
            f"or device_map: auto with num_gpus >= {need}; extraction.gpu_memory_gb sets the per-GPU figure")


def sizing_note(model: Any, ex: Any) -> str:
    """One line for ``check``: what was compared, or why nothing was."""
    if ex.num_gpus <= 0:
        return "extraction sizing: not checked (CPU extraction, num_gpus 0)"
    weights = target_weights_gb(model)
    if weights is None:
        return ("extraction sizing: not checked (no readable model folder and no model.weights_gb); set "
                "model.weights_gb to check away from the weights")
    gpus, _ = extraction_gpus(ex)
    return (f"extraction sizing: weights {weights[0]:,.1f} GB ({weights[1]}) <= {_gpus(gpus)} × "
            f"{ex.gpu_memory_gb:g} GB = {gpus * ex.gpu_memory_gb:,.0f} GB ({ex.backend})")
