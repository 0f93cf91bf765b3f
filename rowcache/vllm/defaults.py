"""The default planner: one pure function of the engine's graph mode and recorded evidence.

With the cache on and no ``moe_expert_cache_planner`` setting (nor
``ROWCACHE_MOE_EXPERT_CACHE_PLANNER``), the config hook (``rowcache.vllm._config``) asks
``choose_planner`` once vLLM has resolved its CUDA graph mode:

* full and piecewise graphs: the device planner once a run has recorded its tokens identical to
  no offload in that mode (``TOKENS_EXACT``), else ``host``;
* eager (no graphs): the device planner only once its tokens are recorded identical to no
  offload there and a run has recorded it at least as fast as the host planner there
  (``EAGER_NOT_SLOWER``), else ``host``;
* never with provider ``cached`` (it has no device planner) or a given ``token`` split (the
  device planner splits by expert groups);
* a record covers the model quantizations it ran (``None``: unquantized); an FP8 engine needs
  its own (FP8 checkpoints are ``fp8``; online per-tensor FP8 is ``fp8_per_tensor`` in both
  vLLM 0.25.0 and 0.33.0: ``rowcache.vllm._config.evidence_quantization``).

The host planner's split, when none is set, comes from ``default_split`` by the same rule: the
expert split (each routed expert copied once a step, a step cut by experts made exact by the
unreduced route of ``rowcache.vllm._method``) once a run has recorded its tokens identical to no
offload in that mode (``HOST_EXPERT_EXACT``), else the token split (every row in one kernel
call, exact by construction, but a step of many rows is cut into row ranges that copy most
experts again: about 2 times the misses of the expert split at 32 rows and over 100 times on a
2,048-token prompt, 32 slots of 128 experts: ``tests/test_split_copies.py``). Provider
``cached`` keeps the token split.

``EVIDENCE`` is the one place those records live: switching the default is one ``Evidence``
entry naming the run (date, commit, vLLM, GPU, where its raw output is kept), no code change. It
holds seven records, six with 32 slots for 128 experts. In full graphs (vLLM's default
``FULL_AND_PIECEWISE``) the device planner's tokens were identical to no offload at batch 1, 8
and 32 and in the first token of 2,048-token prompts, beside a second no-offload engine as the
control (docs/records/, steps run 3). In eager mode, steps run 6: the device planner's tokens
and the host planner's with its expert split were identical to eager no offload at batch 1, 8
and 32 and in the first tokens of the 2,048-token prompts, on the plain and the skewed
checkpoint. In full graphs on a block-scaled FP8 checkpoint, FP8 run 2 of 2026-12-02: the device
planner's tokens were identical to the same FP8 engine without the cache at batch 1 and 8, a
narrower record than the unquantized one (no b32, no long prompt; docs/PLUGIN.md, "FP8
experts"); and at full depth (48 layers of Qwen3-30B-A3B's shapes, 2026-12-06, an H100) at batch
1 and 8 and on 2,048-token prompts, beside a control. In piecewise graphs alone (vLLM's
``PIECEWISE``), the piecewise steps run of 2026-12-02: the device planner's tokens identical to
no offload at batch 1, 8 and 32 and in the first tokens of 2,048-token prompts, one generation
each (docs/records/). gpt-oss-20b's MXFP4 experts in full graphs (``gpt_oss_mxfp4``, vLLM's
``triton_unfused`` backend), 2026-12-04: the device planner with 8 of 32 slots identical to the
same backend without the cache at batch 1 and 8 and on 2,048-token prompts (four passes), beside
a control, one generation each. FP8 in piecewise graphs, online FP8 and gpt-oss outside full
graphs have no record yet. Eager mode has no speed record: in run 6 the device planner ran batch
1 at 0.925 times the host planner's speed on the plain checkpoint (61.6 against 66.6 tok/s) and
1.150 times on the skewed one, one generation each; so eager mode stays on the host planner, now
with the expert split.

``moe_expert_cache_compress: auto`` is resolved with the planner by ``default_compress``: the
device planner's experts are held as bf16 planes where a run recorded the planes' tokens
identical to no offload and the planes at least as fast as the same cache copying raw bytes
(``PLANES_FASTER``), with medians of three, in that graph mode and quantization, and the model's
dtype is bf16 (planes hold bf16 only). One record: the planes steps of 2026-12-04 at
``9d4f84f``, full graphs, unquantized, plain and skewed router: tokens identical at b1, b8, b32
and three 2,048-token prompts beside a control; against the raw-byte cache 1.249 x at b1,
1.281 x at b8, 1.302 x at b32 (that engine's b32 one generation), the prompt in 0.796 x the time.
Piecewise graphs, eager mode and FP8 have no record (FP8 bytes cannot be coded below 0.81 of
their size: docs/VLLM.md), so they hold raw bytes; so does the host planner (which decodes the
planes in its copy step when ``on`` is set) until a run records its planes faster.

This module imports no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

from rowcache.row_provider import Planner
from rowcache.types import Split
from rowcache.vllm.knob import CacheSettings, Compress, with_compress, with_planner, with_split

__all__ = [
    "EAGER_NOT_SLOWER",
    "EVIDENCE",
    "GRAPH_MODES",
    "HOST_EXPERT_EXACT",
    "PLANES_FASTER",
    "TOKENS_EXACT",
    "Evidence",
    "GraphMode",
    "choose_planner",
    "default_compress",
    "default_planner",
    "default_split",
]

GraphMode: TypeAlias = Literal["full", "piecewise", "eager"]
"""vLLM's resolved CUDA graph mode: any mode with full graphs (``FULL``,
``FULL_AND_PIECEWISE``, ``FULL_DECODE_ONLY``), ``PIECEWISE``, or ``NONE`` (eager)."""

GRAPH_MODES: tuple[GraphMode, ...] = ("full", "piecewise", "eager")

Claim: TypeAlias = Literal["tokens_exact", "eager_not_slower", "host_expert_exact", "planes_faster"]
TOKENS_EXACT: Claim = "tokens_exact"
"""The device planner's greedy tokens identical to no offload in the same graph mode, on every
sequence of the run, with steps that need more than one pass."""
EAGER_NOT_SLOWER: Claim = "eager_not_slower"
"""The device planner at least as fast as the host planner in eager mode (batch 1 decode, same
slots, same checkpoint, one engine at a time)."""
HOST_EXPERT_EXACT: Claim = "host_expert_exact"
"""The host planner with the expert split: greedy tokens identical to no offload in the same
graph mode, on every sequence of the run, with steps cut into several expert groups."""
PLANES_FASTER: Claim = "planes_faster"
"""The device planner with bf16 experts held as planes: greedy tokens identical to no offload in
the same graph mode on every sequence, every slot byte-exact, and at least as fast as the same
cache copying raw bytes at every batch size and on the long prompts, medians of three."""


@dataclass(frozen=True)
class Evidence:
    """One recorded engine run that justifies a default."""

    claim: Claim
    modes: tuple[GraphMode, ...]
    quantizations: tuple[str | None, ...]
    """The quantizations of the models the run covers, as
    ``rowcache.vllm._config.evidence_quantization`` names them; ``None``: unquantized."""
    date: str
    commit: str
    vllm: str
    gpu: str
    record: str
    """Where the run's summary and raw outputs are kept (a path under ``docs/vllm/``)."""


