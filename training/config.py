"""Training configuration for the EAGLE-3 drafter (embedded as `training:` in the main config)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from pipeline.base.config import Resources, Strict, aux_layer_ids_problem

# vLLM's names (llama_eagle3.py reads them from the drafter's config.json); see training/model.py
ARCHITECTURE_FLAGS = ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")
LossName = Literal["ce", "tv", "lk_alpha", "lk_lambda"]
Precision = Literal["auto", "bf16", "fp32"]


class DraftTrainConfig(Strict):
    """Hyper-parameters and resources of one drafter training run.

    Defaults suit the tiny CPU target; raise `batch_tokens`, `max_len` and
    `draft_vocab_size` (and lower `lr` to ~1e-4) for real targets.
    """

    steps: int = Field(1000, ge=1, description="optimizer steps (epochs cycle as needed)")
    batch_tokens: int = Field(2048, ge=1, description="token budget of one packed batch per worker")
    max_len: int = Field(
        512, ge=8, description="samples are truncated to this many tokens; also the packed row length, so keep "
        "it well above the typical sample (rows of 256 hold one 160-token sample each: 62% fill, see the `fill` "
        "metric); batch_tokens // max_len rows per batch. Attention is computed in chunks as long as the "
        "longest sample in the batch, so long rows of short samples stay cheap")
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(30, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(0.5, gt=0)
    ttt_steps: int = Field(7, ge=1, description="training-time-test unroll length")
    step_decay: float = Field(0.8, gt=0, description="loss weight of TTT step k is step_decay**k")
    teacher_temperature: float = Field(
        1.0, gt=0, description="the target distribution is softmax(logits / T): 1 is plain distillation; below 1 "
        "sharpens it toward the target's argmax, which is what greedy verification accepts (helps when the "
        "target's distributions are flat)")
    loss: LossName = Field(
        "ce", description="per-step TTT loss against the target's distribution p (draft vocab) of the draft's q: "
        "`ce` soft cross-entropy (KL distillation); `tv` total variation 1 - sum min(p, q) = 1 - P(accept) under "
        "speculative sampling; `lk_alpha` -log P(accept) and `lk_lambda` lambda*KL + (1-lambda)*TV with lambda = "
        "exp(-lk_eta * mean P(accept)), the LK losses of Samarin et al. 2026 (arXiv 2602.23881)")
    lk_eta: float = Field(3.0, ge=0, description="`lk_lambda`: how fast the KL weight fades as acceptance grows "
                          "(the paper's best setting is 3; 0 is plain KL)")
    acceptance_weighting: bool = Field(
        False, description="also weight each position's loss at TTT step k by the (detached) product of its "
        "acceptance probabilities at steps < k, the chance the draft chain reaches step k")
    # EAGLE-3.1 (fc_norm + norm_output) is the default by measurement: +0.27 served acceptance at k=5 over plain
    # EAGLE-3 at 100 steps and +0.10 at 1,000 on the reasoning target, 3 seeds each (bench/RESULTS.md, "Drafter
    # choices"). Both false is plain EAGLE-3, for an engine that does not read the flags.
    fc_norm: bool = Field(True, description="EAGLE-3.1: an RMSNorm on each aux hidden state before `fc` (vLLM "
                          "`fc_norm`, weights `fc_norm.{i}.weight`)")
    norm_before_fc: bool = Field(False, description="one RMSNorm over the concatenated 3*H fc input (vLLM "
                                 "`norm_before_fc`, weight `input_norm.weight`; speculators' gpt-oss variant)")
    norm_output: bool = Field(True, description="EAGLE-3.1: the next draft step consumes the final-norm state "
                              "instead of the pre-norm one (vLLM `norm_output`)")
    norm_before_residual: bool = Field(False, description="the midlayer's attention residual is hidden_norm(h) "
                                       "instead of h (vLLM `norm_before_residual`)")
    draft_vocab_size: int = Field(32000, ge=2, description="clamped to the target vocab size")
    aux_layer_ids: list[int] | None = Field(
        None, description="vLLM convention (input of decoder layer i); None -> [2, L//2, L-3]"
    )
    init_from_target: bool = Field(
        True, description="start lm_head/norm from the target's head rows of the draft vocab"
    )
    precision: Precision = Field(
        "auto", description="the drafter's forward and backward: `bf16` autocast (weights, optimizer, teacher "
        "logits and loss stay float32), as EAGLE-3 trainers run on GPUs; `fp32` throughout; `auto` is bf16 on a "
        "GPU and on a CPU with native bf16 arithmetic (AVX-512 BF16 or AMX: ~1.3x the fp32 step on this "
        "project's CPU bench), fp32 on other CPUs. Decided on each training worker, for its own device")
    num_workers: int = Field(1, ge=1)
    use_gpu: bool = False
    resources_per_worker: Resources = Field(default_factory=lambda: {"CPU": 1.0})
    seed: int = 0
    checkpoint_every: int = Field(200, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    max_failures: int = Field(1, ge=0, description="Ray Train restarts from the latest checkpoint")
    shuffle_buffer: int = Field(1024, ge=1, description="rows in the seeded per-epoch shuffle buffer")
    log_every: int = Field(10, ge=1, description="interval of the worker's [drafter] log line (JSONL logs every step)")
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"], description="where rank 0 also logs each step's metrics (and, at "
        "the end of a pipeline run, the report's figures): tensorboard -> drafter/tensorboard/; wandb and mlflow "
        "when installed and configured (below or WANDB_PROJECT / MLFLOW_TRACKING_URI), else skipped with a warning")
    wandb_project: str | None = None
    wandb_entity: str | None = None
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str = "eagle3-drafter"
    tracker_run_name: str | None = Field(None, description="run name in W&B / MLflow (default: theirs)")
    materialize: bool = Field(
        True, description="keep a streamed dataset's rows in Ray's object store after the first epoch (which "
        "spills to local disk past its size) instead of re-running the extraction every epoch; false for "
        "datasets larger than the cluster's object store: nothing is kept, each epoch extracts again"
    )

    heldout_fraction: float = Field(
        0.02, ge=0, lt=1, description="share of samples (fixed by a hash of the sample id) kept out of training "
        "and the draft vocabulary; the run report gives the drafter's simulated acceptance on them"
    )
    heldout_max_samples: int = Field(64, ge=1, description="held-out samples evaluated (the rest stay unused)")
    eval_k: int = Field(3, ge=1, description="draft length of the held-out acceptance measure")
    served_eval: bool = Field(
        True, description="after the simulated held-out measure, serve the export with the target in vLLM "
        "(EAGLE-3 speculative decoding, greedy, up to the end of turn) on the same held-out prompts, on the "
        "resources of the run's first vllm source, and report the served figure beside the simulated one; "
        "skipped (with the reason in the report) when the run has no such source or it uses tensor parallelism")

    def architecture(self) -> dict[str, bool]:
        """The drafter's structure flags, for `training.model.build_drafter(architecture=...)`."""
        return {flag: getattr(self, flag) for flag in ARCHITECTURE_FLAGS}

    @field_validator("aux_layer_ids")
    @classmethod
    def _distinct_sorted(cls, ids: list[int] | None) -> list[int] | None:
        # the same rule as extraction.aux_layer_ids: the two must name layers vLLM captures in this order
        if problem := aux_layer_ids_problem(ids):
            raise ValueError(problem)
        return ids


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3/vLLM default [2, L//2, L-3]; spread [1, L//2, L-1] when those collide (tiny targets)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if sorted(set(ids)) == ids and ids[0] >= 0:
        return ids
    if num_layers < 3:
        raise ValueError(f"need at least 3 target layers for EAGLE-3, got {num_layers}")
    spread = [1, num_layers // 2, num_layers - 1]
    return spread if sorted(set(spread)) == spread else [0, 1, 2]


def resolve_aux_layer_ids(cfg: DraftTrainConfig, num_layers: int) -> list[int]:
    """Return validated aux layer ids (each in [0, L-1]: id L would be the pre-norm output in vLLM
    but the post-norm state in HF `hidden_states[L]`, so it is refused)."""
    ids = cfg.aux_layer_ids or default_aux_layer_ids(num_layers)
    if not all(0 <= i < num_layers for i in ids):
        raise ValueError(f"aux_layer_ids {ids} out of range for a {num_layers}-layer target")
    return ids
