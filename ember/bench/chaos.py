"""`ember bench chaos`: real failures under load on a local cluster, and what each costs.

The cluster is configs/local-ha.yaml (two prefill workers at `central`, two decode workers at
`edge`, a kvstore per site) on free ports, or `--cluster-config`. Each scenario runs its streams
once disturbed (on prompts the cluster has never seen, so prefills and transfers are real) and
once undisturbed afterwards (the reference), and reports:

- streams kept / total and requests lost (a stream that ended in an error or unfinished; must be 0);
- tokens identical: every stream's tokens equal the undisturbed run's;
- time to recover: from the fault until each affected stream emitted its next token (max, p50,
  each), and from the kill until the restarted service serves and (a worker) the router's
  /metrics count it live (`ember:worker_live`); a supervisor restarts it as soon as it is dead;
- settled: afterwards no sequence running or waiting, no block used, no lease held.

Scenarios:
- decode_kill: SIGKILL the busiest decode worker while 16 greedy streams decode; affected: the
  streams that migrated.
- prefill_kill: SIGKILL a prefill worker while 16 long prompts queue on both; affected: the
  streams whose prefill failed over ("another worker").
- kvstore_kill_<site>: SIGKILL each kvstore at the first token of 8 streams on long prompts
  (prefill write-backs and decode pulls under way), restart it;
  affected: every stream not finished at the kill. Then fresh prompts pull through the restarted
  store.
- blackhole: a second cluster, the same config with the router at the prefill site and every
  router -> decode hop through the chaos relay (1 ms, 10 Gbps); the busiest decode worker's link
  blackholes (faults.json) mid-stream. router.stall_timeout_s (--stall-timeout-s, default 2 s here;
  the shipped default is 30 s) bounds the recovery. Affected: the streams that migrated.
"""
from __future__ import annotations

import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from importlib.resources import files
from pathlib import Path

import yaml

from ember.bench.measure import progress, write_result

SCENARIOS = ("decode_kill", "prefill_kill", "kvstore_kill", "blackhole")
STORY = " ".join(
    f"Section {i}. The harbour town of Eastmere kept its records in a stone archive by the quay. "
    f"In year {1700 + 7 * i} the council counted {40 + i} fishing boats, {3 * i + 2} merchant ships "
    f"and a lighthouse whose keeper wrote down the weather every morning." for i in range(30))
QUESTIONS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             "Once upon a time, in a small village by the sea,", "Q: What is 17 times 3?\nA:",
             "The three primary colours are", "Write a haiku about the tide:"]


def shipped_ha_config() -> Path:
    return Path(str(files("ember.configs") / "local-ha.yaml"))


def _summary(values: list[float | None]) -> dict:
    got = [v for v in values if v is not None]
    return {"max": max(got) if got else None, "p50": statistics.median(got) if got else None,
            "each": [round(v, 3) for v in got]}


def _inter_token_p50(streams) -> float | None:
    gaps = [b - a for s in streams for a, b in zip(s.stamps, s.stamps[1:]) if b > a]
    return round(statistics.median(gaps), 4) if gaps else None


class Supervisor:
    """Restarts a killed service as soon as its processes are gone (in a thread), and records when
    it served again and when the router counted it live, relative to the kill."""

    def __init__(self, cluster, name: str, pids: list[int], killed_at: float):
        from ember.cluster.chaos import wait_dead
        self.result: dict = {}

        def run():
            try:
                wait_dead(pids)
                restart_at = time.monotonic()
                self.result["kill_to_dead_s"] = round(restart_at - killed_at, 3)
                got = cluster.restart(name)
                for key, value in got.items():  # serving_s, router_live_s: from the restart
                    self.result["kill_to_" + key.removesuffix("_s") + "_s"] = round(restart_at - killed_at + value, 3)
            except Exception as e:  # noqa: BLE001 - reported in the JSON, not raised from a thread
                self.result["error"] = f"{type(e).__name__}: {e}"
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout_s: float = 300) -> dict:
        self.thread.join(timeout_s)
        return self.result


def timing(streams) -> dict:
    """Each stream's TTFT and end-to-end time (from its call), and the whole run's wall time."""
    return {"ttft_s": _summary([s.stamps[0] - s.started if s.stamps else None for s in streams]),
            "e2e_s": _summary([s.stamps[-1] - s.started if s.stamps else None for s in streams]),
            "run_s": round(max((s.stamps[-1] for s in streams if s.stamps), default=0)
                           - min(s.started for s in streams), 3)}