EVIDENCE: tuple[Evidence, ...] = (
    Evidence(
        claim=TOKENS_EXACT,
        modes=("full",),
        quantizations=(None,),
        date="2026-12-01",
        commit="25f83b1",
        vllm="vLLM 0.25.0",
        gpu="H200",
        record="docs/vllm/2026-12-01-steps/run3/",
    ),
    # Steps run 6: one run, two claims in eager mode (both planners' tokens).
    *(
        Evidence(
            claim=claim,
            modes=("eager",),
            quantizations=(None,),
            date="2026-12-02",
            commit="17fd5a4",
            vllm="vLLM 0.25.0",
            gpu="H200",
            record="docs/vllm/2026-12-02-steps/run6/",
        )
        for claim in (TOKENS_EXACT, HOST_EXPERT_EXACT)
    ),
    # FP8 run 2 of 2026-12-02: block-scaled FP8 checkpoints (vLLM's Fp8MoEMethod, TRITON),
    # batch 1 and 8, steps of up to 64 experts in two passes. Online FP8 is another key.
    Evidence(
        claim=TOKENS_EXACT,
        modes=("full",),
        quantizations=("fp8",),
        date="2026-12-02",
        commit="0a40184",
        vllm="vLLM 0.25.0",
        gpu="H200",
        record="docs/vllm/2026-12-02-fp8/run2/",
    ),
    # Qwen3-30B-A3B's shapes at full depth (48 layers, block FP8, random weights), 2026-12-06 on
    # an H100: the device planner (32 of 128 slots) identical to no offload at batch 1 and 8 and
    # on three 2,048-token prompts, beside a control, one generation each. The plain router's
    # run (the records checked); the skewed router's run, beside it, gave the same.
    Evidence(
        claim=TOKENS_EXACT,
        modes=("full",),
        quantizations=("fp8",),
        date="2026-12-06",
        commit="5b1b96a",
        vllm="vLLM 0.25.0",
        gpu="H100",
        record="docs/vllm/2026-12-06-qwen3-full-h100/plain/",
    ),
    # The piecewise steps run of 2026-12-02: vLLM's PIECEWISE graphs alone, unquantized,
    # batch 1, 8 and 32 and three 2,048-token prompts, one generation each.
    Evidence(
        claim=TOKENS_EXACT,
        modes=("piecewise",),
        quantizations=(None,),
        date="2026-12-02",
        commit="4f4b1ef",
        vllm="vLLM 0.25.0",
        gpu="H200",
        record="docs/vllm/2026-12-02-steps/piecewise/",
    ),
    # gpt-oss-20b at full depth on vLLM's triton_unfused MXFP4 backend, 2026-12-04: the
    # device planner (8 of 32 slots) identical to the same backend without the cache at batch
    # 1 and 8 and on three 2,048-token prompts (four passes each), beside a control (no
    # offload again, identical), one generation each.
    Evidence(
        claim=TOKENS_EXACT,
        modes=("full",),
        quantizations=("gpt_oss_mxfp4",),
        date="2026-12-04",
        commit="02d9512",
        vllm="vLLM 0.25.0",
        gpu="H200",
        record="docs/vllm/2026-12-04-marlin-3bit/",
    ),
    # The planes steps of 2026-12-04 (medians of three): full graphs, unquantized bf16.
    Evidence(
        claim=PLANES_FASTER,
        modes=("full",),
        quantizations=(None,),
        date="2026-12-04",
        commit="9d4f84f",
        vllm="vLLM 0.25.0",
        gpu="H200",
        record="docs/vllm/2026-12-04-steps-planes-medians/",
    ),
)
"""The runs that switch a default (module docstring)."""

