"""``RowCacheWeightProvider`` and its two planners' classes: what the base builds, what each
sibling has, and that neither promises what it lacks (``rowcache.provider_base``)."""

from __future__ import annotations

import inspect
import pickle
from typing import Any, get_overloads

import pytest
import torch

import rowcache
from rowcache import (
    DevicePlannedProvider,
    HostPlannedProvider,
    InvalidInputError,
    RowCacheWeightProvider,
)
from rowcache.provider_base import _BY_PLANNER, PLANNERS, SURFACE
from rowcache.row_provider import RowCacheWeightProvider as FromRowProvider

E, C = 6, 3


def weights() -> dict[str, torch.Tensor]:
    return {"w13": torch.randn(E, 4, 2), "w2": torch.randn(E, 2, 2)}


def build(**kwargs: Any) -> RowCacheWeightProvider:
    return RowCacheWeightProvider(**weights(), capacity=C, device="cpu", **kwargs)


def test_the_base_builds_the_provider_of_the_planner() -> None:
    host, device = build(), build(planner="device")
    assert type(host) is HostPlannedProvider and host.planner == "host"
    assert type(device) is DevicePlannedProvider and device.planner == "device"
    for p in (host, device):
        assert isinstance(p, RowCacheWeightProvider)
        assert isinstance(p, rowcache.ExpertWeightProvider)
    assert not isinstance(device, HostPlannedProvider)
    assert not isinstance(host, DevicePlannedProvider)
    assert FromRowProvider is RowCacheWeightProvider
    assert type(build(planner="host")) is HostPlannedProvider


@pytest.mark.parametrize("cls", [HostPlannedProvider, DevicePlannedProvider])
def test_the_base_declares_each_planners_constructor(cls: Any) -> None:
    """The ``__new__`` overloads (for type checkers) repeat each planner's ``__init__``: the
    same parameters, kinds, defaults and types, but for ``planner``, which each overload
    narrows to its own planner's literal."""

    def parameters(fn: Any) -> list[tuple[str, Any, Any, Any]]:
        found = list(inspect.signature(fn).parameters.values())[1:]  # no cls / self
        return [(p.name, p.kind, p.default, p.annotation) for p in found if p.name != "planner"]

    overloads = get_overloads(RowCacheWeightProvider.__new__)
    declared = [o for o in overloads if f"Literal['{cls.planner}']" in str(inspect.signature(o))]
    assert len(overloads) == len(PLANNERS) and len(declared) == 1
    assert parameters(declared[0]) == parameters(cls.__init__)


def test_siblings_built_directly() -> None:
    assert type(HostPlannedProvider(**weights(), capacity=C, device="cpu")) is HostPlannedProvider
    p = DevicePlannedProvider(**weights(), capacity=C, device="cpu")  # type: ignore[arg-type]
    assert type(p) is DevicePlannedProvider


