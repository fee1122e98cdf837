"""vLLM inside a Ray actor: the engine's own output ids are the ground truth."""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

import pyarrow as pa

from pipeline.profiles import load_profile
from pipeline.stages import batch_to_rows, mark, rows_to_table


def request_seed(sample_id: str, seed: int) -> int:
    """A per-sample seed: a retried or resumed sample is generated identically."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()[:4], "little")


class VLLMGenerator:
    """Generate with a vLLM engine started once per actor."""

    def __init__(self, model_dir: str, profile: str, sampling: dict[str, Any], engine: dict[str, Any],
                 source_name: str) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(engine.get("kv_cache_gib", 1)))
        from vllm import LLM

        self.profile = load_profile(profile, model_dir)
        self.sampling = sampling
        self.source_name = source_name
        self.max_model_len = engine.get("max_model_len", 4096)
        self.model_name = os.path.basename(model_dir.rstrip("/"))
        self.llm = LLM(
            model=model_dir,
            dtype=engine.get("dtype", "auto"),
            max_model_len=self.max_model_len,
            tensor_parallel_size=engine.get("tensor_parallel_size", 1),
            enforce_eager=engine.get("enforce_eager", True),
            seed=sampling.get("seed", 0),
        )

    def _params(self, sample_id: str, prompt_len: int) -> Any:
        from vllm import SamplingParams

        s = self.sampling
        return SamplingParams(
            temperature=s["temperature"], top_p=s["top_p"],
            max_tokens=min(s["max_tokens"], self.max_model_len - prompt_len),
            seed=request_seed(sample_id, s["seed"]), skip_special_tokens=False,
        )

    def __call__(self, batch: pa.Table) -> pa.Table:
        from vllm.inputs import TokensPrompt

        rows = batch_to_rows(batch)
        todo = []
        for r in rows:
            r.update(source=self.source_name, source_kind="vllm", provider="vllm", model=self.model_name,
                     ids_from="engine", sampling=json.dumps(self.sampling, sort_keys=True))
            if r["status"] != "ok":
                continue
            if len(r["prompt_ids"]) >= self.max_model_len:
                mark(r, "quarantine", "generate",
                     f"prompt of {len(r['prompt_ids'])} tokens does not fit max_model_len {self.max_model_len}")
                continue
            todo.append(r)
        if todo:
            t0 = time.perf_counter()
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in todo],
                [self._params(r["sample_id"], len(r["prompt_ids"])) for r in todo],
                use_tqdm=False,
            )
            per_sample = (time.perf_counter() - t0) / len(todo)
            for r, o in zip(todo, outs, strict=True):
                fill_from_engine(r, self.profile, list(o.outputs[0].token_ids), o.outputs[0].finish_reason,
                                 per_sample)
        return rows_to_table(rows)


def fill_from_engine(row: dict[str, Any], profile: Any, ids: list[int], finish: str | None, seconds: float) -> None:
    """Fill a sample from engine output ids; text fields are split the way a server's parsers would."""
    finish = finish or "stop"
    comp = profile.split_ids(ids, bool(row["thinking"]))
    row.update(
        output_ids=ids, reasoning=comp.reasoning, content=comp.content,
        tool_calls=json.dumps(comp.tool_calls, ensure_ascii=False) if comp.tool_calls else "",
        finish_reason=finish, truncated=finish == "length", t_generate_s=seconds,
    )
