"""Shards on disk: a restarted store holds exactly the keys and records written, crashes leave no torn state."""

import numpy as np
import pytest
from reference import contract_layout

from workers import BFLOAT16
from workers.persist import ShardFiles
from workers.store import ShardStore
from workers.tasks import ShardWrite


def kv(n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, 2, 8)).astype(np.float32).astype(dtype),
            rng.standard_normal((n, 2, 4)).astype(np.float32).astype(dtype))


def restarted(root) -> ShardStore:
    st = ShardStore(10**8, files=ShardFiles(root))
    st.restore()
    return st


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16, np.float64])
def test_a_restarted_store_holds_the_same_keys_bit_for_bit_and_the_newest_record(tmp_path, dtype):
    name = "bfloat16" if dtype == BFLOAT16 else np.dtype(dtype).name
    st = ShardStore(10**8, files=ShardFiles(tmp_path))
    k, v = kv(300, dtype)
    st.create(ShardWrite("c", 0, name, 1000, np.arange(100), reserve=500), k[:100], v[:100], context={"version": 1})
    st.append(ShardWrite("c", 0, name, 1000, np.arange(100, 200)), k[100:200], v[100:200], committed=100)
    st.append(ShardWrite("c", 0, name, 1000, np.arange(200, 300) * 3), k[200:], v[200:], committed=200)
    st.note_context("c", {"version": 3, "id": "c"})
    st.note_context("c", {"version": 2, "id": "c"})  # older: not kept
    again = restarted(tmp_path)
    [info] = again.held()
    assert (info.length, info.dtype, info.context) == (300, name, {"version": 3, "id": "c"})
    got_k, got_v = contract_layout(again.view("c", 0, 300))
    assert got_k.tobytes() == k.tobytes() and got_v.tobytes() == v.tobytes()
    assert again.view("c", 0, 300).k_pos.tolist() == list(range(200)) + list(range(600, 900, 3))
    assert again.used == st.used  # allocated for the same capacity (appends continue without growing)


def test_an_uncommitted_tail_truncated_or_replaced_is_not_restored(tmp_path):
    st = ShardStore(10**8, files=ShardFiles(tmp_path))
    k, v = kv(40, np.float32)
    st.create(ShardWrite("c", 0, "float32", 100, np.arange(10)), k[:10], v[:10], context={})
    st.append(ShardWrite("c", 0, "float32", 100, np.arange(10, 20)), k[10:20], v[10:20], committed=10)
    st.append(ShardWrite("c", 0, "float32", 100, np.arange(10, 20)), k[20:30], v[20:30], committed=10)  # replaces
    st.append(ShardWrite("c", 0, "float32", 100, np.arange(20, 30)), k[30:40], v[30:40], committed=20)
    st.truncate("c", 0, 20)  # the last append's undo
    got, _ = contract_layout(restarted(tmp_path).view("c", 0, 20))
    np.testing.assert_array_equal(got, np.concatenate([k[:10], k[20:30]]))
    assert restarted(tmp_path).held()[0].length == 20


def test_a_crash_mid_write_leaves_a_temporary_that_is_ignored_and_removed(tmp_path):
    st = ShardStore(10**8, files=ShardFiles(tmp_path))
    k, v = kv(20, np.float32)
    st.create(ShardWrite("c", 0, "float32", 100, np.arange(10)), k[:10], v[:10], context={})
    shard_dir = tmp_path / "c" / "0"
    (shard_dir / "000000000010-000000000020.safetensors.tmp").write_bytes(b"half a segm")  # torn
    (shard_dir / "000000000030-000000000040.safetensors").write_bytes(b"")  # after a gap: never committed
    again = restarted(tmp_path)
    assert again.held()[0].length == 10
    assert not list(shard_dir.glob("*.tmp"))


def test_dropped_shards_and_contexts_leave_the_disk(tmp_path):
    st = ShardStore(10**8, files=ShardFiles(tmp_path))
    k, v = kv(10, np.float32)
    for i in (0, 1):
        st.create(ShardWrite("c", i, "float32", 100, np.arange(10)), k, v, context={"version": 1})
    st.create(ShardWrite("e", 0, "float32", 100, np.arange(10)), k, v, context={"version": 1})
    st.drop("c", 0)
    assert sorted((i.context_id, i.index) for i in restarted(tmp_path).held()) == [("c", 1), ("e", 0)]
    st.drop("c")
    assert not (tmp_path / "c").exists()
    assert [(i.context_id, i.index) for i in restarted(tmp_path).held()] == [("e", 0)]


def test_a_shard_over_the_budget_at_restart_stays_on_disk_unloaded(tmp_path):
    st = ShardStore(10**8, files=ShardFiles(tmp_path))
    k, v = kv(1000, np.float32)
    st.create(ShardWrite("c", 0, "float32", 1000, np.arange(1000)), k, v, context={})
    small = ShardStore(1000, files=ShardFiles(tmp_path))
    assert small.restore() == 0 and small.held() == []
    assert (tmp_path / "c" / "0").exists()


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16])
def test_a_shard_without_keys_yet_comes_back_after_a_restart(tmp_path, dtype):
    name = "bfloat16" if dtype == BFLOAT16 else "float32"
    st = ShardStore(10**8, files=ShardFiles(tmp_path))
    k, v = kv(0, dtype)
    st.create(ShardWrite("c", 1, name, 1000, np.arange(0), reserve=300), k, v, context={"version": 1})
    again = restarted(tmp_path)
    [info] = again.held()
    assert (info.context_id, info.index, info.length, info.dtype) == ("c", 1, 0, name)
    assert again.used == st.used  # reserved as before: the planned appends still fit without growing
    more_k, more_v = kv(20, dtype, seed=1)
    again.append(ShardWrite("c", 1, name, 1000, np.arange(20)), more_k, more_v, committed=0)
    got_k, _ = contract_layout(again.view("c", 1, 20))
    assert got_k.tobytes() == more_k.tobytes()


def test_dropping_a_context_removes_its_shards_left_on_disk_unloaded(tmp_path):
    st = ShardStore(10**8, files=ShardFiles(tmp_path))
    k, v = kv(1000, np.float32)
    st.create(ShardWrite("c", 0, "float32", 1000, np.arange(1000)), k, v, context={})
    small = ShardStore(1000, files=ShardFiles(tmp_path))
    assert small.restore() == 0
    small.drop("c")
    assert not (tmp_path / "c").exists()


def test_a_note_that_arrives_after_the_context_was_dropped_brings_nothing_back(tmp_path):
    """A delete dropped the context here before the note of an earlier commit arrived: the
    late note neither keeps the record in memory nor writes it to disk for the next start."""
    st = ShardStore(10**8, files=ShardFiles(tmp_path))
    k, v = kv(50, np.float32)
    st.create(ShardWrite("c", 0, "float32", 100, np.arange(50)), k, v, context={"version": 1, "id": "c"})
    st.drop("c")
    st.note_context("c", {"version": 2, "id": "c"})
    assert st.held() == [] and not (tmp_path / "c").exists()
    st.check_committed("c", 1)  # nothing noted: no version refused
    again = restarted(tmp_path)
    assert again.held() == [] and again.files.load() == ([], {})
