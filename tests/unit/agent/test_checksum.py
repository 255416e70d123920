"""Parameter checksums: equal for bitwise-equal replicas whatever the thread count, changed by
any single flipped bit, in the wire contract's format; and the bit flip of the ``bitflip``
fault."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.agent.checkpoint._checksum import flip_bit, parameter_checksum

HEX = re.compile(r"^[0-9a-f]{16}$")


class Three(torch.nn.Module):
    """Parameters of three float widths, one of them not contiguous."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(5, 3)
        self.b = torch.nn.Parameter(torch.randn(4, 6, dtype=torch.float64).t())
        self.c = torch.nn.Parameter(torch.randn(7).to(torch.bfloat16))


def model() -> Three:
    return Three()


def test_replicas_agree_whatever_the_thread_count():
    first, replica = model(), copy.deepcopy(model())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = parameter_checksum(first)
        torch.set_num_threads(2)
        two = parameter_checksum(replica)
    finally:
        torch.set_num_threads(threads)
    assert one == two
    assert HEX.match(one)


def test_names_shapes_and_dtypes_count():
    base = parameter_checksum(model())
    assert parameter_checksum(torch.nn.ModuleDict({"z": model().a})) != parameter_checksum(
        torch.nn.ModuleDict({"a": model().a})
    )
    wider = model()
    wider.c = torch.nn.Parameter(wider.c.detach().to(torch.float16))  # same bits count, new dtype
    assert parameter_checksum(wider) != base
    assert HEX.match(parameter_checksum(torch.nn.Module()))  # no parameters: still a checksum


@settings(max_examples=200, deadline=None)
@given(
    which=st.sampled_from(["a.weight", "a.bias", "b", "c"]),
    index=st.integers(min_value=0, max_value=10_000),
    bit=st.integers(min_value=0, max_value=63),
)
def test_any_single_flipped_bit_changes_the_checksum(which: str, index: int, bit: int):
    m = model()
    before = parameter_checksum(m)
    param = dict(m.named_parameters())[which]
    flat = param.detach().reshape(-1)
    width = param.element_size() * 8
    element, bit = index % flat.numel(), bit % width
    ints = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[param.element_size()])
    ints[element] ^= -(1 << bit) if bit == width - 1 else 1 << bit
    if not param.is_contiguous():  # reshape copied it: write the flipped copy back
        with torch.no_grad():
            param.copy_(flat.reshape(param.shape))
    assert parameter_checksum(m) != before


def test_flip_bit_flips_the_highest_mantissa_bit_of_the_first_float_parameter():
    torch.manual_seed(0)
    linear = torch.nn.Linear(5, 3)
    m = torch.nn.Sequential(linear)

    def value() -> float:
        return float(linear.weight.detach().reshape(-1)[0].item())

    first = value()
    detail = flip_bit(m)
    after = value()
    assert detail.startswith("0.weight[0] bit 22: ")
    assert 2 / 3 <= after / first <= 3 / 2
    assert after != first
    flip_bit(m, 22)  # the same bit again: back where it was
    assert value() == first
    flip_bit(m, 31)  # the sign bit
    assert value() == -first
    assert flip_bit(model()).startswith("b[0] bit 51: ")  # float64: its own mantissa


def test_flip_bit_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="no floating-point parameter"):
        flip_bit(torch.nn.Module())
    with pytest.raises(ValueError, match=r"bit 32 is beyond the 32-bit elements of 0\.weight"):
        flip_bit(torch.nn.Sequential(torch.nn.Linear(2, 2)), 32)