NO_TOKENS = "the device planner's tokens against no offload are not yet recorded with exact passes"
NOT_FASTER = (
    "in eager mode the device planner is not yet recorded at least as fast as the host planner"
)
NO_HOST_EXPERT = "the host planner's expert split is not yet recorded exact against no offload"
NO_PLANES = "bf16 planes are not yet recorded exact and faster than raw bytes"
NO_HOST_PLANES = (
    "no record shows the host planner's planes faster than its raw bytes (the planes' record "
    "is the device planner's); moe_expert_cache_compress='on' holds them"
)


def _recorded(
    evidence: tuple[Evidence, ...], claim: Claim, mode: GraphMode, quantization: str | None
) -> Evidence | None:
    for item in evidence:
        if item.claim == claim and mode in item.modes and quantization in item.quantizations:
            return item
    return None


def _cite(item: Evidence) -> str:
    return f"{item.claim} in {item.vllm} on {item.gpu}, {item.date} at {item.commit}"


def _where(mode: GraphMode, quantization: str | None, place: str = "") -> str:
    """The engine a default is chosen for, in its reason: ``place`` (else the mode's name) and
    the quantization."""
    place = place or ("eager mode" if mode == "eager" else f"{mode} graphs")
    return place if quantization is None else f"{place}, quantization {quantization!r}"


