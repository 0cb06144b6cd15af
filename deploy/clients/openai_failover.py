"""An OpenAI client that fails over between Flotilla gateways (docs/fleet.md, "Several gateways").

Any gateway serves any request. Each gateway gets the `openai` client's own retries (connection
errors, timeouts, 408/409/429/5xx, with back-off); when they are spent, a connection error, a
timeout or a 5xx (a dead, shedding or draining gateway) sends the request to the next gateway.
Chat completions only; the same shape works for `completions.create`.
A stream is read to its end before it is returned, so one cut by its gateway's death is sent
again whole (greedy or seeded requests give the same text again).

    python3 deploy/clients/openai_failover.py MODEL URL [URL …]     # one request, prints its text
"""

import sys

import openai
from openai import OpenAI

# What sends a request to the next gateway: it never reached one, or its gateway died, shed it
# or is draining (503). Other errors (400, 404, 413) are the request's own and are raised.
FAILOVER = (
    openai.APIConnectionError,
    openai.APITimeoutError,
    openai.InternalServerError,
)


class FailoverClient:
    def __init__(self, urls, retries_per_gateway=1, timeout=600.0):
        self.clients = [
            OpenAI(
                base_url=f"{u.rstrip('/')}/v1",
                api_key="unused",
                max_retries=retries_per_gateway,
                timeout=timeout,
            )
            for u in urls
        ]
        self.first = 0  # the gateway that answered last is tried first

    def chat(self, **request):
        last = None
        for k in range(len(self.clients)):
            i = (self.first + k) % len(self.clients)
            try:
                reply = self.clients[i].chat.completions.create(**request)
            except FAILOVER as e:
                last = e
                continue
            if request.get("stream"):
                try:
                    reply = list(reply)
                except Exception as e:  # noqa: BLE001 — the stream broke off in transport
                    last = e
                    continue
            self.first = i
            return reply
        raise last


if __name__ == "__main__":
    model, urls = sys.argv[1], sys.argv[2:]
    client = FailoverClient(urls)
    chunks = client.chat(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    print("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
