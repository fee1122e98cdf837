"""Model profiles: everything the pipeline knows about a target's tokens and formats."""

from __future__ import annotations

from pipeline.profiles.base import Completion, Profile, RenderedPrompt

__all__ = ["PROFILE_NAMES", "Completion", "Profile", "RenderedPrompt", "load_profile"]

PROFILE_NAMES = ("deepseek", "qwen3", "kimi-k2.5")


def load_profile(name: str, model_dir: str | None = None) -> Profile:
    """The named profile; a model folder's tokenizer files and chat template win over the built-in ones."""
    if name == "deepseek":
        from pipeline.profiles.deepseek import load_deepseek_profile

        return load_deepseek_profile(model_dir)
    if name == "qwen3":
        from pipeline.profiles.qwen3 import load_qwen3_profile

        return load_qwen3_profile(model_dir)
    if name == "kimi-k2.5":
        from pipeline.profiles.kimi import load_kimi_profile

        return load_kimi_profile(model_dir)
    raise ValueError(f"unknown model profile {name!r} (known: {', '.join(PROFILE_NAMES)})")