def outcome(disturbed, reference, affected: list[bool], fault_at: float | None) -> dict:
    """The figures every scenario reports."""
    kept = [s.ok for s in disturbed]
    same = [s.tokens == r.tokens for s, r in zip(disturbed, reference)]
    return {"streams": len(disturbed), "streams_kept": sum(kept), "requests_lost": len(kept) - sum(kept),
            "tokens_identical": all(same) and all(r.ok for r in reference), "streams_with_other_tokens": len(same)
            - sum(same), "errors": sorted({f"{s.error.code().name}: {s.error.details()}"[:200]
                                           for s in disturbed if s.error is not None}),
            "affected_streams": sum(affected),
            "fault_to_recovered_s": _summary([s.recovered_after(fault_at) for s, a in zip(disturbed, affected) if a]
                                              if fault_at is not None else [])}


def settled(cluster, timeout_s: float = 90) -> dict:
    try:
        return {"settled": True, "settle_s": round(cluster.settle(cluster.names("decode"), timeout_s), 3)}
    except TimeoutError as e:
        return {"settled": False, "settle_error": str(e)[:500]}


def decode_kill(cluster, ids: list[list[int]], max_tokens: int) -> dict:
    from ember.cluster.chaos import run_streams
    decoders = cluster.names("decode")
    state: dict = {}

    def kill_busiest(counts) -> bool:
        if min(counts) < 2:  # every stream is past its first (prefill) token
            return False
        name = cluster.busiest(decoders)
        if cluster.decode_stats(name).running == 0:  # not yet decoding, or done already
            return False
        state["running"] = cluster.decode_stats(name).running
        pids = cluster.kill(name)
        state.update(name=name, at=time.monotonic())
        state["supervisor"] = Supervisor(cluster, name, pids, state["at"])
        return True
    disturbed = run_streams(cluster.router, ids, max_tokens, during=kill_busiest, raise_errors=False)
    restart = state["supervisor"].join() if "supervisor" in state else {"error": "never killed"}
    reference = run_streams(cluster.router, ids, max_tokens, raise_errors=False)
    affected = [s.final is not None and s.final.placement.migrations > 0 for s in disturbed]
    return {"killed": state.get("name"), "its_running_sequences": state.get("running"),
            "inter_token_s_reference_p50": _inter_token_p50(reference),
            "migrations": sum(s.final.placement.migrations for s in disturbed if s.final is not None),
            **outcome(disturbed, reference, affected, state.get("at")), "restart": restart, **settled(cluster)}


def prefill_kill(cluster, ids: list[list[int]], baseline_ids: list[list[int]], max_tokens: int) -> dict:
    from ember.cluster.chaos import run_streams
    prefills = cluster.names("prefill")
    state: dict = {}
    baseline = timing(run_streams(cluster.router, baseline_ids, max_tokens))  # same shape, undisturbed

    def kill_one(counts) -> bool:
        if sum(c > 0 for c in counts) < 2:  # prefills under way on both workers, most still queued
            return False
        name = prefills[0]
        pids = cluster.kill(name)
        state.update(name=name, at=time.monotonic(), first_tokens_before=sum(c > 0 for c in counts))
        state["supervisor"] = Supervisor(cluster, name, pids, state["at"])
        return True
    disturbed = run_streams(cluster.router, ids, max_tokens, during=kill_one, raise_errors=False)
    restart = state["supervisor"].join() if "supervisor" in state else {"error": "never killed"}
    reference = run_streams(cluster.router, ids, max_tokens, raise_errors=False)
    fallbacks = [s.final.placement.prefill_fallback if s.final is not None else "" for s in disturbed]
    affected = [f != "" for f in fallbacks]
    return {"killed": state.get("name"), "streams_with_first_token_before_kill": state.get("first_tokens_before"),
            "fallbacks": {f or "none": fallbacks.count(f) for f in set(fallbacks)},
            "undisturbed_baseline": baseline, "disturbed": timing(disturbed),
            "affected_ttft_s": _summary([s.stamps[0] - s.started if s.stamps else None
                                         for s, a in zip(disturbed, affected) if a]),
            **outcome(disturbed, reference, affected, state.get("at")), "restart": restart, **settled(cluster)}


def recoveries(cluster) -> int:
    """Transfers the engines computed around (each engine core logs one)."""
    return sum(line.count("failed (computing") + line.count("write-back to the site kvstore failed")
               for name in cluster.names("prefill") + cluster.names("decode") for line in cluster.log_lines(name))


