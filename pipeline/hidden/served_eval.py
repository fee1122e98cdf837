"""The run's served measure: its exported drafter in vLLM's EAGLE-3 speculative decoding on the held-out prompts.

A Ray task on the resources of the run's first source that serves drafters (pipeline.generate.sources.registry),
so on a GPU cluster the engine lands where the generation engines ran; the measure itself is
``training.served.served_acceptance`` (an engine in a spawned process). The prompts are the held-out
samples' own ``prompt_ids``, exactly as the run rendered them: re-rendering the text through a chat
template (what ``LLM.chat`` does) can change the prompt (thinking on or off, a system turn) and so the
distribution measured. The result sits beside the simulated figure with their per-position agreement.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq

from pipeline.generate.sources.registry import drafter_server

if TYPE_CHECKING:
    from pipeline.generate.sources.engines.config import VLLMSourceConfig
    from pipeline.run.config import RunConfig


def heldout_prompts(samples_dir: Path, sample_ids: Collection[str]) -> list[list[int]]:
    """The ``prompt_ids`` of the given samples, in sample-id order (one per id)."""
    found: dict[str, list[int]] = {}
    wanted = set(sample_ids)
    for f in sorted(samples_dir.glob("*.parquet")):
        for r in pq.read_table(f, columns=["sample_id", "prompt_ids"]).to_pylist():
            if r["sample_id"] in wanted:
                found.setdefault(r["sample_id"], list(r["prompt_ids"]))
    return [found[s] for s in sorted(found)]


def serve_drafter(target: str, draft: str, prompts: list[list[int]], k: int, max_tokens: int, max_model_len: int,
                  dtype: str, kv_cache_gib: int) -> dict[str, Any]:
    """The Ray task's body: one spec-decode engine in a spawned process; an error comes back as a reason."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    from training.served import served_acceptance

    try:
        out = served_acceptance(target, draft, prompts, k, max_tokens, max_model_len, dtype)
    except Exception as e:  # noqa: BLE001 - the run reports it; its samples and drafter are done already
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    out.pop("outputs")
    return out


def measure_served(cfg: RunConfig, export_dir: str, samples_dir: Path, heldout: dict[str, Any],
                   sample_ids: Collection[str]) -> dict[str, Any]:
    """The served figure on the held-out samples' prompts, with its agreement with the simulated ``heldout``."""
    import ray

    from training.served import agreement

    src: VLLMSourceConfig | None = drafter_server(cfg.sources)  # the one kind that serves_drafter
    if src is None:
        return {"skipped": "no source whose engine serves an EAGLE-3 drafter (kind vllm) in this run"}
    if src.tensor_parallel_size > 1:
        return {"skipped": f"source {src.name!r} uses tensor_parallel_size {src.tensor_parallel_size}: measure "
                           f"with `python -m training.served --target ... --draft {export_dir}` on a node that fits"}
    prompts = heldout_prompts(samples_dir, sample_ids)
    if not prompts:
        return {"skipped": "no held-out prompts"}
    k = cfg.training.eval_k
    task = ray.remote(serve_drafter).options(num_cpus=src.num_cpus, num_gpus=src.num_gpus,
                                             resources=dict(src.resources), max_retries=0)
    try:
        served = ray.get(task.remote(cfg.model.path, export_dir, prompts, k, cfg.sampling.max_tokens,
                                     src.max_model_len, src.dtype, src.kv_cache_gib))
    except (ray.exceptions.RayError, OSError) as e:  # the task's worker died (OOM, a lost node): reported, not fatal
        return {"error": f"the served measure's task failed: {type(e).__name__}: {str(e)[:300]}"}
    if "error" in served or heldout.get("acceptance_length") is None:
        return served
    return served | {"source": src.name, "agreement": agreement(served, heldout)}
