"""Byte counts: ``parse_bytes`` and ``format_bytes``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autobatch._units import format_bytes, parse_bytes
from autobatch.testing import SimulatedGPU


def test_units_and_decimals_are_exact() -> None:
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("1.5e9") == 1_500_000_000
    assert parse_bytes("0.1GiB") == 2**30 // 10  # no float product rounding down a byte
    assert parse_bytes(4096.0) == 4096
    assert format_bytes(parse_bytes("3GiB")) == "3.00 GiB"


@given(st.integers(min_value=1, max_value=2**64))
def test_integers_of_any_size_keep_every_byte(n: int) -> None:
    assert parse_bytes(n) == n
    assert parse_bytes(str(n)) == n


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), "1e999", "1e-999", "nan", "inf", 2**80, "1e30TiB"]
)
def test_not_a_size_is_a_value_error_naming_the_parameter(value: object) -> None:
    with pytest.raises(ValueError, match="used_elsewhere") as caught:
        parse_bytes(value, name="used_elsewhere")  # type: ignore[arg-type]
    assert not isinstance(caught.value, OverflowError)


@pytest.mark.parametrize("value", [float("nan"), "1e999", float("inf")])
def test_simulated_gpu_refuses_a_size_that_is_no_size(value: object) -> None:
    with pytest.raises(ValueError, match="capacity"):
        SimulatedGPU(value)  # type: ignore[arg-type]


def test_simulated_gpu_keeps_a_capacity_above_2_to_the_53() -> None:
    assert SimulatedGPU(2**53 + 1).capacity_bytes == 2**53 + 1


@pytest.mark.parametrize("value", [True, None, [1]])
def test_not_a_number_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError, match="capacity"):
        parse_bytes(value)  # type: ignore[arg-type]
