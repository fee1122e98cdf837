"""Demo and test targets only: the tiny targets and the stand-in OpenRouter server."""
