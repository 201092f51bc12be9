#!/usr/bin/env python3
"""Where a streamed step's GPU waits for copies, block by block: the table a run writes with
`CHERENKOV_FLAG_BLOCKS=path` (flagged steps only: the default streamed step, `CHERENKOV_STEP_GRAPH`),
one row per timed MoE block.

    tools/gpu/flag_blocks.py [--last N] PATH [MODEL]

Each row holds what the block's lease found (`misses`: reads it queued; `inflight`: prefetches
still being read; `rest`: experts the router did not find in the hit map), the lookahead's reads
its turn queued, the host's turn (us from the router's flag seen, the host's clock), and the
block's GPU clock stamps (us from the step's first block): its experts' start, the read experts'
wait for the block's flag (began, past) and the combination's start.

Per model (a process's CudaModels count from 0: one a bench case), blocks are put in classes:
  misses     the lease queued at least one read (a demand miss);
  prefetched none queued, but some were still being read (the lookahead's, late);
  landed     the router missed some that had landed since (not yet in the hit map);
  found      the router found every expert.
Every flagged step writes its rows, the prompt's and the warm-up's too: `--last N` keeps each
model's last N steps (a bench case's timed tokens are its last ones: `--last 128` with `--tokens
128`). For each class: blocks, the GPU's mean wait for the flag, the mean time from the experts' start to
the combination, the mean head before the next block (its start less this block's combination,
within a step), and the host's mean marks. The waits' sum over a step is the bench's `waiting`.
Then the mean wait by the block's demand misses and the reads the turn before it queued (within a
step): a prefetch still on the link when a block's misses are queued shows as a longer wait after
more reads.
"""
import sys


def load(path):
    rows = []
    with open(path) as f:
        header = None
        for line in f:
            cols = line.rstrip("\n").split("\t")
            if header is None:
                header = cols
                continue
            if len(cols) != len(header):
                continue
            rows.append(dict(zip(header, cols)))
    return rows


def num(v):
    return None if v in ("-", "") else float(v)


def klass(r):
    if int(r["misses"]) > 0:
        return "misses"
    if int(r["inflight"]) > 0:
        return "prefetched"
    if int(r["rest"]) > 0:
        return "landed"
    return "found"


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def fmt(v):
    return "-" if v is None else f"{v:.1f}"


def main():
    args = sys.argv[1:]
    last = None
    if len(args) >= 2 and args[0] == "--last":
        last = int(args[1])
        args = args[2:]
    if len(args) not in (1, 2):
        print(__doc__)
        sys.exit(2)
    rows = load(args[0])
    if last is not None:
        ends = {}
        for r in rows:
            ends[r["model"]] = max(ends.get(r["model"], 0), int(r["step"]))
        rows = [r for r in rows if int(r["step"]) > ends[r["model"]] - last]
    models = sorted({r["model"] for r in rows}, key=int)
    if len(args) == 2:
        models = [args[1]]
    for m in models:
        mine = [r for r in rows if r["model"] == m]
        # The head before each block's successor in the same step (rows are in queue order).
        for a, b in zip(mine, mine[1:]):
            start, comb = num(b["start_us"]), num(a["combine_us"])
            same = a["step"] == b["step"]
            a["head"] = start - comb if same and start is not None and comb is not None else None
        steps = len({r["step"] for r in mine})
        print(f"model {m}: {len(mine)} blocks in {steps} steps")
        print(f"{'class':<11} {'blocks':>6} {'share':>6} {'wait us':>8} {'experts us':>10} {'head us':>8} "
              f"{'lease us':>8} {'flags us':>8} {'reads q.':>8} {'prefetches':>10}")
        total_wait = 0.0
        for k in ("misses", "prefetched", "landed", "found"):
            rs = [r for r in mine if klass(r) == k]
            if not rs:
                continue
            waits = []
            for r in rs:
                began, past = num(r["wait_began_us"]), num(r["wait_past_us"])
                waits.append(past - began if began is not None and past is not None and past >= began else None)
            total_wait += sum(w for w in waits if w is not None)
            spans = [num(r["combine_us"]) - num(r["start_us"])
                     if num(r["combine_us"]) is not None and num(r["start_us"]) is not None else None for r in rs]
            print(f"{k:<11} {len(rs):>6} {len(rs) / len(mine):>6.1%} {fmt(mean(waits)):>8} {fmt(mean(spans)):>10} "
                  f"{fmt(mean(r.get('head') for r in rs)):>8} {fmt(mean(num(r['lease_us']) for r in rs)):>8} "
                  f"{fmt(mean(num(r['flags_us']) for r in rs)):>8} {fmt(mean(num(r['lookahead_us']) for r in rs)):>8} "
                  f"{mean(int(r['prefetched']) for r in rs):>10.2f}")
        if steps:
            print(f"GPU wait for flags: {total_wait / steps / 1e3:.3f} ms a step")
        by = {}
        for a, b in zip(mine, mine[1:]):
            if a["step"] != b["step"]:
                continue
            began, past = num(b["wait_began_us"]), num(b["wait_past_us"])
            w = past - began if began is not None and past is not None and past >= began else None
            by.setdefault((int(b["misses"]), int(a["prefetched"])), []).append(w)
        if by:
            print("wait by the block's demand misses and the reads the turn before it queued:")
            print(f"{'demand':>6} {'reads before':>12} {'blocks':>6} {'wait us':>8}")
            for (m_, r_), ws in sorted(by.items()):
                print(f"{m_:>6} {r_:>12} {len(ws):>6} {fmt(mean(ws)):>8}")
        print()


if __name__ == "__main__":
    main()
