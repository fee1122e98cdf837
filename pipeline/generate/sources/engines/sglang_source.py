"""SGLang's offline ``sglang.Engine`` as a local engine, same row contract as the vLLM source.

The engine starts with ``skip_tokenizer_init=True``: prompts go in as our own
rendered ids (``input_ids``) and answers come back as ids only, each a dict
``{"output_ids": [...], "meta_info": {"finish_reason": {...}, "prompt_tokens",
"completion_tokens", "e2e_latency", ...}}``. The stop token is part of
``output_ids`` (SGLang returns ids "through stop"); an older build that trims
it is repaired from ``finish_reason.matched``, which names the exact id.

Per-sample seeds (``sampling_seed``) are honoured only with
``enable_deterministic_inference`` (SGLang's seeded sampler; the flashinfer
sampler rejects seeds), so the config turns it on when temperature > 0. With
``deterministic: false`` at temperature > 0 no seed is sent, and the samples
record ``request_seed`` null: they cannot be made again.

``extra_engine_args`` may not set what this adapter owns (the config refuses
``SGLANG_OWNED_ARGS`` at load): a silent override would change the ids or
their provenance (``preferred_sampling_params`` is merged under every request).

``sglang`` is imported only when an actor starts: CPU machines without it
still import the pipeline, and everything around the engine call is pure.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

from pipeline.base.config import SamplingConfig
from pipeline.generate.sources.engines.base import EngineResult, EngineSource, request_seed
from pipeline.generate.sources.engines.config import SGLangSourceConfig


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def engine_kwargs(model_dir: str, cfg: SGLangSourceConfig, seed: int, sampled: bool) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments (names as in SGLang's ``ServerArgs``)."""
    kw: dict[str, Any] = {
        "model_path": model_dir,
        "tp_size": cfg.tensor_parallel_size,
        "dtype": cfg.dtype,
        "context_length": cfg.max_model_len,
        "skip_tokenizer_init": True,
        "random_seed": seed,
        "log_level": cfg.log_level,
    }
    if cfg.mem_fraction_static:
        kw["mem_fraction_static"] = float(cfg.mem_fraction_static)
    if cfg.attention_backend:
        kw["attention_backend"] = cfg.attention_backend
    if cfg.deterministic if cfg.deterministic is not None else sampled:
        kw["enable_deterministic_inference"] = True
    kw.update(cfg.extra_engine_args)  # the config refused every key set above (SGLANG_OWNED_ARGS)
    return kw


def sampling_params(sampling: SamplingConfig, sample_id: str, max_new_tokens: int, stops: list[int],
                    seeded: bool) -> dict[str, Any]:
    """One request's ``sampling_params``; temperature 0 is SGLang's greedy (it maps it to top_k=1)."""
    p: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": -1,
        "stop_token_ids": list(stops),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if seeded:
        p["sampling_seed"] = request_seed(sample_id, sampling.seed)
    return p


def result_from_response(resp: dict[str, Any], fallback_seconds: float) -> EngineResult:
    """One SGLang answer as exact ids + finish reason, or the error SGLang reported."""
    meta = resp.get("meta_info") or {}
    ids = resp.get("output_ids")
    if ids is None:
        ids = meta.get("output_ids")
    finish = meta.get("finish_reason")
    seconds = float(meta.get("e2e_latency") or fallback_seconds)
    if isinstance(finish, str):  # some front ends flatten it
        finish = {"type": finish}
    if not isinstance(finish, dict):
        return EngineResult(None, None, seconds, f"no finish reason in response (meta_info keys {sorted(meta)})")
    kind = finish.get("type")
    if kind == "abort":
        return EngineResult(None, None, seconds, f"aborted: {finish.get('message') or 'no message'}")
    if ids is None:
        return EngineResult(None, None, seconds, "response carries no output_ids")
    ids = [int(i) for i in ids]
    if kind == "stop":
        matched = finish.get("matched")
        if isinstance(matched, list):
            matched = matched[0] if len(matched) == 1 else None
        if isinstance(matched, int) and (not ids or ids[-1] != matched):
            ids.append(matched)  # a build that trims the stop id: it is known exactly from meta_info
        return EngineResult(ids, "stop", seconds)
    if kind == "length":
        return EngineResult(ids, "length", seconds)
    return EngineResult(None, None, seconds, f"unknown finish reason {finish!r}")


class SGLangGenerator(EngineSource):
    """Generate with an ``sglang.Engine`` started once per actor (GPU nodes only)."""

    kind = "sglang"

    cfg: SGLangSourceConfig
    engine: Any = None
    seeded: bool = False  # whether requests carry their per-sample seed (set by ``start``)

    def preflight(self) -> None:
        if not sglang_available():
            raise RuntimeError(f"source {self.source_name!r} is kind sglang but the sglang package is not "
                               "installed where this actor runs (SGLang runs on GPU nodes)")

    def start(self, model_dir: str) -> None:
        import sglang

        sampled = self.sampling.temperature > 0
        self.seeded = sampled and self.cfg.deterministic is not False
        self.stops = sorted({int(self.profile.eot_id)})
        self.engine = sglang.Engine(**engine_kwargs(model_dir, self.cfg, self.sampling.seed, sampled))

    def seed_sent(self) -> bool:
        return self.seeded

    def generate_rows(self, rows: list[dict[str, Any]]) -> list[EngineResult]:
        params = [sampling_params(self.sampling, r["sample_id"], self.max_new_tokens(len(r["prompt_ids"])),
                                  self.stops, self.seeded) for r in rows]
        t0 = time.perf_counter()
        outs = self.engine.generate(input_ids=[list(r["prompt_ids"]) for r in rows], sampling_params=params)
        per_sample = (time.perf_counter() - t0) / len(rows)
        if isinstance(outs, dict):
            outs = [outs]
        if len(outs) != len(rows):
            raise RuntimeError(f"sglang returned {len(outs)} answers for {len(rows)} prompts")
        return [result_from_response(o, per_sample) for o in outs]

    def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:  # None: the engine never started, or is stopped already
            engine.shutdown()
