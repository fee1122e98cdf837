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

__all__ = ["PROFILES", "PROFILE_NAMES", "check_model_folder", "load_profile"]

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


def check_model_folder(name: str, model_dir: str) -> str | None:
    """Why the named profile cannot take its tokenizer and chat template from ``model_dir``, or None.

    Called before Ray starts (``load_config``): it loads the profile exactly as the actors will and, when the
    folder has a chat template, renders a one-turn prompt through it, so a folder that claims a tokenizer
    or template it cannot give stops the run with this reason instead of failing inside an actor.
    """
    if name not in PROFILES:
        return f"unknown model profile {name!r} (known: {', '.join(PROFILE_NAMES)})"
    module, loader = PROFILES[name].split(":")
    load = getattr(import_module(module), loader)
    load = getattr(load, "__wrapped__", load)  # past the loaders' cache: the folder as it is now
    try:
        profile = load(model_dir)
    except KeyError as e:  # a special token the profile needs is not in the folder's tokenizer
        return f"the {name} profile cannot use the tokenizer in {model_dir}: a token it needs is missing ({e.args[0]})"
    except Exception as e:  # any failure here is the reason the actors would fail with
        return f"the {name} profile cannot use the model folder {model_dir}: {e}"
    if profile.chat_template is None:
        return None
    try:
        profile.render_prompt([{"role": "user", "content": "hi"}], None, True)
    except Exception as e:  # a template that cannot render a one-turn chat renders no prompt
        return f"the chat template of {model_dir} cannot render a one-turn chat: {type(e).__name__}: {e}"
    return None
