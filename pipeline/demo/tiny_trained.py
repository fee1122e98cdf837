"""The trained tiny targets: the tiny Llama shape, trained for minutes on a synthetic domain.

``trained`` learns shop arithmetic (tiny_domain, the default domain), ``reasoning`` multi-step word
problems worked in a 100-300 token trace (tiny_reasoning); ``train`` takes the domain's generator.

Random weights give flat next-token distributions and a drafter learns little from them; a
real model is peaked. Training the same 4-layer shape on a narrow synthetic domain gets there
on 2 CPU cores in about a minute (400 steps of 32 conversations: held-out 0.14 nats per response
token, mean top-1 probability 0.94), because the cost that dominates a naive run, the softmax
over all 129,280 ids, is not paid:

* Only the ``used`` ids (those that occur as a response token, ~180) get their own ``lm_head``
  row; every other id shares one trained row, ``unused``. With equal rows, the full softmax's
  normaliser is ``sum(exp(used logits)) + n_unused * exp(unused logit)``: ``tied_log_probs``
  computes the full-vocabulary log-probabilities exactly, at the cost of ``len(used) + 1``
  logits. Training therefore optimises exactly the distribution the checkpoint holds.
* Residual channel 0 is held at ``CONST_VALUE`` through every layer (nothing writes to it, the
  final norm's weight there is 1), so after the final RMSNorm it is ``CONST_VALUE / rms > 0``.
  After training, ``UNUSED_PUSH`` is subtracted from the unused row's channel-0 weight: every
  unused logit drops by ``UNUSED_PUSH * h[0] > 0`` and no used logit moves. So the distribution
  over the used ids, given that one comes, is exactly the trained one; the full distribution
  differs from the trained one only by renormalising away the unused mass, which training had
  already made small and the push makes negligible (the build measures it: ``unused_mass``,
  ~1e-11 at worst on held-out text). Prompt-only specials are never targets, so they are unused.

Deterministic: data from a seeded ``random.Random``, weights from a seeded ``torch.Generator``,
a forward written here (no library's init order or kernel choice besides torch's own), a fixed
thread count and ``torch.use_deterministic_algorithms``. The same torch on the same kind of CPU
writes byte-identical weights; another torch build or CPU instruction set may round differently.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.demo.tiny_domain import Conversation, conversations
from pipeline.profiles.base import Profile

SEED = 2020
HELDOUT_SEED = 9090  # held-out conversations: another stream of the same generator
STEPS = 400
BATCH = 32
LR = 3e-3
WARMUP = 30
THREADS = 2  # fixed, not the machine's count: part of what makes a rebuild byte-identical
CONST_CHANNEL, CONST_VALUE = 0, 4.0
UNUSED_PUSH = 100.0
# The reasoning domain's rows are ~4x longer (~230 tokens, 455 output ids): 400 steps of 32 take about 3 min on
# 2 cores and reach ~0.2 nats per response token; its traces' branch points keep it above the shop target's.
REASONING_STEPS, REASONING_BATCH = 400, 32
MIXED_STEPS = 500  # both domains in one model (tiny_mixed): a little longer, half its rows are short shop ones


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @classmethod
    def of(cls, config: dict[str, Any]) -> Shape:
        """The shape a transformers Llama ``config.json`` describes."""
        return cls(config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
                   config["head_dim"], config["intermediate_size"], config["vocab_size"],
                   float(config["rope_theta"]), float(config["rms_norm_eps"]))


Row = tuple[list[int], int]  # (prompt + response ids, where the response starts)
Domain = Callable[[int, int], list[Conversation]]  # (n, seed) -> n conversations: the corpus generator


def encode(conv: Conversation, profile: Profile) -> Row:
    """(prompt + response ids, where the response starts), tokenized the way the pipeline does.

    The prompt goes through the profile's own rendering, so training sees exactly the ids a
    run feeds the engine; each response text segment (the domain writes no special string) is
    encoded on its own, between the special ids: the canonical tokenization the roundtrip check expects.
    """
    prompt = profile.render_prompt(conv.messages, None, conv.thinking).ids
    response = profile.encode(conv.reasoning) + [profile.think_end_id] if conv.thinking else []
    response += profile.encode(conv.content) + [profile.eot_id]
    return prompt + response, len(prompt)


@dataclass
class Vocab:
    """The compact vocabularies: ids seen as inputs (embedding rows) and as targets (lm_head rows)."""

    inputs: torch.Tensor  # sorted full ids
    outputs: torch.Tensor
    size: int

    @classmethod
    def of(cls, rows: list[Row], size: int) -> Vocab:
        ins = sorted({i for ids, _ in rows for i in ids})
        outs = sorted({i for ids, start in rows for i in ids[start:]})
        return cls(torch.tensor(ins), torch.tensor(outs), size)

    def index(self, ids: torch.Tensor, of: torch.Tensor) -> torch.Tensor:
        """Compact positions of full ids (each must be in ``of``)."""
        pos = torch.searchsorted(of, ids)
        if not torch.equal(of[pos.clamp(max=len(of) - 1)], ids):
            raise ValueError("id outside the compact vocabulary")
        return pos

    @property
    def n_unused(self) -> int:
        return self.size - len(self.outputs)


def tied_log_probs(h: torch.Tensor, head: torch.Tensor, unused: torch.Tensor, n_unused: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary log-probs of the used ids, and of "some unused id", for hidden states ``h``.

    Exact for an ``lm_head`` whose used rows are ``head`` and every other row equals ``unused``:
    the n_unused equal logits enter the normaliser as one logit plus ``log(n_unused)``.
    """
    used = h @ head.T
    rest = (h @ unused).unsqueeze(-1) + math.log(n_unused)
    lse = torch.logsumexp(torch.cat([used, rest], -1), -1, keepdim=True)
    return used - lse, (rest - lse).squeeze(-1)


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding: the two halves of each head rotate as pairs (vLLM's neox style)."""
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat([-b, a], -1) * sin


def forward(w: dict[str, torch.Tensor], ids: torch.Tensor, s: Shape) -> torch.Tensor:
    """Final normed hidden states (B, T, hidden) of the Llama decoder, transformers' weight names."""
    bsz, t = ids.shape
    inv = 1.0 / s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim)
    ang = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x = F.embedding(ids, w["model.embed_tokens.weight"])
    for i in range(s.layers):
        p = f"model.layers.{i}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"], s.eps)
        q, k, v = (F.linear(h, w[p + f"self_attn.{n}_proj.weight"]).view(bsz, t, s.heads, s.head_dim).transpose(1, 2)
                   for n in "qkv")
        a = F.scaled_dot_product_attention(_rope(q, cos, sin), _rope(k, cos, sin), v, is_causal=True)
        x = x + F.linear(a.transpose(1, 2).reshape(bsz, t, -1), w[p + "self_attn.o_proj.weight"])
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"], s.eps)
        gate, up = F.linear(h, w[p + "mlp.gate_proj.weight"]), F.linear(h, w[p + "mlp.up_proj.weight"])
        x = x + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
    return _rms_norm(x, w["model.norm.weight"], s.eps)


