"""``zip_crc_off``: torch's zip CRC32 off while trainguard digests a write, and back after."""

from __future__ import annotations

import io
import threading

import pytest
import torch
from torch.serialization import get_crc32_options, set_crc32_options

from trainguard.agent.checkpoint._zip_crc import zip_crc_off


def test_torch_load_does_not_check_the_crc_so_it_protects_nothing() -> None:
    """The premise of skipping it: a flipped byte in a tensor's record loads silently even
    with the CRC written (if torch starts checking, this fails and the choice is revisited)."""
    assert get_crc32_options()
    buffer = io.BytesIO()
    torch.save(torch.zeros(1000), buffer)
    data = bytearray(buffer.getvalue())
    data[data.find(bytes(64)) + 200] ^= 1
    loaded = torch.load(io.BytesIO(bytes(data)))
    assert not torch.equal(loaded, torch.zeros(1000))


def test_off_within_the_block_and_back_after() -> None:
    with zip_crc_off():
        assert not get_crc32_options()
        with zip_crc_off():
            assert not get_crc32_options()
        assert not get_crc32_options()
    assert get_crc32_options()


def test_back_after_a_block_that_raised() -> None:
    with pytest.raises(RuntimeError), zip_crc_off():
        raise RuntimeError("the write failed")
    assert get_crc32_options()


def test_a_users_own_choice_is_given_back() -> None:
    set_crc32_options(False)
    try:
        with zip_crc_off():
            pass
        assert not get_crc32_options()
    finally:
        set_crc32_options(True)


def test_other_threads_are_untouched() -> None:
    """Torch's config settings are thread-local: the training thread's own ``torch.save``
    beside a digested write keeps its CRC."""
    seen: list[bool] = []
    with zip_crc_off():
        other = threading.Thread(target=lambda: seen.append(get_crc32_options()))
        other.start()
        other.join(10)
    assert seen == [True]
