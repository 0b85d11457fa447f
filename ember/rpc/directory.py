"""The block directory over gRPC: a servicer hosting a MemoryDirectory (the local cluster's
router runs it) and the client kvstores publish through; `open_directory` picks by URL."""
from __future__ import annotations

from ember.kv.directory import BlockDirectory, MemoryDirectory, RedisDirectory
from ember.kv.redis_client import RedisSettings
from ember.rpc import validate
from ember.rpc.server import channel
from ember.v1 import directory_pb2, directory_pb2_grpc


class DirectoryService(directory_pb2_grpc.BlockDirectoryServicer):
    def __init__(self, directory: MemoryDirectory):
        self.directory = directory

    async def Publish(self, request, context):
        site = validate.name(request.site, "site")
        if not site:
            raise validate.invalid("site is required")
        # a kvstore re-publishes every block it holds: no count cap beyond the message size
        limit = validate.MAX_PUBLISHED_BLOCKS
        added = validate.block_hashes(request.added, "added", limit)
        evicted = validate.block_hashes(request.evicted, "evicted", limit)
        await self.directory.publish(site, added, evicted)
        return directory_pb2.PublishResponse()

    async def Lookup(self, request, context):
        validate.count(request.sites, "sites", validate.MAX_SITES)
        sites = [validate.name(s, f"sites[{i}]") for i, s in enumerate(request.sites)]
        prefix = await self.directory.lookup(validate.block_hashes(request.block_hashes), sites)
        return directory_pb2.DirectoryLookupResponse(prefix_blocks=prefix)


class RemoteDirectory(BlockDirectory):
    def __init__(self, address: str, ttl_s: float = 60.0, timeout_s: float = 0.5):
        self.ttl_s, self.timeout_s = ttl_s, timeout_s
        self.channel = channel(address)
        self.stub = directory_pb2_grpc.BlockDirectoryStub(self.channel)

    async def publish(self, site: str, added: list[bytes], evicted: list[bytes]) -> None:
        await self.stub.Publish(directory_pb2.PublishRequest(site=site, added=added, evicted=evicted),
                                timeout=self.timeout_s)

    async def lookup(self, block_hashes: list[bytes], sites: list[str]) -> dict[str, int]:
        response = await self.stub.Lookup(directory_pb2.DirectoryLookupRequest(block_hashes=block_hashes, sites=sites),
                                          timeout=self.timeout_s)
        return {site: response.prefix_blocks.get(site, 0) for site in sites}

    async def close(self) -> None:
        await self.channel.close()


def open_directory(url: str, ttl_s: float = 60.0, redis: RedisSettings | None = None) -> BlockDirectory:
    """redis://HOST:PORT[/DB] (rediss://, unix://) -> RedisDirectory, connected with `redis` (TLS, the
    role's ACL user) when given; grpc://HOST:PORT -> RemoteDirectory."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisDirectory(redis or url, ttl_s)
    if url.startswith("grpc://"):
        return RemoteDirectory(url.removeprefix("grpc://"), ttl_s)
    raise ValueError(f"directory URL {url!r} must start with redis:// or grpc://")
