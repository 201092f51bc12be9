#!/usr/bin/env python3
"""Where each kernel's launches end against their blocks, from a kernel timeline's block records
(`CHERENKOV_TIMELINE`, docs/engine.md).

    tools/gpu/timeline_tails.py PREFIX-stepN.blocks.tsv

Groups each kernel's blocks into its launches (as the launch table does: by the time they passed
their wait, `blocks` at a time) and prints per kernel, as medians over its launches (us, from the
launch's first block past its wait): when half of its blocks had ended, when 90% had, and when the
last did, and the tail (last end - median end). A launch whose last block ends well after the
others is held by work that only one block does at its end (a last-block sum, a merge) or by a
second wave; one whose median end is late is held by every block's own work.
"""
import collections
import statistics
import sys


def launches(path):
    by_kernel = collections.defaultdict(list)
    with open(path) as f:
        next(f)
        for line in f:
            fields = line.rstrip("\n").split("\t")
            name, _block, blocks, sm, start, waited, end = fields[:7]
            # Files written before session 22 have no marked_ns column: -1, as for a block that
            # never passed its mark.
            marked = int(fields[7]) if len(fields) > 7 else -1
            by_kernel[name].append((int(start), int(waited), int(end), int(blocks), int(sm), marked))
    for name, recs in by_kernel.items():
        # Blocks that never wait (waited 0: the shared expert riding along) count from their start.
        recs.sort(key=lambda r: (max(r[0], r[1]), r[0]))
        i = 0
        while i < len(recs):
            n = max(recs[i][3], 1)
            yield name, recs[i : i + n]
            i += n


def first_wait(part):
    """When a launch's first block passed its wait (ns; its first start where none waits)."""
    return min([r[1] for r in part if r[1] > 0] or [r[0] for r in part])


def working(part):
    """A launch's working blocks, each with when it passed its wait (its start where it does not
    wait): those that ran from then longer than 0.3 of the launch's longest. Blocks past a part's
    end in a `matvec_many` grid return at once and are left out."""
    own = [r[1] if r[1] > 0 else r[0] for r in part]
    ran = [r[2] - o for r, o in zip(part, own)]
    longest = max(ran)
    return [(r, o) for r, o, d in zip(part, own, ran) if d > 0.3 * longest]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rows = collections.defaultdict(list)
    for name, part in launches(sys.argv[1]):
        w0 = first_wait(part)
        ends = sorted((r[2] - w0) / 1000 for r in part)
        q = lambda f: ends[round(f * (len(ends) - 1))]
        rows[name].append((q(0.5), q(0.9), ends[-1], ends[-1] - q(0.5)))
    print(f"{'kernel':26} {'launches':>8} {'50% end':>8} {'90% end':>8} {'last end':>9} {'tail':>6}")
    for name, v in sorted(rows.items(), key=lambda kv: -sum(r[3] for r in kv[1])):
        med = [statistics.median(r[i] for r in v) for i in range(4)]
        print(f"{name:26} {len(v):8d} {med[0]:8.2f} {med[1]:8.2f} {med[2]:9.2f} {med[3]:6.2f}")


if __name__ == "__main__":
    main()
