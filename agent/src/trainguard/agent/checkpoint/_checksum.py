"""Parameter checksums that replicas can compare, and the bit flip that should break them.

Imports torch; the agent loads this module only once a model is watched.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

__all__ = ["flip_bit", "parameter_checksum"]

_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Element size (bytes) -> the signed integer dtype of that size."""


def _bits(tensor: torch.Tensor, *, summable: bool = False) -> torch.Tensor:
    """``tensor``'s elements reinterpreted as signed integers of their size (a view when it is
    contiguous); ``summable`` reads 8-byte elements as two int32 each, so that an int64 sum of
    up to 2**32 of them cannot overflow."""
    size = tensor.element_size()
    dtype = torch.int32 if summable and size == 8 else _SIGNED[size]
    return tensor.detach().reshape(-1).view(dtype)


def parameter_checksum(module: nn.Module) -> str:
    """A cheap deterministic checksum of ``module``'s parameters: 16 hex digits.

    Each parameter's bits are read as integers (int32 for 4- and 8-byte floats, int16 for
    2-byte ones) and summed exactly in int64, on the parameter's device; the sums of all
    parameters are copied to the host at once and hashed (BLAKE2b, 8 bytes) together with the
    parameters' names, dtypes and shapes. Integer addition does not depend on the order of
    summation, so bitwise-equal replicas get equal checksums whatever their thread count or
    kernel. Any single flipped bit changes its element's integer by a power of two, and so the
    sum: it is always detected; several corruptions that cancel in the sum, or elements that
    swap places, are not.

    Cost: one read of every parameter (memory bandwidth: about 8 ms per 16 GB on a GPU with
    2 TB/s) and one device-to-host copy of 8 bytes per parameter tensor.
    """
    named = [(name, p) for name, p in module.named_parameters() if p.numel()]
    if not named:
        return hashlib.blake2b(b"", digest_size=8).hexdigest()
    sums = torch.stack([_bits(p, summable=True).sum(dtype=torch.int64).to("cpu") for _, p in named])
    digest = hashlib.blake2b(digest_size=8)
    for (name, p), total in zip(named, sums.tolist(), strict=True):
        digest.update(f"{name}:{p.dtype}:{tuple(p.shape)}:".encode())
        digest.update(int(total).to_bytes(8, "little", signed=True))
    return digest.hexdigest()


def flip_bit(module: nn.Module, bit: int | None = None) -> str:
    """Flip one bit of the first element of ``module``'s first floating-point parameter, in
    place (silent data corruption of this replica); return what was done, in words.

    Args:
        module: the model.
        bit: the bit to flip, 0 = least significant; ``None``: the highest mantissa bit of the
            parameter's dtype (bit 22 of a float32), which moves the value by half its power of
            two, a factor between 2/3 and 3/2 (never an infinity or a NaN).

    Raises:
        ValueError: ``module`` has no floating-point parameter, or ``bit`` is beyond the
            element's width.
    """
    found = next(
        ((n, p) for n, p in module.named_parameters() if p.is_floating_point() and p.numel()),
        None,
    )
    if found is None:
        raise ValueError("the model has no floating-point parameter to flip a bit in")
    name, param = found
    width = param.element_size() * 8
    if bit is None:
        bit = round(-math.log2(torch.finfo(param.dtype).eps)) - 1
    if not 0 <= bit < width:
        raise ValueError(f"bit {bit} is beyond the {width}-bit elements of {name}")
    with torch.no_grad():
        ints = _bits(param)
        before = param.detach().reshape(-1)[0].item()
        # The sign bit of a signed integer dtype is its lowest value.
        ints[0] ^= -(1 << bit) if bit == width - 1 else 1 << bit
        after = param.detach().reshape(-1)[0].item()
    return f"{name}[0] bit {bit}: {before!r} -> {after!r}"
