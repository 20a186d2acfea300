import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from reference import contract_layout

from workers.layout import bytes_per_key, padded_capacity
from workers.store import CapacityError, ShardMissing, ShardStore
from workers.tasks import ShardRead, ShardWrite


def kv(n, h_kv=2, d=8, d_v=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, h_kv, d)).astype(np.float32), rng.standard_normal((n, h_kv, d_v)).astype(np.float32)


def held(keys, max_capacity):
    """What a float32 shard of ``kv``'s heads holds once created with ``keys`` (its body, allocated for
    them; ``max_capacity`` is how far it may grow, page by page, and costs nothing until it does)."""
    return padded_capacity(keys, 4) * bytes_per_key(2, 8, 4, np.float32)


def test_create_append_view_and_held_report():
    st = ShardStore(budget_bytes=10**8)
    k, v = kv(300)
    st.create(ShardWrite("c1", 0, "float32", 1000, np.arange(100)), k[:100], v[:100], context={"version": 1})
    info = st.append(ShardWrite("c1", 0, "float32", 1000, np.arange(100, 300)), k[100:], v[100:], committed=100)
    assert info.length == 300 and info.nbytes == st.used
    view = st.view("c1", 0, 200)
    k2, v2 = contract_layout(view)
    np.testing.assert_array_equal(k2, k[:200])
    np.testing.assert_array_equal(v2, v[:200])
    [rep] = st.held()
    assert rep.context_id == "c1" and rep.context == {"version": 1} and rep.nbytes == st.used


def test_append_drops_an_uncommitted_tail_first():
    st = ShardStore(budget_bytes=10**8)
    k, v = kv(30)
    st.create(ShardWrite("c", 0, "float32", 100, np.arange(10)), k[:10], v[:10], context={})
    st.append(ShardWrite("c", 0, "float32", 100, np.arange(10, 20)), k[10:20], v[10:20], committed=10)  # never committed
    st.append(ShardWrite("c", 0, "float32", 100, np.arange(10, 20)), k[20:30], v[20:30], committed=10)
    got, _ = contract_layout(st.view("c", 0, 20))
    np.testing.assert_array_equal(got, np.concatenate([k[:10], k[20:30]]))


def test_a_shard_no_kept_record_names_is_an_uncommitted_leftover_that_a_new_create_replaces():
    st = ShardStore(budget_bytes=10**8)
    k, v = kv(30)
    committed = {"version": 1, "shards": [{"index": 0, "length": 10, "workers": ["w"]}]}
    st.create(ShardWrite("c", 0, "float32", 10, np.arange(10)), k[:10], v[:10], context=committed)
    st.create(ShardWrite("c", 1, "float32", 10, np.arange(10, 15)), k[10:15], v[10:15], context=committed)  # never committed
    used = st.used
    info = st.create(ShardWrite("c", 1, "float32", 10, np.arange(10, 20)), k[20:30], v[20:30], context=committed)
    assert info.length == 10 and st.used == used - held(5, 10) + held(10, 10)  # the leftover's memory went with it
    got, _ = contract_layout(st.view("c", 1, 10))
    np.testing.assert_array_equal(got, k[20:30])
    with pytest.raises(ValueError, match="shard must not exist yet, got an existing shard 0 of c"):  # named: kept
        st.create(ShardWrite("c", 0, "float32", 10, np.arange(10)), k[:10], v[:10], context=committed)


def test_over_budget_raises_capacity_error_and_writes_nothing():
    st = ShardStore(budget_bytes=50_000)
    k, v = kv(1000)
    with pytest.raises(CapacityError, match="budget"):
        st.create(ShardWrite("c", 0, "float32", 1000, np.arange(1000)), k, v, context={})
    assert st.held() == [] and st.used == 0


def test_missing_shards_and_short_shards_raise_shard_missing():
    st = ShardStore(budget_bytes=10**8)
    with pytest.raises(ShardMissing):
        st.view("nope", 0, 1)
    k, v = kv(5)
    st.create(ShardWrite("c", 0, "float32", 10, np.arange(5)), k, v, context={})
    with pytest.raises(ShardMissing, match="fewer than the 6 committed"):
        st.view("c", 0, 6)


def test_drop_frees_the_memory():
    st = ShardStore(budget_bytes=10**8)
    k, v = kv(100)
    for i in range(3):
        st.create(ShardWrite("c", i, "float32", 100, np.arange(100)), k, v, context={})
    assert st.drop("c", 1) == 1 and len(st.held()) == 2
    assert st.drop("c") == 2 and st.used == 0


