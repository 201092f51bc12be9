#!/usr/bin/env python3
"""Asks a running `cherenkov serve` the same questions on every backend, for tools/gpu/check.sh.

    server_check.py http://127.0.0.1:PORT/v1

Prints one line per request: its name and the text generated (as JSON, so the lines of a CPU server
and a CUDA server compare with `diff`). The requests cover the server's three decode paths on
CUDA: greedy and small top-k (the largest logits picked on the device), logprobs (every logit
copied back), and a repeated prompt (restored from the prefix cache's snapshot). Standard library
only: the GPU machine may lack the `openai` package.
"""

import json
import sys
import time
import urllib.request

base = sys.argv[1].rstrip("/")


def post(path, body):
    req = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def wait_ready():
    for _ in range(600):
        try:
            with urllib.request.urlopen(base + "/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"no server answered at {base}/models")


wait_ready()
chat = [{"role": "user", "content": "Explain hash collisions."}]
requests = [
    ("greedy", {"messages": chat, "max_tokens": 16, "temperature": 0}),
    ("greedy again (prefix cache)", {"messages": chat, "max_tokens": 16, "temperature": 0}),
    ("top-k 20, seed 3", {"messages": chat, "max_tokens": 16, "temperature": 0.8, "top_k": 20, "seed": 3}),
    ("greedy with logprobs", {"messages": chat, "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
]
for name, body in requests:
    r = post("/chat/completions", dict(body, model="cherenkov"))
    text = r["choices"][0]["message"]["content"]
    print(json.dumps({"request": name, "text": text}))
# The repeated prompt must have been restored, or the snapshot path went untested.
root = base[: -len("/v1")] if base.endswith("/v1") else base
with urllib.request.urlopen(root + "/metrics", timeout=30) as r:
    hits = [l for l in r.read().decode().splitlines() if l.startswith("cherenkov_prefix_cache_hits_total")]
print(json.dumps({"prefix cache hits": hits[0].split()[-1] if hits else "absent"}))
