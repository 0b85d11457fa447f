"""Workers really die (SIGKILL) under load on the shipped configs/local-ha.yaml (two prefill and
two decode workers, the default q4 path) and every request still gets exactly the tokens of an
undisturbed run: decode streams migrate token for token, prefill fails over to the other worker
and, with both prefill workers dead, to the decode site. Admission past the router's limit is
refused at once with pushback."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import yaml

from ember.client import RouterClient
from ember.cluster import chaos
from ember.cluster.chaos import Cluster, tokens_of, wait_dead
from tests.cluster_fixture import AT_ONCE_S
from tests.conftest import LONG_TEXT, PROMPTS

pytestmark = pytest.mark.slow
NEW_TOKENS = 24
STREAMS = 16


@pytest.fixture(scope="module")
def ha(ha_cluster) -> Cluster:
    """The session's local-ha cluster (tests/clusters.py): what a test here kills, the next module's reset
    starts again."""
    return ha_cluster.cluster


ATTEMPTS = 3


def prompts(engine_tokenizer, long: bool = False) -> list[list[int]]:
    base = [LONG_TEXT[:1200 + 40 * i] if long else PROMPTS[i % len(PROMPTS)] + f" (variant {i})"
            for i in range(STREAMS)]
    return [engine_tokenizer.encode(p) for p in base]


def run_streams(router: str, ids: list[list[int]], during=None, **sampling) -> list:
    """All streams at once, NEW_TOKENS each; `during(counts)` runs while they do (ember.cluster.chaos)."""
    return chaos.run_streams(router, ids, NEW_TOKENS, during=during, **sampling)


def decoding_now(ha: Cluster, decoders: list[str], counts: list[int]) -> str | None:
    """The decode worker running the most sequences, once every stream is past its first (prefill)
    token; None before, or when the engines are done already (a client reading slower than the
    engines decode, as on a loaded CI host, must not make the kill miss every stream)."""
    if min(counts) < 2:
        return None
    running = {n: ha.decode_stats(n).running for n in decoders}
    busiest = max(running, key=running.get)
    return busiest if running[busiest] > 0 else None


# a JSON array no stream can finish within NEW_TOKENS: the grammar state must survive the move
RECORDS = '{"type": "array", "minItems": 50, "items": {"type": "object", "required": ["id", "name"], ' \
          '"properties": {"id": {"type": "integer"}, "name": {"type": "string"}}}}'


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 1234},
                                      {"temperature": 1.0, "seed": 77, "json_schema": RECORDS}],
                         ids=["greedy", "seeded", "constrained"])
def test_killing_the_busiest_decode_worker_loses_no_stream_and_changes_no_token(ha, engine, sampling):
    ids = prompts(engine.tokenizer)
    reference = run_streams(ha.router, ids, **sampling)
    decoders = ["decode-edge-0", "decode-edge-1"]
    # A kill can land after the victim's engine produced every token (the engines run ahead of
    # clients reading on a loaded host): then nothing moves and the run proves nothing. Such a
    # round is repeated (the worker restarted first), up to ATTEMPTS times; every round's tokens
    # must still equal the reference.
    for _ in range(ATTEMPTS):
        killed: dict[str, list[int]] = {}  # name -> its pids

        def kill_busiest(counts, killed=killed) -> bool:
            busiest = decoding_now(ha, decoders, counts)
            if busiest is None:
                return False
            killed[busiest] = ha.kill(busiest)
            return True
        try:
            disturbed = run_streams(ha.router, ids, during=kill_busiest, **sampling)
            assert len(killed) <= 1
            for pids in killed.values():
                wait_dead(pids)
            assert tokens_of(disturbed) == tokens_of(reference), "every stream continued token for token"
            assert all(len(s.tokens) == NEW_TOKENS and s.final.finished for s in disturbed)
            migrated = sum(s.final.placement.migrations for s in disturbed)
        finally:  # whatever happened, the next round and the next test find both workers serving
            for name in killed:
                survivor = next(n for n in decoders if n != name)
                ha.settle([survivor])
                ha.restart(name)  # serving, and counted live by the router
        ha.settle(decoders)
        if killed and migrated >= 1:
            break
    assert killed and migrated >= 1, f"in {ATTEMPTS} rounds no kill landed while its worker still had tokens to send"


def test_a_stream_over_http_sse_survives_its_decode_worker(ha, engine):
    import openai
    http = yaml.safe_load((ha.run_dir / "cluster.yaml").read_text())["router"]["http"]
    client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused",
                           max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "Count from one to forty in words."}]
    kwargs = dict(model="SmolLM2-135M-Instruct.Q4_1", messages=messages, max_tokens=4 * NEW_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True})
    want = client.chat.completions.create(**kwargs).choices[0].message.content
    # As in the gRPC test above: a kill can land after the engine sent every token (a reader slower
    # than the engine, on a loaded host); such a round proves nothing and is run again.
    for _ in range(ATTEMPTS):
        pieces, killed = [], []
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            assert not getattr(chunk, "error", None)
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if len(pieces) >= 2 and not killed:
                busy = [n for n in ("decode-edge-0", "decode-edge-1") if ha.decode_stats(n).running]
                if busy:
                    killed.append(busy[0])
                    wait_dead(ha.kill(busy[0]))
        assert "".join(pieces) == want, "the SSE stream ended normally ([DONE]) with the same text"
        if killed:
            ha.restart(killed[0])
            break
    assert killed, f"in {ATTEMPTS} rounds no kill landed while a decode worker still ran the stream"


def recoveries(ha: Cluster) -> int:
    """Transfers the engines computed around (logged by each engine core)."""
    return sum(line.count("failed (computing") + line.count("write-back to the site kvstore failed")
               for name in ha.names("prefill") + ha.names("decode") for line in ha.log_lines(name))


@pytest.mark.parametrize("store", ["kvstore-edge", "kvstore-central"])
def test_a_kvstore_killed_and_restarted_under_load_costs_no_request_and_no_token(ha, engine, store):
    ids = [engine.tokenizer.encode(f"Story {i} of {store}: " + LONG_TEXT[:500 + 30 * i]) for i in range(6)]
    fresh = [engine.tokenizer.encode(f"Tale {i} of {store}: " + LONG_TEXT[:500 + 30 * i]) for i in range(6)]
    reference, reference_fresh = run_streams(ha.router, ids), run_streams(ha.router, fresh)
    # Whether transfers are in flight when the kill lands depends on this host's speed: a round whose
    # kill met none proves nothing and is run again (with prompts never seen), later into the burst.
    for attempt in range(ATTEMPTS):
        before, started, victims = recoveries(ha), time.monotonic(), []
        delay_s = 0.3 * (attempt + 1)

        def kill_store(counts, victims=victims, started=started, delay_s=delay_s) -> bool:
            if time.monotonic() - started < delay_s:
                return False
            victims.extend(ha.kill(store))
            return True
        # never seen: each needs a transfer, as the store dies
        bumped = [[t + 1 + attempt for t in p[:1]] + p[1:] for p in fresh]
        during = run_streams(ha.router, bumped[:3] + ids[3:], during=kill_store)
        wait_dead(victims)
        hit = recoveries(ha) > before
        if victims:  # (none: the streams were over before the kill was due)
            ha.restart(store)
        reference_bumped = run_streams(ha.router, bumped[:3])
        assert tokens_of(during) == tokens_of(reference_bumped) + tokens_of(reference[3:])
        assert all(s.final.finished for s in during)
        if hit:
            break
    assert hit, "the kill hit transfers in flight, and the engines computed around them"
    after = run_streams(ha.router, fresh)  # the restarted store: new arena, blocks pulled again
    assert tokens_of(after) == tokens_of(reference_fresh)
    assert all(s.final.finished for s in after)


def test_past_the_admission_limit_requests_are_refused_at_once_with_pushback(ha, engine, tmp_path):
    """A second router in front of the same workers, with router.max_inflight 4."""
    ids = prompts(engine.tokenizer)[:1]
    with ha.second_router(tmp_path, max_inflight=4, retry_after_s=1.0) as (settings, _):
        router = settings["listen"]
        reference = run_streams(router, ids)[0].tokens

        everyone_connected = threading.Barrier(20)

        def one(i):
            with RouterClient(router) as client:
                grpc.channel_ready_future(client.channel).result(timeout=30)  # time the call, not the connect
                everyone_connected.wait(timeout=60)  # one burst, however slowly the threads started
                start = time.monotonic()
                try:
                    tokens = [t for m in client.stream(token_ids=ids[0], max_tokens=NEW_TOKENS, ignore_eos=True,
                                                       timeout=300) for t in m.token_ids]
                    return "ok", tokens, time.monotonic() - start, None
                except grpc.RpcError as e:
                    pushback = dict(e.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
                    return e.code(), None, time.monotonic() - start, pushback
        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(one, range(20)))
    accepted = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(accepted) + len(refused) == 20 and len(accepted) >= 4 and len(refused) >= 10
    assert all(r[1] == reference for r in accepted), "every accepted stream is correct"
    # at once: a refusal never waits for a slot, which would take at least as long as the shortest
    # accepted stream (the first to free one); a fixed 0.5 s bound failed on a loaded CI host at 0.52 s
    at_once = min(r[2] for r in accepted)
    assert all(r[2] < at_once and r[3] == "1000" for r in refused), (at_once, [(r[2], r[3]) for r in refused])


def test_prefill_fails_over_to_the_other_worker_then_to_the_decode_site(ha, engine):
    ids = prompts(engine.tokenizer, long=True)
    reference = run_streams(ha.router, ids)
    # one prefill worker killed while the long prefills queue on both
    started = time.monotonic()
    victims: list[int] = []

    def kill_one(counts) -> bool:
        if time.monotonic() - started < 1.0:
            return False
        victims.extend(ha.kill("prefill-central-0"))
        # its engine core, mid-prefill, exits with the service, not after the step (exit_with_service)
        wait_dead(victims, timeout_s=AT_ONCE_S)
        return True
    disturbed = run_streams(ha.router, ids, during=kill_one)
    assert tokens_of(disturbed) == tokens_of(reference)
    # both prefill workers dead: the decode site prefills (decode-only fallback), same tokens
    wait_dead(ha.kill("prefill-central-1"))
    fallback = run_streams(ha.router, ids[:4])
    assert tokens_of(fallback) == tokens_of(reference[:4])
    assert all(s.final.placement.prefill_fallback == "decode-only" for s in fallback)
    # (left dead: the last test needs no prefill worker, and the module's cluster stops after it)


def test_with_every_decode_worker_dead_a_request_fails_fast_without_spending_prefill(ha, engine):
    victims = ha.kill("decode-edge-0") + ha.kill("decode-edge-1")
    wait_dead(victims)
    start = time.monotonic()
    with RouterClient(ha.router) as client, pytest.raises(grpc.RpcError) as e:
        list(client.stream(text="hello there", max_tokens=8, timeout=30))
    answered_s = time.monotonic() - start
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and answered_s < AT_ONCE_S, answered_s