def test_a_reserved_shard_is_charged_once_and_never_grows():
    st = ShardStore(budget_bytes=held(1000, 1000))
    k, v = kv(1000)
    st.create(ShardWrite("c", 0, "float32", 1000, np.arange(10), reserve=1000), k[:10], v[:10], context={})
    assert st.used == held(1000, 1000)  # the whole reservation, charged now
    arrays = st.view("c", 0, 10).parts[0].kt.base
    for lo in range(10, 1000, 330):
        hi = min(lo + 330, 1000)
        st.append(ShardWrite("c", 0, "float32", 1000, np.arange(lo, hi)), k[lo:hi], v[lo:hi], committed=lo)
    assert st.used == held(1000, 1000)
    view = st.view("c", 0, 1000)
    assert len(view.parts) == 1 and view.parts[0].kt.base is arrays, "the shard must fill its body, not copy it"
    got_k, got_v = contract_layout(st.view("c", 0, 1000))
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)


def test_a_reserve_over_the_budget_fails_at_create_though_the_keys_fit():
    st = ShardStore(budget_bytes=100_000)
    k, v = kv(10)
    with pytest.raises(CapacityError, match="budget"):
        st.create(ShardWrite("c", 0, "float32", 10**6, np.arange(10), reserve=10**6), k, v, context={})
    assert st.held() == [] and st.used == 0


def test_concurrent_creates_never_overdraw_the_budget():
    # Eight threads each create a shard that takes 30% of the budget: three fit, five must fail,
    # however the threads interleave (the budget check and the insert are one write).
    n = 20_000
    st = ShardStore(budget_bytes=int(held(n, n) / 0.3))
    k, v = kv(n)
    start = threading.Barrier(8)

    def create(i):
        start.wait()
        try:
            st.create(ShardWrite(f"c{i}", 0, "float32", n, np.arange(n)), k, v, context={})
            return True
        except CapacityError:
            return False

    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(create, range(8)))
    assert sum(made) == 3 and len(st.held()) == 3 and st.used <= st.budget


def test_readers_see_the_committed_prefix_while_a_writer_appends():
    st = ShardStore(budget_bytes=10**9)
    k, v = kv(64 * 500)
    st.create(ShardWrite("c", 0, "float32", len(k), np.arange(64)), k[:64], v[:64], context={})
    committed = [64]
    done = threading.Event()

    def write():
        for lo in range(64, len(k), 64 * 25):  # grows the shard (new arrays, keys copied) many times
            hi = min(lo + 64 * 25, len(k))
            st.append(ShardWrite("c", 0, "float32", len(k), np.arange(lo, hi)), k[lo:hi], v[lo:hi], committed=lo)
            committed[0] = hi
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    reads = 0
    while not done.is_set() or reads < 3:
        n = committed[0]
        got_k, got_v = contract_layout(st.view("c", 0, n))
        np.testing.assert_array_equal(got_k, k[:n])
        np.testing.assert_array_equal(got_v, v[:n])
        reads += 1
    writer.join()
    assert st.info("c", 0).length == len(k)


def test_a_cached_read_is_refused_when_older_than_a_noted_commit_or_when_none_was_noted():
    from workers.store import RecordStale

    def cached(version):
        return ShardRead("c1", 0, 10, version)

    st = ShardStore(budget_bytes=10**8)
    k, v = kv(10)
    # A create's record is not a commit: a failed append's new shard must not make version 1 look stale.
    st.create(ShardWrite("c1", 0, "float32", 100, np.arange(10)), k, v, context={"version": 2})
    with pytest.raises(RecordStale, match="no committed version"):  # nothing noted: nothing vouched for
        st.check_read(cached(1))
    st.check_read(cached(0))  # 0: not checked
    st.note_context("c1", {"version": 3})
    for version in (3, 4):  # the noted one and newer pass
        st.check_read(cached(version))
    with pytest.raises(RecordStale, match="version 3"):
        st.check_read(cached(2))
    st.note_context("c1", {"version": 1})  # an older note changes nothing
    with pytest.raises(RecordStale):
        st.check_read(cached(2))
    st.drop("c1")  # the context's last shard gone: what was noted goes with it
    with pytest.raises(RecordStale, match="no committed version"):
        st.check_read(cached(3))


def test_a_fresh_read_is_never_refused_and_vouches_for_its_version():
    """A read of a record just taken from the directory lists this worker: its copy holds that version."""
    from workers.store import RecordStale

    st = ShardStore(budget_bytes=10**8)
    k, v = kv(10)
    st.create(ShardWrite("c1", 0, "float32", 100, np.arange(10)), k, v, context={"version": 2})
    st.check_read(ShardRead("c1", 0, 10, 5, fresh=True))
    st.check_read(ShardRead("c1", 0, 10, 5))  # the version read fresh is vouched for now
    with pytest.raises(RecordStale, match="version 5"):
        st.check_read(ShardRead("c1", 0, 10, 4))
    st.check_read(ShardRead("c1", 0, 10, 3, fresh=True))  # older fresh reads are served, the note stays 5
    with pytest.raises(RecordStale, match="version 5"):
        st.check_read(ShardRead("c1", 0, 10, 4))
    st.check_read(ShardRead("c2", 0, 10, 7, fresh=True))  # a shard not held here (a delete raced): no note kept
    with pytest.raises(RecordStale, match="no committed version"):
        st.check_read(ShardRead("c2", 0, 10, 7))
