"""Local engines (vLLM, SGLang, transformers) on the cluster's GPUs."""