def _init(s: Shape, n_in: int, n_out: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Compact weights: ``n_in`` embedding rows, ``n_out`` head rows and the one ``unused`` row."""

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    d, inter, qkv = s.hidden, s.intermediate, s.heads * s.head_dim
    out_std = 0.5 / math.sqrt(2 * s.layers)  # residual writes start small so the stream stays well scaled
    w = {"model.embed_tokens.weight": normal(n_in, d, std=1.0)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(d)
        w[p + "post_attention_layernorm.weight"] = torch.ones(d)
        for n in "qkv":
            w[p + f"self_attn.{n}_proj.weight"] = normal(qkv, d, std=d**-0.5)
        w[p + "self_attn.o_proj.weight"] = normal(d, qkv, std=out_std)
        w[p + "mlp.gate_proj.weight"] = normal(inter, d, std=d**-0.5)
        w[p + "mlp.up_proj.weight"] = normal(inter, d, std=d**-0.5)
        w[p + "mlp.down_proj.weight"] = normal(d, inter, std=out_std)
    w["model.norm.weight"] = torch.ones(d)
    w["head"] = normal(n_out, d, std=d**-0.5)
    w["unused"] = torch.zeros(d)
    _pin_constant_channel(w, s)
    return w


@torch.no_grad()
def _pin_constant_channel(w: dict[str, torch.Tensor], s: Shape) -> None:
    """Hold residual channel 0 at CONST_VALUE: set by the embedding, written by no layer, unscaled at the end."""
    w["model.embed_tokens.weight"][:, CONST_CHANNEL] = CONST_VALUE
    for i in range(s.layers):
        w[f"model.layers.{i}.self_attn.o_proj.weight"][CONST_CHANNEL] = 0.0
        w[f"model.layers.{i}.mlp.down_proj.weight"][CONST_CHANNEL] = 0.0
    w["model.norm.weight"][CONST_CHANNEL] = 1.0


def _batch(rows: list[Row], vocab: Vocab, pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(compact input ids, response-prediction mask, compact targets): right-padded, so causal attention
    never lets padding reach a real position."""
    t = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), t), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.bool)
    for r, (seq, start) in enumerate(rows):
        ids[r, : len(seq)] = torch.tensor(seq)
        mask[r, start - 1 : len(seq) - 1] = True  # position p predicts token p + 1
    targets = vocab.index(ids[:, 1:][mask[:, :-1]], vocab.outputs)
    return vocab.index(ids, vocab.inputs), mask, targets


