#!/usr/bin/env python3
"""Can the GPU copy expert records straight out of the page cache?

The streamed decode reads each missing record from the page cache into pinned memory on the CPU
(0.27-0.29 ms per 2.64 MiB record, memory-bandwidth bound) before the copy engine moves it (0.06-0.08
ms). If the store's read-only file mapping can be registered with CUDA (`cudaHostRegister` with the
read-only flag, pinning the cached pages), the copy engine reads the records where they lie and the
CPU copy goes away. This probe registers a mapping of a file of random bytes and prints: whether
registration succeeds for each flag set, what it costs (warm and cold page cache), the copy time
and rate of record-sized slices from it, and whether the copied bytes are right. Needs torch with
CUDA (the GPU machine):

    python3 tools/gpu/register_probe.py [file_GiB] [record_bytes]
"""

import mmap
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

GIB = int(sys.argv[1]) if len(sys.argv) > 1 else 2
REC = int(sys.argv[2]) if len(sys.argv) > 2 else 2_768_896
SIZE = GIB << 30
FLAGS = {"read-only": 8, "read-only|portable": 8 | 1, "default": 0}
rt = torch.cuda.cudart()
dev = torch.device("cuda")


def report(name, value):
    print(f"{name:60s} {value}", flush=True)


def copies(host, dst, offsets):
    s = torch.cuda.Stream()
    out = []
    for off in offsets:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s):
            e0.record()
            dst.copy_(host[off : off + REC], non_blocking=True)
            e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1))
    return statistics.median(out)


def main():
    print(f"# register probe: a {GIB} GiB file, {REC}-byte records")
    fd, path = tempfile.mkstemp(dir=os.environ.get("PROBE_DIR", "/tmp"))
    rng = np.random.default_rng(1)
    with os.fdopen(fd, "wb") as f:
        for _ in range(GIB * 4):
            f.write(rng.integers(0, 256, 256 << 20, dtype=np.uint8).tobytes())
    dst = torch.empty(REC, dtype=torch.uint8, device=dev)
    nrec = SIZE // REC
    offsets = [((i * 7919) % nrec) * REC for i in range(60)]
    pinned = torch.empty(REC, dtype=torch.uint8, pin_memory=True)
    report("pinned buffer, for comparison (ms per record)", f"{copies(pinned, dst, [0] * 40):.4f}")
    for cold in (False, True):
        for name, flags in FLAGS.items():
            f = open(path, "rb")
            if cold:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            mm = mmap.mmap(f.fileno(), SIZE, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
            arr = np.frombuffer(mm, dtype=np.uint8)
            ptr = arr.ctypes.data
            t0 = time.perf_counter()
            err = rt.cudaHostRegister(ptr, SIZE, flags)
            dt = time.perf_counter() - t0
            label = f"{'cold' if cold else 'warm'} page cache, flags {name}"
            if int(err) != 0:
                report(label, f"register failed: {err}")
                torch.cuda.synchronize()
                del arr
                mm.close()
                f.close()
                continue
            report(label + ": register", f"{dt * 1e3:.1f} ms ({SIZE / dt / 1e9:.1f} GB/s)")
            host = torch.from_numpy(arr)
            ms = copies(host, dst, offsets)
            report(label + ": copy per record", f"{ms:.4f} ms ({REC / ms / 1e6:.1f} GB/s)")
            ok = all(torch.equal(dst.cpu(), host[offsets[-1] : offsets[-1] + REC]) for _ in range(1))
            report(label + ": last copy's bytes right", ok)
            t0 = time.perf_counter()
            rt.cudaHostUnregister(ptr)
            report(label + ": unregister", f"{(time.perf_counter() - t0) * 1e3:.1f} ms")
            del host, arr
            mm.close()
            f.close()
    os.unlink(path)


main()
