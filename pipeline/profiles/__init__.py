"""Model profiles: everything the pipeline knows about a target's tokens and formats.

``PROFILES`` is the registry: a profile name (what ``model.profile`` in a config
says) and where its loader lives. Adding a target is one module with a loader plus
one line here; the config schema and ``load_profile`` read their names from it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.profiles.base import Profile

__all__ = ["PROFILES", "PROFILE_NAMES", "load_profile"]

# name -> "module:loader"; a loader takes the model folder (or None: the built-in tokenizer and template).
PROFILES: dict[str, str] = {
    "deepseek": "pipeline.profiles.deepseek:load_deepseek_profile",
    "qwen3": "pipeline.profiles.qwen3:load_qwen3_profile",
    "kimi-k2.5": "pipeline.profiles.kimi:load_kimi_profile",
}
PROFILE_NAMES = tuple(PROFILES)


def load_profile(name: str, model_dir: str | None = None) -> Profile:
    """The named profile; a model folder's tokenizer files and chat template win over the built-in ones."""
    if name not in PROFILES:
        raise ValueError(f"unknown model profile {name!r} (known: {', '.join(PROFILE_NAMES)})")
    module, loader = PROFILES[name].split(":")
    return getattr(import_module(module), loader)(model_dir)
