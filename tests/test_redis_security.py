"""The block directory's Redis with TLS and one ACL user per role, against a real redis-server
(`--tls-port`, `tls-auth-clients yes`, the `aclfile` `ember certs` writes): a client without TLS,
without a certificate, without the password or with a wrong one is refused; the kvstores publish
and the router looks up through the real RedisDirectory as their own users; each user runs only
its role's commands on its role's keys; a password never comes from the config nor shows.
No cluster: the settings come from the config as each service reads them."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as redis
import yaml
from redis.exceptions import AuthenticationError, ConnectionError, NoPermissionError, ResponseError

from ember.cluster.certs import write_cluster_certs
from ember.config.load import config_from_dict, load_config
from ember.config.services import kvstore_settings, router_settings
from ember.kv.directory import RedisDirectory
from ember.services.kvstore.publisher import Publisher
from ember.services.kvstore.store import BlockStore
from ember.services.router.shared_view import SharedWorkerView
from tests.cluster_fixture import AT_ONCE_S, free_port, wait_until_async, write_config
from tests.redis_fixture import USERS, installed, secure_overrides, secure_server, write_secure_files

H = [bytes([i]) * 16 for i in range(4)]


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """(config, certs folder, url) of a cluster whose directory is a TLS + ACL redis-server, running."""
    run_dir = tmp_path_factory.mktemp("redis-tls")
    port = free_port()
    url = f"rediss://127.0.0.1:{port}/0"
    write_config(run_dir / "cluster.yaml", overrides=secure_overrides(url))
    certs = write_secure_files(run_dir / "cluster.yaml")
    server = secure_server(port, certs).start()
    try:
        yield load_config(run_dir / "cluster.yaml"), certs, url
    finally:
        server.stop()


def raw_client(url: str, certs, folder: str | None = "kvstore-edge", **kw) -> redis.Redis:
    tls = {} if not url.startswith("rediss://") else {"ssl_ca_certs": str(certs / "ca.crt")} | (
        {} if folder is None else {"ssl_certfile": str(certs / folder / "tls.crt"),
                                   "ssl_keyfile": str(certs / folder / "tls.key")})
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5, **tls, **kw)


async def refused(client: redis.Redis, *errors) -> Exception:
    try:
        await client.get("ember:blk:edge:x")
    except errors as e:
        return e
    finally:
        await client.aclose()
    raise AssertionError("the command was served")


def test_a_client_without_tls_a_certificate_or_the_acl_password_is_refused(secured, tmp_path):
    config, certs, url = secured
    password = (certs / "kvstore-edge" / "redis-password").read_text().strip()
    user = {"username": USERS["kvstore"], "password": password}
    other_ca = write_cluster_certs(config, tmp_path / "other")  # same names, another CA
    log = next(certs.parent.glob("redis-*.log"))

    async def go():
        plain = url.replace("rediss://", "redis://")
        await refused(raw_client(plain, certs, **user), ConnectionError)  # TLS only: no plaintext port
        e = await refused(raw_client(url, certs, folder=None, **user), ConnectionError)
        # tls-auth-clients yes: no client certificate, no session. Under TLS 1.3 the server checks the
        # certificate after the client's handshake is done, so the client sees its "certificate required"
        # alert or only the reset that follows it (a loaded host): the server's log says why either way.
        assert "certificate" in str(e).lower() or "reset" in str(e).lower(), e
        await wait_until_async(lambda: "did not return a certificate" in log.read_text(), AT_ONCE_S,
                               "redis-server's log names the missing client certificate")
        await refused(raw_client(url, other_ca, **user), ConnectionError)  # another CA's certificate
        e = await refused(raw_client(url, certs), AuthenticationError, ResponseError)  # no user: default is off
        assert "auth" in str(e).lower()
        await refused(raw_client(url, certs, username=USERS["kvstore"], password=password + "x"), AuthenticationError)
        await refused(raw_client(url, certs, username=USERS["router"], password=password), AuthenticationError)
        ok = raw_client(url, certs, **user)  # the same client, with all of it, is served
        try:
            assert await ok.ping()
        finally:
            await ok.aclose()
    asyncio.run(go())


def test_kvstores_publish_and_the_router_looks_up_as_their_own_users(secured):
    """The directory still works: a kvstore's Publisher over rediss:// as the kvstore user, the router's
    RedisDirectory and shared worker view as the router user, each with the settings its service reads."""
    config, certs, _ = secured
    kv, router = kvstore_settings(config, "edge").redis, router_settings(config).redis
    assert kv.user.username == USERS["kvstore"] and router.user.username == USERS["router"] and kv.tls

    async def go():
        with installed(certs / "kvstore-edge"):
            store = BlockStore(4 * 4096)
            publisher = Publisher(store, RedisDirectory(kv, ttl_s=30), "edge")
            publisher.start()
        with installed(certs / "router"):
            lookups = RedisDirectory(router, ttl_s=30)
            view_a, view_b = SharedWorkerView(router, "a"), SharedWorkerView(router, "b")
        try:
            for i in range(3):
                store.put(H[i], bytes([i]) * 4096)

            async def published():
                return (await lookups.lookup(H, ["edge", "central"])) == {"edge": 3, "central": 0}
            await wait_until_async(published, AT_ONCE_S, "the kvstore's blocks seen by the router")
            assert publisher.healthy
            assert await view_a.sync({"10.0.0.1:1": 2}) == {}
            assert await view_b.sync({}) == {"10.0.0.1:1": 2}, "the routers share their load through Redis"
        finally:
            await publisher.stop()
            for d in (lookups, view_a, view_b):
                await d.close()
    asyncio.run(go())


@pytest.mark.parametrize("role", ["kvstore", "router"])
def test_a_role_user_cannot_run_a_command_outside_its_acl(secured, role):
    config, certs, _ = secured
    name, settings = ("kvstore-edge", kvstore_settings(config, "edge").redis) if role == "kvstore" else \
        ("router", router_settings(config).redis)
    own = {"kvstore": [("SET", "ember:blk:edge:k", "1", "PX", "60000"), ("DEL", "ember:blk:edge:k")],
           "router": [("MGET", "ember:blk:edge:k"), ("SADD", "ember:routers", "r"), ("SREM", "ember:routers", "r")]}
    outside = [("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("ACL", "LIST"), ("EVAL", "return 1", "0"),
               ("SET", "elsewhere", "1"), ("GET", "ember:routers"), ("SHUTDOWN", "NOSAVE")]
    outside += {"kvstore": [("MGET", "ember:blk:edge:k"), ("PUBLISH", "ember:worker-down", "x")],
                "router": [("SET", "ember:blk:edge:k", "1"), ("DEL", "ember:blk:edge:k")]}[role]

    async def go():
        with installed(certs / name):
            d = RedisDirectory(settings)
        try:
            for command in own[role]:
                await d.redis.execute_command(*command)
            for command in outside:
                with pytest.raises(NoPermissionError):
                    await d.redis.execute_command(*command)
        finally:
            await d.close()
    asyncio.run(go())


def test_redis_passwords_come_from_files_or_the_environment_never_the_config(secured, tmp_path, monkeypatch):
    config, certs, url = secured
    kv = kvstore_settings(config, "edge").redis
    password = kv.user.password()
    assert password == (certs / "kvstore-edge" / "redis-password").read_text().strip() and len(password) >= 32
    assert password not in repr(kv) and password not in repr(router_settings(config))
    assert password not in (certs / "redis" / "users.acl").read_text(), "redis-server's file holds digests"
    raw = yaml_of(certs)
    raw["directory"]["url"] = url.replace("rediss://", f"rediss://{USERS['kvstore']}:{password}@")
    with pytest.raises(ValueError, match="directory.url.*password in the URL"):
        config_from_dict(raw, tmp_path)
    raw = yaml_of(certs)
    raw["directory"]["users"]["kvstore"] = {"username": "k", "password_env": "EMBER_TEST_REDIS_PW"}
    env_config = config_from_dict(raw, certs.parent)
    with pytest.raises(ValueError, match=r"directory.users.kvstore.password_env: \$EMBER_TEST_REDIS_PW is not set"):
        kvstore_settings(env_config, "edge").redis.user.password()
    monkeypatch.setenv("EMBER_TEST_REDIS_PW", "from-the-env")
    assert kvstore_settings(env_config, "edge").redis.user.password() == "from-the-env"
    raw = yaml_of(certs)
    raw["directory"]["users"]["router"]["password_file"] = "nowhere/{name}"
    with pytest.raises(ValueError, match="directory.users.router.password_file: cannot read .*nowhere/router"):
        router_settings(config_from_dict(raw, certs.parent)).redis.user.password()


def yaml_of(certs) -> dict:
    """The test cluster's YAML, as written."""
    return yaml.safe_load((certs.parent / "cluster.yaml").read_text())
