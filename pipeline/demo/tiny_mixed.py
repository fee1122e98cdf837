"""The ``mixed`` tiny target's world: the shop domain and the reasoning domain in one corpus.

One target that serves both tiny domains lets one run hold two datasets whose drafters learn at different
rates: a shop answer is ~30 near-certain tokens that a drafter learns from a few dozen samples, a reasoning
answer a 100-300 token trace with branch points that keeps paying for more. That is the case the value curves
and the plan (``python -m pipeline value`` / ``plan``) exist for, and what ``bench/bench_value.py`` measures.

Each conversation is drawn from one domain, shop with probability ``SHOP_SHARE``, from one seeded
``random.Random`` stream; the two domains' prompts differ (their questions and system prompts), so the
prompt tells the target which kind of answer to write.
"""

from __future__ import annotations

import random

from pipeline.demo import tiny_domain, tiny_reasoning
from pipeline.demo.tiny_domain import Conversation

__all__ = ["Conversation", "conversations"]

SHOP_SHARE = 0.5  # half the corpus each: the reasoning half carries ~85% of the response tokens


def conversations(n: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)
    return [(tiny_domain if rng.random() < SHOP_SHARE else tiny_reasoning).conversation(rng) for _ in range(n)]
