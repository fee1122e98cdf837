"""Simulated greedy speculative decoding in pure torch (no serving engine).

For a sequence that is the target's own greedy continuation, greedy verification of a draft is
decidable from one target forward: a drafted token is accepted iff it equals the target argmax
at that position, and accepting keeps the context on the stored sequence. So we run the drafter
K steps over all start indices in parallel (the TTT unroll, fed its own proposals instead of the
ground-truth tokens) and then walk the decode: from start t (hidden h_t, token t+1 verified) the
drafts predict tokens t+2..t+K+1; accept the longest matching prefix n, add the target's bonus
token, and continue from t+n+1 -- exactly how vLLM counts drafts and accepted tokens.

The tail counts too: vLLM drafts k tokens in every round until the request ends, even when fewer than
k tokens remain before the end of turn, and counts a draft past the end as accepted when the target's
own argmax agrees (its scheduler counts acceptances before it truncates at the stop token). So a round
runs from every t whose verified token t+1 is not the sequence's last, and a draft is compared with the
target's argmax wherever the row has it (up to the prediction after the last token); a draft beyond
that is counted as rejected, the one guess this cannot check. Stopping k tokens short of the end instead
leaves out the rounds where the deep positions fail most (measured on 16-token answers at k=3: 228
drafts counted against vLLM's 233; the share grows with k).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from training.data import as_float32
from training.model import Eagle3Drafter
from training.target import greedy_ids
from training.ttt_attention import StepKVCache, step0_mask


@dataclass
class AcceptanceStats:
    """Tokens per target step (1 + mean accepted drafts) and per-position acceptance rates."""

    acceptance_length: float
    per_position: list[float]
    num_drafts: int
    num_accepted: int


@dataclass(frozen=True)
class RowCounts:
    """One row's verification rounds (drafts) and, per draft position, how many of them were accepted."""

    drafts: int
    accepted: list[int]


@torch.no_grad()
def propose_all(drafter: Eagle3Drafter, input_ids: torch.Tensor, aux_hidden: torch.Tensor, k: int) -> torch.Tensor:
    """Greedy draft proposals for every start index: (k, T) target token ids, where row j at t
    is the drafter's guess for token t+j+2 given verified tokens <= t+1."""
    ids = input_ids[None]
    length = ids.shape[1]
    doc = torch.zeros_like(ids)
    mask0 = step0_mask(doc)
    pos = torch.arange(length)[None]
    cache = StepKVCache()
    hidden = drafter.project(aux_hidden[None].float())
    tokens = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)  # token t+1 at index t
    out = []
    for j in range(k):
        pre_norm = drafter.step(tokens, hidden, pos + j, mask0, cache)
        tokens = drafter.draft_to_target[drafter.logits(pre_norm).argmax(-1)]
        out.append(tokens[0])
        hidden = drafter.carry(pre_norm)  # what vLLM feeds the next draft step (post-norm with norm_output)
    return torch.stack(out)


def walk_acceptance(proposals: np.ndarray, target_next: np.ndarray, start: int) -> tuple[int, list[int]]:
    """Greedy verification from `start` to the end: returns (#drafts, accepted count per position).

    `target_next[j]` is the target's greedy token after position j; proposals[:, t] predict
    tokens t+2.. so they are compared with target_next[t+1..t+K]. Rounds run while the verified
    token t+1 is not the last one (the module docstring says why the tail counts)."""
    k, length = proposals.shape
    accepted = [0] * k
    drafts = 0
    t = start
    while t + 1 < length - 1:
        n = 0
        while n < k and t + 1 + n < length and proposals[n, t] == target_next[t + 1 + n]:
            n += 1
        for i in range(n):
            accepted[i] += 1
        drafts += 1
        t += n + 1
    return drafts, accepted


def response_start(mask: np.ndarray) -> int:
    """Index of the response's first token: where the last run of loss-masked tokens begins. The mask also
    covers the earlier assistant turns of a multi-turn prompt (``pipeline.hidden.extract.loss_mask``), so its
    first masked token can lie inside the prompt; the response is the last run, which ends the row."""
    mask = np.asarray(mask, bool)
    last = len(mask) - 1 - int(np.argmax(mask[::-1]))
    unmasked = np.flatnonzero(~mask[:last])
    return int(unmasked[-1]) + 1 if unmasked.size else 0


def row_counts(drafter: Eagle3Drafter, rows: Sequence[dict], lm_head: torch.Tensor, k: int = 3) -> list[RowCounts]:
    """Per row, in order: its drafts and accepted drafts per position under simulated greedy verification
    (a row without loss-masked tokens drafts nothing). One pass serves every breakdown of the rows
    (``training.heldout`` groups them by dataset and source); ``simulate_acceptance`` sums it."""
    drafter = drafter.eval()
    out: list[RowCounts] = []
    for row in rows:
        # copies: Ray hands out read-only arrays; rows may carry bf16 bits (the extraction's compact format)
        ids = torch.from_numpy(np.array(row["input_ids"], np.int64))
        aux = torch.from_numpy(np.array(as_float32(row["aux_hidden"])))
        final = torch.from_numpy(np.array(as_float32(row["final_hidden"])))
        mask = np.asarray(row["loss_mask"]).astype(bool)
        if not mask.any():
            out.append(RowCounts(0, [0] * k))
            continue
        start = response_start(mask) - 1  # hidden of the last prompt token
        if start < 0:
            raise ValueError("row must have at least one prompt token before its response")
        proposals = propose_all(drafter, ids, aux, k).numpy()
        stored = row.get("target_ids")  # the extraction's argmax, when it computed one
        target_next = np.asarray(stored, np.int64) if stored is not None else greedy_ids(final, lm_head).numpy()
        out.append(RowCounts(*walk_acceptance(proposals, target_next, start)))
    return out


def stats_from_counts(counts: Sequence[RowCounts], k: int) -> AcceptanceStats:
    """The acceptance of a set of rows from their counts: drafts and accepted tokens summed, then divided."""
    drafts = sum(c.drafts for c in counts)
    accepted = [sum(c.accepted[i] for c in counts) for i in range(k)]
    total = sum(accepted)
    return AcceptanceStats(
        acceptance_length=1.0 + total / max(drafts, 1),
        per_position=[a / max(drafts, 1) for a in accepted],
        num_drafts=drafts,
        num_accepted=total,
    )


def simulate_acceptance(
    drafter: Eagle3Drafter,
    rows: Sequence[dict],
    lm_head: torch.Tensor,
    k: int = 3,
) -> AcceptanceStats:
    """Acceptance of `drafter` on rows of the extraction contract whose loss-masked part is the
    target's greedy continuation of the prompt (decoding starts at the last prompt token). The
    target's choices are the rows' ``target_ids`` where present, else ``final_hidden @ lm_head.T``."""
    return stats_from_counts(row_counts(drafter, rows, lm_head, k), k)
