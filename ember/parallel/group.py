"""The process group of a parallel engine: this process is rank 0, the driver; it spawns ranks
1..N-1 and sends them commands. Used by tensor_parallel.py and pipeline_parallel.py.

Communication is torch.distributed, its backend chosen with the ranks' devices in ember.engine.device
(gloo on CPU; NCCL when every rank has a GPU; gloo with CUDA tensors staged through host memory when
ranks share one). A rank that dies breaks its peers' next collective (gloo: the connection closes), every
collective has the group's timeout, and a rank that dies while starting fails the start at once:
the engine fails instead of hanging.
"""
from __future__ import annotations

import datetime
import socket
import threading
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ember.engine.device import collective_backend, host_staged, rank_device

START_TIMEOUT_S = 300  # ranks loading their parts and joining the group
ABORT_S = 10  # the longest a failed group's teardown may hold its caller


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join(rank: int, world: int, port: int, device: torch.device) -> None:
    backend = collective_backend(device, world)
    if backend == "nccl":
        torch.cuda.set_device(rank_device(device, rank, world))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=START_TIMEOUT_S))


def comm_device() -> torch.device:
    """Where a collective's tensors live: the rank's GPU under NCCL, host memory under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce(t: torch.Tensor, ranks=None) -> torch.Tensor:
    """Sum t over the ranks (`ranks`: a subgroup's dist.new_group; None: all), in place: in fp32 for a
    bf16 tensor (each rank's partial sum rounded once, at the end, as the unsplit layer's sum is),
    through host memory for a CUDA tensor under gloo."""
    work = t.float() if t.dtype == torch.bfloat16 else t
    if host_staged(work):
        work = work.cpu()
    dist.all_reduce(work, group=ranks)
    return t if work is t else t.copy_(work)


def serve(rank: int, world: int, port: int, threads: int, make, device: torch.device) -> None:
    """A spawned rank's life: join, build its part (`make()`, an object whose methods are the
    commands), then run the driver's commands until "stop"."""
    torch.set_num_threads(threads)
    join(rank, world, port, device)
    me = make()
    dist.barrier()  # every rank built
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        command, *args = box[0]
        if command == "stop":
            break
        with torch.inference_mode():
            getattr(me, command)(*args)
    dist.destroy_process_group()


class RankGroup:
    """The driver's handle on the spawned ranks."""

    def __init__(self, world: int, target, args_of_rank, name: str, device: torch.device):
        """target(rank, world, port, *args_of_rank(rank)) runs in each spawned rank (it calls serve)."""
        if dist.is_initialized():
            raise RuntimeError("one parallel engine per process: close the other one first (its ranks hold "
                               "this process's torch.distributed group)")
        self.world, self.device = world, device
        self.port = _free_port()
        context = mp.get_context("spawn")
        self.procs = [context.Process(target=target, args=(r, world, self.port, *args_of_rank(r)), daemon=True,
                                      name=f"ember-{name}-rank{r}") for r in range(1, world)]
        for p in self.procs:
            p.start()
        self._closed = False

    def join(self) -> None:
        """Join the group (it forms when every rank has joined), failing fast when a rank dies first."""
        failed: list[BaseException] = []

        def run():
            try:
                join(0, self.world, self.port, self.device)
            except BaseException as e:  # noqa: BLE001  (re-raised below)
                failed.append(e)
        joining = threading.Thread(target=run, daemon=True, name="ember-parallel-join")
        joining.start()
        while joining.is_alive():
            joining.join(timeout=0.2)
            dead = [p for p in self.procs if p.exitcode is not None]
            if dead and joining.is_alive():
                raise RuntimeError(f"rank process {dead[0].name} exited with code {dead[0].exitcode} while "
                                   "starting (see its log above)")
        if failed:
            raise failed[0]

    @contextmanager
    def failing(self):
        """A command the ranks and the driver run together: if it fails on the driver (a rank died, or
        the driver's own part raised), the group cannot be trusted to be in step again: abort it."""
        if self._closed:
            raise RuntimeError("the parallel engine's ranks are gone (an earlier command failed): restart it")
        dead = [p for p in self.procs if p.exitcode is not None]
        if dead:  # known dead: fail now, whether or not the collective library has noticed yet
            self.abort()
            raise RuntimeError(f"rank process {dead[0].name} exited with code {dead[0].exitcode}: restart the "
                               "parallel engine")
        try:
            yield
        except BaseException:
            self.abort()
            raise

    def ready(self) -> None:
        dist.barrier()  # every rank built its part

    def send(self, *command) -> None:
        dist.broadcast_object_list([command], src=0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.send("stop")
        except Exception:  # noqa: BLE001  (a rank already gone: the group is broken, kill the rest)
            pass
        try:
            dist.destroy_process_group()  # (a later engine in this process makes a group of its own)
        except Exception:  # noqa: BLE001
            pass
        for p in self.procs:
            p.join(timeout=10)
        self.kill()

    def abort(self) -> None:
        """After a failure: the ranks killed at once (a rank waiting in a collective the driver will
        never join would otherwise hold close() for the group's timeout), the group destroyed."""
        self._closed = True
        self.kill()

        def destroy():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
        # bounded: a group whose peers died mid-collective must not hold the caller's error
        destroying = threading.Thread(target=destroy, daemon=True, name="ember-parallel-abort")
        destroying.start()
        destroying.join(timeout=ABORT_S)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def gather_padded(t: torch.Tensor, widths: dict[int, int]) -> list[torch.Tensor] | None:
    """Gather t, each dim d in `widths` zero-padded up to widths[d], to rank 0: the list there (in host
    memory), None elsewhere."""
    t = t.to(comm_device())
    for dim, width in widths.items():
        if width > t.shape[dim]:
            shape = list(t.shape)
            shape[dim] = width - t.shape[dim]
            t = torch.cat([t, t.new_zeros(shape)], dim=dim)
    t = t.contiguous()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
    dist.gather(t, out, dst=0)
    return None if out is None else [part.cpu() for part in out]


def int_view(itemsize: int) -> torch.dtype:
    """The integer dtype of this width (bytes of a cache moved as integers, whatever the float)."""
    return {2: torch.int16, 4: torch.int32}[itemsize]
