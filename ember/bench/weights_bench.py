"""`ember bench weights`: model weights as content-addressed chunks, compressed per tensor kind.

(a) The codec table (ember.model.weight_codec, one core): per tensor kind and per whole file, raw
bytes against stored bytes (the smallest lossless coding per chunk), the saving, and encode (trying
every candidate, as a store seeding itself does) and decode GB/s. Three files:
- `bf16_from_gguf`: the shipped Q4_1 GGUF dequantized (its load cache's fp32 safetensors) and cast to
  bf16, written as a safetensors file: real trained weights, but they went through 4-bit quantization,
  so their low mantissa bits are not a real bf16 checkpoint's;
- `bf16_random_init`: a model of the same tensors, normal(0, 0.02) weights and unit norms (what an
  untrained checkpoint looks like);
- `q4_1_gguf`: the shipped GGUF file itself.
There is no real bf16 checkpoint on this machine (and no internet): say which is which.

(b) A decode worker with an empty model cache at the edge site, behind an emulated 60 ms RTT /
1 Gbit/s link (the `ember.cluster.wan` relay): seconds from its start to its first streamed token, with
compressed chunks and with raw ones (EMBER_MODEL_FETCH_CODEC=raw: every hop uncompressed), against a
worker loading the model from its disk; the fetch itself from the worker's log; its tokens against the
disk worker's. The fetched worker gets the GGUF and then its load caches (ember.model.derived: the
HF-layout folder and the int4 packs, published by central's store from its host's current caches), so
it builds nothing. Central's kvstore is asked for both manifests once before the timed starts (it seeds
its chunks from its files on the first request: ~1-2 s for the GGUF, ~3-7 s for the caches, once per
store).
"""
from __future__ import annotations

import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from ember.bench.measure import progress, write_result
from ember.model import weight_codec
from ember.model.weight_chunks import build_manifest

RTT_MS, GBPS = 60.0, 1.0
PROMPT = "Write a short poem about the sea."
MAX_TOKENS = 16


# --- (a) codecs -------------------------------------------------------------------------------------

def codec_table(path: Path) -> dict:
    """Per kind and for the whole file: raw and stored bytes, saving, encode/decode GB/s, codecs chosen."""
    rows: dict[str, dict] = defaultdict(lambda: {"raw_bytes": 0, "stored_bytes": 0, "encode_s": 0.0,
                                                 "decode_s": 0.0, "codecs": defaultdict(int), "chunks": 0})
    exact = True

    def measure(chunk, data):
        nonlocal exact
        start = time.perf_counter()
        codec, encoded = weight_codec.encode(chunk.kind, data)
        middle = time.perf_counter()
        out = weight_codec.decode(codec, chunk.kind, encoded, chunk.length)
        end = time.perf_counter()
        exact = exact and out == data
        for key in (chunk.kind, "whole_file"):
            row = rows[key]
            row["raw_bytes"] += chunk.length
            row["stored_bytes"] += len(encoded)
            row["encode_s"] += middle - start
            row["decode_s"] += end - middle
            row["codecs"][weight_codec.NAMES[codec]] += 1
            row["chunks"] += 1
    manifest = build_manifest(path, on_chunk=measure)
    out = {}
    for kind, row in rows.items():
        out[kind] = {"raw_bytes": row["raw_bytes"], "stored_bytes": row["stored_bytes"],
                     "saving": round(1 - row["stored_bytes"] / row["raw_bytes"], 4),
                     "encode_GBps": round(row["raw_bytes"] / row["encode_s"] / 1e9, 3),
                     "decode_GBps": round(row["raw_bytes"] / row["decode_s"] / 1e9, 3),
                     "chunks": row["chunks"], "codecs": dict(row["codecs"])}
    out["whole_file"]["bit_exact"] = exact
    out["whole_file"]["file_bytes"] = manifest.size
    return out


