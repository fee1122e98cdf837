"""EAGLE-3 drafter training: model, TTT loss, vocab mapping, Ray Train loop, export, evaluation.

Entry points: `training.train.train_drafter` (Ray Train), `training.train.train_loop` (in-process),
`training.export.export_draft` / `load_exported`, `training.simulate.simulate_acceptance`, and
`python -m training.evaluate` (vLLM speculative decoding). Submodules are imported lazily so the
GPU benchmark can use the model and loss with torch and transformers alone.
"""
