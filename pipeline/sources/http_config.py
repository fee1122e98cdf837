"""Config of the HTTP (OpenRouter / OpenAI-compatible) source; the classes live in pipeline.config."""

from pipeline.config import HealthConfig, OpenRouterSourceConfig, ProviderPreferences

__all__ = ["HealthConfig", "OpenRouterSourceConfig", "ProviderPreferences"]