def bf16_files(model: Path, folder: Path, quick: bool) -> dict[str, Path]:
    """The GGUF's dequantized weights as bf16, and a random-init model of the same tensors."""
    import torch
    from safetensors.torch import load_file, save_file

    from ember.model.files import ensure_gguf_cache
    dense = load_file(str(ensure_gguf_cache(model) / "model.safetensors"))
    if quick:  # a third of the layers: the same kinds, a smoke run's size
        dense = {k: v for k, v in dense.items()
                 if ".layers." not in k or int(k.split(".layers.")[1].split(".")[0]) < 10}
    real = {k: v.to(torch.bfloat16).contiguous() for k, v in dense.items()}
    gen = torch.Generator().manual_seed(0)
    random = {k: (torch.randn(v.shape, generator=gen) * 0.02).to(torch.bfloat16) if v.dim() > 1
              else torch.ones(v.shape, dtype=torch.bfloat16) for k, v in dense.items()}
    out = {"bf16_from_gguf": folder / "dequantized-bf16.safetensors",
           "bf16_random_init": folder / "random-init-bf16.safetensors"}
    save_file(real, str(out["bf16_from_gguf"]))
    save_file(random, str(out["bf16_random_init"]))
    return out


# --- (b) a worker with an empty cache behind the link --------------------------------------------------

def first_token_runs(model: Path, run_dir: Path, modes: list[str]) -> dict:
    from ember.client import RouterClient
    from ember.cluster.ports import write_local_config
    from ember.cluster.staged import Staged
    from ember.model.derived import derived_name
    from ember.model.fetch import DEFAULT_MODEL, MODELS
    from ember.model.weight_chunks import Manifest
    from ember.rpc import security
    from ember.v1 import kvstore_pb2, kvstore_pb2_grpc
    if model.suffix != ".gguf" or model.name != MODELS[DEFAULT_MODEL].filename:
        raise SystemExit("ember bench weights: the worker run needs the default named model's GGUF (--model)")
    home = str(model.parent.parent)  # the cache folder holding it: central's host
    run_dir.mkdir(parents=True, exist_ok=True)
    addr = write_local_config(run_dir / "cluster.yaml", DEFAULT_MODEL, overrides={
        "placement": {"emulate_links": True},
        "links": [{"a": "central", "b": "edge", "rtt_ms": RTT_MS, "bandwidth_gbps": GBPS}]})
    staged = Staged(run_dir / "cluster.yaml", run_dir)
    results: dict = {}
    try:
        staged.start("links")
        staged.start("kvstore-central", {"EMBER_CACHE_DIR": home})
        staged.start("prefill-central", {"EMBER_CACHE_DIR": home})
        staged.start("router", {"EMBER_CACHE_DIR": home})
        operator = security.Credentials.load(run_dir / "certs" / "kvstore-edge")
        with security.dial(addr["kv_central"], operator) as ch:  # central seeds its chunks (once per store)
            stub = kvstore_pb2_grpc.WeightStoreStub(ch)
            start = time.perf_counter()
            reply = stub.GetManifest(kvstore_pb2.ManifestRequest(name=model.name), timeout=300)
            results["central_seed_s"] = round(time.perf_counter() - start, 2)
            sha256 = Manifest.from_json(reply.manifest).files[0].sha256
            start = time.perf_counter()
            reply = stub.GetManifest(kvstore_pb2.ManifestRequest(name=derived_name(model.name, sha256)), timeout=300)
            results["central_seed_load_caches_s"] = round(time.perf_counter() - start, 2)
            results["load_caches_bytes"] = Manifest.from_json(reply.manifest).size
        with RouterClient(addr["router"]) as client:
            for mode in modes:
                progress(f"decode worker at the edge: {mode}")
                cache = home if mode == "disk" else str(run_dir / f"edge-cache-{mode}")
                staged.start("kvstore-edge", {"EMBER_CACHE_DIR": cache})
                env = {"EMBER_CACHE_DIR": cache, "EMBER_MODEL_FETCH_CODEC": "raw" if mode == "raw" else ""}
                start = time.monotonic()
                staged.start("decode-edge", env, wait=False)
                first, serving, tokens = first_token(client, start, staged)
                results[mode] = {"first_token_s": round(first, 2), "serving_s": round(serving, 2), "tokens": tokens,
                                 **fetch_figures(run_dir / "decode-edge.log", staged, addr["kv_edge"], operator)}
                staged.stop("decode-edge")
                staged.stop("kvstore-edge")
    finally:
        staged.close()
    return results


