"""What journaling a billed response costs the source's event loop, as a ratio to a bare list append.

    python bench/bench_journal.py [--n 100000] [--chars 4000] [--dir /path/on/the/run/filesystem]

``ResponseJournal.append`` (default policy: background writes, fsync at most
once a second) against ``list.append`` of the same pre-built records, plus
serialisation alone, so the ratio shows what the journal adds on top of
turning a record into a line. The source runs ~2,000 requests in flight, i.e.
tens of responses a second: anything above ~10k appends/s is far from mattering.
Pass ``--dir`` on the filesystem a run writes to (NFS fsyncs cost more).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.generate.sources.http.journal import Record, ResponseJournal, iter_journal  # noqa: E402


def records(n: int, chars: int) -> list[Record]:
    body = ("Let me think about this step by step. " * (chars // 38 + 1))[:chars]
    return [Record(sample_id=f"sample-{i:07d}", dataset="math", source="openrouter", model="vendor/model",
                   sampling='{"max_tokens": 8192, "temperature": 0.6, "top_p": 0.95}', request_digest="ab" * 32,
                   provider="SomeProvider", reasoning=body, content=body[: chars // 4], finish_reason="stop",
                   native_finish_reason="stop", billed_completion_tokens=chars // 4, cost=0.0012,
                   generation_id=f"gen-{i}", t_generate_s=12.5, attempts=1) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--chars", type=int, default=4000, help="reasoning characters per record (content is 1/4)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the journal (default: a temp dir)")
    args = ap.parse_args()
    recs = records(args.n, args.chars)

    t0 = time.perf_counter()
    bare: list[Record] = []
    for r in recs:
        bare.append(r)
    t_list = time.perf_counter() - t0

    t0 = time.perf_counter()
    lines: list[bytes] = []
    for r in recs:
        lines.append(r.to_json())
    t_ser = time.perf_counter() - t0
    mb = sum(map(len, lines)) / 1e6

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = Path(d) / f"openrouter-{uuid.uuid4().hex}.jsonl"
        j = ResponseJournal(path)  # the default policy
        t0 = time.perf_counter()
        for r in recs:
            j.append(r)
        t_journal = time.perf_counter() - t0
        t0 = time.perf_counter()
        j.close()
        t_close = time.perf_counter() - t0
        assert sum(1 for _ in iter_journal(path)) == args.n

    rate = args.n / t_journal
    print(f"{args.n} records of ~{mb / args.n * 1e3:.1f} KB ({mb:.0f} MB)")
    print(f"list.append        {args.n / t_list:>14,.0f} appends/s")
    print(f"to_json only       {args.n / t_ser:>14,.0f} lines/s")
    print(f"ResponseJournal    {rate:>14,.0f} appends/s  ({t_journal * 1e6 / args.n:.1f} us each; "
          f"close flushed the rest in {t_close * 1e3:.0f} ms)")
    print(f"ratio journal/list {t_journal / t_list:>14.0f}x   journal/to_json {t_journal / t_ser:.2f}x")


if __name__ == "__main__":
    main()
