"""Test-only helpers shared by tests/ and bench/ (import as `tests.helpers.<module>`)."""
