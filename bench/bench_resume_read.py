"""What a partial resume reads before its first request: the source actor's replay index and the read pass.

    python bench/bench_resume_read.py [--n 200000] [--left 0.1] [--chars 300]

A resume with work left starts each HTTP source actor by indexing every response the folder's journals hold
(``replay.ReplayIndex``: what was paid for must not be paid again), and the read pass streams the prompt files
for the rows left to do. Both are timed against a baseline measured in the same run:

- replay index, ``n`` journaled responses (~``chars`` characters each, the 200,000-prompt bench's size): every
  line parsed into a ``Record`` (how the index was built before), every line checked (``record_fields``, a
  journal with no projection beside it), and the projection the writers stored (``ReplayIndex`` as a resume's
  actor builds it);
- read pass, ``n`` prompts with ``left`` of them to do: ``todo_rows`` parsing the whole file, and with the id
  index the index pass keeps (``prompts/{dataset}.ids.parquet``) parsing only the rows left.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.base.config import DatasetConfig  # noqa: E402
from pipeline.base.layout import RunLayout  # noqa: E402
from pipeline.generate.sources.http.journal import Record, ResponseJournal  # noqa: E402
from pipeline.generate.sources.http.replay import ReplayIndex  # noqa: E402
from pipeline.prompts.read import index_dataset, todo_rows  # noqa: E402


def timed(fn, repeat: int = 3, setup=None) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def record_parse_index(folder: Path, source: str) -> int:
    """The index as it was built before: each line parsed into a Record, the latest per sample id kept."""
    where: dict[str, tuple[int, float]] = {}
    for path in sorted(folder.glob(f"{source}-*.jsonl")):
        offset = 0
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    rec = Record.from_json(line)
                    if rec.kind == "response" and rec.source == source:
                        seen = where.get(rec.sample_id)
                        if seen is None or rec.at >= seen[1]:
                            where[rec.sample_id] = (offset, rec.at)
                offset += len(line)
    return len(where)


def journal(folder: Path, n: int, chars: int, files: int = 4) -> None:
    body = ("Step by step: 12 + 30 = 42. " * (chars // 28 + 1))[:chars]
    per = n // files
    for k in range(files):
        with ResponseJournal(RunLayout(folder).response_journal("api", f"actor{k}")) as j:
            for i in range(k * per, (k + 1) * per):
                j.append(Record(sample_id=f"chat:{i}:{i * 7919 % 10007:04x}", dataset="chat", source="api",
                                model="vendor/model", sampling='{"max_tokens": 512}', request_digest="ab" * 32,
                                provider="P", reasoning=body, content=body[: chars // 4], finish_reason="stop",
                                billed_completion_tokens=chars // 4, cost=1e-4, generation_id=f"gen-{i}",
                                identity="id1"))
            j.store_projection()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--left", type=float, default=0.1, help="fraction of the prompts left to do")
    ap.add_argument("--chars", type=int, default=300, help="reasoning characters per journaled response")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-resume-read-"))
    try:
        run = RunLayout(work / "run")
        journal(run.root, args.n, args.chars)
        bare = work / "bare"
        bare.mkdir()
        for f in run.responses.glob("*.jsonl"):
            shutil.copy(f, bare / f.name)
        size = sum(f.stat().st_size for f in bare.iterdir()) / 1e6
        base, n0 = timed(lambda: record_parse_index(bare, "api"))
        # the first read of a bare journal stores its projection: each try starts without one
        checked, idx1 = timed(lambda: ReplayIndex(bare, "api"),
                              setup=lambda: shutil.rmtree(bare / ".totals", ignore_errors=True))
        projected, idx2 = timed(lambda: ReplayIndex(run.responses, "api"))
        assert n0 == len(idx1) == len(idx2) == args.n
        print(f"replay index, {args.n:,} responses ({size:.0f} MB of journal), one actor's start:")
        print(f"  every line parsed into a Record (before)  {base:6.2f} s   1.00x")
        print(f"  every line checked, no projection         {checked:6.2f} s   {base / checked:.2f}x faster")
        print(f"  the writers' projection (a resume)         {projected:6.2f} s   {base / projected:.2f}x faster")

        prompts = work / "chat.jsonl"
        with open(prompts, "w") as f:
            for i in range(args.n):
                f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + {i % 97}?"}]}) + "\n")
        d = DatasetConfig(name="chat", path=str(prompts))
        index_dataset(d, run, set(), {})  # a first pass keeps the file's ids
        every = [r["sample_id"] for r in todo_rows(d, set())]
        keep = max(1, int(len(every) * args.left))
        skip = set(every[keep:])
        whole, rows1 = timed(lambda: sum(1 for _ in todo_rows(d, skip)), repeat=2)
        indexed, rows2 = timed(lambda: sum(1 for _ in todo_rows(d, skip, index=run.prompt_index("chat"))),
                               repeat=2)
        assert rows1 == rows2 == keep
        print(f"read pass, {args.n:,} prompts with {keep:,} left to do:")
        print(f"  the whole file parsed (before)            {whole:6.2f} s   1.00x")
        print(f"  only the rows the id index says are left  {indexed:6.2f} s   {whole / indexed:.2f}x faster")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
