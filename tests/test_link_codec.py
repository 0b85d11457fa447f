"""Compression priced by the link (torch-free): the pipelined codec's break-even, the kvstore's
configured link priors, and the placer's link cost using the codec where the kvstores would."""
from __future__ import annotations

import pytest

from ember.config.derived import link_codec_saving
from ember.config.schema import ClusterConfig
from ember.config.services import kvstore_settings
from ember.kv import codec
from ember.placement.policy import Placer
from tests.test_placement import three_sites


def test_the_pipelined_data_plane_pays_below_the_codec_speed_not_on_loopback():
    # encode overlapped with the send, decode with the next block's arrival: the slowest stage bounds it
    assert codec.worth_it(1.0 / 8, 2) and codec.worth_it(0.3, 2)  # 1 and 2.4 Gbit/s WAN links
    assert not codec.worth_it(2.5, 2) and not codec.worth_it(1.25, 2)  # loopback, 10 Gbit/s LAN
    # on a host whose codec runs slower (measured: a busy or small core), only on slower links
    assert not codec.worth_it(1.0 / 8, 2, True, 0.1, 0.3) and codec.worth_it(0.05, 2, True, 0.1, 0.3)
    speeds = codec.measured_speeds()
    assert all(0 < s < 100 for s in speeds) and codec.measured_speeds() is speeds  # measured once
    # one block at a time (encode, send, decode in turn) it pays only on much slower links
    assert codec.worth_it(0.1, 2, pipelined=False) and not codec.worth_it(0.4, 2, pipelined=False)


def _config(gbps: float, **kvstore) -> ClusterConfig:
    data = three_sites()
    data["links"] = [{"a": "central", "b": "west", "rtt_ms": 60, "bandwidth_gbps": gbps},
                     {"a": "central", "b": "east", "rtt_ms": 40, "bandwidth_gbps": 10}]
    data["kvstore"] = kvstore
    return ClusterConfig.model_validate(data)


def test_each_kvstore_knows_its_configured_links_to_its_peers():
    config = _config(1.0)
    west = kvstore_settings(config, "west")
    assert dict(west.link_GBps) == {config.site("central").kvstore: 1.0 / 8}  # no link to east: unpriced
    central = dict(kvstore_settings(config, "central").link_GBps)
    assert central == {config.site("west").kvstore: 1.0 / 8, config.site("east").kvstore: 10.0 / 8}


@pytest.mark.parametrize("mode, gbps, expected", [("auto", 1.0, codec.SAVING[2]), ("auto", 10.0, 0.0),
                                                  ("planes", 10.0, codec.SAVING[2]), ("raw", 1.0, 0.0)])
def test_the_placer_prices_a_link_with_the_codec_the_kvstores_use_on_it(mode, gbps, expected):
    config = _config(gbps, codec=mode, stream_prefill=False)  # remote KV pulled after the prefill
    assert link_codec_saving(config, gbps, 2) == expected
    placer = Placer(config)
    slow = placer.routes[("central", "west")]
    assert slow.bytes_per_s == pytest.approx(gbps * 1e9 / 8 / (1 - expected))
    streamed = Placer(_config(gbps, codec=mode))  # (the default) a streamed push crosses raw
    assert streamed.routes[("central", "west")].bytes_per_s == pytest.approx(gbps * 1e9 / 8)
    pinned = _config(gbps, codec=mode).model_copy(
        update={"placement": config.placement.model_copy(update={"codec_saving": 0.1})})
    assert link_codec_saving(pinned, gbps, 2) == 0.1  # an explicit placement.codec_saving wins


def test_the_codec_is_exact_when_threads_encode_at_once():
    """The data plane encodes in worker threads, several at a time (one block ahead per connection,
    several connections): each thread has its own zstd objects, so every round trip is exact."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    rng = np.random.default_rng(0)
    payloads = [(rng.standard_normal(64 * 1024).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
                + os.urandom(64) for _ in range(8)]

    def round_trip(p: bytes) -> bool:
        for _ in range(5):
            encoded = codec.encode(codec.PLANES, p, 2)
            out = bytearray(len(p))
            codec.decode_into(codec.PLANES, encoded, 2, memoryview(out))
            if bytes(out) != p:
                return False
        return True
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(round_trip, payloads * 4))
