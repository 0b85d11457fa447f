"""`ember bench tls`: what TLS on the router's public ports costs a client (issue 34).

One cluster (the shipped configs/local.yaml, or --cluster-config, on free ports) and two more
routers in front of its workers, alike but for `router.tls`: one serving TLS (a certificate from
the cluster's CA, `{cert, key, ca}` files), one plaintext. Rounds alternate which router goes first
(ABBA), so drift on a shared host hits both. Per round and router, one request at a time with a
fresh prompt of ~PROMPT_TOKENS tokens (never cached), streamed to MAX_TOKENS tokens:

- gRPC (`RouterClient`, one channel per router for the run: the handshake is paid once, as a
  client that keeps its channel pays it) and HTTP (the official `openai` client streaming a chat
  completion; https trusting the CA file, one keep-alive connection);
- TTFT: request sent to the first token received; decode: seconds per token after the first
  (single stream).

Also each router's new-connection cost: a fresh channel's first call (ListModels), TLS handshake
included. Targets: TTFT and decode time per token with TLS <= 1.05x plaintext, gRPC and HTTP.
"""
from __future__ import annotations

import contextlib
import ssl
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from ember.bench.measure import progress, write_result

PROMPT_TOKENS = 256
MODES = ("tls", "plaintext")
TARGET = 1.05


def grpc_stream(client, ids: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT s, decode s per token after the first) of one streamed request."""
    start, times = time.perf_counter(), []
    for m in client.stream(token_ids=ids, max_tokens=max_tokens, ignore_eos=True, timeout=300):
        now = time.perf_counter()
        times += [now] * len(m.token_ids)
    return times[0] - start, (times[-1] - times[0]) / max(1, len(times) - 1)


def http_stream(api, text: str, max_tokens: int) -> tuple[float, float]:
    start, times = time.perf_counter(), []
    for chunk in api.completions.create(model="", prompt=text, max_tokens=max_tokens, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    return times[0] - start, (times[-1] - times[0]) / max(1, len(times) - 1)


def connect_s(address: str, ca: str | None, n: int) -> list[float]:
    """Seconds of a new channel's first call (ListModels), `n` times."""
    from ember.client import RouterClient
    out = []
    for _ in range(n):
        start = time.perf_counter()
        with RouterClient(address, ca=ca) as c:
            c.models(timeout=30)
        out.append(time.perf_counter() - start)
    return out


def main(args) -> int:
    import openai
    import yaml

    from ember.client import RouterClient
    from ember.cluster.certs import CertificateAuthority
    from ember.cluster.chaos import Cluster
    from ember.cluster.launcher import default_config, running
    from ember.cluster.ports import free_port, on_free_ports
    from ember.model.files import model_folder
    from ember.model.tokenizer import Tokenizer
    model = str(Path(args.model).resolve())
    source = Path(args.cluster_config).resolve() if args.cluster_config else default_config()
    tok = Tokenizer.from_folder(model_folder(model))
    rounds, per_round, max_tokens, connects = (2, 1, 8, 2) if args.quick else (4, 5, 32, 10)
    words = tok.decode(list(range(2000, 2000 + PROMPT_TOKENS)))  # varied text, re-tokenized below
    samples = {m: {k: [] for k in ("grpc_ttft_s", "grpc_tpot_s", "http_ttft_s", "http_tpot_s", "connect_s")}
               for m in MODES}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        run_dir = Path(tmp)
        data = on_free_ports(source, run_dir / "cluster.yaml", model)
        if not data["router"].get("http"):  # (the HTTP API is measured too; second_router moves it)
            data["router"]["http"] = f"127.0.0.1:{free_port()}"
        data["router"].pop("tls", None)
        (run_dir / "cluster.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        stack.enter_context(running(run_dir / "cluster.yaml", run_dir, timeout_s=300))
        cluster = Cluster(run_dir)
        certs = run_dir / "certs"
        ca = CertificateAuthority.load(certs) if (certs / "ca.key").is_file() else CertificateAuthority.create()
        public = ca.write_server(run_dir / "tls" / "public", "ember router", ["127.0.0.1:0"])
        routers, clients, apis = {}, {}, {}
        for mode in MODES:
            tls = {"tls": {"cert": "public/tls.crt", "key": "public/tls.key", "ca": "public/ca.crt"}} \
                if mode == "tls" else {"tls": None}
            routers[mode], _ = stack.enter_context(cluster.second_router(run_dir / mode, **tls))
            ca_file = str(public / "ca.crt") if mode == "tls" else None
            clients[mode] = stack.enter_context(RouterClient(routers[mode]["listen"], ca=ca_file))
            grpc.channel_ready_future(clients[mode].channel).result(timeout=30)
            scheme = "https" if mode == "tls" else "http"
            verify = ssl.create_default_context(cafile=ca_file) if ca_file else True
            http_client = stack.enter_context(openai.DefaultHttpxClient(verify=verify))
            apis[mode] = openai.OpenAI(base_url=f"{scheme}://{routers[mode]['http']}/v1", api_key="unused",
                                       max_retries=0, timeout=300, http_client=http_client)
            warm = tok.encode(f"Warm-up {mode}: " + words)[:PROMPT_TOKENS]  # first-request costs out of the figures
            grpc_stream(clients[mode], warm, 2)
            http_stream(apis[mode], tok.decode(warm), 2)
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                s = samples[mode]
                for i in range(per_round):
                    ids = tok.encode(f"Round {r} {mode} prompt {i}: " + words)[:PROMPT_TOKENS]
                    ttft, tpot = grpc_stream(clients[mode], ids, max_tokens)
                    s["grpc_ttft_s"].append(ttft)
                    s["grpc_tpot_s"].append(tpot)
                    text = tok.decode(tok.encode(f"Round {r} {mode} http {i}: " + words)[:PROMPT_TOKENS])
                    ttft, tpot = http_stream(apis[mode], text, max_tokens)
                    s["http_ttft_s"].append(ttft)
                    s["http_tpot_s"].append(tpot)
                s["connect_s"] += connect_s(routers[mode]["listen"], str(public / "ca.crt") if mode == "tls" else None,
                                            connects)
                progress(f"round {r} {mode}: gRPC TTFT median {statistics.median(s['grpc_ttft_s']) * 1000:.0f} ms, "
                         f"HTTP TTFT {statistics.median(s['http_ttft_s']) * 1000:.0f} ms, decode "
                         f"{statistics.median(s['grpc_tpot_s']) * 1000:.1f} ms/token")
    med = {m: {k: statistics.median(v) for k, v in samples[m].items()} for m in MODES}
    targets = {}
    for key, label in (("grpc_ttft_s", "gRPC TTFT"), ("grpc_tpot_s", "gRPC decode s/token"),
                       ("http_ttft_s", "HTTP TTFT"), ("http_tpot_s", "HTTP decode s/token")):
        ratio = med["tls"][key] / med["plaintext"][key]
        targets[f"{label}, TLS / plaintext"] = {"value": round(ratio, 3), "target": f"<= {TARGET}",
                                                "met": ratio <= TARGET}
    result = {
        "config": str(source), "model": model, "rounds": rounds, "requests_per_round": per_round,
        "prompt_tokens": PROMPT_TOKENS, "max_tokens": max_tokens, "order": "ABBA over rounds",
        "median": med, "samples": samples,
        "new_connection_ratio": round(med["tls"]["connect_s"] / med["plaintext"]["connect_s"], 3),
        "wall_s": round(time.monotonic() - started, 1), "targets": targets,
    }
    write_result(result, args.output)
    return 0
