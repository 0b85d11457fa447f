"""`ember generate` streams the engine's text from a real process."""
from __future__ import annotations

import subprocess
import sys

from ember.engine.sampling_params import SamplingParams


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember.cli", "generate", "--threads", "1",
                           "--kv-cache-mb", "64", *args], capture_output=True, text=True, timeout=180)


def test_generate_chat_streams_the_engines_answer(engine):
    question = "What is the capital of France?"
    proc = run_cli("--chat", "--max-tokens", "12", "--weights", "dense", "--dtype", "float32", question)
    assert proc.returncode == 0, proc.stderr
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    [want] = engine.generate([prompt], SamplingParams(max_tokens=12))
    assert proc.stdout.strip() == want.text.strip() and "Paris" in proc.stdout
    assert "completion tokens" in proc.stderr


def test_generate_rejects_bad_params_with_a_clear_message():
    proc = run_cli("--temperature", "-1", "hi")
    assert proc.returncode == 2 and "temperature" in proc.stderr
