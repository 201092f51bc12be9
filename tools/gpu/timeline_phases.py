#!/usr/bin/env python3
"""A kernel's launches by phase: kernel timelines taken at different marks, side by side
(`CHERENKOV_TIMELINE` with `CHERENKOV_KERNEL_DEFINES=TL_MARK_AT=n`, docs/engine.md).

    tools/gpu/timeline_phases.py N=PREFIX-stepS.blocks.tsv [N=PREFIX-stepS.blocks.tsv ...]

N names the mark each file was taken at (0 for a timeline without TL_MARK_AT). For each kernel
and grid size, one column per file: the median over launches of the working blocks' mean time from
their own wait to their mark (us; "-" where no block of that kernel passed that mark). Then, from
the first file: the working blocks' mean time from their wait to their end, and the launch's last
end after its first block passed its wait (medians over launches). The files should be the same
step of runs of the same build, so that their launches line up; the columns still come from
different runs. Working blocks, launches and waits as in tools/gpu/timeline_tails.py.
"""
import collections
import statistics
import sys

from timeline_tails import first_wait, launches, working


def to_mark(path):
    """(kernel, grid) -> the median over launches of the marked working blocks' mean wait-to-mark."""
    per = collections.defaultdict(list)
    for name, part in launches(path):
        marked = [(r, o) for r, o in working(part) if r[5] > 0]
        if marked:
            per[(name, len(part))].append(statistics.mean((r[5] - o) / 1000 for r, o in marked))
    return {k: statistics.median(v) for k, v in per.items()}


def ends(path):
    """(kernel, grid) -> (launches, median mean wait-to-end, median last end after the first wait)."""
    per = collections.defaultdict(list)
    for name, part in launches(path):
        w0 = first_wait(part)
        mean_end = statistics.mean((r[2] - o) / 1000 for r, o in working(part))
        per[(name, len(part))].append((mean_end, max(r[2] for r in part) / 1000 - w0 / 1000))
    return {k: (len(v), statistics.median(e for e, _ in v), statistics.median(l for _, l in v)) for k, v in per.items()}


def main():
    args = sys.argv[1:]
    if not args or any("=" not in a for a in args):
        sys.exit(__doc__)
    files = [a.split("=", 1) for a in args]
    marks = [to_mark(path) for _, path in files]
    base = ends(files[0][1])
    head = "".join(f" {'mark ' + n:>8}" for n, _ in files)
    print(f"{'kernel':22} {'grid':>5} {'launches':>8}{head} {'end':>8} {'last end':>9}")
    for (name, grid), (n, end, last) in sorted(base.items(), key=lambda kv: -kv[1][0] * kv[1][2]):
        cols = "".join(f" {m[(name, grid)]:8.2f}" if (name, grid) in m else f" {'-':>8}" for m in marks)
        print(f"{name:22} {grid:5d} {n:8d}{cols} {end:8.2f} {last:9.2f}")


if __name__ == "__main__":
    main()
