"""Paged resident shards (workers.layout, "Pages"): memory is held page by page as keys are written, counted
exactly, and never moved by an append."""

import ctypes
import mmap
import sys

import numpy as np
import pytest
from reference import assert_close_to_reference, contract_layout

from merge import finalize
from workers import BFLOAT16, ShardKV, StreamingKV, partial_attention_resident
from workers.layout import bytes_per_key, held_bytes, padded_capacity, page_keys
from workers.options import AttentionOptions, KernelOptions
from workers.store import CapacityError, ShardStore
from workers.tasks import ShardWrite

GEOMETRIES = [(8, 128, 128, np.float32), (2, 8, 4, np.float32), (8, 128, 128, np.float16), (3, 20, 7, np.float64),
              (1, 64, 32, BFLOAT16)]


def resident_bytes(a: np.ndarray) -> int:
    """Bytes of ``a``'s mapping the kernel holds in memory now (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    base = a.base
    while not isinstance(base, mmap.mmap):
        base = base.base if hasattr(base, "base") else base.obj  # array -> its mapping
    start = ctypes.addressof(ctypes.c_char.from_buffer(base))
    pages = -(-len(base) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(start, len(base), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are reserved on Linux only")


@linux
@pytest.mark.parametrize("h_kv,d,d_v,dtype", GEOMETRIES)
def test_a_paged_shard_holds_what_the_kernel_holds_and_at_most_one_page_beyond_its_data(rng, h_kv, d, d_v, dtype):
    kv = StreamingKV(h_kv, d, d_v, dtype, max_capacity=50_000)
    n = 0
    item = np.dtype(dtype).itemsize
    page = page_keys(item) * bytes_per_key(h_kv, d, d_v, dtype)
    for step in (1, 1, 7, 1000, 1, 2047, 3000, 1, 5):
        k = rng.standard_normal((step, h_kv, d)).astype(dtype)
        v = rng.standard_normal((step, h_kv, d_v)).astype(dtype)
        kv.append(k, v, np.arange(n, n + step))
        n += step
        held = kv.nbytes
        assert held == sum(resident_bytes(a) for a in (kv._kt, kv._v, kv._pos)), "the count must be what is held"
        data = n * bytes_per_key(h_kv, d, d_v, dtype)
        assert data <= held <= data + page, (n, held, data, page)


@linux
def test_appends_to_a_paged_shard_never_move_its_keys(rng):
    kv = StreamingKV(2, 16, 8, np.float32, max_capacity=20_000)
    k = rng.standard_normal((20_000, 2, 16)).astype(np.float32)
    v = rng.standard_normal((20_000, 2, 8)).astype(np.float32)
    kv.append(k[:1], v[:1], np.arange(1))
    first = kv.snapshot().kt.base
    for lo in range(1, 20_000, 997):
        hi = min(lo + 997, 20_000)
        kv.append(k[lo:hi], v[lo:hi], np.arange(lo, hi))
    assert kv.snapshot().kt.base is first and kv.paged
    got_k, got_v = contract_layout(kv.snapshot())
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)


def test_a_shard_grown_past_its_reservation_is_allocated_and_still_exact(rng):
    k = rng.standard_normal((600, 2, 8)).astype(np.float32)
    kv = StreamingKV(2, 8, 8, np.float32, max_capacity=10)
    kv.append(k[:300], k[:300], np.arange(300))
    kv.append(k[300:], k[300:], np.arange(300, 600))  # past the 272 keys reserved: copied into arrays that fit
    assert not kv.paged and kv.nbytes == kv.capacity * bytes_per_key(2, 8, 8, np.float32)
    np.testing.assert_array_equal(contract_layout(kv.snapshot())[0], k)


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16])
def test_attention_over_a_shard_grown_key_by_key_matches_the_reference(rng, dtype):
    n = 300
    k = rng.standard_normal((n, 2, 16)).astype(dtype)
    v = rng.standard_normal((n, 2, 16)).astype(dtype)
    q = rng.standard_normal((1, 4, 16)).astype(np.float32)
    kv = StreamingKV(2, 16, 16, dtype, max_capacity=4096)
    for i in range(n):
        kv.append(k[i:i + 1], v[i:i + 1], np.arange(i, i + 1))
    st = partial_attention_resident(q, kv.snapshot(), q_pos=[n - 1], options=AttentionOptions(causal=True),
                                    kernel=KernelOptions())
    out, lse = finalize(st)
    assert_close_to_reference(out, lse, q, k, v, causal=True)


def test_the_page_is_8_kib_of_every_row():
    assert [page_keys(i) for i in (8, 4, 2)] == [1024, 2048, 4096]
    assert held_bytes(8, 128, 128, np.float32, padded_capacity(10**5, 4), 0) == 0


def test_an_append_that_needs_a_page_past_the_budget_fails_naming_bytes_needed_and_free_and_writes_nothing(rng):
    k = rng.standard_normal((5000, 2, 8)).astype(np.float32)
    st = ShardStore(budget_bytes=10**9)
    st.create(ShardWrite("c", 0, "float32", 10**5, np.arange(2000)), k[:2000], k[:2000], context={})
    body = st._get("c", 0).body.capacity  # keys the created shard's arrays hold (rows padded)
    st.budget = st.used  # what the body holds, and not a byte more
    st.append(ShardWrite("c", 0, "float32", 10**5, np.arange(2000, body)), k[2000:body], k[2000:body],
              committed=2000)  # the body's padding takes keys without a new byte
    used = st.used
    with pytest.raises(CapacityError, match=r"needs \d+ bytes, but this worker holds \d+ of its \d+-byte budget "
                                            r"\(0 free\)"):
        st.append(ShardWrite("c", 0, "float32", 10**5, np.arange(body, body + 1)), k[body:body + 1],
                  k[body:body + 1], committed=body)
    assert st.used == used and st.info("c", 0).length == body
    st.budget = 10**9
    st.append(ShardWrite("c", 0, "float32", 10**5, np.arange(body, body + 1)), k[body:body + 1], k[body:body + 1],
              committed=body)
    assert st.info("c", 0).length == body + 1 and st.used > used
    assert st.drop("c") == 1 and st.used == 0


@linux
@pytest.mark.parametrize("h_kv,d,d_v,dtype", GEOMETRIES)
def test_an_undone_append_gives_back_the_pages_it_took(rng, h_kv, d, d_v, dtype):
    kv = StreamingKV(h_kv, d, d_v, dtype, max_capacity=50_000)
    k = rng.standard_normal((9000, h_kv, d)).astype(dtype)
    v = rng.standard_normal((9000, h_kv, d_v)).astype(dtype)
    kv.append(k[:1000], v[:1000], np.arange(1000))
    before = kv.nbytes
    kv.append(k[1000:9000], v[1000:9000], np.arange(1000, 9000))  # never committed
    kv.truncate(1000)
    assert kv.nbytes == before == sum(resident_bytes(a) for a in (kv._kt, kv._v, kv._pos))
    kv.append(k[1000:1001], v[1000:1001], np.arange(1000, 1001))  # the next append writes over the tail
    got_k, got_v = contract_layout(kv.snapshot())
    np.testing.assert_array_equal(got_k, k[:1001])
    np.testing.assert_array_equal(got_v, v[:1001])


def test_a_reserved_shard_keeps_its_reservation_through_an_undone_append(rng):
    kv = StreamingKV(2, 8, 8, np.float32, capacity=5000, max_capacity=50_000)
    k = rng.standard_normal((6000, 2, 8)).astype(np.float32)
    kv.append(k[:10], k[:10], np.arange(10))
    reserved = kv.nbytes
    kv.append(k[10:6000], k[10:6000], np.arange(10, 6000))
    kv.truncate(10)
    assert kv.nbytes == reserved


def test_the_count_of_pages_by_offsets_is_the_count_row_by_row(rng):
    from workers.layout import _spanned_rows, spanned

    for _ in range(2000):
        rows = int(rng.integers(1, 300))
        row_bytes = int(rng.integers(1, 5)) * 4096 + int(rng.integers(0, 64)) * 64
        used = int(rng.integers(1, row_bytes + 1))
        assert spanned(rows, row_bytes, used) == _spanned_rows(rows, row_bytes, used), (rows, row_bytes, used)


@linux
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_shard_holds_its_created_keys_tightly_and_what_appends_add_at_most_a_page_beyond_them(rng, dtype):
    st = ShardStore(budget_bytes=10**10)
    n = 2048  # a short context's shard: 4 KiB rows in float16, where a tail's straddled pages would cost most
    k = rng.standard_normal((n + 5000, 8, 64)).astype(dtype)
    st.create(ShardWrite("c", 0, np.dtype(dtype).name, 10**6, np.arange(n)), k[:n], k[:n], context={})
    per_key = bytes_per_key(8, 64, 64, dtype)
    created = st.used
    assert created == padded_capacity(n, np.dtype(dtype).itemsize) * per_key  # rows padded, nothing more
    length = n
    for step in (1, 1, 30, 1000, 1, 3967):
        st.append(ShardWrite("c", 0, np.dtype(dtype).name, 10**6, np.arange(length, length + step)),
                  k[length:length + step], k[length:length + step], committed=length)
        length += step
        kv = st._get("c", 0)
        appended = (length - kv.body.capacity) * per_key if kv.tail is not None else 0
        page = page_keys(np.dtype(dtype).itemsize) * per_key
        assert st.used - created <= appended + page and st.used == kv.nbytes
    got_k, _ = contract_layout(st.view("c", 0, length))
    np.testing.assert_array_equal(got_k, k[:length])


@pytest.mark.parametrize("dtype", [np.float32, BFLOAT16, np.float16])
@pytest.mark.parametrize("kernel", [KernelOptions(), KernelOptions(cpu_kernels="fused", threads=2)])
def test_attention_over_a_shards_body_and_tail_matches_the_reference(rng, dtype, kernel):
    n = 700
    k = rng.standard_normal((n, 2, 16)).astype(dtype)
    v = rng.standard_normal((n, 2, 8)).astype(dtype)
    q = rng.standard_normal((2, 4, 16)).astype(dtype)
    kv = ShardKV(2, 16, 8, dtype, capacity=300, reach=10_000)
    kv.append(k[:250], v[:250], np.arange(250))
    for lo in range(250, n, 97):  # past the body's padded capacity into the tail
        kv.append(k[lo:lo + 97], v[lo:lo + 97], np.arange(lo, min(lo + 97, n)))
    view = kv.snapshot(n)
    assert len(view.parts) == 2 and view.n_k == n
    q_pos = np.array([400, 699])
    st = partial_attention_resident(q, view, q_pos=q_pos, options=AttentionOptions(causal=True, window=(300, 0)),
                                    kernel=kernel)
    out, lse = finalize(st)
    assert_close_to_reference(out, lse, q, k, v, causal=True, window=(300, 0), q_pos=q_pos)
    short = kv.snapshot(100)  # a committed prefix inside the body: the body's part alone
    assert [p.n_k for p in short.parts] == [100]
