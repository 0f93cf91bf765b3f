"""The vLLM knob without vLLM: parsing, precedence, errors."""

from __future__ import annotations

import pytest

from rowcache.errors import InvalidInputError
from rowcache.vllm.knob import ENV, CacheSettings, KnobError, parse_settings

SIZE_ENV = "ROWCACHE_MOE_EXPERT_CACHE_SIZE"
PROVIDER_ENV = "ROWCACHE_MOE_EXPERT_CACHE_PROVIDER"
SPLIT_ENV = "ROWCACHE_MOE_EXPERT_CACHE_SPLIT"
PLANNER_ENV = "ROWCACHE_MOE_EXPERT_CACHE_PLANNER"


def cfg(**section: object) -> dict[str, object]:
    return {"rowcache": section}


def test_env_names_are_the_documented_ones() -> None:
    assert ENV["moe_expert_cache_size"] == SIZE_ENV
    assert ENV["moe_expert_cache_provider"] == PROVIDER_ENV
    assert ENV["moe_expert_cache_split"] == SPLIT_ENV
    assert ENV["moe_expert_cache_planner"] == PLANNER_ENV


@pytest.mark.parametrize("config", [None, {}, {"other_plugin": {"x": 1}}, cfg()])
def test_absent_means_off(config: object) -> None:
    settings = parse_settings(config, {})
    assert settings == CacheSettings()
    assert not settings.cache_on
    assert not settings.active


def test_size_zero_is_off_even_with_provider() -> None:
    settings = parse_settings(cfg(moe_expert_cache_size=0, moe_expert_cache_provider="cached"), {})
    assert not settings.cache_on
    assert settings.provider == "cached"


def test_full_config() -> None:
    settings = parse_settings(
        cfg(
            moe_expert_cache_size=32,
            moe_expert_cache_provider="cached",
            moe_expert_cache_split="expert",
        ),
        {},
    )
    assert settings == CacheSettings(size=32, provider="cached", split="expert")
    assert settings.cache_on and settings.active


def test_defaults_when_only_size_given() -> None:
    settings = parse_settings(cfg(moe_expert_cache_size=16), {})
    assert (settings.size, settings.provider, settings.split) == (16, "row", "token")


def test_env_is_the_second_source() -> None:
    env = {SIZE_ENV: "24", PROVIDER_ENV: "cached", SPLIT_ENV: "expert"}
    assert parse_settings(None, env) == CacheSettings(size=24, provider="cached", split="expert")


def test_config_wins_key_by_key() -> None:
    env = {SIZE_ENV: "24", PROVIDER_ENV: "cached", SPLIT_ENV: "expert"}
    settings = parse_settings(cfg(moe_expert_cache_size=8, moe_expert_cache_split="token"), env)
    # size and split from the config, provider from the environment
    assert settings == CacheSettings(size=8, provider="cached", split="token")


def test_config_zero_turns_an_env_size_off() -> None:
    assert not parse_settings(cfg(moe_expert_cache_size=0), {SIZE_ENV: "32"}).cache_on


def test_env_values_are_trimmed_and_case_insensitive() -> None:
    env = {SIZE_ENV: " 12 ", PROVIDER_ENV: "ROW", SPLIT_ENV: " Expert"}
    assert parse_settings(None, env) == CacheSettings(size=12, provider="row", split="expert")


def test_empty_env_size_is_off() -> None:
    assert not parse_settings(None, {SIZE_ENV: ""}).cache_on


def test_eager_baseline_flag() -> None:
    settings = parse_settings(cfg(moe_eager_between_graphs=True), {})
    assert settings.active and not settings.cache_on
    assert parse_settings(None, {"ROWCACHE_MOE_EAGER_BETWEEN_GRAPHS": "1"}).active
    assert not parse_settings(None, {"ROWCACHE_MOE_EAGER_BETWEEN_GRAPHS": "off"}).active


@pytest.mark.parametrize(
    ("config", "env", "fragments"),
    [
        (
            cfg(moe_expert_cache_size=-4),
            {},
            ["additional_config['rowcache']['moe_expert_cache_size']", "-4", ">= 0"],
        ),
        (
            cfg(moe_expert_cache_size="many"),
            {},
            ["moe_expert_cache_size", "'many'", "an integer >= 0"],
        ),
        (cfg(moe_expert_cache_size=True), {}, ["moe_expert_cache_size", "True"]),
        (cfg(moe_expert_cache_size=2.5), {}, ["moe_expert_cache_size", "2.5"]),
        ({}, {SIZE_ENV: "1e3"}, ["environment variable " + SIZE_ENV, "'1e3'"]),
        (
            cfg(moe_expert_cache_provider="lru"),
            {},
            ["moe_expert_cache_provider", "'lru'", "allowed values: row, cached"],
        ),
        (
            {},
            {PROVIDER_ENV: "fast"},
            ["environment variable " + PROVIDER_ENV, "'fast'", "row, cached"],
        ),
        (
            cfg(moe_expert_cache_split="tokens"),
            {},
            ["moe_expert_cache_split", "'tokens'", "allowed values: token, expert"],
        ),
        (cfg(moe_eager_between_graphs="maybe"), {}, ["moe_eager_between_graphs", "'maybe'"]),
        (
            cfg(moe_expert_cache_sise=8),
            {},
            ["unknown key(s) moe_expert_cache_sise", "allowed keys: moe_expert_cache_size"],
        ),
        (
            {"rowcache": 32},
            {},
            ["additional_config['rowcache']", "32", "not an object", "moe_expert_cache_compress"],
        ),
        (
            cfg(moe_expert_cache_planner="gpu"),
            {},
            ["moe_expert_cache_planner", "'gpu'", "allowed values: host, device"],
        ),
        (
            cfg(moe_expert_cache_planner="device", moe_expert_cache_provider="cached"),
            {},
            ["moe_expert_cache_provider", "'cached' has no device planner", "allowed values: row"],
        ),
        (
            {},
            {PLANNER_ENV: "device", SPLIT_ENV: "token"},
            ["environment variable " + SPLIT_ENV, "'token' is not allowed", "expert"],
        ),
    ],
)
def test_errors_name_key_value_and_allowed(
    config: object, env: dict[str, str], fragments: list[str]
) -> None:
    with pytest.raises(KnobError) as info:
        parse_settings(config, env)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_bad_value_is_an_error_even_when_off() -> None:
    with pytest.raises(KnobError, match="moe_expert_cache_provider"):
        parse_settings(cfg(moe_expert_cache_size=0, moe_expert_cache_provider="lfu"), {})


