"""Hugging Face ``generate`` as a local engine: for machines with neither vLLM nor SGLang.

Slow but exact: one prompt at a time (no padding, so no batch-shape effects
on the numbers), the model's own output ids kept, and each sample seeded from
its id so a retried sample is generated identically. Same row contract as the
vLLM source (``EngineSource``).
"""

from __future__ import annotations

import time
from typing import Any

from pipeline.base.config import SamplingConfig
from pipeline.generate.sources.engines.base import EngineResult, EngineSource, request_seed
from pipeline.generate.sources.engines.config import TransformersSourceConfig


def stop_ids(profile: Any, generation_config: Any | None) -> list[int]:
    """What ends a response: the profile's end of turn plus the model's configured EOS ids (as vLLM does)."""
    ids = {int(profile.eot_id)}
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is not None:
        ids.update(int(e) for e in (eos if isinstance(eos, list | tuple) else [eos]))
    return sorted(ids)


def neutral_generation_config(model: Any, eos_ids: list[int]) -> Any:
    """Give ``model`` a default ``GenerationConfig`` stopping on ``eos_ids`` only, and return it.

    Why: transformers fills every field a ``generate`` call leaves unset from ``model.generation_config``, which
    ``from_pretrained`` loads from the folder's ``generation_config.json``; its ``repetition_penalty``,
    ``min_new_tokens``, ``min_p``, ``no_repeat_ngram_size``, ``bad_words_ids``, ... would then change the ids,
    while vLLM and SGLang apply only the sampling they are sent. Call it once after loading the model.
    """
    from transformers import GenerationConfig

    ids = [int(i) for i in eos_ids]
    neutral = GenerationConfig(eos_token_id=ids, pad_token_id=ids[0])
    model.generation_config = neutral
    return neutral


def generation_kwargs(sampling: SamplingConfig, max_new_tokens: int, stops: list[int]) -> dict[str, Any]:
    """``generate`` arguments matching the engines' semantics: greedy at temperature 0, no hidden top-k."""
    kw: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": stops, "pad_token_id": stops[0],
                          "do_sample": sampling.temperature > 0}
    if kw["do_sample"]:
        kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
    return kw


def finish_reason(ids: list[int], stops: list[int], max_new_tokens: int) -> str:
    if ids and ids[-1] in stops:
        return "stop"
    return "length" if len(ids) >= max_new_tokens else "stop"


class TransformersGenerator(EngineSource):
    """The target through ``transformers``, loaded once per actor; GPU when the actor holds one."""

    kind = "transformers"

    cfg: TransformersSourceConfig

    def start(self, model_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.torch = torch
        use_gpu = self.cfg.num_gpus > 0 and torch.cuda.is_available()
        self.device = "cuda" if use_gpu else "cpu"
        if not use_gpu:
            torch.set_num_threads(max(1, int(self.cfg.num_cpus)))
        dtype = getattr(torch, self.cfg.dtype.replace("auto", "float32"))
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        try:
            folder_config = GenerationConfig.from_pretrained(model_dir)
        except OSError:
            folder_config = None
        self.stops = stop_ids(self.profile, folder_config)  # the folder's EOS ids are kept, as vLLM keeps them
        neutral_generation_config(self.model, self.stops)  # ... and nothing else of its generation config

    def generate_rows(self, rows: list[dict[str, Any]]) -> list[EngineResult]:
        return [self._one(r) for r in rows]

    def _one(self, row: dict[str, Any]) -> EngineResult:
        from transformers import GenerationConfig

        torch = self.torch
        prompt = row["prompt_ids"]
        max_new = self.max_new_tokens(len(prompt))
        torch.manual_seed(request_seed(row["sample_id"], self.sampling.seed))
        ids = torch.tensor([prompt], device=self.device)
        t0 = time.perf_counter()
        config = GenerationConfig(**generation_kwargs(self.sampling, max_new, self.stops))  # every field we set
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        new = out[0, len(prompt):].tolist()
        return EngineResult(new, finish_reason(new, self.stops, max_new), time.perf_counter() - t0)
