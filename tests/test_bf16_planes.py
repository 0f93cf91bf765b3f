"""The lossless bf16 planes (``rowcache.compress.bf16_planes``): every bit pattern round-trips,
whatever its class and however its exponents spread, and the encoder refuses no bf16 tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rowcache.compress import BLOCK, Bf16Planes, decode, decode_experts, encode
from rowcache.compress.bf16_planes import CODE_WIDTHS
from rowcache.errors import InvalidInputError


def from_bits(bits: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    """A bf16 tensor of these 16-bit patterns (0 to 65535)."""
    signed = [b - 0x10000 if b >= 0x8000 else b for b in bits]
    return torch.tensor(signed, dtype=torch.int16).view(torch.bfloat16).reshape(shape)


def pattern(sign: int, exponent: int, mantissa: int) -> int:
    return (sign << 15) | (exponent << 7) | mantissa


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def round_trips(x: torch.Tensor) -> Bf16Planes:
    """Encode ``x`` at every code width and at the encoder's choice, check each decodes to
    ``x`` bit for bit (whole and expert by expert), and that the choice is the smaller; return
    the planes of the choice."""
    before = x.clone()
    chosen = encode(x)
    sizes = {}
    for bits in CODE_WIDTHS:
        planes = encode(x, bits)
        assert planes.code_bits == bits
        assert same_bits(decode(planes), x)
        for expert in range(x.shape[0]):
            assert same_bits(decode_experts(planes, [expert])[0], x[expert])
        sizes[bits] = planes.nbytes
    assert same_bits(x, before)  # the encoder reads, it does not write
    assert same_bits(decode(chosen), x)
    assert chosen.nbytes == min(sizes.values())
    assert chosen.code_bits == (3 if sizes[3] < sizes[4] else 4)
    return chosen


# Every class of bit pattern: signed zeros, subnormals (exponent 0), the smallest and largest
# normal exponents, infinities, NaNs with every kind of payload (quiet, signalling, negative).
CLASSES = {
    "zeros": [pattern(0, 0, 0), pattern(1, 0, 0)],
    "subnormals": [pattern(s, 0, m) for s in (0, 1) for m in (1, 2, 0x40, 0x7F)],
    "smallest normal": [pattern(s, 1, m) for s in (0, 1) for m in (0, 0x7F)],
    "largest finite": [pattern(s, 0xFE, m) for s in (0, 1) for m in (0, 0x7F)],
    "infinities": [pattern(0, 0xFF, 0), pattern(1, 0xFF, 0)],
    "nan payloads": [pattern(s, 0xFF, m) for s in (0, 1) for m in (1, 0x3F, 0x40, 0x41, 0x7F)],
}


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_each_pattern_class_round_trips(name: str) -> None:
    bits = CLASSES[name]
    # Alone, and among many ordinary values (so that the class is escaped, not in the codebook).
    round_trips(from_bits(bits, (1, len(bits))))
    ordinary = encode_input(3, 5000, seed=1)
    flat = ordinary.view(torch.int16).flatten().clone()
    positions = torch.arange(len(bits)) * 977 % flat.numel()
    flat[positions] = from_bits(bits, (len(bits),)).view(torch.int16)
    planes = round_trips(flat.view(torch.bfloat16).reshape(3, 5000))
    assert planes.escapes.numel() > 0


def encode_input(experts: int, n: int, seed: int, std: float = 0.02) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(experts, n, generator=gen) * std).to(torch.bfloat16)


def test_every_exponent_at_once_round_trips_and_costs_escapes() -> None:
    """All 65,536 patterns: 249 of the 256 exponents cannot be coded in 3 bits (241 in 4); they
    escape, exactly."""
    x = from_bits(list(range(1 << 16)), (4, 1 << 14))
    planes = round_trips(x)
    assert planes.code_bits == 3 and planes.escapes.numel() == (256 - 7) * 256
    assert encode(x, 4).escapes.numel() == (256 - 15) * 256
    assert planes.ratio > 1.0  # it cannot save here, and says so


def test_gaussian_weights_take_about_seven_tenths() -> None:
    """3 bits a code: about 2% of the values escape (the 7 most common exponents cover the
    rest), 0.70 of the bytes, where 4 bits take 0.75 with under 0.1% escaping."""
    x = encode_input(4, 3 * BLOCK + 5, seed=2)
    planes = round_trips(x)
    assert planes.code_bits == 3 and 0.69 < planes.ratio < 0.71
    values = planes.raw_nbytes // 2
    assert values // 100 < planes.escapes.numel() < values * 3 // 100
    four = encode(x, 4)
    assert 0.75 < four.ratio < 0.76 and four.escapes.numel() < values // 1000


def test_a_wide_spread_of_exponents_takes_four_bits() -> None:
    """Where the exponents spread wider than 7 binades carry, 4 bits store fewer bytes."""
    gen = torch.Generator().manual_seed(6)
    scale = torch.exp2(torch.randint(-6, 7, (2, 5000), generator=gen).float())
    planes = round_trips((torch.randn(2, 5000, generator=gen) * scale).to(torch.bfloat16))
    assert planes.code_bits == 4


@pytest.mark.parametrize("bits", [0, 2, 5, 8])
def test_a_code_width_the_planes_do_not_store_is_refused(bits: int) -> None:
    x = encode_input(1, 8, seed=7)
    with pytest.raises(InvalidInputError, match=f"code_bits {bits} is not a width"):
        encode(x, bits)
    fields = {name: getattr(encode(x), name) for name in Bf16Planes.__dataclass_fields__}
    with pytest.raises(InvalidInputError, match="allowed: 3, 4"):
        Bf16Planes(**{**fields, "code_bits": bits})


@settings(max_examples=200, deadline=None)
@given(
    experts=st.integers(1, 4),
    n=st.integers(1, 2 * BLOCK + 3),
    bits=st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=1000),
)
def test_any_bit_patterns_round_trip(experts: int, n: int, bits: list[int]) -> None:
    """Any patterns, repeated to fill ``experts`` rows of ``n`` values (so that escapes fall
    in several blocks and several experts)."""
    repeated = (bits * (experts * n // len(bits) + 1))[: experts * n]
    round_trips(from_bits(repeated, (experts, n)))


@settings(max_examples=60, deadline=None)
@given(
    experts=st.integers(1, 5),
    n=st.integers(1, 3 * BLOCK),
    spread=st.integers(0, 40),
    seed=st.integers(0, 2**16),
)
def test_weights_with_any_spread_of_exponents_round_trip(
    experts: int, n: int, spread: int, seed: int
) -> None:
    """Values whose exponents spread over ``spread`` binades around a centre: from one exponent
    (all coded) to far more than the codebook holds (many escapes, in many blocks)."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-spread, spread + 1, (experts, n), generator=gen) - 20.0)
    x = (torch.randn(experts, n, generator=gen) * scale).to(torch.bfloat16)
    planes = round_trips(x)
    blocks = -(-n // BLOCK)
    assert planes.escape_starts.shape == (experts, blocks + 1)
    assert int(planes.escape_starts[-1, -1]) == planes.escapes.numel()
    # each expert's escapes follow the last one's, and every block's lie inside its expert's
    for expert in range(1, experts):
        assert int(planes.escape_starts[expert, 0]) == int(planes.escape_starts[expert - 1, -1])
    assert bool((planes.escape_starts.diff(dim=1) >= 0).all())


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (2, 7, 3), (3, BLOCK), (2, BLOCK + 1, 1)])
def test_shapes_with_odd_counts_and_block_edges(shape: tuple[int, ...]) -> None:
    x = encode_input(shape[0], int(torch.tensor(shape[1:]).prod()), seed=3).reshape(shape)
    planes = round_trips(x)
    assert planes.shape == shape and decode(planes).shape == shape


