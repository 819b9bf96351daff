"""`jackfield serve` takes run's config flags: a server started with --speculative-method ngram
drafts (its /metrics count them) and answers with the greedy tokens of an engine without drafts.
The server is a subprocess on 127.0.0.1 with bounded waits: a hang fails the test, never the run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

from jackfield import LLM, SamplingParams
from jackfield.commands.pd import free_address

WAIT_S = 120.0


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def test_serve_with_ngram_drafts_and_keeps_the_greedy_tokens() -> None:
    address = free_address()
    port = address.rsplit(":", 1)[1]
    command = [sys.executable, "-m", "jackfield.cli", "serve", "--port", port, "--device", "cpu",
               "--speculative-method", "ngram", "--num-speculative-tokens", "3",
               "--set", "speculative.prompt_lookup_min=2"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://{address}"
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            assert server.poll() is None, f"the server exited: {server.stdout.read()}"  # type: ignore[union-attr]
            try:
                _get(f"{url}/health")
                break
            except OSError:
                assert time.monotonic() < deadline, f"no /health within {WAIT_S} s"
                time.sleep(0.5)
        prompt = [5, 17, 42, 9] * 6
        body = json.dumps({"model": json.loads(_get(f"{url}/v1/models"))["data"][0]["id"], "prompt": prompt,
                           "max_tokens": 12, "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            text = json.loads(response.read())["choices"][0]["text"]
        metrics = {line.split()[0]: float(line.split()[1]) for line in _get(f"{url}/metrics").splitlines()
                   if line.startswith("jackfield_spec_decode_")}
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
    want = LLM(None, device="cpu").generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                                    ignore_eos=True))[0]
    assert text == want.text
    drafts, draft_tokens, accepted = (metrics[f"jackfield_spec_decode_{name}_total"]
                                      for name in ("drafts", "draft_tokens", "accepted_tokens"))
    assert drafts > 0 and draft_tokens >= accepted, metrics
