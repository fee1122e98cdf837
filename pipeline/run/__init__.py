"""The job on top: read -> generate -> write -> extract -> train -> report, the CLI, status."""