def default_planner(
    mode: GraphMode,
    *,
    provider: str = "row",
    token_split_set: bool = False,
    quantization: str | None = None,
    evidence: tuple[Evidence, ...] | None = None,
) -> tuple[Planner, str]:
    """The planner for an engine in ``mode`` serving a model of ``quantization`` without a
    planner setting, and why (``evidence``: ``EVIDENCE`` when not given)."""
    evidence = EVIDENCE if evidence is None else evidence
    where = _where(mode, quantization)
    if provider == "cached":
        return "host", "default: provider 'cached' has no device planner"
    if token_split_set:
        return "host", (
            "default: split 'token' is set and the device planner splits by expert groups"
        )
    tokens = _recorded(evidence, TOKENS_EXACT, mode, quantization)
    if tokens is None:
        return "host", f"default in {where}: {NO_TOKENS}"
    if mode == "eager":
        speed = _recorded(evidence, EAGER_NOT_SLOWER, mode, quantization)
        if speed is None:
            return "host", f"default in {where}: {NOT_FASTER}"
        return "device", f"default in {where}: {_cite(tokens)}; {_cite(speed)}"
    return "device", f"default in {where}: {_cite(tokens)}"


def default_split(
    mode: GraphMode,
    *,
    provider: str = "row",
    quantization: str | None = None,
    evidence: tuple[Evidence, ...] | None = None,
) -> tuple[Split, str]:
    """The host planner's split for an engine in ``mode`` serving a model of ``quantization``
    without a split setting, and why (``evidence``: ``EVIDENCE`` when not given)."""
    evidence = EVIDENCE if evidence is None else evidence
    place = ""
    if mode == "full":  # the host planner runs between piecewise graphs (adjust_graphs)
        mode, place = "piecewise", "piecewise graphs (full graphs lowered for the host planner)"
    where = _where(mode, quantization, place)
    if provider == "cached":
        return "token", "default for provider 'cached'"
    exact = _recorded(evidence, HOST_EXPERT_EXACT, mode, quantization)
    if exact is None:
        return "token", f"default in {where}: {NO_HOST_EXPERT}"
    return "expert", f"default in {where}: {_cite(exact)}"


def default_compress(
    mode: GraphMode,
    *,
    planner: Planner,
    quantization: str | None = None,
    dtype: str | None = None,
    evidence: tuple[Evidence, ...] | None = None,
) -> tuple[Compress, str]:
    """What ``moe_expert_cache_compress: auto`` means for an engine in ``mode`` whose experts
    ``planner`` serves, of a model of ``quantization`` and ``dtype`` (torch's name without
    ``torch.``, e.g. ``bfloat16``; None: unknown), and why (``evidence``: ``EVIDENCE`` when not
    given)."""
    evidence = EVIDENCE if evidence is None else evidence
    where = _where(mode, quantization)
    if planner != "device":
        return "off", f"default: {NO_HOST_PLANES}"
    if quantization is not None:
        # The model's dtype is bf16 there too; its experts are not.
        return "off", f"default: planes hold bf16 experts; quantization {quantization!r} does not"
    if dtype != "bfloat16":
        known = "not known" if dtype is None else dtype
        return "off", f"default: planes hold bf16 experts and the model's dtype is {known}"
    planes = _recorded(evidence, PLANES_FASTER, mode, None)
    if planes is None:
        return "off", f"default in {where}: {NO_PLANES}"
    return "on", f"default in {where}: {_cite(planes)}"


def choose_planner(
    settings: CacheSettings,
    mode: GraphMode,
    quantization: str | None = None,
    evidence: tuple[Evidence, ...] | None = None,
    dtype: str | None = None,
) -> CacheSettings:
    """``settings`` with the planner chosen for ``mode`` and the model's ``quantization``
    unless it is set or already chosen, then ``compress: auto`` resolved for that planner and
    the model's ``dtype``, then, for the host planner, the split unless it is set or already
    chosen."""
    if not settings.cache_on:
        return settings
    if settings.planner_source == "unset":
        planner, reason = default_planner(
            mode,
            provider=settings.provider,
            token_split_set=settings.split_set and settings.split == "token",
            quantization=quantization,
            evidence=evidence,
        )
        settings = with_planner(settings, planner, reason)
    if settings.compress == "auto":
        compress, reason = default_compress(
            mode,
            planner=settings.planner,
            quantization=quantization,
            dtype=dtype,
            evidence=evidence,
        )
        settings = with_compress(settings, compress, reason)
    if settings.planner != "host" or settings.split_source != "unset":
        return settings
    split, reason = default_split(
        mode, provider=settings.provider, quantization=quantization, evidence=evidence
    )
    return with_split(settings, split, reason)