def kvstore_kill(cluster, store: str, ids: list[list[int]], fresh: list[list[int]], baseline_ids: list[list[int]],
                 max_tokens: int) -> dict:
    from ember.cluster.chaos import run_streams
    baseline = timing(run_streams(cluster.router, baseline_ids, max_tokens))  # same shape, undisturbed
    before, state = recoveries(cluster), {}

    def kill_store(counts) -> bool:
        if not any(counts):  # at the first token: write-backs to central and pulls to edge under way
            return False
        pids = cluster.kill(store)
        state.update(at=time.monotonic(), unfinished=sum(c < max_tokens for c in counts))
        state["supervisor"] = Supervisor(cluster, store, pids, state["at"])
        return True
    disturbed = run_streams(cluster.router, ids, max_tokens, during=kill_store, raise_errors=False)
    restart = state["supervisor"].join() if "supervisor" in state else {"error": "never killed"}
    after = run_streams(cluster.router, fresh, max_tokens, raise_errors=False)  # through the restarted store
    reference = run_streams(cluster.router, ids + fresh, max_tokens, raise_errors=False)
    at = state.get("at")
    affected = [at is not None and (not s.stamps or s.stamps[-1] > at) for s in disturbed]
    both = outcome(disturbed + after, reference, affected + [False] * len(after), at)
    return {"killed": store, "transfers_computed_around": recoveries(cluster) - before,
            "after_restart_streams": len(after), "after_restart_ok": all(s.ok for s in after)
            and [s.tokens for s in after] == [r.tokens for r in reference[len(ids):]],
            "undisturbed_baseline": baseline, "disturbed": timing(disturbed),
            **both, "restart": restart, **settled(cluster)}


def blackhole(cluster, ids: list[list[int]], max_tokens: int, stall_s: float) -> dict:
    from ember.cluster.chaos import run_streams
    decoders = cluster.names("decode")
    state: dict = {}

    def break_busiest(counts) -> bool:
        if min(counts) < 2:
            return False
        name = cluster.busiest(decoders)
        if cluster.decode_stats(name).running == 0:
            return False
        cluster.set_faults({cluster.relay_to(name): "blackhole"})
        state.update(name=name, at=time.monotonic())
        return True
    try:
        disturbed = run_streams(cluster.router, ids, max_tokens, during=break_busiest, raise_errors=False)
    finally:
        cluster.set_faults({})
    healed = time.monotonic()
    heal: dict = {}
    if "name" in state:
        try:
            heal["heal_to_router_live_s"] = round(cluster.wait_router_sees(state["name"], live=True, timeout_s=60), 3)
        except TimeoutError as e:
            heal["error"] = str(e)
    reference = run_streams(cluster.router, ids, max_tokens, raise_errors=False)
    affected = [s.final is not None and s.final.placement.migrations > 0 for s in disturbed]
    return {"blackholed_link_to": state.get("name"), "stall_timeout_s": stall_s,
            "inter_token_s_reference_p50": _inter_token_p50(reference),
            "migrations": sum(s.final.placement.migrations for s in disturbed if s.final is not None),
            "fault_lasted_s": round(healed - state["at"], 3) if "at" in state else None,
            **outcome(disturbed, reference, affected, state.get("at")), "heal": heal, **settled(cluster)}


