"""A streaming OpenAI client run as its own process (tests/test_tp_server.py):
it can run inside a network namespace, where the test process cannot reach.

    python tests/tp_client.py URL PROMPTS_JSON MAX_TOKENS [--kill PID --after N]

Waits (bounded) for URL/health, streams one greedy completion per prompt
(all at once, on threads) and prints one JSON line: per prompt the text, the
tokens (logprobs' token strings: "token_id:N" for models without a
tokenizer) and the error event's message or the exception that ended the
stream, if any. --kill PID --after N: SIGKILL PID once N chunks have
arrived over all streams (a rank killed mid-stream), then read on."""
import argparse
import json
import os
import signal
import threading
import time

import httpx
import openai


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("prompts")
    p.add_argument("max_tokens", type=int)
    p.add_argument("--kill", type=int)
    p.add_argument("--after", type=int, default=4)
    p.add_argument("--ready-timeout", type=float, default=240)
    a = p.parse_args()
    deadline = time.monotonic() + a.ready_timeout
    while True:
        try:
            if httpx.get(a.url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            print(json.dumps({"error": "server not ready"}))
            return
        time.sleep(0.2)
    client = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    prompts = json.loads(a.prompts)
    results = [{"text": "", "tokens": [], "error": None} for _ in prompts]
    chunks, lock = [0], threading.Lock()

    def run(i: int) -> None:
        r = results[i]
        try:
            for c in client.completions.create(model=model, prompt=prompts[i], max_tokens=a.max_tokens,
                                               temperature=0, logprobs=0, stream=True):
                ch = c.choices[0] if c.choices else None
                if ch is None:
                    continue
                r["text"] += ch.text
                r["tokens"] += ch.logprobs.tokens if ch.logprobs else []
                with lock:
                    chunks[0] += 1
                    if a.kill and chunks[0] == a.after:
                        os.kill(a.kill, signal.SIGKILL)
        except Exception as e:        # the server's error event (openai raises APIError on it) or a cut stream
            r["error"] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
