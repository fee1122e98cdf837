"""The base every stage uses: config schema, row schemas, the run folder's paths, logs, console, run lock."""