def _batches(rows: list[Row], batch: int, rng: random.Random, group: int = 8) -> list[list[Row]]:
    """Batches of similar lengths (sorted within groups of ``group`` batches, then shuffled): less padding."""
    out = []
    for g in range(0, len(rows), batch * group):
        chunk = sorted(rows[g : g + batch * group], key=lambda r: len(r[0]))
        out += [chunk[i : i + batch] for i in range(0, len(chunk), batch)]
    rng.shuffle(out)
    return out


@dataclass
class Scores:
    nll: float  # mean nats per response token
    top1_prob: float  # mean probability of the most likely next id
    top1_acc: float  # how often that id is the one that came
    unused_mass: float  # largest probability any position puts on all unused ids together
    tokens: int


@torch.no_grad()
def score(w: dict[str, torch.Tensor], s: Shape, vocab: Vocab, rows: list[Row],
          pad: int, batch: int = 64) -> Scores:
    """Next-token scores on the response tokens of ``rows``, over the full vocabulary."""
    nll = top1 = acc = 0.0
    worst, n = 0.0, 0
    for b in range(0, len(rows), batch):
        ids, mask, targets = _batch(rows[b : b + batch], vocab, pad)
        h = forward(w, ids, s)[mask]
        logp, rest = tied_log_probs(h, w["head"], w["unused"], vocab.n_unused)
        best = logp.max(-1)
        nll -= float(logp.gather(1, targets[:, None]).sum())
        top1 += float(best.values.exp().sum())
        acc += float((best.indices == targets).sum())
        worst = max(worst, float(rest.exp().max()))
        n += len(targets)
    return Scores(nll / n, top1 / n, acc / n, worst, n)


@contextmanager
def deterministic(threads: int = THREADS) -> Iterator[None]:
    """Fixed threads and deterministic kernels for the block; the caller's settings come back after."""
    before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        torch.use_deterministic_algorithms(before[1])


