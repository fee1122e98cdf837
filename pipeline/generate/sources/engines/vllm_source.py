"""vLLM as a local engine source: one ``vllm.LLM`` per Ray Data actor, fed our own prompt ids.

Finish reasons (vLLM 0.32's ``FINISH_REASON_STRINGS``): ``stop`` and ``length`` are answers; ``repetition``
(its repetition detector cut the answer) is an answer cut off, kept and flagged truncated like ``length``;
``abort`` fails the prompt; ``error`` (a retryable request-level internal error, e.g. a KV load failure) is the
engine's fault, so the row is handed on or left to do (``finish_result``).

TP > 1 on GPUs: the actor holds no GPU itself and sits in a placement group of
TP bundles whose GPUs vLLM's Ray executor fills with its workers
(``distributed_executor_backend="ray"``; see pipeline.generate.sources.chain).
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Mapping
from typing import Any

from pipeline.base.config import SamplingConfig
from pipeline.base.flight import NextSource
from pipeline.base.layout import RunLayout
from pipeline.generate.sources.engines.base import EngineResult, EngineSource, request_seed
from pipeline.generate.sources.engines.config import VLLMSourceConfig

ANSWERS = frozenset({"stop", "length", "repetition"})  # finish reasons that come with the answer's ids
RETRYABLE = frozenset({"error"})  # the engine's own failure on the request: may pass on a retry


def finish_result(ids: list[int], finish: str | None, seconds: float) -> EngineResult:
    """One vLLM answer as an ``EngineResult``: ids kept for an answer (``repetition`` is cut off, so truncated),
    a retryable engine error for ``error``, and the prompt's failure for ``abort`` or a reason we do not know."""
    if finish in ANSWERS:
        return EngineResult(ids, finish, seconds)
    return EngineResult(None, finish, seconds, f"request finished with {finish!r}", retryable=finish in RETRYABLE)


class VLLMGenerator(EngineSource):
    """Generate with a vLLM engine started once per actor (or an existing ``llm`` handed in)."""

    kind = "vllm"

    cfg: VLLMSourceConfig

    def __init__(self, model_dir: str, profile: str, sampling: SamplingConfig | Mapping[str, Any],
                 cfg: VLLMSourceConfig, router: NextSource | None = None, llm: Any | None = None,
                 layout: RunLayout | None = None) -> None:
        self.llm = llm
        self.owns_engine = llm is None  # an engine handed in belongs to the caller
        super().__init__(model_dir, profile, sampling, cfg, router, layout)

    def start(self, model_dir: str) -> None:
        if self.llm is None:
            self.llm = start_vllm(model_dir, self.cfg, self.sampling.seed)

    def shutdown(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None and getattr(self, "owns_engine", False):
            stop_vllm(llm)

    def engine_dead(self, error: BaseException) -> bool:
        """vLLM's engine core (its own process) died: every later request fails the same way."""
        try:
            from vllm.v1.engine.exceptions import EngineDeadError
        except ImportError:
            return False
        return isinstance(error, EngineDeadError)

    def _params(self, sample_id: str, prompt_len: int) -> Any:
        from vllm import SamplingParams

        s = self.sampling
        return SamplingParams(
            temperature=s.temperature, top_p=s.top_p, max_tokens=self.max_new_tokens(prompt_len),
            seed=request_seed(sample_id, s.seed), skip_special_tokens=False,
            # The profile's end of turn ends an answer, as in the other engines, even where the folder's EOS differs
            # (vLLM adds the tokenizer's and generation config's EOS ids itself).
            stop_token_ids=[int(self.profile.eot_id)],
            detokenize=False,  # ids are the product; the profile splits them, so engine-side text is wasted CPU
        )

    def generate_rows(self, rows: list[dict[str, Any]]) -> list[EngineResult]:
        results: list[EngineResult] = []
        for group in prefill_groups([len(r["prompt_ids"]) for r in rows], self._prefill_budget()):
            results += self._generate([rows[i] for i in group])
        return results

    def _prefill_budget(self) -> int | None:
        """On CPU, seeded requests must not have their prefill split across steps.

        vLLM rewinds a request's generator when its prefill is chunked, and the CPU
        generator cannot rewind ("CPU Generator does not use offset"): send at most one
        step's worth of prompt tokens per call there. GPUs have no such limit.
        """
        import torch

        if torch.cuda.is_available():
            return None
        try:
            return int(self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)
        except AttributeError:
            return 2048

    def _generate(self, rows: list[dict[str, Any]]) -> list[EngineResult]:
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in rows],
            [self._params(r["sample_id"], len(r["prompt_ids"])) for r in rows],
            use_tqdm=False,
        )
        per_sample = (time.perf_counter() - t0) / len(rows)
        return [finish_result(list(o.outputs[0].token_ids), o.outputs[0].finish_reason, per_sample) for o in outs]


def prefill_groups(lengths: list[int], budget: int | None) -> list[list[int]]:
    """Consecutive index groups whose prompt tokens (plus one decode slot each) fit one scheduler step."""
    if budget is None:
        return [list(range(len(lengths)))] if lengths else []
    groups: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if groups and used + n + len(groups[-1]) + 1 <= budget:
            groups[-1].append(i)
            used += n
        else:
            groups.append([i])
            used = n
    return groups


# vLLM gives its processes 5 s to exit before it SIGKILLs them; on a loaded node that is too short, and a killed
# worker leaves its shared memory for the resource tracker ("leaked shared_memory objects" in the logs). The
# engine-core process reads VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (set for engine actors, ENGINE_ACTOR_ENV);
# this process waits a little longer than that for the engine core.
STOP_TIMEOUT_S = 45.0


def stop_vllm(llm: Any) -> None:
    """Stop a ``vllm.LLM``'s engine-core processes now (vLLM otherwise does it at interpreter exit).
    Idempotent: a stopped engine's client ignores a second call."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown(timeout=STOP_TIMEOUT_S)


def stop_at_exit(llm: Any) -> Any:
    """Make sure ``llm`` is stopped with our timeout when this process exits, and return it.

    A retired Ray actor does not always drop its stage object before it exits; vLLM's own exit hook then
    stops the engine with a 5 s grace. Hooks run last-registered first, so this one (registered after
    vLLM's) stops the engine before vLLM's runs.
    """
    atexit.register(stop_vllm, llm)
    return llm


def start_vllm(model_dir: str, cfg: VLLMSourceConfig, seed: int) -> Any:
    """The vLLM engine for one actor; TP > 1 on GPUs runs its workers through Ray (see module doc)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
    from vllm import LLM

    extra: dict[str, Any] = {}
    if cfg.tensor_parallel_size > 1 and cfg.num_gpus > 0:
        extra["distributed_executor_backend"] = "ray"
    if cfg.gpu_memory_utilization:
        extra["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    return stop_at_exit(LLM(model=model_dir, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                            tensor_parallel_size=cfg.tensor_parallel_size, enforce_eager=cfg.enforce_eager, seed=seed,
                            **extra))
