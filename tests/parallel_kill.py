"""The killed-rank check both parallel kinds share (test_tensor_parallel, test_pipeline_parallel)."""
from __future__ import annotations

import os
import signal
import threading

from ember.engine.sampling_params import SamplingParams


def assert_a_killed_rank_fails_the_engine(engine, prompt: str, within_s: float = 60) -> None:
    """SIGKILL the engine's first spawned rank after a step: the next request must fail with a
    RuntimeError within `within_s`, not hang. Closes the engine."""
    try:
        assert engine.generate([prompt], SamplingParams(max_tokens=2))
        victim = engine.runner.procs[0]
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=30)
        assert victim.exitcode == -signal.SIGKILL
        failed: list[BaseException] = []

        def step():
            try:
                engine.generate([prompt], SamplingParams(max_tokens=4))
            except BaseException as e:  # noqa: BLE001
                failed.append(e)
        worker = threading.Thread(target=step, daemon=True)
        worker.start()
        worker.join(timeout=within_s)
        assert not worker.is_alive(), "the engine hung on a dead rank"
        assert failed and isinstance(failed[0], RuntimeError), failed
    finally:
        engine.close()
