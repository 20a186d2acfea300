"""What travels to a worker: bfloat16 arrays travel as their bits, out of band."""

import pickle

import numpy as np
import pytest

from workers import BFLOAT16
from workers.tasks import Carried, arrive, carry


def out_of_band(x):
    buffers = []
    head = pickle.dumps(x, protocol=5, buffer_callback=buffers.append)
    return head, buffers


def test_numpy_pickles_bfloat16_in_band_which_is_why_it_is_carried_as_bits():
    a = np.ones((1000, 8), dtype=BFLOAT16)
    head, buffers = out_of_band(a)
    assert not buffers and len(head) > a.nbytes  # the bytes are copied into the pickle itself
    head, buffers = out_of_band(carry(a))
    assert len(buffers) == 1 and len(head) < 1000  # one out-of-band buffer: Ray's store takes it as is


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32, np.float64], ids=lambda t: np.dtype(t).name)
def test_an_array_arrives_as_the_same_bits_and_dtype(rng, dtype):
    a = rng.standard_normal((7, 3, 5)).astype(dtype)
    sent = carry(a)
    assert isinstance(sent, Carried) == (np.dtype(dtype) == BFLOAT16)
    head, buffers = out_of_band(sent)
    got = arrive(pickle.loads(head, buffers=buffers))
    assert got.dtype == a.dtype and got.shape == a.shape and got.tobytes() == a.tobytes()