def first_token(client, start: float, staged) -> tuple[float, float, list[int]]:
    """Seconds from `start` to the first streamed token of a request once the worker serves (the
    router placing it there), seconds to its serving, and the request's tokens."""
    import grpc
    staged.wait_serving("decode-edge", 600)
    serving = time.monotonic() - start
    deadline = time.monotonic() + 120
    while True:
        tokens, first = [], None
        try:
            for msg in client.stream(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, timeout=120):
                if msg.token_ids and first is None:
                    first = time.monotonic() - start
                tokens.extend(msg.token_ids)
            return first, serving, tokens
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # the router has not seen the worker live yet


def fetch_figures(log: Path, staged, kv_edge: str, creds) -> dict:
    from ember.rpc import security
    from ember.v1 import kvstore_pb2, kvstore_pb2_grpc
    fetched = caches = None
    for line in log.read_text(errors="replace").splitlines()[::-1]:
        text = json.loads(line).get("message", line) if line.startswith("{") else line
        if "fetched model" in text and fetched is None:
            fetched = float(text.rsplit(" in ", 1)[1].split()[0])
        if "fetched the load caches" in text and caches is None:
            caches = float(text.rsplit(" in ", 1)[1].split()[0])
    with security.dial(kv_edge, creds) as ch:
        stats = kvstore_pb2_grpc.WeightStoreStub(ch).WeightStats(kvstore_pb2.StatsRequest(), timeout=10)
    return {"fetch_s": fetched, "load_caches_fetch_s": caches, "wire_bytes": stats.wire_bytes_pulled,
            "chunks_pulled": stats.chunks_pulled}


def main(args) -> int:
    model = Path(args.model)
    result: dict = {"link": {"rtt_ms": RTT_MS, "gbps": GBPS}, "model": str(model)}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        progress("codec table: bf16 from the GGUF, bf16 random init, the Q4_1 GGUF")
        files = {**bf16_files(model, folder, args.quick), "q4_1_gguf": model}
        result["codecs"] = {name: codec_table(path) for name, path in files.items()}
        for name, table in result["codecs"].items():
            progress(f"{name}: " + ", ".join(f"{k} {v['saving']:.1%} (enc {v['encode_GBps']}, dec "
                                            f"{v['decode_GBps']} GB/s)" for k, v in table.items()))
        modes = ["disk", "compressed"] if args.quick else ["disk", "compressed", "raw"]
        result["first_token"] = first_token_runs(model, folder / "cluster", modes)
    ft, codecs = result["first_token"], result["codecs"]
    whole = {name: t["whole_file"] for name, t in codecs.items()}
    targets = {
        "bf16 (from the GGUF) stored / file, saving": {"value": whole["bf16_from_gguf"]["saving"], "target": ">= 0.15",
                                                      "met": whole["bf16_from_gguf"]["saving"] >= 0.15},
        "bf16 (random init) stored / file, saving": {"value": whole["bf16_random_init"]["saving"],
                                                    "target": ">= 0.15",
                                                    "met": whole["bf16_random_init"]["saving"] >= 0.15},
        "Q4_1 GGUF saving (reported; small)": {"value": whole["q4_1_gguf"]["saving"], "target": "> 0",
                                               "met": whole["q4_1_gguf"]["saving"] > 0},
        "every chunk bit-exact after decode": {"value": all(w["bit_exact"] for w in whole.values()),
                                               "target": True, "met": all(w["bit_exact"] for w in whole.values())},
        "fetched worker's tokens == disk worker's": {
            "value": all(ft[m]["tokens"] == ft["disk"]["tokens"] for m in modes), "target": True,
            "met": all(ft[m]["tokens"] == ft["disk"]["tokens"] for m in modes)}}
    if "raw" in ft:
        targets["first token, compressed / raw chunks"] = {
            "value": round(ft["compressed"]["first_token_s"] / ft["raw"]["first_token_s"], 3), "target": "< 1",
            "met": ft["compressed"]["first_token_s"] < ft["raw"]["first_token_s"]}
    result["targets"] = targets
    write_result(result, args.output)
    correct = ("every chunk bit-exact after decode", "fetched worker's tokens == disk worker's")
    return 0 if all(targets[k]["met"] for k in correct) else 1  # (speed and size are reported, not failed on)
