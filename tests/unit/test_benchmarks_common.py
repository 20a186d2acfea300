"""benchmarks/common.py: the machine line every report starts with, and BLAS thread limits that hold."""

import sys

import pytest
from benchloader import benchmark_module


@pytest.fixture(scope="module")
def common():
    with benchmark_module("common.py") as module:
        yield module

ZEN1 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx fma f16c avx2 sha_ni

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: something else
flags\t\t: avx512f
"""


def test_describe_cpu_names_family_model_and_vector_flags_of_the_first_processor(common):
    assert common.describe_cpu(ZEN1) == "AMD EPYC (family 23, model 1; avx2 fma f16c)"


def test_describe_cpu_without_family_or_flags_is_the_model_name_alone(common):
    assert common.describe_cpu("model name\t: Neoverse\n") == "Neoverse"


def test_describe_cpu_of_an_empty_text_says_unknown(common):
    assert common.describe_cpu("") == "unknown"


def test_blas_threads_limits_blas_inside_and_restores_it_after(common):
    from threadpoolctl import threadpool_info

    def blas() -> list[int]:
        return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]

    before = blas()
    with common.blas_threads(1):
        assert blas() and all(n == 1 for n in blas())
    assert blas() == before


def test_blas_threads_refuses_without_threadpoolctl(common, monkeypatch):
    # A benchmark must not report "one BLAS thread" while BLAS runs on every core.
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # import raises ImportError
    with pytest.raises(RuntimeError, match=r"threadpoolctl.*pip install -e '\.\[bench\]'"):
        common.blas_threads(1)
