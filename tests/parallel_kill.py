"""The killed-rank check both parallel kinds share (test_tensor_parallel, test_pipeline_parallel)."""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading

from ember.engine.sampling_params import SamplingParams


def assert_a_killed_rank_fails_the_engine(engine, prompt: str, within_s: float = 60, mid_step: bool = False) -> None:
    """SIGKILL the engine's first spawned rank after a step: the next request must fail with a
    RuntimeError within `within_s`, not hang. `mid_step`: the rank is frozen first and killed
    while the next step waits on it (the collective library must notice the death itself).
    Closes the engine."""
    try:
        assert engine.generate([prompt], SamplingParams(max_tokens=2))
        victim = engine.runner.procs[0]
        if mid_step:
            os.kill(victim.pid, signal.SIGSTOP)
        else:
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(timeout=30)
            assert victim.exitcode == -signal.SIGKILL
        failed: list[BaseException] = []
        stepping = threading.Event()

        def step():
            stepping.set()
            try:
                engine.generate([prompt], SamplingParams(max_tokens=4))
            except BaseException as e:  # noqa: BLE001
                failed.append(e)
        worker = threading.Thread(target=step, daemon=True)
        worker.start()
        if mid_step:
            assert stepping.wait(timeout=30)
            worker.join(timeout=0.5)  # (the step reaches the frozen rank; killed earlier, it fails the same)
            assert worker.is_alive(), "a step finished without its frozen rank"
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(timeout=30)
        worker.join(timeout=within_s)
        if worker.is_alive():
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)  # where it hangs, for the report
        assert not worker.is_alive(), "the engine hung on a dead rank"
        assert failed and isinstance(failed[0], RuntimeError), failed
        try:  # and every later request, at once
            engine.generate([prompt], SamplingParams(max_tokens=1))
        except RuntimeError:
            pass
        else:
            raise AssertionError("a request after the rank died was served")
    finally:
        engine.close()
