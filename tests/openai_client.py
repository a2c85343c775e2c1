"""The official `openai` Python client against `simpler serve` on the qwen3-tiny preset.

Usage: python openai_client.py PATH/TO/simpler

Starts the server on a free loopback port, completes, chats and streams through the client,
checks that errors arrive as the client's typed exceptions, reads `/metrics` through the
official `prometheus_client` parsers in both formats the server speaks, then stops the server
with SIGTERM while a client holds a half-sent request open, and requires a clean exit anyway.
"""

import signal
import socket
import subprocess
import sys
import urllib.request

import openai
from prometheus_client.openmetrics import parser as openmetrics_text
from prometheus_client import parser as prometheus_text

MODEL = "qwen3-tiny"


def main(exe: str) -> None:
    server = subprocess.Popen(
        [exe, "serve", "--preset", MODEL, "--port", "0", "--num-kv-blocks", "64",
         "--max-seq-len", "2048", "--max-batch-size", "8", "--drain-secs", "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = server.stdout.readline().strip()
        assert line.startswith("listening on http://"), f"unexpected first line: {line!r}"
        url = line.removeprefix("listening on ")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        run(client)
        check_metrics(url)
        # A client that sent half a request and stays: shutdown must not wait for it forever.
        host, port = url.removeprefix("http://").rsplit(":", 1)
        half = socket.create_connection((host, int(port)))
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=120)
    assert code == 0, f"the server exited with {code} after SIGTERM"
    print("openai client: all checks passed; the server shut down cleanly")


def run(client: "openai.OpenAI") -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL], ids

    # Completions, whole and streamed: the same greedy text.
    c = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10)
    text = c.choices[0].text
    assert c.object == "text_completion"
    assert c.choices[0].finish_reason in ("stop", "length")
    assert 1 <= c.usage.completion_tokens <= 10
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=10, stream=True)
        if ch.choices
    )
    assert streamed == text, (streamed, text)

    # Chat, whole and streamed (with the usage chunk).
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hello in French."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, seed=3)
    answer = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    parts, usage = [], None
    for ch in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, seed=3, stream=True,
            stream_options={"include_usage": True}):
        if ch.usage is not None:
            usage = ch.usage
        for choice in ch.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
    assert "".join(parts) == answer, (parts, answer)
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens

    # Sampling with a seed is repeatable.
    a = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                       temperature=0.8, top_p=0.9, seed=11)
    b = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                       temperature=0.8, top_p=0.9, seed=11)
    assert a.choices[0].message.content == b.choices[0].message.content

    # Errors come back as the client's typed exceptions, and the server keeps serving.
    for call, kind in [
        (lambda: client.completions.create(model="no-such-model", prompt="x"),
         openai.NotFoundError),
        (lambda: client.completions.create(model=MODEL, prompt="x", max_tokens=-1),
         openai.BadRequestError),
        (lambda: client.completions.create(model=MODEL, prompt="x", n=2),
         openai.BadRequestError),
        (lambda: client.completions.create(model=MODEL, prompt=[5] * 3000),
         openai.BadRequestError),
    ]:
        try:
            call()
        except kind as e:
            assert e.status_code in (400, 404), e.status_code
        else:
            raise AssertionError(f"expected {kind.__name__}")
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10)
    assert again.choices[0].text == text


def check_metrics(url: str) -> None:
    """`/metrics` as the Prometheus text format by default and as OpenMetrics when asked for,
    each read by the official parser of that format, with the same samples."""
    def scrape(accept):
        req = urllib.request.Request(f"{url}/metrics", headers={"Accept": accept} if accept else {})
        with urllib.request.urlopen(req) as r:
            return r.headers["Content-Type"], r.read().decode()

    kind, text = scrape(None)
    assert kind.startswith("text/plain; version=0.0.4"), kind
    plain = {s.name + str(sorted(s.labels.items())): s.value
             for f in prometheus_text.text_string_to_metric_families(text) for s in f.samples}
    kind, text = scrape("application/openmetrics-text; version=1.0.0,text/plain;q=0.5")
    assert kind.startswith("application/openmetrics-text"), kind
    families = list(openmetrics_text.text_string_to_metric_families(text))
    om = {s.name + str(sorted(s.labels.items())): s.value for f in families for s in f.samples}
    assert {f.name: f.type for f in families}["simpler_requests"] == "counter"
    # The counters moved while the requests above ran; the gauges may differ between scrapes.
    for name in ("simpler_prompt_tokens_total[]", "simpler_generation_tokens_total[]"):
        assert plain[name] == om[name] > 0, (name, plain.get(name), om.get(name))
    assert plain.keys() == om.keys(), plain.keys() ^ om.keys()


if __name__ == "__main__":
    main(sys.argv[1])