def test_knob_error_is_a_value_error() -> None:
    assert issubclass(KnobError, InvalidInputError)
    assert issubclass(KnobError, ValueError)


def test_planner_defaults_to_host_and_device_splits_by_expert() -> None:
    assert parse_settings(cfg(moe_expert_cache_size=8), {}).planner == "host"
    device = parse_settings(cfg(moe_expert_cache_size=8), {PLANNER_ENV: " Device "})
    assert (device.planner, device.split, device.provider) == ("device", "expert", "row")
    assert "planned on the device" in device.describe()


def test_describe() -> None:
    assert "32 slots" in CacheSettings(size=32).describe()
    assert "off" in CacheSettings(eager_between_graphs=True).describe()


def test_compress_defaults_to_auto_unresolved_until_the_planner_is_chosen() -> None:
    """Parsed alone, ``auto`` holds raw bytes; ``rowcache.vllm.defaults.choose_planner``
    resolves it (tests/test_vllm_default_planner.py)."""
    settings = parse_settings(cfg(moe_expert_cache_size=8, moe_expert_cache_planner="device"), {})
    assert settings.compress == "auto" and not settings.compress_planes
    assert settings.compress_source == "unset" and settings.compress_line() is None
    assert "bf16 planes" not in settings.describe()
    assert ENV["moe_expert_cache_compress"] == "ROWCACHE_MOE_EXPERT_CACHE_COMPRESS"


def test_compress_on_with_the_device_planner_holds_planes() -> None:
    settings = parse_settings(
        cfg(moe_expert_cache_size=8, moe_expert_cache_planner="device"),
        {"ROWCACHE_MOE_EXPERT_CACHE_COMPRESS": " On "},
    )
    assert settings.compress == "on" and settings.compress_planes
    assert settings.describe().endswith("planned on the device, experts held as bf16 planes")


@pytest.mark.parametrize("section", [{"moe_expert_cache_planner": "host"}, {}])
def test_compress_on_holds_planes_with_the_host_planner_or_one_not_set(
    section: dict[str, object],
) -> None:
    # Either planner decodes the planes (the host planner in its copy step).
    settings = parse_settings(
        cfg(moe_expert_cache_size=8, moe_expert_cache_compress="on", **section), {}
    )
    assert settings.compress == "on" and settings.compress_planes
    assert settings.compress_source == "setting"
    assert settings.describe().endswith("planned on the host, experts held as bf16 planes")


def test_compress_on_with_the_cached_provider_is_refused() -> None:
    with pytest.raises(KnobError) as caught:
        parse_settings(
            cfg(
                moe_expert_cache_size=8,
                moe_expert_cache_compress="on",
                moe_expert_cache_provider="cached",
            ),
            {},
        )
    assert (
        "additional_config['rowcache']['moe_expert_cache_compress']: 'on' needs "
        "moe_expert_cache_provider='row' (the row provider decodes the planes, with either "
        "planner), and moe_expert_cache_provider is 'cached'; allowed values with it: auto, off"
    ) in str(caught.value)


def test_compress_takes_auto_on_off_only() -> None:
    with pytest.raises(KnobError, match="'zstd' is not allowed; allowed values: auto, on, off"):
        parse_settings(cfg(moe_expert_cache_compress="zstd"), {})


def test_policy_defaults_to_lru_and_takes_lfu_from_either_source() -> None:
    assert parse_settings(cfg(moe_expert_cache_size=8), {}).policy == "lru"
    settings = parse_settings(cfg(moe_expert_cache_size=8, moe_expert_cache_policy="lfu"), {})
    assert settings.policy == "lfu"
    assert settings.describe().endswith("planned on the host, victims by request count")
    env = {SIZE_ENV: "8", "ROWCACHE_MOE_EXPERT_CACHE_POLICY": " LFU "}
    assert ENV["moe_expert_cache_policy"] == "ROWCACHE_MOE_EXPERT_CACHE_POLICY"
    assert parse_settings(None, env).policy == "lfu"
    device = cfg(
        moe_expert_cache_size=8, moe_expert_cache_policy="lfu", moe_expert_cache_planner="device"
    )
    assert parse_settings(device, {}).policy == "lfu"


def test_policy_takes_lru_lfu_only_and_lfu_needs_the_row_provider() -> None:
    with pytest.raises(KnobError, match="'arc' is not allowed; allowed values: lru, lfu"):
        parse_settings(cfg(moe_expert_cache_policy="arc"), {})
    with pytest.raises(KnobError) as caught:
        parse_settings(cfg(moe_expert_cache_policy="lfu", moe_expert_cache_provider="cached"), {})
    assert (
        "additional_config['rowcache']['moe_expert_cache_policy']: 'lfu' needs "
        "moe_expert_cache_provider='row' ('cached' evicts by its own frequency over age); "
        "allowed values with it: lru"
    ) in str(caught.value)
