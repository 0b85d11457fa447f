"""CPU sets: the cores an engine process runs on (torch-free).

Engines that share a host must not share its cores: two engine processes with two OpenMP/C++
threads each on a 2-core host preempt each other's threads mid-barrier, and a decode step can
take 4-25x longer while the other engine is busy (FACTS.md). So a cluster can give each engine
on a host a disjoint set of the host's cores (`engine.cpus: auto`) and each engine runs as many
threads as its set has cores.
"""
from __future__ import annotations

import ipaddress
import os


def parse_cpus(text: str) -> list[int]:
    """'0', '0-3', '0,2,4-5' -> sorted CPU ids; ValueError naming the problem otherwise."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list (e.g. '0', '2-3', '0,2,4-5')")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{part!r} in {text!r}: a range must go up (e.g. '2-3')")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpus(cpus: list[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def host_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity, which a container's cpuset narrows)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return list(range(os.cpu_count() or 1))


def split_cores(cpus: list[int], weights: list[int]) -> list[list[int]] | None:
    """Disjoint sets of `cpus`, one per engine, sized by `weights` (its ranks: every rank of a
    tensor/pipeline-parallel engine needs a core), the cores left over going to the first engines;
    None when there are fewer cores than ranks (then nothing is pinned: sharing beats starving)."""
    need = sum(weights)
    if need == 0 or need > len(cpus):
        return None
    extra, out, at = len(cpus) - need, [], 0
    for i, w in enumerate(weights):
        share = w + extra // len(weights) + (1 if i < extra % len(weights) else 0)
        out.append(cpus[at:at + share])
        at += share
    return out


def is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
