"""Phases that repeat engines of earlier phases, picked by their attributes.

* ``split`` (run C of 2026-11-30): the tiny model's piecewise cache engines next to their
  same-mode reference, ``tiny.piecewise.eager_moe``.
* ``qwen8seq`` (run D): (b) and (c) ``row`` 128 of ``qwen8``, each engine alone on the machine.
* ``rerun`` (run 2 of 2026-11-29): the same-mode references with and without an identity
  ``expert_map``, and the ``qwen8`` engines (b) to (d) in one phase.
"""

from __future__ import annotations

from dataclasses import replace

from tools.vllm.harness import engines
from tools.vllm.harness.engines import QWEN_EXPERTS
from tools.vllm.harness.specs import EngineSpec, Provider


def split() -> list[EngineSpec]:
    """The tiny model's piecewise cache engines and their same-mode reference: no cache with
    the MoE op eager between pieces, the plugin's baseline mode (``tiny.piecewise.none`` keeps
    the MoE op inside the pieces, which inductor fuses and rounds differently)."""
    cache_engines = [s for s in engines.tiny() if s.caches and s.graphs and not s.debug_checks]
    return [engines.tiny_eager_moe(), *cache_engines]


def qwen8seq() -> list[EngineSpec]:
    """(b) and (c) ``row`` with every expert resident, to be started one at a time: neither
    compiles nor runs next to another engine, and (c)'s tokens are compared with (b)'s."""
    prefix = "qwen8seq"
    reference = (f"{prefix}.b.eager_moe",)
    return [
        replace(s, profiled=False, compare_with=reference)
        for s in engines.qwen8(prefix)
        if s.knob is not None
        and (
            s.knob.eager_between_graphs
            or (s.knob.provider is Provider.ROW and s.knob.size == QWEN_EXPERTS)
        )
    ]


def rerun() -> list[EngineSpec]:
    """The second run of 2026-11-29: the same-mode references (MoE op eager between pieces,
    with and without an identity ``expert_map``) next to the cache engines, and (b) to (d)
    again in one phase. Left out to fit the device budget: the vLLM-only engines and (c)
    ``cached``, already measured in the first run."""
    reference = engines.tiny_eager_moe()
    specs = [
        reference,
        replace(reference, name=engines.TINY_EAGER_MOE_IDMAP, identity_expert_map=True),
    ]
    for spec in engines.qwen8():
        knob = spec.knob
        if knob is None or (knob.provider is Provider.CACHED and knob.size == QWEN_EXPERTS):
            continue
        specs.append(replace(spec, profiled=False))
        if knob.eager_between_graphs:
            specs.append(
                replace(
                    spec,
                    name=engines.QWEN_B_IDMAP,
                    profiled=False,
                    identity_expert_map=True,
                    compare_with=(engines.QWEN_B, "qwen8.ref.eager"),
                )
            )
    return specs
