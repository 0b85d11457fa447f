"""Redis ACL users, one per role: each may run only the commands its role sends, on only its keys.

What each role does to Redis:
- kvstore (ember.kv.directory.RedisDirectory.publish): SET with PX and DEL on `ember:blk:*`;
- router: MGET on `ember:blk:*` (directory lookups, read-only); the shared worker view
  (ember.services.router.shared_view): HSET, PEXPIRE, HGETALL, DEL on `ember:router-load:*`, SADD,
  SMEMBERS, SREM on `ember:routers`, PUBLISH / SUBSCRIBE on the channel `ember:worker-down`.
Both may PING (health checks, redis-cli). Nothing else: no FLUSHALL, CONFIG, KEYS, EVAL, no other
key or channel. The default user is off, so a client that does not log in can run nothing.

`acl_file` writes redis-server's `aclfile` with passwords as SHA-256 digests (`#...`), so the
file redis-server mounts holds no password.
"""
from __future__ import annotations

import hashlib

ROLES = ("router", "kvstore")
RULES = {
    "kvstore": "resetkeys %W~ember:blk:* resetchannels -@all +set +del +ping",
    "router": ("resetkeys %R~ember:blk:* ~ember:routers ~ember:router-load:* resetchannels &ember:worker-down "
               "-@all +mget +hset +pexpire +hgetall +del +sadd +smembers +srem +publish +subscribe +unsubscribe "
               "+ping"),
}
DEFAULT_OFF = "user default off resetkeys resetchannels -@all"


def user_rule(role: str, username: str, password: str) -> str:
    """One `user ...` line of an ACL file: `username` with the rights of `role`."""
    if role not in RULES:
        raise ValueError(f"no Redis ACL rules for role {role!r}; roles: {', '.join(ROLES)}")
    if not username or any(c.isspace() for c in username):
        raise ValueError(f"Redis user name {username!r} must be non-empty, without spaces")
    digest = hashlib.sha256(password.encode()).hexdigest()
    return f"user {username} reset on #{digest} {RULES[role]}"


def acl_file(users: dict[str, tuple[str, str]]) -> str:
    """redis-server's ACL file for `users` (role -> (username, password)), the default user off."""
    names = [u for u, _ in users.values()]
    if len(set(names)) != len(names):
        raise ValueError(f"each role needs its own Redis user, got {names}")
    return "\n".join([DEFAULT_OFF, *(user_rule(role, u, p) for role, (u, p) in users.items())]) + "\n"
