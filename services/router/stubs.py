"""The router's channels to every site's prefill and decode, opened on first use, through
the emulated link when one is configured (`routes`: true address -> relay address)."""
from __future__ import annotations

from ember.config.schema import ClusterConfig
from ember.rpc.server import channel
from ember.v1 import decode_pb2_grpc, prefill_pb2_grpc


class SiteStubs:
    def __init__(self, config: ClusterConfig, routes: dict[str, str] | None = None):
        self.config, self.routes = config, routes or {}
        self._prefill: dict[str, prefill_pb2_grpc.PrefillStub] = {}
        self._decode: dict[str, decode_pb2_grpc.DecodeStub] = {}

    def _address(self, address: str) -> str:
        return self.routes.get(address, address)

    def prefill(self, site: str) -> prefill_pb2_grpc.PrefillStub:
        if site not in self._prefill:
            self._prefill[site] = prefill_pb2_grpc.PrefillStub(channel(self._address(self.config.site(site).prefill)))
        return self._prefill[site]

    def decode(self, site: str) -> decode_pb2_grpc.DecodeStub:
        if site not in self._decode:
            self._decode[site] = decode_pb2_grpc.DecodeStub(channel(self._address(self.config.site(site).decode)))
        return self._decode[site]
