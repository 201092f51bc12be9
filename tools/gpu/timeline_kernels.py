#!/usr/bin/env python3
"""Two kernel-timeline launch tables (`CHERENKOV_TIMELINE`, docs/engine.md) side by side, per kernel.

    tools/gpu/timeline_kernels.py [--split] PREFIX-stepN.tsv [OTHER-stepN.tsv]

For each kernel of the first table: its launches in the step, their summed own time (last end -
first past its wait) and the time they added to the step (`added`), and the mean added per launch,
largest first (the table's footer has the last two); with a second table, that table's per-launch
figure and the difference beside it, and both steps' lengths. For an A/B of kernel changes:
per-launch figures moved by about 0.2 us between calls and hosts in session 18, tok/s rounds by
about 5% (benchmark/notes-cuda.md).

--split names each launch by its kernel, its grid and the kernel launched before it
(`matvec_q4/320<attend`), so that launches of one kernel in different places are apart: the
attention layers' output projection and the GDN layers', the GDN input projection and the router.
"""
import sys


def load(path, split=False):
    """{kernel: [launches, own, added]} and the step's length (us)."""
    kernels, step = {}, 0.0
    before = "-"
    with open(path) as f:
        header = None
        for line in f:
            if line.startswith("#"):
                continue
            if not line.strip():
                break  # the table's own totals follow
            cols = line.rstrip("\n").split("\t")
            if header is None:
                header = cols
                continue
            row = dict(zip(header, cols))
            name = f"{row['kernel']}/{row['blocks']}<{before}" if split else row["kernel"]
            before = row["kernel"]
            k = kernels.setdefault(name, [0, 0.0, 0.0])
            k[0] += 1
            k[1] += float(row["own"])
            k[2] += float(row["added"])
            step = max(step, float(row["end"]))
    return kernels, step


def main():
    args = sys.argv[1:]
    split = "--split" in args
    args = [a for a in args if a != "--split"]
    if len(args) not in (1, 2):
        sys.exit(__doc__)
    a, step_a = load(args[0], split)
    b, step_b = load(args[1], split) if len(args) == 2 else (None, None)
    width = max([26] + [len(k) + 2 for k in a])
    head = f"{'kernel':<{width}}{'launches':>9}{'own us':>10}{'added us':>10}{'per launch':>11}"
    print(head + (f"{'other':>9}{'diff':>8}" if b is not None else ""))
    for name, (n, own, added) in sorted(a.items(), key=lambda kv: -kv[1][2]):
        line = f"{name:<{width}}{n:>9}{own:>10.2f}{added:>10.2f}{added / n:>11.2f}"
        if b is not None:
            if name in b:
                other = b[name][2] / b[name][0]
                line += f"{other:>9.2f}{added / n - other:>+8.2f}"
            else:
                line += f"{'-':>9}{'':>8}"
        print(line)
    if b is not None:
        for name in sorted(set(b) - set(a)):
            print(f"{name:<{width}}{'-':>9}{'':>10}{'':>10}{'':>11}{b[name][2] / b[name][0]:>9.2f}")
    print(f"step {step_a:.1f} us" + (f" (other {step_b:.1f} us, {step_a - step_b:+.1f})" if b is not None else ""))


if __name__ == "__main__":
    main()
