#!/usr/bin/env python3
"""Where a kernel's warps stall, instruction by instruction, from Nsight Compute's source page.

    ncu --set full -k regex:NAME --launch-skip N --launch-count M -o R <command>   (GPU machine)
    ncu -i R.ncu-rep --page source --print-source sass --csv > source.csv
    tools/gpu/ncu_stalls.py source.csv [TOP]

The CSV holds one table per profiled launch, each starting with its header row (Address, Source,
"Warp Stall Sampling (All Samples)", ..., one `stall_<reason>` column per reason and another for
its not-issued samples). Prints for each launch: its SASS lines and warp stall samples; the
samples per reason, most first (the `stall_<reason>` columns, all samples); and its TOP (default
40) lines by samples, each with its three largest reasons. Lines are numbered from 0 within the
launch's table, as in the SASS listing.
"""
import csv
import sys

TOTAL = "Warp Stall Sampling (All Samples)"


def number(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return 0.0


def tables(rows):
    """(header, body rows) per launch: a table starts at a row holding both Source and TOTAL."""
    starts = [i for i, r in enumerate(rows) if "Source" in r and TOTAL in r]
    for n, s in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(rows)
        header = rows[s]
        yield header, [r for r in rows[s + 1 : end] if len(r) == len(header)]


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    top = int(sys.argv[2]) if len(sys.argv) == 3 else 40
    with open(sys.argv[1], newline="", errors="replace") as f:
        rows = list(csv.reader(f))
    found = False
    for n, (header, body) in enumerate(tables(rows)):
        found = True
        src, tot = header.index("Source"), header.index(TOTAL)
        reasons = [i for i, c in enumerate(header) if c.startswith("stall_") and "(" not in c]
        total = sum(number(r[tot]) for r in body)
        print(f"launch {n}: {len(body)} lines, {total:.0f} samples")
        by_reason = sorted(((sum(number(r[i]) for r in body), header[i][6:]) for i in reasons), reverse=True)
        share = lambda v: 100.0 * v / total if total else 0.0
        print("  reasons: " + ", ".join(f"{k} {v:.0f} ({share(v):.1f}%)" for v, k in by_reason if v > 0))
        ranked = sorted(range(len(body)), key=lambda k: (-number(body[k][tot]), k))[:top]
        for k in ranked:
            r = body[k]
            if number(r[tot]) <= 0:
                break
            most = sorted(((number(r[i]), header[i][6:]) for i in reasons if number(r[i]) > 0), reverse=True)[:3]
            text = " ".join(r[src].split())
            print(f"  {number(r[tot]):6.0f}  {k:5d}  {text[:64]:64s}  " + " ".join(f"{k2}={v:.0f}" for v, k2 in most))
    if not found:
        sys.exit(f"{sys.argv[1]}: no table with a Source and a '{TOTAL}' column")


if __name__ == "__main__":
    main()
