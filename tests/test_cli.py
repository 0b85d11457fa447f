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


def test_engine_flags_are_the_engine_settings_names_and_defaults():
    from ember.cli import build_parser, engine_settings
    from ember.engine.config import EngineSettings
    args = build_parser().parse_args(["generate", "hi"])
    assert engine_settings(args) == EngineSettings().model_dump(), "every engine setting is a flag, same default"
    assert "--max-waiting-requests" in build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    args = build_parser().parse_args(["generate", "hi", "--kv-cache-mb", "64", "--dtype", "bfloat16"])
    assert EngineSettings(**engine_settings(args)).kv_cache_mb == 64


def test_generate_names_a_bad_engine_setting():
    proc = run_cli("--block-size", "12", "hi")
    assert proc.returncode == 2 and "block_size" in proc.stderr
