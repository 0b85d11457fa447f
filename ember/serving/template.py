"""The engine template: one process per local cluster that has imported what an engine core runs
(torch, the engine, the KV connector: ~1.3 s of a core's ~2 s start) and forks a core on request.

`python -m ember.serving.template --socket @NAME` (`ember up` starts it before the engine services
and gives them EMBER_ENGINE_TEMPLATE=@NAME). A service asks for a core by sending, over the unix
socket, the core's arguments, its environment and working folder as JSON, with three descriptors:
its end of the core's socketpair and its stdout and stderr (the core logs into the service's log).
The template forks; the child takes the service's environment, descriptors and folder and runs
`ember.serving.core_process.main`; the template answers with the child's pid. A restarted worker's
core so starts from a warm interpreter (a restart is the service's ~0.4 s and the model's load),
and the cores share the template's pages of those imports until they write them.

Fork safety: the template never runs a torch op or starts a thread (OpenMP's pool is created by
the first parallel op, in the child; numpy's BLAS pool is kept at one thread by
OPENBLAS_NUM_THREADS=1, set before the imports). If it finds itself with more than one thread it
refuses to fork and the service starts its core the usual way (a fresh interpreter), as it does
when no template answers.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys

MAX_REQUEST = 1 << 20


def address(name: str) -> str:
    """'@NAME' (the abstract namespace, as in kvstore.shm_socket) or a path -> a bind/connect address."""
    return "\0" + name[1:] if name.startswith("@") else name


def preload() -> None:
    """Import what `core_process.main` imports, here, once."""
    import ember.engine.engine  # noqa: F401 - torch and the engine
    import ember.rpc.kv_connector  # noqa: F401
    import ember.rpc.model_fetch  # noqa: F401
    import ember.serving.engine_client  # noqa: F401
    import ember.serving.engine_core  # noqa: F401


def request_core(name: str, argv: list[str], theirs: int, timeout_s: float = 30) -> int:
    """Ask the template at `name` for a core running `argv` (core_process's arguments, less --fd) on
    the socketpair end `theirs`; its pid. OSError (or RuntimeError: it refused) when it cannot."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)  # (a template still importing keeps the request in its backlog)
        conn.connect(address(name))
        request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
        socket.send_fds(conn, [json.dumps(request).encode()], [theirs, 1, 2])
        reply = json.loads(conn.recv(MAX_REQUEST) or b"{}")
    if "pid" not in reply:
        raise RuntimeError(f"the engine template refused: {reply.get('error', 'no answer')}")
    return reply["pid"]


class ForkedCore:
    """A core the template forked (not this process's child): the part of Popen's interface the
    engine client uses. Its exit code is the template's to reap, so it reads as None."""
    returncode = None

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd = None

    def poll(self):
        return None if self._pidfd is not None and not self._exited(0) else -1

    def _exited(self, timeout_s: float | None) -> bool:
        import select
        if self._pidfd is None:
            return True
        return bool(select.select([self._pidfd], [], [], timeout_s)[0])

    def wait(self, timeout: float | None = None):
        if not self._exited(timeout):
            import subprocess
            raise subprocess.TimeoutExpired(f"engine core {self.pid}", timeout)
        return None

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def fork_core(request: dict, fds: list[int]) -> int:
    """Fork a core for `request` ({"argv", "env", "cwd"}); fds: the socketpair end, stdout, stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.dup2(fds[1], 1)
        os.dup2(fds[2], 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        from ember.serving import core_process
        code = core_process.main([*request["argv"], "--fd", str(fds[0])])
    except BaseException:  # noqa: BLE001 - a child never returns into the template's loop
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(listener: socket.socket) -> None:
    while True:
        conn, _ = listener.accept()
        fds: list[int] = []
        with conn:
            try:
                message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
                if len(fds) != 3:
                    raise ValueError(f"a core request carries 3 descriptors, got {len(fds)}")
                if threads() > 1:
                    raise RuntimeError(f"the template runs {threads()} threads: forking it is not safe")
                reply = {"pid": fork_core(json.loads(message), fds)}
            except Exception as e:  # noqa: BLE001 - said to the service, which starts its core itself
                reply = {"error": f"{type(e).__name__}: {e}"}
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(json.dumps(reply).encode())
            except OSError:
                pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ember.serving.template")
    p.add_argument("--socket", required=True, help="@NAME (abstract) or a path to listen on")
    args = p.parse_args(argv)
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads: no BLAS thread to lose in a fork
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address(args.socket))  # first: services that ask now wait in the backlog, not fall back
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the cores are reaped by the kernel
    preload()
    from ember.rpc import logs
    logs.setup("engine-template")
    import logging
    logging.getLogger("ember").info("engine template ready on %s (%d thread)", args.socket, threads())
    serve(listener)
    return 0


if __name__ == "__main__":
    sys.exit(main())