@pytest.mark.parametrize("bits", CODE_WIDTHS)
def test_an_expert_moves_its_three_ranges(bits: int) -> None:
    x = encode_input(3, 2 * BLOCK + 1, seed=4)
    x[1, 7] = float("inf")  # one escape in expert 1
    planes = encode(x, bits)
    n = 2 * BLOCK + 1
    code_bytes = (n + 1) // 2 if bits == 4 else 3 * -(-n // 8)
    escaped = [planes.expert_escapes(e).numel() for e in range(3)]
    assert escaped[1] >= 1
    assert [planes.expert_nbytes(e) for e in range(3)] == [n + code_bytes + k for k in escaped]


@pytest.mark.parametrize(
    ("x", "message"),
    [
        (torch.zeros(2, 3), "bf16 planes hold bfloat16 tensors, got torch.float32"),
        (torch.zeros(0, 3, dtype=torch.bfloat16), r"E >= 1, got shape \(0, 3\)"),
        (torch.tensor(1.0, dtype=torch.bfloat16), r"E >= 1, got shape \(\)"),
    ],
)
def test_what_is_not_a_bf16_expert_tensor_is_refused(x: torch.Tensor, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        encode(x)


def test_an_expert_outside_the_planes_is_refused() -> None:
    planes = encode(encode_input(2, 8, seed=5))
    with pytest.raises(InvalidInputError, match=r"expert 2 is outside \[0, 2\)"):
        decode_experts(planes, [0, 2])


@pytest.mark.parametrize("width", CODE_WIDTHS)
@pytest.mark.parametrize("damage", ["sign", "escape order", "codebook", "code group"])
def test_damaged_planes_are_caught(damage: str, width: int) -> None:
    """The round-trip comparison itself: planes with one kind of damage (a flipped sign bit,
    escapes taken in the wrong order, two codebook entries swapped) do not decode to the
    input, and the bit comparison sees it, NaNs and signed zeros included."""
    bits = [b for name in sorted(CLASSES) for b in CLASSES[name]]
    spread = list(range(0, 1 << 16, 97))  # every exponent: many escapes
    x = from_bits(bits + spread, (1, len(bits) + len(spread)))
    planes = encode(x, width)
    assert planes.escapes.numel() > 100
    changed = {
        "sign": {"sign_mantissa": planes.sign_mantissa ^ torch.tensor(0x80, dtype=torch.uint8)},
        "escape order": {"escapes": planes.escapes.flip(0)},
        "codebook": {"codebook": planes.codebook[[1, 0, *range(2, len(planes.codebook))]]},
        # the first two bytes of the codes plane swapped (one code group read out of order)
        "code group": {"codes": planes.codes[:, [1, 0, *range(2, planes.codes.shape[1])]]},
    }[damage]
    fields = {name: getattr(planes, name) for name in planes.__dataclass_fields__}
    assert not same_bits(decode(Bf16Planes(**{**fields, **changed})), x)
    assert same_bits(decode(planes), x)


@settings(max_examples=40, deadline=None)
@given(
    experts=st.integers(1, 6),
    n=st.integers(1, 2 * BLOCK + 9),
    chunk_values=st.integers(1, 4 * BLOCK),
    width=st.sampled_from([None, *CODE_WIDTHS]),
    seed=st.integers(0, 2**16),
)
def test_the_planes_do_not_depend_on_the_chunks_encode_works_in(
    experts: int, n: int, chunk_values: int, width: int | None, seed: int
) -> None:
    """Encoding a group of experts at a time (to bound the temporaries) gives the planes of
    one pass over the whole tensor, plane by plane, escapes in several chunks included."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-5, 6, (experts, n), generator=gen) - 8.0)
    x = (torch.randn(experts, n, generator=gen) * scale).to(torch.bfloat16)
    whole = encode(x, width, chunk_values=experts * n)
    chunked = encode(x, width, chunk_values=chunk_values, work_device="cpu")
    for name in Bf16Planes.__dataclass_fields__:
        a, b = getattr(whole, name), getattr(chunked, name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, name
    assert same_bits(decode(chunked), x)


def test_a_chunk_size_below_one_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="chunk_values must be >= 1, got 0"):
        encode(encode_input(2, 8, seed=8), chunk_values=0)
