"""The router's admission (services/router/admission.py) and the keys file's tenant section, with
a fake clock: fair shares of the capacity by weight, each quota's refusal and its Retry-After
(honoured, the retry gets in), and the keys file's errors."""
from __future__ import annotations

import pytest

from ember.services.router import auth
from ember.services.router.admission import Admission, TenantPolicy, Throttled


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def refused(fn, *args) -> Throttled:
    with pytest.raises(Throttled) as e:
        fn(*args)
    return e.value


def test_one_tenant_gets_the_whole_capacity_then_is_refused():
    a = Admission(4, retry_after_s=2.0)
    for _ in range(4):
        a.admit("")
    e = refused(a.admit, "")
    assert e.reason == "capacity" and e.retry_after_s == 2.0
    a.release("")
    a.admit("")
    assert a.inflight == 4


def test_a_burst_fills_idle_capacity_but_another_tenant_inside_its_share_still_gets_in():
    a = Admission(8)
    for _ in range(8):
        a.admit("A")
    assert refused(a.admit, "A").reason == "capacity"  # A alone: its share is everything, and it has it
    for _ in range(4):  # B's share, with A in flight, is half: admitted though the router is full
        a.admit("B")
    assert refused(a.admit, "B").reason == "capacity"
    assert refused(a.admit, "A").reason == "capacity"  # A stays refused while it holds more than its share
    for _ in range(5):
        a.release("A")  # A: 3 < its share (4), the router at 7 < 8
    a.admit("A")
    assert a.inflight_of("A") == 4 and a.inflight_of("B") == 4


def test_shares_follow_weights():
    a = Admission(9, {"big": TenantPolicy(weight=2.0)})
    for _ in range(9):
        a.admit("small")
    assert a.share("big") == pytest.approx(6.0)  # 9 * 2 / (1 + 2)
    for _ in range(6):
        a.admit("big")
    assert refused(a.admit, "big").reason == "capacity"


def test_max_inflight_quota():
    a = Admission(100, {"t": TenantPolicy(max_inflight=2)}, retry_after_s=0.5)
    a.admit("t")
    a.admit("t")
    e = refused(a.admit, "t")
    assert e.reason == "max_inflight" and e.retry_after_s == 0.5
    a.admit("other")  # others are not affected
    a.release("t")
    a.admit("t")


def test_requests_per_s_quota_retry_after_is_when_a_request_fits_again():
    clock = Clock()
    a = Admission(100, {"t": TenantPolicy(requests_per_s=2)}, clock=clock)
    a.admit("t")
    a.admit("t")  # a second's worth: the burst allowed
    e = refused(a.admit, "t")
    assert e.reason == "requests_per_s" and e.retry_after_s == pytest.approx(0.5)
    clock.t += e.retry_after_s * 0.9
    assert refused(a.admit, "t").reason == "requests_per_s"  # not yet
    clock.t += e.retry_after_s * 0.1
    a.admit("t")  # honoured: in
    assert a.inflight_of("t") == 3


def test_tokens_per_min_quota_charges_prompt_and_max_tokens_and_refunds_what_was_not_generated():
    clock = Clock()
    a = Admission(100, {"t": TenantPolicy(tokens_per_min=600)}, clock=clock)  # 10 tokens/s
    a.charge("t", 500)
    e = refused(a.charge, "t", 200)
    assert e.reason == "tokens_per_min" and e.retry_after_s == pytest.approx(10.0)  # 100 short at 10/s
    a.refund("t", 300)  # the first request generated less than its max_tokens
    a.charge("t", 200)
    e = refused(a.charge, "t", 300)
    clock.t += e.retry_after_s
    a.charge("t", 300)
    # a request larger than a whole minute gets in once the bucket is full, leaving a debt
    clock.t += 120
    a.charge("t", 1000)
    assert refused(a.charge, "t", 1).retry_after_s == pytest.approx(40.1)


def test_policy_values_are_checked():
    for bad in ({"weight": 0}, {"weight": float("nan")}, {"max_inflight": 0}, {"max_inflight": 1.5},
                {"requests_per_s": -1}, {"tokens_per_min": 0}):
        with pytest.raises(ValueError):
            TenantPolicy(**bad)


def test_the_keys_file_gives_tenants_weights_and_quotas(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  key-a-0123456789: a\n  key-b-0123456789: b\n"
                    "tenants:\n  a: {weight: 3, tokens_per_min: 6000}\n")
    table = auth.load(path)
    assert table.tenant("key-a-0123456789") == "a" and table.tenant("key-b-0123456789") == "b"
    assert table.policies == {"a": TenantPolicy(weight=3, tokens_per_min=6000)}
    for text, message in (
            ("keys: {k-0123456789: a}\ntenants: {a: {weight: 0}}\n", "tenants.a: weight must be a positive"),
            ("keys: {k-0123456789: a}\ntenants: {a: {burst: 3}}\n", r"tenants.a: unknown \['burst'\]"),
            ("keys: {k-0123456789: a}\ntenants: {b: {weight: 2}}\n", r"tenants \['b'\] have quotas but no key"),
            ("keys: {k-0123456789: a}\nextra: 1\n", "only `keys:` and `tenants:`")):
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            auth.load(path)
    path.write_text("key-a-0123456789: a\n")  # the one-section form still reads
    assert auth.load(path).tenant("key-a-0123456789") == "a" and auth.load(path).policies == {}
