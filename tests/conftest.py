"""Session-wide fixtures: one tiny target, one local Ray, one vLLM engine per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.tiny_model import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, ignore_reinit_error=True,
                 runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}})
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
    yield ray


@pytest.fixture(scope="session")
def tiny_llm(tiny_target: Path):
    """The session's one directly-called vLLM engine on the tiny target."""
    from vllm import LLM

    llm = LLM(model=str(tiny_target), dtype="float32", max_model_len=2048, seed=0, enforce_eager=True)
    yield llm
    del llm
