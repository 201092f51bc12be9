#!/usr/bin/env python3
"""How each launch's working blocks lay over the multiprocessors, from a kernel timeline's block
records (`CHERENKOV_TIMELINE`, docs/engine.md).

    tools/gpu/timeline_sms.py PREFIX-stepN.blocks.tsv

Groups the blocks into launches as tools/gpu/timeline_tails.py does. A launch's working blocks are
those that ran (from their wait, or their start where they do not wait) longer than 0.3 of its
longest block; blocks past a part's end in a `matvec_many` grid return at once and are left out.
Prints per kernel and grid size, over its launches: the working blocks, the multiprocessors they
ran on (median), how many multiprocessors held 1, 2, 3... of them (summed over the launches), and
the median over launches of the working blocks' mean end and last end (us after the launch's first
block past its wait). Many multiprocessors with 3 beside many with 1 is the block scheduler
filling some to their limit: the third block slows the other two, and the launch ends on them
(session 21, benchmark/notes-cuda.md).
"""
import collections
import statistics
import sys

from timeline_tails import first_wait, launches, working


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    by_shape = collections.defaultdict(list)
    for name, part in launches(sys.argv[1]):
        w0 = first_wait(part)
        work = [r for r, _ in working(part)]
        per_sm = collections.Counter(r[4] for r in work)
        ends = [(r[2] - w0) / 1000 for r in work]
        by_shape[(name, len(part))].append((len(work), len(per_sm), collections.Counter(per_sm.values()),
                                        statistics.mean(ends), max(ends)))
    print(f"{'kernel':22} {'grid':>5} {'launches':>8} {'working':>7} {'SMs':>4}  {'SMs holding 1/2/3/4+ (all launches)':36} {'mean end':>8} {'last end':>8}")
    for (name, grid), v in sorted(by_shape.items(), key=lambda kv: -sum(r[4] for r in kv[1])):
        dist = collections.Counter()
        for r in v:
            dist.update(r[2])
        held = "/".join(str(dist[k]) for k in (1, 2, 3)) + f"/{sum(c for k, c in dist.items() if k >= 4)}"
        med = lambda i: statistics.median(r[i] for r in v)
        print(f"{name:22} {grid:5d} {len(v):8d} {med(0):7.0f} {med(1):4.0f}  {held:36} {med(3):8.2f} {med(4):8.2f}")


if __name__ == "__main__":
    main()
