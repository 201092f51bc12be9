#!/usr/bin/env python3
"""Why does one expert record's host-to-device copy run slower than a large buffer's?

Times cudaMemcpyAsync of a pinned host buffer into device memory with CUDA events, the way the
engine's loads do (one record, its own stream), under the conditions a load meets: the buffer just
written by the CPU (memset, or pread from a file in the page cache), by a thread on another NUMA
node, two copies at once, and copies while the GPU runs memory-bound kernels. Prints a median per
case in ms and GB/s. Needs torch with CUDA (the GPU machine); run from anywhere:

    python3 tools/gpu/copy_probe.py [record_bytes]
"""

import os
import statistics
import subprocess
import sys
import tempfile
import threading

import torch

REC = int(sys.argv[1]) if len(sys.argv) > 1 else 2_768_896  # 2.64 MiB, the released shape's record
REPS = 40
dev = torch.device("cuda")


def pinned(n):
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)


def timed(host, dst, prep=None, reps=REPS, stream=None):
    s = stream or torch.cuda.Stream()
    out = []
    for i in range(reps):
        if prep:
            prep(i)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s):
            e0.record()
            dst.copy_(host, non_blocking=True)
            e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1))
    return statistics.median(out)


def report(name, ms, n=REC):
    print(f"{name:64s} {ms:8.4f} ms  {n / ms / 1e6:7.1f} GB/s", flush=True)


def main():
    print(f"# copy probe: {REC} bytes per copy, median of {REPS}")
    for cmd in (["nvidia-smi", "topo", "-m"], ["lscpu"]):
        try:
            text = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
            keep = [ln for ln in text.splitlines() if cmd[0] == "nvidia-smi" or "NUMA" in ln or "Model name" in ln]
            print("\n".join(keep))
        except Exception as e:  # noqa: BLE001 - a probe prints what it can
            print(f"({' '.join(cmd)}: {e})")
    dst = torch.empty(REC, dtype=torch.uint8, device=dev)
    h = pinned(REC)
    h.numpy()[:] = 1
    timed(h, dst, reps=5)

    report("pinned, untouched since the last copy", timed(h, dst))
    for size in (256 << 10, 1 << 20, 8 << 20, 64 << 20, 1 << 30):
        hb, db = pinned(size), torch.empty(size, dtype=torch.uint8, device=dev)
        hb.numpy()[:] = 1
        report(f"pinned, untouched, {size >> 10} KiB", timed(hb, db, reps=10 if size >= 1 << 30 else REPS), size)
        del hb, db

    hv = h.numpy()
    report("pinned, CPU memset before each copy", timed(h, dst, prep=lambda i: hv.fill(i & 0xFF)))

    fd, path = tempfile.mkstemp()
    os.write(fd, os.urandom(REC))
    os.fsync(fd)
    mv = memoryview(hv)
    os.preadv(fd, [mv], 0)

    def pread(i):
        os.preadv(fd, [mv], 0)

    report("pinned, pread from the page cache before each copy", timed(h, dst, prep=pread))

    def pread4(i):
        q = REC // 4
        ts = [threading.Thread(target=os.preadv, args=(fd, [mv[k * q : (k + 1) * q]], k * q)) for k in range(4)]
        [t.start() for t in ts]
        [t.join() for t in ts]

    report("pinned, pread in 4 threads before each copy", timed(h, dst, prep=pread4))

    # Buffers first touched from each NUMA node's CPUs (pinned pages land where first touched).
    nodes = sorted({int(d[4:]) for d in os.listdir("/sys/devices/system/node") if d.startswith("node") and d[4:].isdigit()})
    for node in nodes:
        cpus = open(f"/sys/devices/system/node/node{node}/cpulist").read().strip()
        cpu_set = set()
        for part in cpus.split(","):
            a, _, b = part.partition("-")
            cpu_set |= set(range(int(a), int(b or a) + 1))
        old = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cpu_set)
        hn = pinned(REC)
        hnv = hn.numpy()
        hnv[:] = 1
        report(f"pinned on node {node} (cpus {cpus}), untouched", timed(hn, dst))
        report(f"pinned on node {node}, memset before each copy", timed(hn, dst, prep=lambda i: hnv.fill(i & 0xFF)))
        os.sched_setaffinity(0, old)
        del hn

    pageable = torch.empty(REC, dtype=torch.uint8)
    pageable.numpy()[:] = 1
    report("pageable host memory", timed(pageable, dst))

    # Two records at once on two streams (a block's two misses).
    h2, dst2 = pinned(REC), torch.empty(REC, dtype=torch.uint8, device=dev)
    h2.numpy()[:] = 2
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    both = []
    for _ in range(REPS):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        with torch.cuda.stream(s1):
            ev[0].record()
            dst.copy_(h, non_blocking=True)
            ev[1].record()
        with torch.cuda.stream(s2):
            ev[2].record()
            dst2.copy_(h2, non_blocking=True)
            ev[3].record()
        torch.cuda.synchronize()
        both.append(max(ev[0].elapsed_time(ev[1]), ev[2].elapsed_time(ev[3])))
    report("two records at once on two streams (the slower)", statistics.median(both))

    # While the GPU streams through HBM on another stream (a decode step's kernels).
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    big2 = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        for _ in range(200):
            big2.copy_(big)
    report("pinned, untouched, while device-to-device copies run", timed(h, dst))
    torch.cuda.synchronize()
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    with torch.cuda.stream(busy):
        for _ in range(400):
            a @ a
    report("pinned, untouched, while matmuls run", timed(h, dst))
    torch.cuda.synchronize()
    os.close(fd)
    os.unlink(path)


if __name__ == "__main__":
    main()
