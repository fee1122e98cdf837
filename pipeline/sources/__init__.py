"""Inference sources: local engines and HTTP APIs, each a Ray Data callable class."""
