"""Breadth-first search of any `FactoredModel`, with both halves of every transition memoized.

It explores exactly the states and transitions `bfs.bfs` explores on the same model, in the
same order, with the same canonical form, and reports the same counts, tags and verdict; it
only avoids recomputing what a transition depends on. A state is a host part and a device
part (`FactoredModel.split`), and every transition is a host half, a function of the host part
and the action, composed with a device half, a function of the device part and the program
the host half hands over. Host parts, device parts and programs are interned to small
integers, and memoized per interned key:

- the host halves of every action from a host part, and the canonical form of a host part;
- the device halves of a program on a device part, and the renaming of a device part;
- the composition of a program and its follow-up program (`HostHalf.then`) on a device part;
- for states at the depth bound, whose successors are not stored, only the number of
  transitions, whether some verdict failed and the tags, packed into one int.

Verdicts are not reported from here: as soon as any transition of a state may fail a verdict,
the state is expanded again through `Model.outcomes` and handled exactly as `bfs.bfs` handles
it, so the verdict, its message and where the search stops are those of the plain search. The
memoized halves therefore only have to be exact about "no violation", successor states,
transition counts and reachability tags; the tests compare the two searches (counts, tags,
verdicts, traces) on the real table and on every mutant, and at the production bounds in a
slow test (spec/README.md says which).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any, Generic, NamedTuple, TypeVar

from model_check.search.bfs import straighten
from model_check.search.model import FactoredModel, Result, without_cycle_collection
from model_check.streams.interpreter import Action
from model_check.table.properties import Violation

H = TypeVar("H", bound=Hashable)
D = TypeVar("D", bound=Hashable)
P = TypeVar("P", bound=Hashable)

NO_PROGRAM = -1
# Keys of the memo tables pack interned ids: programs take 20 bits, device parts 32 bits in a
# state key (host id above them) and the rest of a memo key.
PROGRAM_BITS = 20
STATE_SHIFT = 32
DEVICE = (1 << STATE_SHIFT) - 1
# At the depth bound, per action: the transition count in the low 32 bits, then FAILED, then
# one bit per reachability tag (`Memo.tag_mask`).
COUNT = (1 << 32) - 1
FAILED = 1 << 32
TAG_SHIFT = 33


class Step(NamedTuple):
    """A host half on interned ids."""

    program: int  # NO_PROGRAM: rejected, no device work
    host: int
    violated: bool
    tags: frozenset[str]
    then: Action | None


class Item(NamedTuple):
    """Per action of a state: the device work and the canonical host part it ends in."""

    program: int
    then: int  # the follow-up's program, or NO_PROGRAM
    canon: int  # canonical host part
    swapped: int  # its renamed twin
    cmp: int  # order of the two host parts: -1, 0 or 1 (-1: the canonical one is smaller)


class HostInfo(NamedTuple):
    """Everything a state's expansion needs from its host part."""

    violated: bool  # some host half may fail a verdict
    tags: frozenset[str]  # of every host half
    items: tuple[Item, ...]


class Frontier(NamedTuple):
    """`HostInfo` for a state at the depth bound."""

    violated: bool
    tags: int  # tag mask
    rejected: int  # rejected calls: one transition each, no device work
    codes: tuple[int, ...]  # per accepted call: program << PROGRAM_BITS | then + 1


class Branch(NamedTuple):
    """A device half on interned ids."""

    device: int
    violated: bool
    tags: frozenset[str]


class Chain(NamedTuple):
    """A program and its follow-up on a device part: the device parts reached, in transition
    order, whether some verdict failed, the union of the device tags."""

    reached: tuple[int, ...]
    violated: bool
    tags: frozenset[str]


