#!/usr/bin/env python3
"""Summarises the blocks of one launch in a kernel timeline (`CHERENKOV_TIMELINE`, docs/engine.md).

    tools/gpu/timeline_blocks.py PREFIX-stepN.blocks.tsv KERNEL FROM_US TO_US

takes the blocks of KERNEL that passed their wait between FROM_US and TO_US (the launch table's
`waited` column gives the window) and prints how many blocks each multiprocessor ran, and the
spread of the blocks' start, wait and end times from the first block past its wait (us), and of
each block's own time (end - wait): where a launch's time goes among its blocks (a second wave,
a tail of slow blocks, blocks with nothing to do). Then the last blocks past their wait and the
last to end, each with its block (the linear index, x fastest, so a part of a `matvec_many` grid
is a range of them) and multiprocessor: whether the launch ends with late blocks or slow ones.
"""
import collections
import sys

LAST = 4  # blocks listed by each of the last two lines


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    path, kernel, lo, hi = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
    rows = []
    with open(path) as f:
        next(f)
        for line in f:
            name, block, _blocks, sm, start, waited, end = line.rstrip("\n").split("\t")[:7]
            if name != kernel or int(waited) < 0:
                continue
            w = int(waited) / 1000
            if lo <= w <= hi:
                rows.append((int(block), int(sm), int(start) / 1000, w, int(end) / 1000))
    if not rows:
        sys.exit(f"no blocks of {kernel} passed their wait between {lo} and {hi} us in {path}")
    w0 = min(r[3] for r in rows)
    print(f"{kernel}: {len(rows)} blocks, the first past its wait at {w0:.2f} us")
    per_sm = collections.Counter(r[1] for r in rows)
    print("multiprocessors by blocks run:", dict(sorted(collections.Counter(per_sm.values()).items())))

    def spread(name, vals):
        vals = sorted(vals)
        qs = (0, 0.1, 0.25, 0.5, 0.75, 0.9, 1)
        print(f"{name:10}", "  ".join(f"{int(q * 100)}%: {vals[round(q * (len(vals) - 1))]:.2f}" for q in qs))

    spread("start", [r[2] - w0 for r in rows])
    spread("waited", [r[3] - w0 for r in rows])
    spread("end", [r[4] - w0 for r in rows])
    spread("end-wait", [r[4] - r[3] for r in rows])

    def last(name, key):
        print(f"last {name}:", "  ".join(
            f"block {b} sm {sm} waited {w - w0:.2f} end {e - w0:.2f}"
            for b, sm, _s, w, e in sorted(rows, key=key)[-LAST:][::-1]))

    last("past the wait", lambda r: (r[3], r[0]))
    last("to end", lambda r: (r[4], r[0]))


if __name__ == "__main__":
    main()