@dataclass
class Trained:
    weights: dict[str, torch.Tensor]  # compact; ``assemble`` makes the checkpoint
    vocab: Vocab
    heldout: Scores
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def train(profile: Profile, s: Shape, *, steps: int = STEPS, batch: int = BATCH, seed: int = SEED,
          heldout: int = 256, log_every: int = 0, domain: Domain = conversations) -> Trained:
    """Train the compact model on fresh conversations of ``domain`` every step; score it on held-out ones."""
    t0 = time.monotonic()
    rows = [encode(c, profile) for c in domain(steps * batch, seed)]
    held = [encode(c, profile) for c in domain(heldout, HELDOUT_SEED)]
    vocab = Vocab.of(rows, s.vocab)
    # Scored in the compact vocabularies: a held-out row with an id training never saw is left out.
    ins, outs = set(vocab.inputs.tolist()), set(vocab.outputs.tolist())
    held = [(ids, start) for ids, start in held if set(ids) <= ins and set(ids[start:]) <= outs]
    pad = profile.eot_id
    with deterministic():
        gen = torch.Generator().manual_seed(seed)
        w = _init(s, len(vocab.inputs), len(vocab.outputs), gen)
        params = [t.requires_grad_() for t in w.values()]
        opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.98), weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / WARMUP) * (
            0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(k, steps) / steps))))
        losses = []
        for k, chunk in enumerate(_batches(rows, batch, random.Random(seed))):
            ids, mask, targets = _batch(chunk, vocab, pad)
            h = forward(w, ids, s)[mask]
            logp, _ = tied_log_probs(h, w["head"], w["unused"], vocab.n_unused)
            loss = F.nll_loss(logp, targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            _pin_constant_channel(w, s)
            losses.append(loss.item())
            if log_every and (k + 1) % log_every == 0:
                print(f"step {k + 1}/{steps} loss {sum(losses[-log_every:]) / log_every:.3f} "
                      f"{time.monotonic() - t0:.0f}s", flush=True)
        w = {k: t.detach() for k, t in w.items()}
        w["unused"][CONST_CHANNEL] -= UNUSED_PUSH
        scores = score(w, s, vocab, held, pad)
    return Trained(w, vocab, scores, losses, time.monotonic() - t0)


def assemble(weights: dict[str, torch.Tensor], vocab: Vocab) -> dict[str, torch.Tensor]:
    """The full-vocabulary checkpoint: every id outside the compact vocabularies gets the shared rows.

    An id never seen as input embeds as the mean trained embedding (an "average word"), so an
    out-of-domain prompt reads as vague text rather than as random vectors.
    """
    w = {k: v for k, v in weights.items() if k not in ("head", "unused", "model.embed_tokens.weight")}
    trained_embed = weights["model.embed_tokens.weight"]
    embed = trained_embed.mean(0).repeat(vocab.size, 1)
    embed[vocab.inputs] = trained_embed
    head = weights["unused"].repeat(vocab.size, 1)
    head[vocab.outputs] = weights["head"]
    w["model.embed_tokens.weight"] = embed
    w["lm_head.weight"] = head
    return {k: v.contiguous() for k, v in w.items()}


def build_weights(config: dict[str, Any], *, steps: int = STEPS, batch: int = BATCH, domain: Domain = conversations
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The checkpoint's tensors for a tiny Llama ``config`` trained on ``domain``, and a report of the build
    (held-out scores, time)."""
    from pipeline.profiles.deepseek import load_deepseek_profile

    t = train(load_deepseek_profile(), Shape.of(config), steps=steps, batch=batch, domain=domain)
    report = {"domain": domain.__module__, "steps": steps, "batch": batch, "seconds": round(t.seconds, 1),
              "final_loss": round(t.losses[-1], 4),
              "input_ids": len(t.vocab.inputs), "output_ids": len(t.vocab.outputs),
              "heldout": {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in asdict(t.heldout).items()}}
    return assemble(t.weights, t.vocab), report
