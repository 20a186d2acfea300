"""Copies into the resident layout: the bits given, by the compiled loop and by the NumPy fallback."""

import platform
import sys

import numpy as np
import pytest

from workers import BFLOAT16, copies
from workers.copies import as_bits, copy_keys_dmajor, copy_values

DTYPES = [np.float16, BFLOAT16, np.float32, np.float64]
LINUX_5_14 = sys.platform.startswith("linux") and tuple(
    int(x) for x in platform.release().split("-")[0].split(".")[:2]) >= (5, 14)


@pytest.fixture(params=["compiled", "numpy"])
def path(request, monkeypatch):
    if request.param == "numpy":
        monkeypatch.setattr(copies, "compiled_transpose", lambda: None)
    elif copies.compiled_transpose() is None:
        pytest.skip("numba is not installed")
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 127, 129, 700])
@pytest.mark.parametrize("d", [5, copies.TILE_DIMS, copies.TILE_DIMS * 2 + 3])  # tiles whole, none, and a tail
def test_keys_land_d_major_bit_for_bit_in_a_strided_destination(rng, path, dtype, n, d):
    k = rng.standard_normal((n, 3, d)).astype(dtype)
    k[: n // 3] = np.array(np.nan, dtype=dtype)  # NaNs keep their bits: nothing is computed
    kt = np.zeros((3, d, n + 40), dtype=dtype)  # a capacity past n: rows are strided
    copy_keys_dmajor(kt[:, :, 10:10 + n], k)
    assert as_bits(kt[:, :, 10:10 + n]).tobytes() == as_bits(k.transpose(1, 2, 0).copy()).tobytes()
    assert not as_bits(kt[:, :, :10]).any() and not as_bits(kt[:, :, 10 + n:]).any()  # nothing else written


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_read_only_and_writable_keys_run_one_compiled_transpose(rng, dtype):
    # A request's keys arrive read-only, a shard's and warm()'s writable: one compiled loop for both, so
    # that the first upload of each dtype does not compile one of its own (workers.fused.warm fills it).
    loop = copies.compiled_transpose()
    if loop is None:
        pytest.skip("numba is not installed")
    k = rng.standard_normal((20, 2, 8)).astype(dtype)
    kt = np.zeros((2, 8, 20), dtype=dtype)
    copy_keys_dmajor(kt, k)
    compiled = len(loop.signatures)
    k.flags.writeable = False
    copy_keys_dmajor(kt, k)
    assert len(loop.signatures) == compiled
    assert as_bits(kt).tobytes() == as_bits(k.transpose(1, 2, 0).copy()).tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_values_land_heads_first_bit_for_bit(rng, dtype):
    v = rng.standard_normal((300, 4, 6)).astype(dtype)
    vv = np.zeros((4, 320, 6), dtype=dtype)
    copy_values(vv[:, 7:307], v)
    assert as_bits(vv[:, 7:307]).tobytes() == as_bits(v.transpose(1, 0, 2).copy()).tobytes()


def test_prefault_keeps_what_the_memory_holds_while_another_thread_writes(rng):
    import threading

    a = np.empty(8 * 2**20 + 123, dtype=np.uint8)
    a[:4096] = 7
    writer = threading.Thread(target=lambda: a.__setitem__(slice(4096, None), 9))
    writer.start()
    done = copies.prefault(a)
    writer.join()
    assert done == LINUX_5_14  # MADV_POPULATE_WRITE is there since Linux 5.14
    assert (a[:4096] == 7).all() and (a[4096:] == 9).all()


def test_prefault_of_nothing_does_nothing():
    assert copies.prefault(np.empty(0, dtype=np.float32)) is False
