"""benchmarks/common.py: the machine line every report starts with."""

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