class Memo(Generic[H, D, P]):
    """Interned parts and programs, and the memoized halves of every transition."""

    def __init__(self, model: FactoredModel[Any, H, D, P]) -> None:
        self.model = model
        self.actions = tuple(model.host_actions())
        self.symmetric = model.symmetric
        self.hparts: list[H] = []
        self.hpart_id: dict[H, int] = {}
        self.dparts: list[D] = []
        self.dpart_id: dict[D, int] = {}
        self.programs: list[P] = []
        self.program_id: dict[P, int] = {}
        self.steps: dict[int, list[Step]] = {}
        self.follow: dict[tuple[int, Action], Step] = {}
        self.device: dict[int, tuple[Branch, ...]] = {}
        self.canon_h: dict[int, tuple[int, int, int]] = {}
        self.canon_d: dict[int, tuple[int, int]] = {}
        self.infos: dict[int, HostInfo] = {}
        self.frontiers: dict[int, Frontier] = {}
        self.chains: dict[int, Chain] = {}
        self.light: dict[int, int] = {}
        self.light_follow: dict[int, int] = {}
        self.tag_names: list[str] = []
        self.tag_index: dict[str, int] = {}
        self.tag_masks: dict[frozenset[str], int] = {}

    # ------------------------------------------------------------ interning

    def hid(self, part: H) -> int:
        found = self.hpart_id.get(part)
        if found is None:
            found = len(self.hparts)
            self.hparts.append(part)
            self.hpart_id[part] = found
        return found

    def did(self, part: D) -> int:
        found = self.dpart_id.get(part)
        if found is None:
            found = len(self.dparts)
            assert found < 1 << STATE_SHIFT, "state keys hold 32 bits of device part id"
            self.dparts.append(part)
            self.dpart_id[part] = found
        return found

    def prog_id(self, program: P | None) -> int:
        if program is None:
            return NO_PROGRAM
        found = self.program_id.get(program)
        if found is None:
            found = len(self.programs)
            assert found < 1 << PROGRAM_BITS, "memo keys hold 20 bits of program id"
            self.programs.append(program)
            self.program_id[program] = found
        return found

    def state(self, key: int) -> Any:
        return self.model.join(self.hparts[key >> STATE_SHIFT], self.dparts[key & DEVICE])

    def key_of(self, state: Any) -> int:
        host, device = self.model.split(state)
        return (self.hid(host) << STATE_SHIFT) | self.did(device)

    # ------------------------------------------------------------ host side

    def _step(self, h: int, action: Action) -> Step:
        half = self.model.host_half(self.hparts[h], action)
        return Step(
            self.prog_id(half.program), self.hid(half.host), half.violated, half.tags, half.then
        )

    def steps_of(self, h: int) -> list[Step]:
        found = self.steps.get(h)
        if found is None:
            found = [self._step(h, action) for action in self.actions]
            self.steps[h] = found
        return found

    def follow_step(self, h: int, action: Action) -> Step:
        key = (h, action)
        found = self.follow.get(key)
        if found is None:
            found = self._step(h, action)
            self.follow[key] = found
        return found

    def host_info(self, h: int) -> HostInfo:
        found = self.infos.get(h)
        if found is not None:
            return found
        violated = False
        tags: set[str] = set()
        items: list[Item] = []
        for step in self.steps_of(h):
            violated = violated or step.violated
            tags |= step.tags
            then, final = NO_PROGRAM, step.host
            if step.then is not None:
                follow = self.follow_step(step.host, step.then)
                violated = violated or follow.violated
                tags |= follow.tags
                then, final = follow.program, follow.host
            items.append(Item(step.program, then, *self.canon_host(final)))
        found = HostInfo(violated, frozenset(tags), tuple(items))
        self.infos[h] = found
        return found

    def frontier_info(self, h: int) -> Frontier:
        found = self.frontiers.get(h)
        if found is None:
            violated, tags, items = self.host_info(h)
            rejected = sum(1 for item in items if item.program < 0)
            codes = tuple(
                (item.program << PROGRAM_BITS) | (item.then + 1)
                for item in items
                if item.program >= 0
            )
            found = Frontier(violated, self.tag_mask(tags), rejected, codes)
            self.frontiers[h] = found
        return found

    # ------------------------------------------------------------ device side

    def branches(self, d: int, prog: int) -> tuple[Branch, ...]:
        """Every device half of program `prog` on device part `d`."""
        key = (d << PROGRAM_BITS) | prog
        found = self.device.get(key)
        if found is None:
            halves = self.model.device_half(self.dparts[d], self.programs[prog])
            did = self.did
            found = tuple([Branch(did(part), failed, tags) for part, failed, tags in halves])
            self.device[key] = found
        return found

    def chain(self, d: int, prog: int, then: int) -> Chain:
        """Program `prog` on device part `d`, then program `then` on each outcome (when
        `then` is a program)."""
        key = (d << 2 * PROGRAM_BITS) | (prog << PROGRAM_BITS) | (then + 1)
        found = self.chains.get(key)
        if found is not None:
            return found
        reached: list[int] = []
        violated = False
        tags: set[str] = set()
        for q, failed, qtags in self.branches(d, prog):
            tags |= qtags
            if failed:
                violated = True
                reached.append(q)
            elif then < 0:
                reached.append(q)
            else:
                for r, rfailed, rtags in self.branches(q, then):
                    violated = violated or rfailed
                    tags |= rtags
                    reached.append(r)
        found = Chain(tuple(reached), violated, frozenset(tags))
        self.chains[key] = found
        return found

    def light_chain(self, d: int, code: int) -> int:
        """`chain` at the depth bound, packed: transition count, FAILED and tag bits. The
        device parts reached after the follow-up are not needed there, so they are not
        reduced (`FactoredModel.device_verdicts`)."""
        prog, then = code >> PROGRAM_BITS, (code & ((1 << PROGRAM_BITS) - 1)) - 1
        count = 0
        acc = 0
        for q, failed, qtags in self.branches(d, prog):
            acc |= self.tag_mask(qtags)
            if failed:
                acc |= FAILED
                count += 1
            elif then < 0:
                count += 1
            else:
                key = (q << PROGRAM_BITS) | then
                v = self.light_follow.get(key)
                if v is None:
                    verdicts = self.model.device_verdicts(self.dparts[q], self.programs[then])
                    v = len(verdicts)
                    for rfailed, rtags in verdicts:
                        v |= (FAILED if rfailed else 0) | self.tag_mask(rtags)
                    self.light_follow[key] = v
                count += v & COUNT
                acc |= v
        found = count | (acc & ~COUNT)
        self.light[(d << 2 * PROGRAM_BITS) | code] = found
        return found

    # ------------------------------------------------------------ tags

    def tag_mask(self, tags: frozenset[str]) -> int:
        found = self.tag_masks.get(tags)
        if found is None:
            found = 0
            for tag in sorted(tags):
                index = self.tag_index.get(tag)
                if index is None:
                    index = len(self.tag_names)
                    self.tag_names.append(tag)
                    self.tag_index[tag] = index
                found |= 1 << (TAG_SHIFT + index)
            self.tag_masks[tags] = found
        return found

    def tag_set(self, mask: int) -> set[str]:
        return {name for i, name in enumerate(self.tag_names) if mask >> (TAG_SHIFT + i) & 1}

    # ------------------------------------------------------------ canonical form

    def canon_host(self, h: int) -> tuple[int, int, int]:
        """(canonical host part, its renamed twin, order of the two)."""
        found = self.canon_h.get(h)
        if found is None:
            model = self.model
            live = model.forget(self.hparts[h])
            canon = self.hid(live)
            if not self.symmetric:
                found = (canon, canon, -1)
            else:
                swapped = model.swap_host(live)
                order = _order(model.host_order(live), model.host_order(swapped))
                found = (canon, self.hid(swapped), order)
            self.canon_h[h] = found
        return found

    def canon_device(self, d: int) -> tuple[int, int]:
        """(renamed device part, order of the device part and its renaming)."""
        found = self.canon_d.get(d)
        if found is None:
            model = self.model
            part = self.dparts[d]
            swapped = model.swap_device(part)
            order = _order(model.device_order(part), model.device_order(swapped))
            found = (self.did(swapped), order)
            self.canon_d[d] = found
        return found


