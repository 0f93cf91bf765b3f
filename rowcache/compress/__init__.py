"""Lossless formats that hold expert weights in fewer host bytes, decoded exactly on the way
into the slots (``bf16_planes``)."""

from rowcache.compress.bf16_planes import BLOCK, ESCAPE, Bf16Planes, decode, decode_experts, encode

__all__ = ["BLOCK", "ESCAPE", "Bf16Planes", "decode", "decode_experts", "encode"]
