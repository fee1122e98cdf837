"""Training-time-test (TTT) unroll and loss.

Alignment (same as vLLM's proposer and SpecForge's `padding(..., left=False)` shifts). Index t of
a document at TTT step k (k = 0..K-1) uses
  * hidden: step 0 -> model.project(aux_hidden[t]); step k -> model.carry of the draft output at t from step k-1
              (its pre-norm state, or the final-norm state with norm_output)
  * token:  input_ids[t + k + 1]          (step 0: the token that follows the hidden's position)
  * position id: t + k                     (vLLM advances positions by one per draft step;
                                            SpecForge adds the number of cached steps likewise)
and predicts token t + k + 2, whose teacher is the target distribution at position t + k + 1,
softmax(final_hidden[t + k + 1] @ lm_head[draft ids].T), i.e. restricted to the draft vocab.
So at step 0, h_t and the embedding of token t+1 predict token t+2.

A prediction counts when token t+k+2 exists in the same document, is loss-masked (assistant
token), and the target's full-vocab argmax at t+k+1 is in the draft vocab. SpecForge weights by
loss_mask[t + k] instead; keying on the predicted token keeps the very first draft of a turn
(from the last prompt position) in the loss, which is the draft vLLM makes right after prefill.

Losses (`step_loss`, per step over its valid positions; p = the teacher's softmax over the draft vocab,
q = the draft's): `ce` soft cross-entropy (KL distillation, the default); acceptance-aware ones built on
speculative sampling's P(accept) = sum_v min(p_v, q_v) = 1 - TV(p, q): `tv`, and the LK losses of Samarin
et al., "LK Losses: Direct Acceptance Rate Optimization for Speculative Decoding" (arXiv 2602.23881) as the
authors put them into SpecForge: `lk_alpha` = -log P(accept), and `lk_lambda` = lambda*KL + (1-lambda)*TV
with lambda = exp(-eta * sg(mean P(accept))) over the step's positions (KL's strong gradient while the
draft is far off, acceptance itself once it is close). p is renormalised over the draft vocab (speculators
does the same; SpecForge uses the unnormalised full-vocab mass, which needs the full lm_head per position).
`acceptance_weighting` multiplies each position's step-k loss by sg(prod_{j<k} P(accept at step j)), the
chance the chain gets to step k (the gradient of expected acceptance length sum_k prod_{j<=k} alpha_j
with the earlier factors held fixed; D-PACE weights DFlash positions by such cumulative confidence).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from training.config import LossName
from training.data import Batch
from training.model import Eagle3Drafter
from training.ttt_attention import StepKVCache


@dataclass
class TTTOutput:
    """Weighted total loss plus per-step loss, accuracy and counts (python floats for logging)."""

    loss: torch.Tensor
    step_losses: list[float]
    step_accs: list[float]
    step_counts: list[int]


def shift_left(x: torch.Tensor, n: int, fill: float | int | bool) -> torch.Tensor:
    """x[:, n:] right-padded with `fill` back to x's length along dim 1."""
    if n == 0:
        return x
    pad = torch.full((x.shape[0], n, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x[:, n:], pad], dim=1)


def teacher_logits(final_hidden: torch.Tensor, lm_head_draft: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Target logits restricted to the draft vocab (lm_head rows of the draft ids), divided by the
    teacher temperature, in float32 even under bf16 autocast: the teacher should not lose precision."""
    with torch.autocast(final_hidden.device.type, enabled=False):
        logits = final_hidden.float() @ lm_head_draft.float().T
        return logits if temperature == 1.0 else logits / temperature


class _DistillCE(torch.autograd.Function):
    """Per-row -sum softmax(t) * log_softmax(d), with the gradient softmax(d) - softmax(t) written out:
    fewer passes over the (N, V) tensors and only (softmax(d), softmax(t)) kept for backward.

    Only the softmax kernels touch exponentials: `torch.exp` and `torch.logsumexp` take a slow path on CPU
    for inputs far below the row's max (~15x at exp(x) < 1e-38, which a trained drafter's logits reach
    on most of the draft vocab), the softmax kernels do not."""

    @staticmethod
    def forward(ctx, draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(draft_logits.dtype, torch.float32)  # bf16 logits -> float32
        d = draft_logits.to(dtype)
        p_t = torch.softmax(teacher_logits.to(dtype), dim=-1)
        ctx.save_for_backward(torch.softmax(d, dim=-1), p_t)
        ctx.in_dtype = draft_logits.dtype
        return -(p_t * torch.log_softmax(d, dim=-1)).sum(-1)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        p_d, p_t = ctx.saved_tensors
        return (p_d - p_t).mul_(grad_out[:, None]).to(ctx.in_dtype), None


def distill_cross_entropy(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of the soft cross-entropy from teacher logits to draft logits (N, V)."""
    if draft_logits.shape[0] == 0:
        return draft_logits.sum() * 0.0  # keeps lm_head in the graph (DDP expects its gradient)
    return _DistillCE.apply(draft_logits, teacher_logits).mean()


