"""Case B24 through the official `anthropic` Python client (installed by `make test` into
.venv). Usage: check.py GATEWAY_URL MODEL. Exits non-zero with a message on the first failure."""
import sys

import anthropic

base, model = sys.argv[1], sys.argv[2]
client = anthropic.Anthropic(base_url=base, api_key="unused", timeout=60, max_retries=0)
SYSTEM = "You are a terse assistant."
MSG = [{"role": "user", "content": "Name three colors."}]


def check(cond, what):
    if not cond:
        print("FAILED:", what)
        sys.exit(1)


# anthropic 2.17 no longer takes temperature as an argument: greedy decoding (so that a
# streamed and a non-streamed answer agree) goes through extra_body, as the client documents
# for fields it does not list.
GREEDY = {"temperature": 0}


def create(**kw):
    extra = dict(GREEDY, **kw.pop("extra_body", {}))
    args = dict(model=model, max_tokens=24, system=SYSTEM, messages=MSG, extra_body=extra)
    args.update(kw)
    return client.messages.create(**args)


# A message: its shape and usage.
m = create()
check(m.type == "message" and m.role == "assistant", f"message shape: {m}")
check(m.id.startswith("msg_"), f"id {m.id}")
check(m.model == model, f"model {m.model}")
check(len(m.content) == 1 and m.content[0].type == "text", f"one text block: {m.content}")
check(m.content[0].text.strip() != "", "some text")
check(m.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {m.stop_reason}")
check(m.stop_sequence is None, "no stop_sequence")
check(m.usage.output_tokens > 0, f"output_tokens {m.usage}")
check(m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0, f"input_tokens {m.usage}")

# The same through messages.stream: text_stream and get_final_message agree with it.
with client.messages.stream(model=model, max_tokens=24, system=SYSTEM, messages=MSG,
                            extra_body=GREEDY) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
check(text == m.content[0].text, f"streamed text {text!r} == {m.content[0].text!r}")
check(final.content[0].text == text, "final message text")
check(final.stop_reason == m.stop_reason, f"final stop_reason {final.stop_reason}")
check(final.usage.output_tokens == m.usage.output_tokens, f"final usage {final.usage}")
check(final.id.startswith("msg_"), "final id")

# Raw events with stream=True: Anthropic's order.
types = [e.type for e in create(stream=True)]
check(types[0] == "message_start" and types[1] == "content_block_start", f"opening {types}")
check(types[-3:] == ["content_block_stop", "message_delta", "message_stop"], f"closing {types}")
check(all(t == "content_block_delta" for t in types[2:-3]), f"deltas {types}")

# stop_sequences: the reference text cut before the sequence, named in stop_sequence.
words = m.content[0].text.split()
check(len(words) >= 2, f"enough words in {m.content[0].text!r}")
seq = words[1]
cut = create(stop_sequences=[seq])
check(cut.stop_reason == "stop_sequence" and cut.stop_sequence == seq, f"stop {cut}")
check(cut.content[0].text == m.content[0].text[: m.content[0].text.index(seq)], "cut text")
with client.messages.stream(model=model, max_tokens=24, system=SYSTEM, messages=MSG,
                            stop_sequences=[seq], extra_body=GREEDY) as s:
    streamed = s.get_final_message()
check(streamed.stop_reason == "stop_sequence" and streamed.stop_sequence == seq, "streamed stop")
check(streamed.content[0].text == cut.content[0].text, "streamed cut text")

# max_tokens.
short = create(max_tokens=3)
check(short.stop_reason == "max_tokens" and short.usage.output_tokens == 3, f"max_tokens {short}")


def error_of(e):
    body = e.body if isinstance(e.body, dict) else {}
    return body.get("error", body)


# Errors in Anthropic's shape, raised as the client's own exception classes.
try:
    create(model="no-such-model")
    check(False, "unknown model accepted")
except anthropic.NotFoundError as e:
    check(e.status_code == 404 and error_of(e).get("type") == "not_found_error", f"404 {e.body}")
image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}
for kw, name in (
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]},
     "image"),
    ({"tools": [{"name": "get_weather", "description": "weather",
                 "input_schema": {"type": "object", "properties": {}}}]}, "tools"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"speed": "fast"}, "speed"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "output_config"),
):
    try:
        create(**kw)
        check(False, f"{name} accepted")
    except anthropic.BadRequestError as e:
        err = error_of(e)
        check(err.get("type") == "invalid_request_error", f"{name}: {e.body}")
        check(name in err.get("message", ""), f"{name} named: {e.body}")

# count_tokens: the prompt a message with the same system and messages runs.
counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=MSG)
check(counted.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0),
      f"count_tokens {counted} vs {m.usage}")
try:
    client.messages.count_tokens(model="no-such-model", messages=MSG)
    check(False, "count_tokens: unknown model accepted")
except anthropic.NotFoundError as e:
    check(error_of(e).get("type") == "not_found_error", f"count_tokens 404 {e.body}")
# Consecutive user turns are one turn: the same answer as their texts joined with "\n".
two = create(messages=[{"role": "user", "content": "Name three colors."},
                       {"role": "user", "content": "Be brief."}])
one = create(messages=[{"role": "user", "content": "Name three colors.\nBe brief."}])
check(two.content[0].text == one.content[0].text, f"combined turns {two} vs {one}")

print("anthropic client checks passed")
