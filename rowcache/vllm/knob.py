"""The knob that turns the expert cache on in vLLM, parsed without vLLM.

Two sources, in order of precedence:

1. ``--additional-config '{"rowcache": {...}}'`` (vLLM's ``VllmConfig.additional_config``),
2. the environment: ``ROWCACHE_MOE_EXPERT_CACHE_SIZE``, ``ROWCACHE_MOE_EXPERT_CACHE_PROVIDER``,
   ``ROWCACHE_MOE_EXPERT_CACHE_SPLIT``, ``ROWCACHE_MOE_EXPERT_CACHE_PLANNER``,
   ``ROWCACHE_MOE_EXPERT_CACHE_COMPRESS``, ``ROWCACHE_MOE_EXPERT_CACHE_POLICY``.

``moe_expert_cache_policy`` (``lru``, ``lfu``; default ``lru``) is the row provider's victim
choice (``rowcache.policy``): the least recently used, or the fewest requests. ``lfu`` needs the
row provider (``cached`` evicts by its own frequency over age); one GPU run of single
generations is its only record, so it is never a default.

``moe_expert_cache_compress`` (``auto``, ``on``, ``off``; default ``auto``) holds bf16 experts
as lossless bf16 planes in host memory and decodes each miss on the GPU
(``rowcache.compress``). ``on`` needs the row provider (either planner: the device planner
decodes after its gather, the host planner in its copy step) and bf16 experts; the layer's own
pinned w13 and w2 are then freed (``rowcache.vllm._method.release_host_weights``). ``auto`` is
resolved with the planner, from the recorded runs (``rowcache.vllm.defaults.default_compress``):
``on`` where a run with medians of three recorded the planes exact and faster than raw bytes
for the engine's graph mode and quantization, the device planner serves and the model's dtype
is bf16; else ``off``.
The choice is written back under ``moe_expert_cache_compress_chosen``, as the planner's is.

``moe_expert_cache_planner`` chooses where the row provider plans: ``host`` (the MoE op runs
eagerly between captured graph pieces) or ``device`` (``rowcache.device_plan``: planned and
copied on the device, so vLLM's graph modes stay as the user set them). Without it the planner
is chosen once vLLM has resolved its graph mode, by ``rowcache.vllm.defaults.choose_planner``
from that mode and the recorded evidence; the choice is written back into ``additional_config``
under ``moe_expert_cache_planner_chosen`` (the plugin's own key) so that every process and every
copy of the configuration serves the same planner. Likewise ``moe_expert_cache_split``: the
device planner always splits by experts; without a setting, the host planner's split is chosen
with the planner (``rowcache.vllm.defaults.default_split``) and written back under
``moe_expert_cache_split_chosen``.

Each key is taken from the first source that sets it, so an environment default can be
overridden key by key on the command line. A size of 0 (or no size at all) means the cache is
off. ``moe_eager_between_graphs`` (env ``ROWCACHE_MOE_EAGER_BETWEEN_GRAPHS``) runs vLLM's own
MoE op eagerly between captured graph pieces with every expert on the GPU: the baseline a cache
run is compared with, and the mode the cache itself needs.

Every rejection is a ``KnobError`` naming the key, the value and what is allowed, raised while
vLLM builds its configuration, so a bad value stops the engine before anything is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, TypeAlias

from rowcache.errors import InvalidInputError
from rowcache.policy import POLICIES, Policy
from rowcache.row_provider import Planner
from rowcache.types import Split

__all__ = [
    "COMPRESS_CHOSEN",
    "COMPRESS_VALUES",
    "CONFIG_SECTION",
    "ENV",
    "PLANNERS",
    "PLANNER_CHOSEN",
    "PROVIDERS",
    "SPLITS",
    "SPLIT_CHOSEN",
    "CacheSettings",
    "Compress",
    "CompressSource",
    "KnobError",
    "PlannerSource",
    "ProviderName",
    "SplitSource",
    "chosen_record",
    "compress_record",
    "parse_settings",
    "split_record",
    "with_compress",
    "with_planner",
    "with_split",
]

ProviderName: TypeAlias = Literal["row", "cached"]
PlannerSource: TypeAlias = Literal["unset", "setting", "default"]
"""Where ``CacheSettings.planner`` comes from: not chosen yet (``host`` stands in until the
config hook chooses), a user's setting, or the default chosen for the engine's graph mode."""
SplitSource: TypeAlias = Literal["unset", "setting", "default"]
"""Where ``CacheSettings.split`` comes from, as ``PlannerSource`` (``token`` stands in until
the config hook chooses; the device planner's ``expert`` needs no choice)."""
CompressSource: TypeAlias = Literal["unset", "setting", "default"]
"""Where ``CacheSettings.compress`` comes from, as ``PlannerSource`` (``auto`` until the config
hook resolves it to ``on`` or ``off``)."""

CONFIG_SECTION = "rowcache"
SIZE = "moe_expert_cache_size"
PROVIDER = "moe_expert_cache_provider"
SPLIT = "moe_expert_cache_split"
EAGER = "moe_eager_between_graphs"
PLANNER = "moe_expert_cache_planner"
COMPRESS = "moe_expert_cache_compress"
POLICY = "moe_expert_cache_policy"
KEYS = (SIZE, PROVIDER, SPLIT, EAGER, PLANNER, COMPRESS, POLICY)
ENV = {key: "ROWCACHE_" + key.upper() for key in KEYS}
PLANNER_CHOSEN = "moe_expert_cache_planner_chosen"
"""Written by the plugin, not by users: ``{"planner": ..., "reason": ...}``, the default chosen
for this configuration (``rowcache.vllm._config``)."""
SPLIT_CHOSEN = "moe_expert_cache_split_chosen"
"""Written by the plugin, not by users: ``{"split": ..., "reason": ...}``, the host planner's
default split chosen for this configuration."""
COMPRESS_CHOSEN = "moe_expert_cache_compress_chosen"
"""Written by the plugin, not by users: ``{"compress": "on"|"off", "reason": ...}``, what
``auto`` resolved to for this configuration."""
PROVIDERS: tuple[ProviderName, ...] = ("row", "cached")
SPLITS: tuple[Split, ...] = ("token", "expert")
PLANNERS: tuple[Planner, ...] = ("host", "device")
Compress: TypeAlias = Literal["auto", "on", "off"]
COMPRESS_VALUES: tuple[Compress, ...] = ("auto", "on", "off")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class KnobError(InvalidInputError):
    """A knob value that cannot be used; the message names key, value and allowed values."""


@dataclass(frozen=True)
class CacheSettings:
    """What the knob asks for. ``size`` is the number of GPU slots per MoE layer (0: off)."""

    size: int = 0
    provider: ProviderName = "row"
    split: Split = "token"
    eager_between_graphs: bool = False
    planner: Planner = "host"
    compress: Compress = "auto"
    policy: Policy = "lru"
    # Provenance, not part of what the cache is (equal settings serve alike):
    planner_source: PlannerSource = field(default="unset", compare=False)
    planner_reason: str = field(default="", compare=False)
    split_source: SplitSource = field(default="unset", compare=False)
    split_reason: str = field(default="", compare=False)
    compress_source: CompressSource = field(default="unset", compare=False)
    compress_reason: str = field(default="", compare=False)

    @property
    def split_set(self) -> bool:
        """Whether the split was given (a given ``token`` split rules the device planner out)."""
        return self.split_source == "setting"

    @property
    def cache_on(self) -> bool:
        return self.size > 0

    @property
    def compress_planes(self) -> bool:
        """Whether the provider holds bf16 experts as planes: ``on``, set or resolved from
        ``auto`` (an ``auto`` not yet resolved holds raw bytes)."""
        return self.compress == "on"

    @property
    def active(self) -> bool:
        """Whether the plugin changes anything in vLLM (cache on, or the eager MoE baseline)."""
        return self.cache_on or self.eager_between_graphs

    def describe(self) -> str:
        if not self.cache_on:
            return "expert cache off, MoE op eager between graph pieces"
        planes = ", experts held as bf16 planes" if self.compress_planes else ""
        if self.policy == "lfu":
            planes += ", victims by request count"
        if self.planner == "device":
            return f"{self.size} slots per MoE layer, provider 'row', planned on the device{planes}"
        where = ", planned on the host" if self.provider == "row" else ""
        return (
            f"{self.size} slots per MoE layer, provider {self.provider!r}, split "
            f"{self.split!r}{where}{planes}"
        )

    def planner_line(self) -> str:
        """The start-up line that says which planner serves and why."""
        if self.planner_source == "unset":
            return f"rowcache: planner {self.planner} (not chosen yet)"
        return f"rowcache: planner {self.planner} ({self.planner_reason})"

    def split_line(self) -> str | None:
        """The start-up line that says which split the host planner takes and why (None for
        the device planner, whose split is always by experts, and for a split given)."""
        if self.planner != "host" or self.split_source != "default":
            return None
        return f"rowcache: split {self.split} ({self.split_reason})"

    def compress_line(self) -> str | None:
        """The start-up line that says whether ``auto`` holds the experts as planes and why
        (None for a value given, and before ``auto`` is resolved)."""
        if self.compress_source != "default":
            return None
        return f"rowcache: compress {self.compress} ({self.compress_reason})"


def _where(key: str, from_config: bool) -> str:
    if from_config:
        return f"additional_config[{CONFIG_SECTION!r}][{key!r}]"
    return f"environment variable {ENV[key]}"


def _size(value: object, where: str) -> int:
    if isinstance(value, bool):
        raise KnobError(f"{where}: {value!r} is not a slot count; allowed: an integer >= 0")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and value.strip().lstrip("+").isdigit():
        number = int(value.strip())
    elif isinstance(value, str) and value.strip() == "":
        number = 0
    else:
        raise KnobError(f"{where}: {value!r} is not a slot count; allowed: an integer >= 0")
    if number < 0:
        raise KnobError(f"{where}: {value!r} is negative; allowed: an integer >= 0 (0 = off)")
    return number


def _choice(value: object, where: str, allowed: tuple[str, ...]) -> str:
    text = value.strip().lower() if isinstance(value, str) else value
    for option in allowed:
        if text == option:
            return option
    raise KnobError(f"{where}: {value!r} is not allowed; allowed values: {', '.join(allowed)}")


def _flag(value: object, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise KnobError(f"{where}: {value!r} is not a boolean; allowed values: true, false")


def _section(additional_config: object) -> Mapping[str, object]:
    if additional_config is None:
        return {}
    if not isinstance(additional_config, Mapping):
        # vLLM also accepts an object with compute_hash(); it cannot carry our section.
        return {}
    section = additional_config.get(CONFIG_SECTION)
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise KnobError(
            f"additional_config[{CONFIG_SECTION!r}]: {section!r} is not an object; allowed: "
            f"an object of the keys {', '.join(KEYS)}"
        )
    written = (PLANNER_CHOSEN, SPLIT_CHOSEN, COMPRESS_CHOSEN)
    unknown = sorted(str(k) for k in section if k not in (*KEYS, *written))
    if unknown:
        raise KnobError(
            f"additional_config[{CONFIG_SECTION!r}]: unknown key(s) {', '.join(unknown)}; "
            f"allowed keys: {', '.join(KEYS)}"
        )
    return section


def parse_settings(additional_config: object, environ: Mapping[str, str]) -> CacheSettings:
    """Read the knob from vLLM's ``additional_config`` first, then from ``environ``.

    Values are validated even when the cache ends up off (a typo in the provider name is an
    error whatever the size), so that a configuration that starts once keeps starting when the
    size is raised.
    """
    section = _section(additional_config)

    def pick(key: str) -> tuple[object, str] | None:
        if key in section:
            return section[key], _where(key, True)
        if ENV[key] in environ:
            return environ[ENV[key]], _where(key, False)
        return None

    size = _size(*raw) if (raw := pick(SIZE)) is not None else 0
    provider = _choice(*raw, PROVIDERS) if (raw := pick(PROVIDER)) is not None else "row"
    split_raw = pick(SPLIT)
    split = _choice(*split_raw, SPLITS) if split_raw is not None else "token"
    eager = _flag(*raw) if (raw := pick(EAGER)) is not None else False
    planner_raw = pick(PLANNER)
    planner = _choice(*planner_raw, PLANNERS) if planner_raw is not None else "host"
    if planner == "device" and provider == "cached":
        raise KnobError(
            f"{_where(PROVIDER, PROVIDER in section)}: 'cached' has no device planner; with "
            f"{PLANNER}='device' allowed values: row"
        )
    compress_raw = pick(COMPRESS)
    compress = _choice(*compress_raw, COMPRESS_VALUES) if compress_raw is not None else "auto"
    compress_where = compress_raw[1] if compress_raw is not None else COMPRESS
    if compress == "on" and provider == "cached":
        raise KnobError(
            f"{compress_where}: 'on' needs {PROVIDER}='row' (the row provider decodes the "
            f"planes, with either planner), and {PROVIDER} is 'cached'; allowed values with "
            "it: auto, off"
        )
    policy_raw = pick(POLICY)
    policy = _choice(*policy_raw, POLICIES) if policy_raw is not None else "lru"
    if policy == "lfu" and provider == "cached":
        assert policy_raw is not None
        raise KnobError(
            f"{policy_raw[1]}: 'lfu' needs {PROVIDER}='row' ('cached' evicts by its own "
            "frequency over age); allowed values with it: lru"
        )
    if planner == "device" and split_raw is not None and split == "token":
        raise KnobError(
            f"{split_raw[1]}: 'token' is not allowed with {PLANNER}='device', which splits a "
            "step by passes over expert groups; allowed values: expert"
        )
    source: PlannerSource = "unset"
    reason = ""
    if planner_raw is not None:
        source = "setting"
        reason = "set by " + (PLANNER if PLANNER in section else ENV[PLANNER])
    elif (chosen := _chosen(section, PLANNER_CHOSEN, "planner", PLANNERS)) is not None:
        planner, reason = chosen
        source = "default"
    split_source: SplitSource = "unset"
    split_reason = ""
    if split_raw is not None:
        split_source = "setting"
    elif (chosen := _chosen(section, SPLIT_CHOSEN, "split", SPLITS)) is not None:
        split, split_reason = chosen
        split_source = "default"
    compress_source: CompressSource = "unset"
    compress_reason = ""
    if compress_raw is not None:
        compress_source = "setting"
    elif (chosen := _chosen(section, COMPRESS_CHOSEN, "compress", ("on", "off"))) is not None:
        compress, compress_reason = chosen
        compress_source = "default"
        if compress == "on" and (planner != "device" or provider == "cached"):
            # The default chooses planes only for the device planner (the one a record shows
            # them faster for): a chosen "on" with another is a stale configuration.
            served = f"provider {provider!r}" if provider == "cached" else f"{PLANNER} {planner!r}"
            raise KnobError(
                f"additional_config[{CONFIG_SECTION!r}][{COMPRESS_CHOSEN!r}]: 'on' needs the "
                f"device planner (the only one the default holds planes for), and this engine "
                f"has {served}; allowed with it: off"
            )
    return CacheSettings(
        size=size,
        provider="cached" if provider == "cached" else "row",
        # The device planner splits a step by passes over expert groups (checked above).
        split="expert" if split == "expert" or planner == "device" else "token",
        eager_between_graphs=eager,
        planner="device" if planner == "device" else "host",
        compress="on" if compress == "on" else "off" if compress == "off" else "auto",
        policy="lfu" if policy == "lfu" else "lru",
        planner_source=source,
        planner_reason=reason,
        split_source=split_source,
        split_reason=split_reason,
        compress_source=compress_source,
        compress_reason=compress_reason,
    )


def _chosen(
    section: Mapping[str, object], key: str, what: str, allowed: tuple[str, ...]
) -> tuple[str, str] | None:
    """The plugin's own record of a default ``what`` (one of ``allowed``) under ``key``;
    anything else is an error."""
    value = section.get(key)
    if value is None:
        return None
    where = f"additional_config[{CONFIG_SECTION!r}][{key!r}]"
    if not isinstance(value, Mapping):
        raise KnobError(f"{where}: {value!r} is not the plugin's record of a default {what}")
    chosen = _choice(value.get(what), where, allowed)
    reason = value.get("reason")
    if not isinstance(reason, str):
        raise KnobError(f"{where}: {value!r} has no reason")
    return chosen, reason


def with_planner(settings: CacheSettings, planner: Planner, reason: str) -> CacheSettings:
    """``settings`` with a default planner chosen (the device planner splits by experts)."""
    return replace(
        settings,
        split="expert" if planner == "device" else settings.split,
        planner=planner,
        planner_source="default",
        planner_reason=reason,
    )


def with_split(settings: CacheSettings, split: Split, reason: str) -> CacheSettings:
    """``settings`` with the host planner's default split chosen."""
    return replace(settings, split=split, split_source="default", split_reason=reason)


def with_compress(settings: CacheSettings, compress: Compress, reason: str) -> CacheSettings:
    """``settings`` with ``auto`` resolved to ``compress`` (``on`` or ``off``)."""
    return replace(settings, compress=compress, compress_source="default", compress_reason=reason)


def compress_record(settings: CacheSettings) -> dict[str, str]:
    """What ``COMPRESS_CHOSEN`` holds for a resolved ``auto``."""
    return {"compress": settings.compress, "reason": settings.compress_reason}


def chosen_record(settings: CacheSettings) -> dict[str, str]:
    """What ``PLANNER_CHOSEN`` holds for a default choice."""
    return {"planner": settings.planner, "reason": settings.planner_reason}


def split_record(settings: CacheSettings) -> dict[str, str]:
    """What ``SPLIT_CHOSEN`` holds for a default split."""
    return {"split": settings.split, "reason": settings.split_reason}