def _probs(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def acceptance_prob(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Per row of (N, V): sum_v min(p_v, q_v), the chance speculative sampling accepts a token drawn from q."""
    return torch.minimum(_probs(teacher_logits), _probs(draft_logits)).sum(-1)


def total_variation(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Per row: TV(p, q) = 1/2 sum |p - q| = 1 - acceptance_prob."""
    return 1.0 - acceptance_prob(draft_logits, teacher_logits)


def kl_divergence(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Per row: KL(p || q) (the soft cross-entropy minus the teacher's entropy: same gradient)."""
    dtype = torch.promote_types(draft_logits.dtype, torch.float32)
    p = _probs(teacher_logits)
    return (torch.special.xlogy(p, p) - p * torch.log_softmax(draft_logits.to(dtype), -1)).sum(-1)  # 0 log 0 = 0


def step_loss(
    name: LossName,
    draft_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    weights: torch.Tensor | None = None,
    lk_eta: float = 3.0,
) -> torch.Tensor:
    """Loss `name` (see the module docstring) over rows of (N, V): the mean of per-row losses, each times
    `weights` (N,) when given. Rows weighted 1 give exactly the unweighted mean."""
    if draft_logits.shape[0] == 0:
        return draft_logits.sum() * 0.0  # keeps lm_head in the graph (DDP expects its gradient)
    if name == "ce":
        rows = _DistillCE.apply(draft_logits, teacher_logits)
    elif name == "tv":
        rows = total_variation(draft_logits, teacher_logits)
    elif name == "lk_alpha":
        rows = -torch.log(acceptance_prob(draft_logits, teacher_logits).clamp_min(1e-8))
    elif name == "lk_lambda":
        alpha = acceptance_prob(draft_logits, teacher_logits)
        lam = torch.exp(-lk_eta * alpha.detach().mean())
        rows = lam * kl_divergence(draft_logits, teacher_logits) + (1.0 - lam) * (1.0 - alpha)
    else:
        raise ValueError(f"unknown loss {name!r}")
    return (rows if weights is None else rows * weights).mean()


@dataclass
class StepView:
    """Inputs and loss positions of TTT step k, aligned to index t of the packed batch."""

    tokens: torch.Tensor  # (B, L) input_ids[t + k + 1]
    position_ids: torch.Tensor  # (B, L) position of t, plus k
    trained: torch.Tensor  # (B, L) bool: token t+k+2 is in t's document and loss-masked
    valid: torch.Tensor  # (B, L) bool: trained and the target argmax at t+k+1 is in the draft vocab


def step_view(batch: Batch, in_draft: torch.Tensor, k: int) -> StepView:
    """Pure index bookkeeping of step k (see the module docstring for the alignment)."""
    same_doc = shift_left(batch.doc_ids, k + 2, -2) == batch.doc_ids
    trained = same_doc & shift_left(batch.loss_mask, k + 2, False) & (batch.doc_ids >= 0)
    return StepView(
        tokens=shift_left(batch.input_ids, k + 1, 0),
        position_ids=batch.position_ids + k,
        trained=trained,
        valid=trained & shift_left(in_draft, k + 1, False),
    )


def reach_update(reach: torch.Tensor, view: StepView, rows: torch.Tensor, cols: torch.Tensor,
                 alpha: torch.Tensor) -> torch.Tensor:
    """Chance the chain from each start t gets past step k: times alpha at valid positions, times 0 where
    the step is trained but the target's choice lies outside the draft vocab (never accepted), unchanged
    where the step is not trained (outside the document or the loss mask)."""
    factor = torch.where(view.trained, 0.0, 1.0).to(reach.dtype)
    factor[rows, cols] = alpha.to(reach.dtype)
    return reach * factor


def unroll(
    model: Eagle3Drafter, batch: Batch, in_draft: torch.Tensor, ttt_steps: int
) -> Iterator[tuple[StepView, torch.Tensor]]:
    """Yield (view, pre-norm hidden (B, L, H)) for steps 0..ttt_steps-1, feeding `model.carry` of each step's
    output back as the next step's hidden state (gradients flow through the whole unroll).

    Only the indices some step trains are computed (`StepKVCache.compact`): the first step's keys at every
    index (every later query's prefix), everything else at those indices only: ~30% fewer in rows whose
    prompts are a third of their tokens. The hidden states are zero at the indices left out, which no loss
    reads."""
    cache = StepKVCache()
    views = [step_view(batch, in_draft, k) for k in range(ttt_steps)]
    rows, cols = torch.stack([v.trained for v in views]).any(0).nonzero(as_tuple=True)
    cache.compact(rows, cols, batch.doc_ids)  # the documents' masks too: no (L, L) step-0 mask is built
    hidden = model.project(batch.aux_hidden)
    for k, view in enumerate(views):
        tokens, positions = (view.tokens, view.position_ids) if k == 0 else (
            view.tokens[rows, cols][None], view.position_ids[rows, cols][None])
        out = model.step(tokens, hidden, positions, None, cache)
        yield view, out.new_zeros(*batch.doc_ids.shape, out.shape[-1]).index_put((rows, cols), out[0])
        hidden = model.carry(out)


def ttt_forward(
    model: Eagle3Drafter,
    batch: Batch,
    lm_head_draft: torch.Tensor,
    ttt_steps: int,
    step_decay: float = 0.8,
    teacher_temperature: float = 1.0,
    loss: LossName = "ce",
    lk_eta: float = 3.0,
    acceptance_weighting: bool = False,
) -> TTTOutput:
    """Unroll `ttt_steps` draft steps over a packed batch and return the weighted loss (`loss`, step k
    weighted step_decay**k, and per position by the chance to reach step k with `acceptance_weighting`).

    `lm_head_draft` is the target's lm_head rows of the draft vocab (draft order), (V_d, H_t).
    Logits are computed only at the step's valid positions (the vocab-sized tensors dominate
    time and memory). Accuracy counts predictions whose target argmax lies outside the draft
    vocab as misses."""
    with torch.no_grad():
        in_draft = model.t2d[batch.target_ids] & (batch.doc_ids >= 0)
        # draft index of each target id (valid only where in_draft): rank among kept ids
        draft_index = (torch.cumsum(model.t2d.long(), 0) - 1)[batch.target_ids]
    total = torch.zeros((), dtype=torch.float32, device=batch.input_ids.device)
    reach = torch.ones(batch.doc_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
    losses, accs, counts = [], [], []
    for k, (view, hidden) in enumerate(unroll(model, batch, in_draft, ttt_steps)):
        rows, cols = view.valid.nonzero(as_tuple=True)
        logits = model.logits(hidden[rows, cols])  # (N, V_d)
        teacher = teacher_logits(batch.final_hidden[rows, cols + k + 1], lm_head_draft, teacher_temperature)
        weights = reach[rows, cols] if acceptance_weighting else None
        loss_k = step_loss(loss, logits, teacher, weights, lk_eta)
        total = total + (step_decay**k) * loss_k
        if acceptance_weighting and k + 1 < ttt_steps:
            with torch.no_grad():
                reach = reach_update(reach, view, rows, cols, acceptance_prob(logits, teacher))
        with torch.no_grad():  # max's indices: argmax's (the first maximum), ~3x faster on bf16 on CPU
            hits = int((logits.max(-1).indices == draft_index[rows, cols + k + 1]).sum())
            n_trained = int(view.trained.sum())
            accs.append(hits / max(n_trained, 1))
        losses.append(float(loss_k.detach()))
        counts.append(n_trained)
    return TTTOutput(total, losses, accs, counts)


class TTTObjective(torch.nn.Module):
    """nn.Module wrapper so DDP sees the whole TTT unroll as one `forward` call."""

    def __init__(self, drafter: Eagle3Drafter, lm_head_draft: torch.Tensor, ttt_steps: int, step_decay: float,
                 teacher_temperature: float = 1.0, loss: LossName = "ce", lk_eta: float = 3.0,
                 acceptance_weighting: bool = False):
        super().__init__()
        self.drafter = drafter
        self.register_buffer("lm_head_draft", lm_head_draft, persistent=False)
        self.ttt_steps = ttt_steps
        self.step_decay = step_decay
        self.teacher_temperature = teacher_temperature
        self.loss = loss
        self.lk_eta = lk_eta
        self.acceptance_weighting = acceptance_weighting

    def forward(self, batch: Batch) -> TTTOutput:
        return ttt_forward(self.drafter, batch, self.lm_head_draft, self.ttt_steps, self.step_decay,
                           self.teacher_temperature, self.loss, self.lk_eta, self.acceptance_weighting)
