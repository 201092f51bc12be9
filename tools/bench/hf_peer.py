#!/usr/bin/env python3
"""Decode speed of Hugging Face transformers' eager `qwen4_exp` on the same shape Cherenkov benchmarks.

Builds the model from a `config.json` (random weights, bf16, on the GPU), prefills a prompt of
`--prompt-tokens` random ids, then decodes `--tokens` tokens greedily with the KV cache, and prints
one JSON line: {"tokens": N, "seconds": S, "tokens_per_s": N/S, ...}. `--layers N` builds only the
first N decoder layers of that config (its bf16 experts take about 5 GB a layer of the released
shape, so the 48-layer model does not fit one GPU). Used by `cherenkov bench`, which passes the
synthetic store's config.json and the depths that fit the GPU (`--peer-layers`) and runs it
before it takes the GPU itself; runs where torch and transformers 5.17 are installed (the GPU
machine). "gpu_memory_gib" in its line is torch's max_memory_allocated, which the bench's memory
estimate for choosing the depth was checked against.

    python3 tools/bench/hf_peer.py --config STORE/config.json --tokens 32 --layers 8
"""

import argparse
import json
import time

import torch
import transformers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--layers", type=int, default=None,
                    help="build only the first N decoder layers (default: all of the config's)")
    args = ap.parse_args()

    cfg = json.load(open(args.config))
    text = cfg.get("text_config", cfg)
    text = with_layers(dict(text), args.layers, args.config)
    text["model_type"] = "qwen4_exp_text"
    config = transformers.AutoConfig.for_model(**text)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    # Built in bf16 from the start: built in f32 and converted, 8 layers of the released shape
    # would hold 80 GB and then 120 GB at once, beside the benchmark's own model.
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.Qwen4ExpForCausalLM(config).to(torch.bfloat16).eval()
    vocab = min(config.vocab_size, 500)
    ids = torch.randint(0, vocab, (1, args.prompt_tokens), device="cuda")

    def decode(n):
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            cache = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                out = model(input_ids=tok, past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                tok = out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

    decode(args.warmup)
    secs = decode(args.tokens)
    print(json.dumps({
        "peer": f"transformers {transformers.__version__} eager qwen4_exp, bf16, torch {torch.__version__}",
        "layers": config.num_hidden_layers,
        "experts": config.num_experts,
        "tokens": args.tokens,
        "seconds": secs,
        "tokens_per_s": args.tokens / secs,
        "gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }))


def with_layers(text, layers, path):
    """The text config `text` cut to its first `layers` decoder layers (None: unchanged): the
    per-layer list (`layer_types`) cut to match and the PLE layers beyond the cut dropped."""
    if layers is None:
        return text
    full = text.get("num_hidden_layers")
    if layers < 1 or (full is not None and layers > full):
        raise SystemExit(f"--layers {layers}: {path} has {full} decoder layers; give 1 to {full}")
    text["num_hidden_layers"] = layers
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:layers]
    if isinstance(text.get("ple_layer_ids"), list):
        text["ple_layer_ids"] = [i for i in text["ple_layer_ids"] if i <= layers]
    return text


if __name__ == "__main__":
    main()