def _order(a: Any, b: Any) -> int:
    """-1, 0 or 1 as `a` is smaller than, equal to or larger than `b`."""
    return -1 if a < b else (1 if a > b else 0)


@without_cycle_collection()
def memo_search(
    model: FactoredModel[Any, Any, Any, Any],
    depth: int,
    *,
    stop_at_first: bool = True,
    only: str | None = None,
) -> Result:
    """`bfs.bfs(model, depth, ...)` with symmetry, computed with `Memo`."""
    start = time.perf_counter()
    memo: Memo[Any, Any, Any] = Memo(model)
    result = Result(depth=depth, model=model.name, expected_tags=model.expected_tags)
    init = memo.key_of(model.canonical(model.initial()))
    seen: set[int] = {init}
    level = [init]
    tagsets: set[frozenset[str]] = set()
    tag_mask = 0
    d = 0
    stopped = False
    while level and not stopped:
        result.max_depth_reached = d
        grow = d < depth
        nxt_level: list[int] = []
        for key in level:
            if not grow:
                counted = _count_frontier(memo, key)
                if counted is not None:
                    result.transitions += counted[0]
                    tag_mask |= counted[1]
                    continue
            found = _expand(memo, key, grow, tagsets)
            if found is None:
                stopped = _slow_expand(
                    memo, key, grow, result, seen, nxt_level, stop_at_first, only
                )
                if stopped:
                    break
                continue
            count, successors = found
            result.transitions += count
            for succ in successors:
                if succ not in seen:
                    seen.add(succ)
                    nxt_level.append(succ)
        level = nxt_level
        d += 1
    for tags in tagsets:
        result.tags |= tags
    result.tags |= memo.tag_set(tag_mask)
    result.states = len(seen)
    result.seconds = time.perf_counter() - start
    if result.violation is not None:
        straighten(result, model, depth, only)
    return result