@pytest.mark.parametrize(
    ("cls", "planner", "message"),
    [
        (RowCacheWeightProvider, "gpu", "planner must be one of ['host', 'device'], got 'gpu'"),
        (HostPlannedProvider, "device", "HostPlannedProvider plans on the host, got 'device'"),
        (DevicePlannedProvider, "host", "DevicePlannedProvider plans on the device, got 'host'"),
    ],
)
def test_a_planner_a_class_does_not_have_is_rejected(cls: Any, planner: str, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        cls(**weights(), capacity=C, device="cpu", planner=planner)


def test_each_sibling_defines_the_surface() -> None:
    for cls in (HostPlannedProvider, DevicePlannedProvider):
        for name in SURFACE:
            assert getattr(cls, name) is not getattr(RowCacheWeightProvider, name), (cls, name)
    assert {HostPlannedProvider.planner, DevicePlannedProvider.planner} == set(PLANNERS)


def test_a_planner_class_without_the_surface_is_refused() -> None:
    with pytest.raises(TypeError, match="does not define"):

        class Partial(RowCacheWeightProvider, planner="host"):
            def prepare(self, topk_ids: Any, unique_ids: Any = None) -> Any:
                return None


def test_every_attribute_a_provider_has_answers() -> None:
    """No attribute of either sibling raises ``AttributeError`` (nothing is switched off)."""
    for p in (build(), build(planner="device")):
        for name in dir(type(p)):
            if not name.startswith("_"):
                getattr(p, name)  # a property that raised would fail here


def test_host_only_and_device_only_capabilities() -> None:
    host, device = build(), build(planner="device")
    assert host.backend is not None and callable(host.step_groups)
    assert not hasattr(device, "backend") and not hasattr(device, "step_groups")
    for name in ("num_passes", "handoff", "check_errors", "kernels", "state", "forward_map"):
        assert hasattr(device, name) and not hasattr(host, name), name
    # Both answer the shared inspection surface from their own state.
    for p in (host, device):
        p.prepare(torch.tensor([[0, 1]]))
        assert p.resident_experts() == {0: 0, 1: 1}
        assert p.lru_order() == (0, 1)
        assert p.slot_of()[:3] == (0, 1, -1)
        assert p.forward_pairs == ((0, 0), (1, 1))
    assert host.owner == "cpu"  # the CPU backend's one stream
    assert device.owner is None  # the device planner keeps no stream on the CPU


def test_classes_pickle_by_name_and_repr_names_the_class() -> None:
    for cls in (RowCacheWeightProvider, HostPlannedProvider, DevicePlannedProvider):
        assert pickle.loads(pickle.dumps(cls)) is cls
    assert repr(build()) == "HostPlannedProvider(num_experts=6, capacity=3, device=cpu)"
    assert repr(build(planner="device")).startswith("DevicePlannedProvider(num_experts=6,")


class ContractSubclass(RowCacheWeightProvider):
    """Integration code written against the contract: it subclasses the contract's class and
    hands its weights to ``super().__init__``, wrapping a method on the way."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, *, capacity: int, device: str) -> None:
        super().__init__(w13, w2, capacity=capacity, device=device)  # type: ignore[call-arg]
        self.prepared = 0

    def prepare(self, topk_ids: Any, unique_ids: Any = None) -> Any:
        self.prepared += 1
        return super().prepare(topk_ids, unique_ids)


def test_a_subclass_of_the_contract_class_is_a_host_planned_provider() -> None:
    w = weights()
    p = ContractSubclass(w["w13"], w["w2"], capacity=C, device="cpu")
    assert isinstance(p, HostPlannedProvider) and isinstance(p, RowCacheWeightProvider)
    assert p.planner == "host" and ContractSubclass.__bases__ == (HostPlannedProvider,)
    result = p.prepare(torch.tensor([[4, 1]]))
    assert p.prepared == 1 and p.resident_experts() == {1: 0, 4: 1}
    assert torch.equal(result.w1[0], w["w13"][1]) and torch.equal(result.w2[1], w["w2"][4])
    # the planners' classes are still what the base builds
    assert type(build()) is HostPlannedProvider
    assert type(build(planner="device")) is DevicePlannedProvider


def test_a_device_planned_subclass_derives_from_its_class() -> None:
    class Device(DevicePlannedProvider):
        pass

    p = Device(**weights(), capacity=C, device="cpu")  # type: ignore[arg-type]
    assert p.planner == "device" and isinstance(p, DevicePlannedProvider)
    assert type(build()) is HostPlannedProvider


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "class Both(HostPlannedProvider, planner='device'): pass",
            "Both derives from HostPlannedProvider, which plans on the host, but names"
            " planner='device'",
        ),
        (
            "class Named(RowCacheWeightProvider, planner='device'): pass",
            "Named plans on the device but does not define",
        ),
        ("class Odd(RowCacheWeightProvider, planner='gpu'): pass", "got 'gpu'"),
    ],
)
def test_a_subclass_that_contradicts_its_planner_is_refused_when_defined(
    source: str, message: str
) -> None:
    scope = {
        "HostPlannedProvider": HostPlannedProvider,
        "RowCacheWeightProvider": RowCacheWeightProvider,
    }
    before = dict(_BY_PLANNER)
    with pytest.raises(TypeError, match=message.replace("[", r"\[")) as caught:
        exec(source, scope)
    assert "\n" not in str(caught.value)
    assert before == _BY_PLANNER and type(build()) is HostPlannedProvider
