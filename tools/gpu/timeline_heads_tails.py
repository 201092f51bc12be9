#!/usr/bin/env python3
"""A streamed step's MoE blocks split into head and tail, from kernel timeline launch tables
(`CHERENKOV_TIMELINE`, docs/engine.md).

    tools/gpu/timeline_heads_tails.py PREFIX-stepN.tsv [OTHER-stepN.tsv ...]

For each MoE block of the step (found by its `moe_combine` launch): the head, from the previous
block's combination's end to the end of the block's router (the first `route_topk` after that
combination; the second, where the lookahead is on, is the next block's prediction), and the tail,
from the router's end to the block's combination's end: the host's turn, the misses' copies, the
read experts and the combination. Prints each table's step length, the sums of heads (the first
block's left out: it starts with the embedding) and tails, and every tail (us). Tables of the same
step of two paths compare where one of them spends its time; the routing of a step is the same in
both where the binaries route alike.
"""
import sys


def launches(path):
    """[(kernel, end us)] in launch order."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.startswith("#") or line.startswith("launch"):
                continue
            if not line.strip():
                break  # the table's own totals follow
            cols = line.rstrip("\n").split("\t")
            rows.append((cols[1], float(cols[6])))
    return rows


def split(rows):
    """[(head us or None, tail us)] per MoE block."""
    blocks, last_combine, router = [], None, None
    for kernel, end in rows:
        if kernel == "route_topk" and router is None:
            router = end
        elif kernel == "moe_combine":
            if router is None:
                sys.exit("a combination without a router before it: not a streamed step's table?")
            blocks.append((None if last_combine is None else router - last_combine, end - router))
            last_combine, router = end, None
    return blocks


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        rows = launches(path)
        blocks = split(rows)
        heads = sum(h for h, _ in blocks if h is not None)
        tails = sum(t for _, t in blocks)
        step = max(end for _, end in rows)
        print(f"{path}: step {step:.0f} us, {len(blocks)} blocks, heads {heads:.0f} us, tails {tails:.0f} us")
        print("  tails: " + " ".join(f"{t:.1f}" for _, t in blocks))


if __name__ == "__main__":
    main()
