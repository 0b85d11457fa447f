"""What the KV frame MAC costs (ember/kv/wire.py), torch-free: `python -m ember.bench.mac_bench`.

1. MAC candidates on one KV block of the default model's layout (SmolLM2-135M: 30 layers,
   3 KV heads, head_dim 64, 16-token blocks: 360 KiB bf16, 720 KiB fp32): keyed BLAKE2b and
   BLAKE2s (hashlib), HMAC-SHA256/512 (hashlib, OpenSSL), Poly1305 with a per-frame key
   (cryptography, OpenSSL), XXH3 (today's checksum) for scale; and whether each lets a second
   thread run meanwhile (hashlib releases the GIL on large buffers).
2. The chosen scheme through the real functions, both sides: the producer's `sign_frame` of
   an exported frame (what KVConnector.store does) and `encode_frame` with a key, against
   `encode_frame` without; the importer's `decode_frame` with the key against without. Per
   block and per 1000-token prompt (62 full blocks).
Medians of many repetitions; the machine's other load shows as noise, so run it twice.
"""
from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import threading
import time

import xxhash

from ember.bench.measure import median_time
from ember.kv import wire
from ember.kv.block_hash import KVLayout


def candidates(key: bytes) -> dict:
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    def poly1305(buf):
        mac = Poly1305(hashlib.blake2b(b"nonce and header", key=key, digest_size=32).digest())
        mac.update(buf)
        return mac.finalize()
    return {
        "xxh3-64 (the checksum)": lambda buf: xxhash.xxh3_64(buf).intdigest(),
        "blake2b keyed": lambda buf: hashlib.blake2b(buf, key=key, digest_size=16).digest(),
        "blake2s keyed": lambda buf: hashlib.blake2s(buf, key=key, digest_size=16).digest(),
        "hmac-sha256": lambda buf: hmac.digest(key, buf, "sha256"),
        "hmac-sha512": lambda buf: hmac.digest(key, buf, "sha512"),
        "poly1305 (derived key)": poly1305,
    }


def parallel_ratio(fn, buf, n: int = 100) -> float:
    """Two threads doing n each, over one thread doing n: ~1 if the GIL is released, ~2 if not."""
    def work():
        for _ in range(n):
            fn(buf)
    start = time.perf_counter()
    work()
    one = time.perf_counter() - start
    threads = [threading.Thread(target=work) for _ in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (time.perf_counter() - start) / one


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m ember.bench.mac_bench", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=80)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    key = os.urandom(32)
    blocks = args.prompt_tokens // args.block_size
    print(f"{os.cpu_count()} CPUs; a {args.prompt_tokens}-token prompt is {blocks} full blocks")
    for dtype in ("bfloat16", "float32"):
        layout = KVLayout("bench", dtype, block_size=args.block_size, num_layers=args.layers,
                          num_kv_heads=args.kv_heads, head_dim=args.head_dim)
        one_layout(layout, key, blocks, args.reps)


def one_layout(layout: KVLayout, key: bytes, blocks: int, reps: int) -> None:
    payload = os.urandom(layout.block_bytes)
    print(f"\n{layout.dtype}: one block is {layout.block_bytes / 1024:.0f} KiB")
    for name, fn in candidates(key).items():
        t = median_time(lambda fn=fn: fn(payload), reps, warmup=0)
        print(f"  {name:24s} {t * 1e6:7.0f} us/block {layout.block_bytes / t / 1e9:6.2f} GB/s  "
              f"x{blocks}: {t * blocks * 1e3:6.1f} ms  2 threads: x{parallel_ratio(fn, payload):.2f} time")
    template = wire.layout_header(layout, b"\x11" * 16)
    h = b"\x22" * 16
    plain = wire.encode_frame(template, h, payload)
    signed = wire.encode_frame(template, h, payload, mac_key=key)
    enc = median_time(lambda: wire.encode_frame(template, h, payload), reps, warmup=0)
    enc_mac = median_time(lambda: wire.encode_frame(template, h, payload, mac_key=key), reps, warmup=0)
    sign = median_time(lambda: wire.sign_frame(plain, key), reps, warmup=0)
    dec = median_time(lambda: wire.decode_frame(plain, template, block_hash=h), reps, warmup=0)
    dec_mac = median_time(lambda: wire.decode_frame(signed, template, block_hash=h, mac_key=key), reps, warmup=0)
    print(f"  producer: encode_frame {enc * 1e6:.0f} us, with the key {enc_mac * 1e6:.0f} us "
          f"(+{(enc_mac - enc) * 1e6:.0f}); sign_frame of an exported frame {sign * 1e6:.0f} us "
          f"-> +{sign * blocks * 1e3:.1f} ms per prompt (KVConnector.store)")
    print(f"  importer: decode_frame {dec * 1e6:.0f} us, with the key {dec_mac * 1e6:.0f} us "
          f"(+{(dec_mac - dec) * 1e6:.0f}) -> +{(dec_mac - dec) * blocks * 1e3:.1f} ms per prompt")
    print(f"  both sides, one prompt of {blocks} blocks: +{(sign + dec_mac - dec) * blocks * 1e3:.1f} ms")

if __name__ == "__main__":
    main()
