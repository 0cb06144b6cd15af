#!/usr/bin/env python3
"""Burst of N one-turn /v1/completions (token-id prompts, distinct) to a Dynamo frontend, two
classes alternating in send order, all sent at once. Class named by the x-dynamo-meta-policy-class
header. Records each request's first-token time; prints per-class shares of first tokens served
while both classes still had requests waiting, and TTFT percentiles.
usage: burst.py URL N [--prompt 512] [--out 64] [--classes interactive,batch] [--json out.json]"""
import argparse, asyncio, json, random, time, statistics
import aiohttp
NOHDR = False

async def one(sess, url, model, i, cls, prompt, out, t0, res):
    rng = random.Random(1_000_003 * (i + 1))
    body = {"model": model, "prompt": [rng.randrange(1000, 49000) for _ in range(prompt)],
            "max_tokens": out, "min_tokens": out, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    hdr = {"x-dynamo-meta-policy-class": cls} if cls and not NOHDR else {}
    first = None; ntok = 0; status = None; err = None; cached = None
    try:
        async with sess.post(url, json=body, headers=hdr) as r:
            status = r.status
            if r.status != 200:
                err = (await r.text())[:300]
            else:
                async for line in r.content:
                    line = line.strip()
                    if not line.startswith(b"data:"): continue
                    d = line[5:].strip()
                    if d == b"[DONE]": break
                    j = json.loads(d)
                    if j.get("choices"):
                        if first is None: first = time.monotonic() - t0
                        ntok += 1
                    u = j.get("usage")
                    if u:
                        ntok = u.get("completion_tokens", ntok)
                        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
    except Exception as e:
        err = repr(e)
    res.append({"i": i, "cls": cls, "status": status, "ttft": first, "end": time.monotonic() - t0,
                "tokens": ntok, "cached": cached, "err": err})

def pct(xs, p):
    xs = sorted(xs); k = (len(xs) - 1) * p / 100; f = int(k); c = min(f + 1, len(xs) - 1)
    return xs[f] + (xs[c] - xs[f]) * (k - f)

def shares(res, classes):
    ok = [r for r in res if r["ttft"] is not None]
    last = {c: max(r["ttft"] for r in ok if r["cls"] == c) for c in classes}
    end = min(last.values())  # the class that finishes first got its last first token
    win = [r for r in ok if r["ttft"] <= end]
    n = len(win)
    return end, n, {c: sum(1 for r in win if r["cls"] == c) for c in classes}

async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url"); ap.add_argument("n", type=int)
    ap.add_argument("--model", default="smollm2"); ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--out", type=int, default=64); ap.add_argument("--classes", default="interactive,batch")
    ap.add_argument("--json")
    ap.add_argument("--no-header", action="store_true", help="label classes client-side only; send no class header")
    a = ap.parse_args()
    global NOHDR; NOHDR = a.no_header
    classes = a.classes.split(",")
    conn = aiohttp.TCPConnector(limit=0, force_close=True)  # fresh connection per request
    res = []
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.monotonic()
        await asyncio.gather(*(one(s, a.url, a.model, i, classes[i % len(classes)], a.prompt, a.out, t0, res)
                               for i in range(a.n)))
        wall = time.monotonic() - t0
    bad = [r for r in res if r["status"] != 200 or r["ttft"] is None]
    print(f"requests {a.n}, ok {a.n - len(bad)}, failed {len(bad)}, wall {wall:.2f} s")
    for r in bad[:5]: print("  fail:", r)
    cached = [r["cached"] for r in res if r["cached"]]
    print(f"requests reporting cached_tokens>0: {len(cached)}")
    end, n, cnt = shares(res, classes)
    print(f"window: first tokens until {end:.3f} s (last first token of the class done first): {n}")
    for c in classes:
        t = [r["ttft"] for r in res if r["cls"] == c and r["ttft"] is not None]
        print(f"  {c:12s} share {100*cnt[c]/n:5.1f} %  ({cnt[c]})  TTFT p50 {1000*pct(t,50):8.0f} ms  "
              f"p90 {1000*pct(t,90):8.0f} ms  last {1000*max(t):8.0f} ms  tokens/req {statistics.mean(r['tokens'] for r in res if r['cls']==c):.1f}")
    if a.json:
        json.dump({"args": vars(a), "wall": wall, "results": sorted(res, key=lambda r: r["i"])}, open(a.json, "w"))

asyncio.run(main())
