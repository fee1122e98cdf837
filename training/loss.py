"""Training-time-test (TTT) unroll and loss.

Alignment (same as vLLM's proposer and SpecForge's `padding(..., left=False)` shifts). Index t of
a document at TTT step k (k = 0..K-1) uses
  * hidden: step 0 -> fc(aux_hidden[t]); step k -> the draft's pre-norm output at t from step k-1
  * token:  input_ids[t + k + 1]          (step 0: the token that follows the hidden's position)
  * position id: t + k                     (vLLM advances positions by one per draft step)
and predicts token t + k + 2, whose teacher is the target distribution at position t + k + 1,
softmax(final_hidden[t + k + 1] @ lm_head[draft ids].T), i.e. restricted to the draft vocab.
So at step 0, h_t and the embedding of token t+1 predict token t+2.

A prediction counts when token t+k+2 exists in the same document, is loss-masked (assistant
token), and the target's full-vocab argmax at t+k+1 is in the draft vocab. SpecForge weights by
loss_mask[t + k] instead; keying on the predicted token keeps the very first draft of a turn
(from the last prompt position) in the loss, which is the draft vLLM makes right after prefill.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from training.data import Batch
from training.model import Eagle3Drafter
from training.ttt_attention import StepKVCache, step0_mask


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


def soft_cross_entropy(target_probs: torch.Tensor, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over masked positions of -sum_v p_target(v) log p_draft(v) (float32 for stability)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    per_pos = -(target_probs * logp).sum(-1)
    count = mask.sum()
    return (per_pos * mask).sum() / count.clamp(min=1)


def teacher_probs(final_hidden: torch.Tensor, lm_head_draft: torch.Tensor) -> torch.Tensor:
    """Target distribution restricted to the draft vocab: softmax over lm_head[draft ids] logits
    (float32 even under bf16 autocast: the teacher should not lose precision)."""
    with torch.autocast(final_hidden.device.type, enabled=False):
        logits = final_hidden.float() @ lm_head_draft.float().T
        return torch.softmax(logits, dim=-1)


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


def unroll(
    model: Eagle3Drafter, batch: Batch, in_draft: torch.Tensor, ttt_steps: int
) -> Iterator[tuple[StepView, torch.Tensor]]:
    """Yield (view, draft logits) for steps 0..ttt_steps-1, feeding each step's pre-norm output
    back as the next step's hidden state (gradients flow through the whole unroll)."""
    mask0 = step0_mask(batch.doc_ids)
    cache = StepKVCache()
    hidden = model.project(batch.aux_hidden)
    for k in range(ttt_steps):
        view = step_view(batch, in_draft, k)
        hidden, logits = model.step(view.tokens, hidden, view.position_ids, mask0, cache)
        yield view, logits


def ttt_forward(
    model: Eagle3Drafter,
    batch: Batch,
    lm_head_draft: torch.Tensor,
    ttt_steps: int,
    step_decay: float = 0.8,
) -> TTTOutput:
    """Unroll `ttt_steps` draft steps over a packed batch and return the weighted loss.

    `lm_head_draft` is the target's lm_head rows of the draft vocab (draft order), (V_d, H_t).
    Accuracy counts predictions whose target argmax lies outside the draft vocab as misses."""
    with torch.no_grad():
        probs = teacher_probs(batch.final_hidden, lm_head_draft)  # (B, L, V_d) at position j
        teacher_top = probs.argmax(-1)
        in_draft = model.t2d[batch.target_ids] & (batch.doc_ids >= 0)
    total = torch.zeros((), dtype=torch.float32, device=batch.input_ids.device)
    losses, accs, counts = [], [], []
    for k, (view, logits) in enumerate(unroll(model, batch, in_draft, ttt_steps)):
        loss_k = soft_cross_entropy(shift_left(probs, k + 1, 0.0), logits, view.valid)
        total = total + (step_decay**k) * loss_k
        with torch.no_grad():
            hit = (logits.argmax(-1) == shift_left(teacher_top, k + 1, -1)) & view.valid
            n_trained = int(view.trained.sum())
            accs.append(float(hit.sum()) / max(n_trained, 1))
        losses.append(float(loss_k.detach()))
        counts.append(n_trained)
    return TTTOutput(total, losses, accs, counts)


class TTTObjective(torch.nn.Module):
    """nn.Module wrapper so DDP sees the whole TTT unroll as one `forward` call."""

    def __init__(self, drafter: Eagle3Drafter, lm_head_draft: torch.Tensor, ttt_steps: int, step_decay: float):
        super().__init__()
        self.drafter = drafter
        self.register_buffer("lm_head_draft", lm_head_draft, persistent=False)
        self.ttt_steps = ttt_steps
        self.step_decay = step_decay

    def forward(self, batch: Batch) -> TTTOutput:
        return ttt_forward(self.drafter, batch, self.lm_head_draft, self.ttt_steps, self.step_decay)
