"""Checks of the GPU decode of bf16 planes (``rowcache.compress.triton_decode``) against the
reference decode (``bf16_planes.decode_experts``), runnable on a GPU or, under
``TRITON_INTERPRET=1``, on the CPU:

    TRITON_INTERPRET=1 python tests/decode_kernel_checks.py [--mutant K] [--one-miss]
    python tests/decode_kernel_checks.py --device cuda [--mutant K] [--one-miss]

Each case encodes a tensor of experts (Gaussian weights, every bit pattern, escape-heavy
spreads; value counts at and around the block edges), decodes a miss list into slots that lie
inside a larger buffer, and checks that (1) each listed slot holds exactly its expert's bits,
(2) every other slot, the entries past the miss count included (they name real experts and
slots, as a stale list would), keeps its bytes, and (3) nothing before or after the slots was
written. ``--one-miss`` decodes the first count entries one launch each, the miss given as the
launch's scalars (``SlotDecoder.decode_one``: the host planner's path) instead of one launch over
the list. Prints one line a failed check, then ``ok: N cases`` or ``FAILED: k of N cases``;
exit status 0 only when every case passed. The tests run it with and without seeded bugs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rowcache.compress import BLOCK, decode_experts, encode
from rowcache.compress.triton_decode import SlotDecoder, decode_into_slots

GUARD = 4096  # values of sentinel before and after the slots
SENTINEL = 0x5A5A


@dataclass(frozen=True)
class Case:
    name: str
    weights: torch.Tensor  # bf16 [E, ...]
    capacity: int
    misses: list[tuple[int, int]]  # (expert, slot), the first `count` decoded
    count: int
    grid: int
    code_bits: int | None = None  # None: the encoder's choice


def _bits_tensor(bits: list[int], shape: tuple[int, ...]) -> torch.Tensor:
    signed = [b - 0x10000 if b >= 0x8000 else b for b in bits]
    return torch.tensor(signed, dtype=torch.int16).view(torch.bfloat16).reshape(shape)


def cases() -> Iterator[Case]:
    gen = torch.Generator().manual_seed(0)
    for n in (1, 3, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7):
        experts = 5
        weights = (torch.randn(experts, n, generator=gen) * 0.02).to(torch.bfloat16)
        flat = weights.view(torch.int16).flatten()
        # a few values of every class, so that escapes fall in several blocks and experts
        specials = [0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0xFF81, 0x7F7F]
        positions = torch.arange(len(specials)) * 613 % flat.numel()
        flat[positions] = _bits_tensor(specials, (len(specials),)).view(torch.int16)
        yield Case(f"gaussian n={n}", weights, 3, [(4, 1), (0, 0), (2, 2)], 2, 3)
        yield Case(f"gaussian n={n} all", weights, 3, [(1, 2), (3, 0), (0, 1)], 3, 1)
        if n in (3, BLOCK + 1):  # the width the encoder does not take here, too
            other = 7 - encode(weights).code_bits  # n=3: 3 bits, one partial group
            yield Case(f"gaussian n={n} {other}-bit", weights, 3, [(2, 0), (4, 2)], 2, 2, other)
    every = _bits_tensor(list(range(1 << 16)), (4, 1 << 14))
    yield Case("every pattern", every, 4, [(3, 0), (1, 3), (0, 1), (2, 2)], 4, 7)
    yield Case("every pattern, one miss", every, 4, [(2, 3), (0, 0), (1, 1), (3, 2)], 1, 2)
    yield Case("every pattern, 4-bit", every, 4, [(1, 0), (3, 2), (0, 3)], 3, 5, 4)
    scale = torch.exp2(torch.randint(-30, 31, (3, 2 * BLOCK + 5), generator=gen) - 10.0)
    spread = (torch.randn(3, 2 * BLOCK + 5, generator=gen) * scale).to(torch.bfloat16)
    yield Case("wide spread", spread, 2, [(2, 1), (1, 0)], 2, 4)
    yield Case("no miss", spread, 2, [(2, 1), (1, 0)], 0, 4)
    yield Case("3-d experts", spread[:, : 5 * 7].reshape(3, 5, 7).contiguous(), 2, [(0, 1)], 1, 2)


def run_case(
    case: Case, device: torch.device, mutant: int, pinned: bool = False, one_miss: bool = False
) -> list[str]:
    """What went wrong in this case (nothing: an empty list). ``pinned``: the planes stay in
    pinned host memory and the kernel reads them through unified addressing (the codebook,
    16 bytes, on the device). ``one_miss``: one launch a miss, the miss as its scalars."""
    planes = encode(case.weights, case.code_bits)

    def placed(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if pinned else t.to(device)

    planes = replace(planes.map(placed), codebook=planes.codebook.to(device))
    n = planes.values_per_expert
    buffer = torch.full((GUARD + case.capacity * n + GUARD,), SENTINEL, dtype=torch.int16)
    buffer = buffer.to(device)
    slots = buffer[GUARD : GUARD + case.capacity * n].view(torch.bfloat16)
    slots = slots.view(case.capacity, *case.weights.shape[1:])
    experts = torch.tensor([e for e, _ in case.misses], dtype=torch.int32, device=device)
    slot_ids = torch.tensor([s for _, s in case.misses], dtype=torch.int32, device=device)
    count = torch.tensor(case.count, dtype=torch.int32, device=device)
    if one_miss:
        decoder = SlotDecoder(planes, slots, grid=case.grid, mutant=mutant)
        for expert, slot in case.misses[: case.count]:
            decoder.decode_one(expert, slot)
    else:
        decode_into_slots(planes, slots, experts, slot_ids, count, grid=case.grid, mutant=mutant)
    found: list[str] = []
    decoded = slots.view(torch.int16).reshape(case.capacity, n).cpu()
    reference = decode_experts(encode(case.weights, case.code_bits), [e for e, _ in case.misses])
    expected = torch.full((case.capacity, n), SENTINEL, dtype=torch.int16)
    for index, (_, slot) in enumerate(case.misses[: case.count]):
        expected[slot] = reference[index].view(torch.int16).reshape(n)
    for slot in range(case.capacity):
        wrong = int((decoded[slot] != expected[slot]).sum())
        if wrong:
            listed = [i for i, (_, s) in enumerate(case.misses) if s == slot]
            found.append(f"{case.name}: slot {slot} (miss entry {listed}): {wrong} values wrong")
    outside = torch.cat([buffer[:GUARD], buffer[GUARD + case.capacity * n :]]).cpu()
    if bool((outside != SENTINEL).any()):
        found.append(f"{case.name}: {int((outside != SENTINEL).sum())} values written outside")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mutant", type=int, default=0)
    parser.add_argument("--one-miss", action="store_true", help="one launch a miss (scalars)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    total, failed = 0, 0
    for case in cases():
        total += 1
        problems = run_case(case, device, args.mutant, one_miss=args.one_miss)
        failed += bool(problems)
        for problem in problems:
            print(problem)
    print(f"ok: {total} cases" if not failed else f"FAILED: {failed} of {total} cases")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
