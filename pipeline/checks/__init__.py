"""Exact ids and the checks on them: reconstruction from text, validation, the audit."""