def _cluster(source: Path, model: str, run_dir: Path, edit: Callable[[dict], None] | None = None):
    from ember.cluster.launcher import running
    from ember.cluster.ports import on_free_ports
    if edit is not None:
        data = yaml.safe_load(Path(source).read_text())
        edit(data)
        (run_dir / "source.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        source = run_dir / "source.yaml"
    on_free_ports(source, run_dir / "cluster.yaml", model)
    return running(run_dir / "cluster.yaml", run_dir, timeout_s=300)


def linked(stall_s: float) -> Callable[[dict], None]:
    """The router at the prefill site, each router -> decode hop through the chaos relay."""
    def edit(data: dict) -> None:
        placement = data.setdefault("placement", {})
        prefill_site, decode_site = placement.get("prefill_site", "central"), placement.get("decode_site", "edge")
        data.setdefault("router", {}).update(site=prefill_site, stall_timeout_s=stall_s)
        placement["emulate_links"] = True
        if not data.get("links"):
            data["links"] = [{"a": prefill_site, "b": decode_site, "rtt_ms": 1, "bandwidth_gbps": 10}]
    return edit


def main(args) -> int:
    from ember.cluster.chaos import Cluster
    from ember.model.files import model_folder
    from ember.model.tokenizer import Tokenizer
    model = str(Path(args.model).resolve())
    source = Path(args.cluster_config).resolve() if args.cluster_config else shipped_ha_config()
    # --quick (a smoke run) leaves out blackhole, its second cluster, unless --scenarios names it
    default = [s for s in SCENARIOS if s != "blackhole"] if args.quick else list(SCENARIOS)
    wanted = args.scenarios.split(",") if args.scenarios else default
    unknown = set(wanted) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios {sorted(unknown)}; choose from {', '.join(SCENARIOS)}")
    tok = Tokenizer.from_folder(model_folder(model))
    streams, new_tokens = (4, 12) if args.quick else (16, 24)  # --quick: a smoke run
    nonce = time.strftime("%H%M%S")  # prompts this cluster has never seen

    def short(tag: str, n: int = streams) -> list[list[int]]:
        return [tok.encode(f"[{tag} {nonce}] {QUESTIONS[i % len(QUESTIONS)]} (variant {i})") for i in range(n)]

    def long(tag: str, n: int = streams, chars: int = 900) -> list[list[int]]:
        return [tok.encode(f"[{tag} {nonce} {i}] " + STORY[:chars + 40 * i]) for i in range(n)]
    result: dict = {"config": str(source), "model": model, "streams": streams, "max_tokens": new_tokens,
                    "scenarios": {}}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        if set(wanted) - {"blackhole"}:
            run_dir = Path(tmp) / "ha"
            run_dir.mkdir()
            t0 = time.monotonic()
            with _cluster(source, model, run_dir):
                result["cluster_start_s"] = round(time.monotonic() - t0, 1)
                cluster = Cluster(run_dir)
                if "decode_kill" in wanted:
                    progress(f"decode_kill: SIGKILL the busiest decode worker under {streams} streams")
                    # long enough that the kill lands mid-decode: 12 tokens of 4 streams end in ~0.15 s on a
                    # quiet host, before a 50 ms poll saw a worker running (the smoke run then killed nothing)
                    result["scenarios"]["decode_kill"] = decode_kill(cluster, short("decode"),
                                                                       64 if args.quick else new_tokens)
                if "prefill_kill" in wanted:
                    progress(f"prefill_kill: SIGKILL a prefill worker under {streams} long prefills")
                    result["scenarios"]["prefill_kill"] = prefill_kill(cluster, long("prefill"), long("prefill base"),
                                                                       8)
                if "kvstore_kill" in wanted:
                    # --quick: one store (tests/test_fault_tolerance.py kills each under load)
                    for store in cluster.names("kvstore")[-1:] if args.quick else cluster.names("kvstore"):
                        progress(f"kvstore_kill: SIGKILL and restart {store} under load")
                        n = max(4, streams // 2)
                        result["scenarios"][f"kvstore_kill_{store.removeprefix('kvstore-')}"] = kvstore_kill(
                            cluster, store, long(f"{store} load", n, 500), long(f"{store} fresh", n, 500),
                            long(f"{store} base", n, 500), new_tokens)
        if "blackhole" in wanted:
            run_dir = Path(tmp) / "linked"
            run_dir.mkdir()
            progress(f"blackhole: the chaos relay drops the busiest decode worker's link under {streams} streams")
            with _cluster(source, model, run_dir, linked(args.stall_timeout_s)):
                result["scenarios"]["blackhole"] = blackhole(Cluster(run_dir), short("blackhole"), new_tokens,
                                                             args.stall_timeout_s)
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["targets"] = {}
    for name, s in result["scenarios"].items():
        result["targets"] |= {f"{name}: requests lost": {"value": s["requests_lost"], "target": 0,
                                                          "met": s["requests_lost"] == 0},
                              f"{name}: tokens identical": {"value": s["tokens_identical"], "target": True,
                                                            "met": s["tokens_identical"]},
                              f"{name}: settled": {"value": s["settled"], "target": True, "met": s["settled"]}}
        if "restart" in s:  # the killed service came back (serving, and a worker counted live by the router)
            ok = "error" not in s["restart"]
            result["targets"][f"{name}: restarted"] = {"value": ok, "target": True, "met": ok}
    write_result(result, args.output)
    return 0 if all(t["met"] for t in result["targets"].values()) else 1