def _expand(
    memo: Memo[Any, Any, Any], key: int, grow: bool, tagsets: set[frozenset[str]]
) -> tuple[int, list[int]] | None:
    """Transition count and canonical successors of a state, or None when some transition
    may fail a verdict (the plain search's code then expands the state)."""
    h, d = key >> STATE_SHIFT, key & DEVICE
    violated, host_tags, items = memo.host_info(h)
    if violated:
        return None
    count = 0
    successors: list[int] = []
    chains = memo.chains
    chain = memo.chain
    canon_d = memo.canon_d
    canon_device = memo.canon_device
    shifted = d << 2 * PROGRAM_BITS
    for prog, then, canon, swapped, cmp in items:
        if prog < 0:  # rejected: the device part stays
            reached: tuple[int, ...] = (d,)
        else:
            found = chains.get(shifted | (prog << PROGRAM_BITS) | (then + 1))
            if found is None:
                found = chain(d, prog, then)
            reached, failed, tags = found
            if failed:
                return None
            tagsets.add(tags)
        count += len(reached)
        if not grow:
            continue
        # `canonical_parts` on interned parts: `canon_host` forgot the dead host data; the
        # renamed twin is taken when its host part, or with equal host parts its device part,
        # is the smaller.
        if cmp < 0:
            for q in reached:
                successors.append((canon << STATE_SHIFT) | q)
            continue
        for q in reached:
            cq = canon_d.get(q)
            if cq is None:
                cq = canon_device(q)
            if cmp > 0 or cq[1] > 0:
                successors.append((swapped << STATE_SHIFT) | cq[0])
            else:
                successors.append((canon << STATE_SHIFT) | q)
    tagsets.add(host_tags)
    return count, successors


def _count_frontier(memo: Memo[Any, Any, Any], key: int) -> tuple[int, int] | None:
    """Transition count and tag mask of a state at the depth bound, or None when some
    transition may fail a verdict."""
    h, d = key >> STATE_SHIFT, key & DEVICE
    violated, acc, count, codes = memo.frontier_info(h)
    if violated:
        return None
    shifted = d << 2 * PROGRAM_BITS
    light = memo.light
    for code in codes:
        v = light.get(shifted | code)
        if v is None:
            v = memo.light_chain(d, code)
        count += v & COUNT
        acc |= v
    if acc & FAILED:
        return None
    return count, acc


def _slow_expand(
    memo: Memo[Any, Any, Any],
    key: int,
    grow: bool,
    result: Result,
    seen: set[int],
    nxt_level: list[int],
    stop_at_first: bool,
    only: str | None,
) -> bool:
    """The body of `bfs.bfs`'s loop for one state, on `Model.outcomes`."""
    model = memo.model
    state = memo.state(key)
    for action in model.actions(state):
        for outcome in model.outcomes(state, action):
            result.transitions += 1
            result.tags |= outcome.tags
            found: Violation | None = outcome.violation
            if found is not None and only is not None and found.prop != only:
                found = None
            if found is not None and result.violation is None:
                result.violation = found
                result.trace = [(action, outcome)]
                if stop_at_first:
                    return True
            if not grow:
                continue
            succ = memo.key_of(model.canonical(outcome.state))
            if succ not in seen:
                seen.add(succ)
                nxt_level.append(succ)
    return result.violation is not None and stop_at_first


__all__ = ["Memo", "memo_search"]
