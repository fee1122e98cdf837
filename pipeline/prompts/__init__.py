"""Prompts in: dataset files read, ids assigned, malformed rows to quarantine."""
