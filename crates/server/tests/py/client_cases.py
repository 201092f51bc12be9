"""The official `openai` Python client against a running Cherenkov server.

Run by crates/server/tests/openai_client.rs, one case per process:

    python client_cases.py CASE

with CHERENKOV_BASE_URL (http://127.0.0.1:PORT/v1), CHERENKOV_TEST_KEY (the API key, if any) and,
for cases that compare with the engine, CHERENKOV_EXPECT (a JSON file the Rust test wrote). A case
fails by raising; the exit status says which. Nothing here depends on timing: waits poll the
server's /status with a generous bound.
"""

import json
import os
import sys
import threading
import time
import urllib.request

import openai

BASE = os.environ["CHERENKOV_BASE_URL"]
KEY = os.environ.get("CHERENKOV_TEST_KEY") or "unused"


def client(key=KEY):
    return openai.OpenAI(base_url=BASE, api_key=key, max_retries=0, timeout=300)


def expect():
    with open(os.environ["CHERENKOV_EXPECT"]) as f:
        return json.load(f)


def status():
    req = urllib.request.Request(BASE.rsplit("/v1", 1)[0] + "/status", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def wait_for(what, cond):
    for _ in range(3000):
        s = status()
        if cond(s):
            return s
        time.sleep(0.02)
    raise AssertionError(f"{what} never happened: {status()}")


def raises(exc, fn):
    try:
        fn()
    except exc as e:
        return e
    raise AssertionError(f"expected {exc.__name__}")


def chat(c, content, **kw):
    args = dict(model="cherenkov", messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0)
    args.update(kw)
    return c.chat.completions.create(**args)


def case_chat():
    c = client()
    r = chat(c, "Say something.")
    assert r.object == "chat.completion", r
    assert r.id.startswith("chatcmpl-"), r.id
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant", choice
    assert choice.finish_reason in ("stop", "length"), choice
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 8, u
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens, u

    # The registered name is the same model; greedy decoding is deterministic.
    r2 = chat(c, "Say something.", model="tiny")
    assert r2.model == "tiny" and r2.choices[0].message.content == choice.message.content

    # A seed reproduces a sampled answer; sampling settings are accepted.
    kw = dict(temperature=1.0, top_p=0.9, seed=42, max_tokens=10, presence_penalty=0.5, frequency_penalty=0.3)
    a, b = chat(c, "Tell a story.", **kw), chat(c, "Tell a story.", **kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    k = chat(c, "Tell a story.", max_tokens=4, temperature=0.8, extra_body={"top_k": 5, "repetition_penalty": 1.1})
    assert k.usage.completion_tokens <= 4

    # Log-probabilities: one entry per token, alternatives sorted, the greedy choice the first.
    r = chat(c, "Count.", max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens, (len(content), r.usage)
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True), t
        assert t.logprob == tops[0] and t.logprob <= 0, t
        assert isinstance(t.bytes, list) and t.token == bytes(t.bytes).decode("utf-8", "replace"), t

    # Errors come back as the client's exception types.
    e = raises(openai.BadRequestError, lambda: chat(c, "x", temperature=5))
    assert e.status_code == 400 and e.param == "temperature", e
    e = raises(openai.NotFoundError, lambda: chat(c, "x", model="gpt-4"))
    assert e.code == "model_not_found", e
    e = raises(openai.BadRequestError, lambda: chat(c, "x", max_tokens=10**9))
    assert e.code == "context_length_exceeded", e


def case_completions():
    c = client()
    ex = expect()
    r = c.completions.create(model="cherenkov", prompt=ex["prompt_text"], max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-"), r
    text = r.choices[0].text
    assert text == ex["greedy_text"], (text, ex["greedy_text"])
    assert r.usage.prompt_tokens == len(ex["prompt_ids"]), r.usage
    # Token ids instead of text give the same answer.
    r2 = c.completions.create(model="cherenkov", prompt=ex["prompt_ids"], max_tokens=8, temperature=0)
    assert r2.choices[0].text == text

    # Stop strings end the text before them.
    stop = text[len(text) // 2 :][:2]
    if stop.strip():
        r3 = c.completions.create(model="cherenkov", prompt=ex["prompt_ids"], max_tokens=8, temperature=0, stop=[stop])
        assert r3.choices[0].text == text[: text.index(stop)] and r3.choices[0].finish_reason == "stop", r3

    # logprobs: parallel lists, offsets into the text.
    r4 = c.completions.create(model="cherenkov", prompt=ex["prompt_ids"], max_tokens=5, temperature=0, logprobs=2)
    lp = r4.choices[0].logprobs
    n = r4.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n, lp
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0, lp
    for top, p in zip(lp.top_logprobs, lp.token_logprobs):
        assert len(top) <= 2 and abs(max(top.values()) - p) < 1e-6, (top, p)


def case_stream():
    c = client()
    full = chat(c, "Stream this.", max_tokens=12)
    chunks = list(chat(c, "Stream this.", max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant", chunks[0]
    assert len({ch.id for ch in chunks}) == 1
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content, (text, full.choices[0].message.content)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason], finishes
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens

    # Streamed logprobs cover every token once.
    chunks = list(chat(c, "Stream this.", max_tokens=12, stream=True, logprobs=True, top_logprobs=2))
    n = sum(len(ch.choices[0].logprobs.content) for ch in chunks if ch.choices and ch.choices[0].logprobs)
    assert n == full.usage.completion_tokens, n

    # Text completions stream too.
    whole = c.completions.create(model="cherenkov", prompt="Once", max_tokens=10, temperature=0)
    parts = list(c.completions.create(model="cherenkov", prompt="Once", max_tokens=10, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def case_echo():
    c = client()
    ex = expect()
    ids, want = ex["prompt_ids"], ex["token_logprobs"]
    r = c.completions.create(model="cherenkov", prompt=ids, echo=True, logprobs=5, max_tokens=0)
    choice = r.choices[0]
    assert choice.text == ex["prompt_text"], (choice.text, ex["prompt_text"])
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0, r.usage
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp
    for i in range(1, len(ids)):
        got, exp = lp.token_logprobs[i], want[i]
        assert abs(got - exp) <= 1e-5 * max(1.0, abs(exp)), (i, got, exp)
        tops = sorted(lp.top_logprobs[i].values(), reverse=True)
        exp_tops = ex["top5"][i]
        # Distinct ids can share a spelling, which the dict keeps once.
        assert all(any(abs(t - e) <= 1e-5 * max(1.0, abs(e)) for e in exp_tops) for t in tops), (i, tops, exp_tops)
        assert abs(tops[0] - exp_tops[0]) <= 1e-5 * max(1.0, abs(exp_tops[0])), (i, tops, exp_tops)

    # Echo with generation: the prompt's entries, then the completion's.
    r = c.completions.create(model="cherenkov", prompt=ids, echo=True, logprobs=1, max_tokens=3, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(ex["prompt_text"])
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens, lp
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - want[i]) <= 1e-5 * max(1.0, abs(want[i]))
    # Streamed echo: the prompt comes first.
    parts = list(c.completions.create(model="cherenkov", prompt=ids, echo=True, max_tokens=2, stream=True))
    assert parts[0].choices[0].text == ex["prompt_text"], parts[0]


def case_cancel():
    c = client()
    before = status()
    # Seeded: an unseeded draw could end at a stop token within the first chunks (it did, once in
    # many runs), which leaves nothing to cancel.
    stream = c.completions.create(
        model="cherenkov", prompt="Go on", max_tokens=4000, temperature=1.0, seed=11, stream=True
    )
    it = iter(stream)
    for _ in range(3):
        next(it)
    stream.close()
    after = wait_for(
        "the cancellation",
        lambda s: s["active"] == 0 and s["cancelled"] == before["cancelled"] + 1,
    )
    assert after["completed"] == before["completed"], (before, after)
    # The server goes on serving.
    r = c.completions.create(model="cherenkov", prompt="Go on", max_tokens=2)
    assert r.usage.completion_tokens <= 2


def case_concurrent():
    c = client()
    prompts = ["alpha beta", "gamma", "delta epsilon zeta", "eta"]
    alone = [chat(c, p, max_tokens=16).choices[0].message.content for p in prompts]
    results = [None] * len(prompts)
    errors = []

    def worker(i):
        try:
            pieces = []
            for ch in chat(client(), prompts[i], max_tokens=16, stream=True):
                if ch.choices and ch.choices[0].delta.content:
                    pieces.append(ch.choices[0].delta.content)
            results[i] = "".join(pieces)
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # Interleaved decoding gives each stream exactly what it gets alone.
    assert results == alone, (results, alone)
    s = status()
    assert s["active"] == 0 and s["completed"] >= 2 * len(prompts), s


def case_auth():
    r = chat(client(), "hi", max_tokens=2)
    assert r.usage.completion_tokens <= 2
    e = raises(openai.AuthenticationError, lambda: chat(client("wrong-key"), "hi"))
    assert e.status_code == 401 and e.code == "invalid_api_key", e


if __name__ == "__main__":
    globals()["case_" + sys.argv[1]]()
    print(f"{sys.argv[1]}: ok")
