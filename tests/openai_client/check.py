"""Cases B01-B05 and B23 through the official `openai` Python client (installed by `make test` into
.venv). Usage: check.py GATEWAY_URL MODEL. Exits non-zero with a message on the first failure."""
import sys
import time

import openai
from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=30, max_retries=0)
MSG = [{"role": "user", "content": "Say hi"}]


def check(cond, what):
    if not cond:
        print("FAILED:", what)
        sys.exit(1)


# B01: chat and completions streams iterate to the end without error, within 30 s.
t0 = time.time()
chunks = list(client.chat.completions.create(model=model, messages=MSG, stream=True, max_tokens=8))
check(len({c.id for c in chunks}) == 1, "B01 one id")
check(all(c.object == "chat.completion.chunk" for c in chunks), "B01 chunk object")
comp = list(client.completions.create(model=model, prompt="Say hi", stream=True, max_tokens=8))
check(all(c.object == "text_completion" for c in comp), "B01 completion object")
check(time.time() - t0 < 30, "B01 within 30 s")

# B02: a usage chunk iff include_usage is true, last, with consistent counts.
def stream(**kw):
    return list(client.chat.completions.create(model=model, messages=MSG, stream=True,
                                               max_tokens=16, temperature=0, seed=7, **kw))

with_usage = stream(stream_options={"include_usage": True})
empty = [c for c in with_usage if not c.choices]
check(len(empty) == 1 and empty[0] is with_usage[-1], "B02 one usage chunk, last")
u = empty[0].usage
check(u.total_tokens == u.prompt_tokens + u.completion_tokens, "B02 total")
check(all(c.usage is None for c in with_usage[:-1]), "B02 no usage before")
plain = client.chat.completions.create(model=model, messages=MSG, max_tokens=16, temperature=0, seed=7)
check(plain.usage.completion_tokens == u.completion_tokens, "B02 same completion_tokens")
for kw in ({"stream_options": {"include_usage": False}}, {}):
    s = stream(**kw)
    check(all(c.choices and c.usage is None for c in s), "B02 no usage chunk without include_usage")

# B03: finish_reason null until the last chunk; "length" with max_tokens 5.
s = list(client.chat.completions.create(model=model, stream=True, max_tokens=5, temperature=0,
         messages=[{"role": "user", "content": "Write a long essay about the sea."}],
         stream_options={"include_usage": True}))
reasons = [c.choices[0].finish_reason for c in s if c.choices]
check(all(r is None for r in reasons[:-1]) and reasons[-1] == "length", "B03 reasons %r" % reasons)
check(s[-1].usage.completion_tokens == 5, "B03 completion_tokens == 5")

# B04: the stream helper accumulates exactly one "assistant" role.
if hasattr(client.chat.completions, "stream"):
    capital = [{"role": "user", "content": "What is the capital of France?"}]
    with client.chat.completions.stream(model=model, messages=capital, max_tokens=50, temperature=0) as st:
        for _ in st:
            pass
        final = st.get_final_completion()
    check(final.choices[0].message.role == "assistant", "B04 role %r" % final.choices[0].message.role)
    check(final.choices[0].message.content == "The capital of France is Paris.", "B04 content")
roles = [c.choices[0].delta.role for c in chunks if c.choices]
check(roles[0] == "assistant" and all(r is None for r in roles[1:]), "B04 role once: %r" % roles)

# B05 A/B: errors before the stream are BadRequestError, like their non-streaming twins.
for kw in ({"temperature": -1}, {"top_p": 2}):
    for streaming in (True, False):
        try:
            r = client.chat.completions.create(model=model, messages=MSG, stream=streaming, **kw)
            if streaming:
                list(r)
            check(False, "B05 %r accepted" % kw)
        except openai.BadRequestError as e:
            check(e.status_code == 400, "B05 status")
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x " * 20000}], stream=True)
    check(False, "B05 overflow accepted")
except openai.BadRequestError:
    pass

# B23: a list of prompts, n per prompt, prompt-major indexes, each text as the prompt alone,
# usage summed; streamed too.
PROMPTS = ["The capital of France is", "One, two, three,", "The sky is"]
alone = [client.completions.create(model=model, prompt=p, max_tokens=5, temperature=0) for p in PROMPTS]
batch = client.completions.create(model=model, prompt=PROMPTS, max_tokens=5, temperature=0, n=2)
check(len(batch.choices) == 6, "B23 prompts x n choices")
for c in batch.choices:
    check(c.text == alone[c.index // 2].choices[0].text, "B23 choice %d text" % c.index)
check(sorted(c.index for c in batch.choices) == list(range(6)), "B23 indexes")
check(batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone), "B23 prompt_tokens summed")
check(batch.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone),
      "B23 completion_tokens summed")
chunks = list(client.completions.create(model=model, prompt=PROMPTS, max_tokens=5, temperature=0,
                                        stream=True, stream_options={"include_usage": True}))
texts = {}
for ch in chunks:
    for c in ch.choices:
        texts[c.index] = texts.get(c.index, "") + c.text
check([texts.get(i) for i in range(3)] == [a.choices[0].text for a in alone], "B23 streamed texts")
check(sum(1 for ch in chunks if ch.usage is not None) == 1, "B23 one usage record")
try:
    client.completions.create(model=model, prompt=["a", ""], max_tokens=5)
    check(False, "B23 an empty prompt in the list accepted")
except openai.BadRequestError as e:
    check(e.status_code == 400 and e.param == "prompt", "B23 empty prompt names prompt")

# Echo (issue 33 item 6): what lm-evaluation-harness sends to score a text — the prompt alone
# with its logprobs, the first one None; then the prompt followed by a completion, streamed too.
scored = client.completions.create(model=model, prompt="The sky is blue", echo=True, max_tokens=0,
                                   logprobs=1, temperature=0)
c = scored.choices[0]
check(c.text == "The sky is blue", "echo text is the prompt")
check(c.finish_reason == "length", "echo max_tokens 0 finishes with length")
lp = c.logprobs
check(lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, "echo first token has no logprob")
check(len(lp.tokens) == scored.usage.prompt_tokens and scored.usage.completion_tokens == 0,
      "echo scores every prompt token, generates none")
check(all(x is not None and x <= 0 for x in lp.token_logprobs[1:]), "echo logprobs are logprobs")
check("".join(lp.tokens) == c.text and lp.text_offset[0] == 0, "echo tokens cover the text")
more = client.completions.create(model=model, prompt="The sky is blue", echo=True, max_tokens=3,
                                 logprobs=1, temperature=0)
m = more.choices[0]
check(m.text.startswith("The sky is blue") and len(m.text) > len(c.text), "echo then completion")
check(all(abs(a - b) < 1e-3 for a, b in zip(m.logprobs.token_logprobs[1:len(lp.tokens)],
                                             lp.token_logprobs[1:])), "echo prompt logprobs agree")
check(len(m.logprobs.tokens) == len(lp.tokens) + more.usage.completion_tokens, "echo logprobs cover both")
chunks = list(client.completions.create(model=model, prompt="The sky is blue", echo=True, max_tokens=3,
                                        logprobs=1, temperature=0, stream=True))
check("".join(ch.choices[0].text for ch in chunks if ch.choices) == m.text, "streamed echo text")
first = next(ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].text)
check(first.text.startswith("The sky is blue") and first.logprobs.token_logprobs[0] is None,
      "streamed echo: the prompt comes first")
print("openai client checks passed")
