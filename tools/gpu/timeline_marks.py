#!/usr/bin/env python3
"""Where a kernel's blocks spend their time around their mark, from a kernel timeline's block
records (`CHERENKOV_TIMELINE`, docs/engine.md).

    tools/gpu/timeline_marks.py PREFIX-stepN.blocks.tsv

Kernels call tl_mark() (common.cuh) at one point of their work: the tiled matvecs and expert
kernels once their input is staged, `attend` once a split's share is done (before the merge),
`route_topk` once its logits are loaded. Groups the blocks into launches as
tools/gpu/timeline_tails.py does and prints per kernel and grid size, over the launches' working
blocks that passed their mark (those that ran longer than 0.3 of the launch's longest), the medians
over launches of: the blocks' mean time from the launch's first block past its wait to their own
wait's return (the wait's spread), from their wait to their mark, and from their mark to their end;
and the latest mark-to-end (us). Blocks that never wait count from their start.
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
        marked = [(r, o) for r, o in working(part) if r[5] > 0]
        if not marked:
            continue
        spread = statistics.mean((o - w0) / 1000 for _, o in marked)
        to_mark = statistics.mean((r[5] - o) / 1000 for r, o in marked)
        after = [(r[2] - r[5]) / 1000 for r, _ in marked]
        by_shape[(name, len(part))].append((len(marked), spread, to_mark, statistics.mean(after), max(after)))
    if not by_shape:
        sys.exit("no block passed a mark (a timeline written before session 22, or kernels without tl_mark)")
    print(f"{'kernel':22} {'grid':>5} {'launches':>8} {'marked':>6} {'wait spread':>11} {'wait-mark':>9} {'mark-end':>8} {'last mark-end':>13}")
    for (name, grid), v in sorted(by_shape.items(), key=lambda kv: -len(kv[1]) * statistics.median(r[3] for r in kv[1])):
        med = lambda i: statistics.median(r[i] for r in v)
        print(f"{name:22} {grid:5d} {len(v):8d} {med(0):6.0f} {med(1):11.2f} {med(2):9.2f} {med(3):8.2f} {med(4):13.2f}")


if __name__ == "__main__":
    main()
