"""The default planner: the selection table for every graph mode and setting, the override, the
write-back that keeps every copy of a configuration on one planner, and the start-up line once
per process (against the fake vLLM of tests/test_vllm_register.py)."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
from test_vllm_register import _config, fake_vllm, fresh_plugin  # noqa: F401 (fixtures)

import rowcache.vllm as plugin
from rowcache.vllm import defaults
from rowcache.vllm.defaults import (
    EAGER_NOT_SLOWER,
    EVIDENCE,
    GRAPH_MODES,
    HOST_EXPERT_EXACT,
    NO_HOST_EXPERT,
    NO_HOST_PLANES,
    NO_PLANES,
    NO_TOKENS,
    NOT_FASTER,
    PLANES_FASTER,
    TOKENS_EXACT,
    Evidence,
    GraphMode,
    choose_planner,
    default_compress,
    default_planner,
    default_split,
)
from rowcache.vllm.knob import (
    COMPRESS,
    COMPRESS_CHOSEN,
    ENV,
    PLANNER,
    PLANNER_CHOSEN,
    SPLIT,
    SPLIT_CHOSEN,
    KnobError,
    parse_settings,
)

PLANNER_ENV = ENV[PLANNER]
ROOT = Path(__file__).resolve().parents[1]


def _evidence(
    claim: str, *modes: GraphMode, quantizations: tuple[str | None, ...] = (None,)
) -> Evidence:
    return Evidence(
        claim=claim,  # type: ignore[arg-type]
        modes=modes,
        quantizations=quantizations,
        date="2026-12-02",
        commit="abc1234",
        vllm="vLLM 0.25.0",
        gpu="H200",
        record="docs/vllm/x.txt",
    )


HOST_EXPERT = _evidence(HOST_EXPERT_EXACT, "eager")
TOKENS_GRAPHS = _evidence(TOKENS_EXACT, "full", "piecewise")
TOKENS_ALL = _evidence(TOKENS_EXACT, "full", "piecewise", "eager")
EAGER_SPEED = _evidence(EAGER_NOT_SLOWER, "eager")


def test_the_recorded_evidence_switches_full_graphs_and_the_eager_split() -> None:
    """The records (steps runs 3 and 6, FP8 run 2, the piecewise steps run): the device
    planner's tokens identical in full graphs, in eager mode and in piecewise graphs alone, the
    host planner's expert split's in eager mode, and the device planner's in full graphs on FP8
    checkpoints (again at full depth, 2026-12-06); their raw output is in the repository. Eager
    mode (no speed record) stays on the host planner, with the expert split; the host planner
    elsewhere takes the token split.
    FP8 in piecewise graphs and online FP8 (``fp8_per_tensor``) have no record. gpt-oss's
    models run of 2026-12-04 records the device planner's tokens in full graphs on its MXFP4
    experts. The planes steps of 2026-12-04 turn ``compress: auto`` on for the device planner's
    bf16 experts in full graphs only."""
    full, eager, host_split, fp8, fp8_full_depth, piecewise, gpt_oss, planes = EVIDENCE
    assert (fp8_full_depth.claim, fp8_full_depth.modes, fp8_full_depth.quantizations) == (
        TOKENS_EXACT,
        ("full",),
        ("fp8",),
    )
    assert (gpt_oss.claim, gpt_oss.modes, gpt_oss.quantizations) == (
        TOKENS_EXACT,
        ("full",),
        ("gpt_oss_mxfp4",),
    )
    assert {
        mode: default_planner(mode, quantization="gpt_oss_mxfp4")[0] for mode in GRAPH_MODES
    } == {
        "full": "device",
        "piecewise": "host",
        "eager": "host",
    }
    assert (planes.claim, planes.modes, planes.quantizations) == (PLANES_FASTER, ("full",), (None,))
    assert {
        mode: default_compress(mode, planner="device", dtype="bfloat16")[0] for mode in GRAPH_MODES
    } == {"full": "on", "piecewise": "off", "eager": "off"}
    assert full.claim == TOKENS_EXACT and full.modes == ("full",)
    assert eager.claim == TOKENS_EXACT and eager.modes == ("eager",)
    assert host_split.claim == HOST_EXPERT_EXACT and host_split.modes == ("eager",)
    assert (fp8.claim, fp8.modes, fp8.quantizations) == (TOKENS_EXACT, ("full",), ("fp8",))
    assert (piecewise.claim, piecewise.modes, piecewise.quantizations) == (
        TOKENS_EXACT,
        ("piecewise",),
        (None,),
    )
    assert {mode: default_planner(mode, quantization="fp8")[0] for mode in GRAPH_MODES} == {
        "full": "device",
        "piecewise": "host",
        "eager": "host",
    }
    assert default_planner("full", quantization="fp8_per_tensor")[0] == "host"
    for record in EVIDENCE:
        assert (ROOT / record.record / "records.jsonl").is_file()
        assert record.commit in (ROOT / "docs" / "VLLM.md").read_text()
    assert {mode: default_planner(mode)[0] for mode in GRAPH_MODES} == {
        "full": "device",
        "piecewise": "device",
        "eager": "host",
    }
    assert {mode: default_split(mode)[0] for mode in GRAPH_MODES} == {
        "full": "token",
        "piecewise": "token",
        "eager": "expert",
    }


def _records(record: str) -> dict[str, dict[str, Any]]:
    """The engines' records of a run kept under ``record`` (a path under docs/vllm/), by name."""
    import json

    lines = (ROOT / record / "records.jsonl").read_text().splitlines()
    return {r["name"]: r for r in map(json.loads, lines)}


def _quantization(record: dict[str, Any]) -> str | None:
    """An engine's model quantization as the records name it (``Evidence.quantizations``)."""
    checkpoint = record["spec"]["checkpoint"]
    if checkpoint.get("arch") == "gpt_oss":
        return "gpt_oss_mxfp4"
    if checkpoint.get("fp8_block"):
        return "fp8"
    # vLLM 0.25.0's ``fp8`` of a bf16 checkpoint quantizes it online, per tensor.
    return "fp8_per_tensor" if record["spec"].get("quantization") == "fp8" else None


def backs_its_claim(evidence: Evidence) -> int:
    """Check that ``evidence``'s stored records show what it claims: in each of its modes every
    engine of the planner (``row<N>dev``: the device planner; ``row<N>host``: the host
    planner's expert split) whose checkpoint's no-offload engine of the same mode ran in the
    same record gave its greedy tokens, sequence by sequence at every batch size measured, and
    the first tokens of the long prompts where both measured them, and the device planner's
    largest batch took at least two passes a layer step on average. Returns the number of
    engines checked. A ``PLANES_FASTER`` record is checked by :func:`planes_back_their_claim`."""
    if evidence.claim == PLANES_FASTER:
        return planes_back_their_claim(evidence)
    engine = {TOKENS_EXACT: "dev", HOST_EXPERT_EXACT: "host"}[evidence.claim]
    label_re = re.compile(rf"(?P<prefix>.+)\.row\d+{engine}\.(?P<mode>\w+)")
    records = _records(evidence.record)
    checked = 0
    for mode in evidence.modes:
        for name, record in records.items():
            match = label_re.fullmatch(name)
            if match is None or match["mode"] != mode:
                continue
            if _quantization(record) not in evidence.quantizations:
                continue
            assert record["ok"], f"{name} did not run: {record.get('error')}"
            none = records.get(f"{match['prefix']}.none.{mode}")
            if none is None:  # its reference ran in another record (a later call)
                continue
            reference = none["steps"]["decode"]
            decode = record["steps"]["decode"]
            assert decode.keys() == reference.keys(), name
            for batch, entry in decode.items():
                assert entry["tokens"] == reference[batch]["tokens"], (name, batch)
            prompts, prompts_ref = record["steps"].get("ttft"), none["steps"].get("ttft")
            if prompts and prompts_ref and prompts.get("first_tokens"):
                assert prompts["first_tokens"] == prompts_ref["first_tokens"], (name, "prompts")
            if engine == "dev":
                largest = decode[max(decode, key=int)]
                layers = sum(record["route"]["routes"].values())
                steps = largest["repeats_run"] * len(largest["tokens"][0]) * layers
                passes = largest["cache"]["passes"]
                assert passes >= 2 * steps, f"{name}: {passes} passes over {steps} layer steps"
            checked += 1
    assert checked, f"no row<N>{engine} engine in {evidence.record} for {evidence.modes}"
    return checked


def planes_back_their_claim(evidence: Evidence) -> int:
    """Check that a ``PLANES_FASTER`` record shows it: in each of its modes, every
    ``row32planes`` engine (started with ``moe_expert_cache_compress: on``) gave its
    checkpoint's no-offload tokens at every batch size and the first tokens of the long
    prompts, measured every batch size three times, and left every resident slot byte-exact;
    beside a ``row32dev`` engine of the same run (the raw-byte cache) it was at least as fast
    at every batch size and took no longer on the prompts. At least one such pair must be
    there. Returns the number of planes engines checked."""
    records = _records(evidence.record)
    checked = compared = 0
    for mode in evidence.modes:
        for name, record in records.items():
            prefix, _, label = name.rpartition(".row32planes.")
            if not prefix or label != mode:
                continue
            reference = records[f"{prefix}.none.{mode}"]["steps"]
            steps = record["steps"]
            assert steps["decode"].keys() == reference["decode"].keys(), name
            for batch, entry in steps["decode"].items():
                assert entry["tokens"] == reference["decode"][batch]["tokens"], (name, batch)
                assert entry["repeats_run"] == 3, (name, batch, entry["repeats_run"])
            assert steps["ttft"]["first_tokens"] == reference["ttft"]["first_tokens"], name
            knob = record["llm_kwargs"]["additional_config"]["rowcache"]
            assert knob[COMPRESS] == "on", name
            slots = record["slots"]
            assert slots["slots"] > 0 and slots["mismatches"] == [], name
            raw = records.get(f"{prefix}.row32dev.{mode}")
            if raw is not None:
                for batch, entry in steps["decode"].items():
                    slower = raw["steps"]["decode"][batch]["tok_s"]
                    assert entry["tok_s"] >= slower, f"{name}: b{batch} {entry['tok_s']} < {slower}"
                assert steps["ttft"]["ms"] <= raw["steps"]["ttft"]["ms"], f"{name}: prompt"
                compared += 1
            checked += 1
    assert checked, f"no row32planes engine in {evidence.record} for {evidence.modes}"
    assert compared, f"no row32dev engine beside the planes in {evidence.record}"
    return checked


@pytest.mark.parametrize("evidence", EVIDENCE, ids=lambda e: f"{e.claim}-{e.record}")
def test_every_record_backs_its_claim(evidence: Evidence) -> None:
    """No record of ``EAGER_NOT_SLOWER`` exists; every other one is checked against its raw
    records (:func:`backs_its_claim`)."""
    assert backs_its_claim(evidence) >= 1


def _rewritten(evidence: Evidence, records: dict[str, dict[str, Any]], folder: Path) -> Evidence:
    """``evidence`` pointing at ``records`` (changed copies of its own) written in ``folder``."""
    import json

    folder.mkdir(exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records.values())
    (folder / "records.jsonl").write_text(text)
    return Evidence(**{**vars(evidence), "record": str(folder)})


def test_the_claim_check_rejects_a_record_that_does_not_back_it(tmp_path: Path) -> None:
    """The check fails on a run whose cached engine's tokens diverge, and on one whose steps
    all fit in one pass."""
    import json

    piecewise = next(e for e in EVIDENCE if e.modes == ("piecewise",))
    records = _records(piecewise.record)

    def write(changed: dict[str, dict[str, Any]]) -> Evidence:
        return _rewritten(piecewise, changed, tmp_path / "bad")

    diverging = json.loads(json.dumps(records))
    diverging["steps.plain.row32dev.piecewise"]["steps"]["decode"]["8"]["tokens"][3][17] += 1
    with pytest.raises(AssertionError, match=r"row32dev\.piecewise"):
        backs_its_claim(write(diverging))
    one_pass = json.loads(json.dumps(records))
    for entry in one_pass["steps.plain.row32dev.piecewise"]["steps"]["decode"].values():
        entry["cache"]["passes"] = 2056
    with pytest.raises(AssertionError, match="2056 passes over 2048 layer steps"):
        backs_its_claim(write(one_pass))


def test_the_claim_check_takes_the_models_engines_of_its_quantization(tmp_path: Path) -> None:
    """gpt-oss's record (``row8dev``, a models phase): its engines are checked, a prompt's first
    token changed or a cache engine of that quantization that did not run fails the check, and
    an engine of another quantization in the same record (the raw-byte steps engine that did
    not start there) is not the claim's."""
    import json

    gpt_oss = next(e for e in EVIDENCE if e.quantizations == ("gpt_oss_mxfp4",))
    records = _records(gpt_oss.record)
    assert not records["steps.plain.row32dev.full"]["ok"]  # another quantization's engine
    assert backs_its_claim(gpt_oss) == 1  # the skewed one's reference ran in another call

    def write(changed: dict[str, dict[str, Any]]) -> Evidence:
        return _rewritten(gpt_oss, changed, tmp_path / "bad")

    engine = "models.gptoss20b.row8dev.full"
    prompt = json.loads(json.dumps(records))
    prompt[engine]["steps"]["ttft"]["first_tokens"][1] += 1
    with pytest.raises(AssertionError, match="prompts"):
        backs_its_claim(write(prompt))
    failed = json.loads(json.dumps(records))
    failed[engine]["ok"] = False
    with pytest.raises(AssertionError, match="did not run"):
        backs_its_claim(write(failed))
    as_fp8 = Evidence(**{**vars(gpt_oss), "quantizations": ("fp8",)})
    with pytest.raises(AssertionError, match="no row<N>dev engine"):
        backs_its_claim(as_fp8)


def test_the_planes_check_rejects_a_record_that_does_not_back_it(tmp_path: Path) -> None:
    """The planes' check fails on diverging tokens, on a batch measured fewer than three
    times, on planes slower than raw bytes, on a slot that differs, and on a run without the
    raw-byte engine beside the planes."""
    import json

    planes = next(e for e in EVIDENCE if e.claim == PLANES_FASTER)
    records = _records(planes.record)

    def write(changed: dict[str, dict[str, Any]]) -> Evidence:
        return _rewritten(planes, changed, tmp_path / "bad")

    def changed() -> dict[str, dict[str, Any]]:
        copy: dict[str, dict[str, Any]] = json.loads(json.dumps(records))
        return copy

    engine = "steps.skew.row32planes.full"
    diverging = changed()
    diverging[engine]["steps"]["decode"]["32"]["tokens"][5][40] += 1
    with pytest.raises(AssertionError, match=r"skew\.row32planes"):
        backs_its_claim(write(diverging))
    once = changed()
    once[engine]["steps"]["decode"]["8"]["repeats_run"] = 1
    with pytest.raises(AssertionError, match="'8', 1"):
        backs_its_claim(write(once))
    slower = changed()
    slower["steps.plain.row32planes.full"]["steps"]["decode"]["8"]["tok_s"] = 100.0
    with pytest.raises(AssertionError, match=r"b8 100\.0 < 139\.3"):
        backs_its_claim(write(slower))
    slot = changed()
    slot[engine]["slots"]["mismatches"] = [[3, 17]]
    with pytest.raises(AssertionError, match=engine):
        backs_its_claim(write(slot))
    alone = changed()
    del alone["steps.plain.row32dev.full"]
    with pytest.raises(AssertionError, match="no row32dev engine beside the planes"):
        backs_its_claim(write(alone))


def test_the_fp8_default_ran_on_the_gpu() -> None:
    """FP8 run 4: an engine of the block-scaled checkpoint with the slot count alone set got
    the device planner in every layer (the route probe) and no offload's tokens."""
    records = _records("docs/vllm/2026-12-02-fp8/run4-default/")
    default = records["fp8.plain.row32default.full"]
    assert default["route"]["planners"] == {"device": 8}
    reference = records["fp8.plain.none.full"]["steps"]["decode"]
    assert default["steps"]["decode"].keys() == reference.keys() == {"1", "8"}
    for batch, entry in default["steps"]["decode"].items():
        assert entry["tokens"] == reference[batch]["tokens"]


# mode -> planner, for each state of the evidence
TABLE: list[tuple[tuple[Evidence, ...], dict[GraphMode, str]]] = [
    ((), {"full": "host", "piecewise": "host", "eager": "host"}),
    ((TOKENS_GRAPHS,), {"full": "device", "piecewise": "device", "eager": "host"}),
    ((TOKENS_ALL,), {"full": "device", "piecewise": "device", "eager": "host"}),
    ((EAGER_SPEED,), {"full": "host", "piecewise": "host", "eager": "host"}),
    ((TOKENS_GRAPHS, EAGER_SPEED), {"full": "device", "piecewise": "device", "eager": "host"}),
    ((TOKENS_ALL, EAGER_SPEED), {"full": "device", "piecewise": "device", "eager": "device"}),
    ((_evidence(TOKENS_EXACT, "full"),), {"full": "device", "piecewise": "host", "eager": "host"}),
]


@pytest.mark.parametrize(("evidence", "expected"), TABLE)
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_selection_table(
    evidence: tuple[Evidence, ...], expected: dict[GraphMode, str], mode: GraphMode
) -> None:
    planner, reason = default_planner(mode, evidence=evidence)
    assert planner == expected[mode]
    assert reason.startswith("default in ")
    if planner == "device":
        assert "2026-12-02 at abc1234" in reason
    elif not any(e.claim == TOKENS_EXACT and mode in e.modes for e in evidence):
        assert NO_TOKENS in reason
    else:
        assert mode == "eager" and NOT_FASTER in reason


def test_today_host_in_eager_mode_with_the_stated_reason() -> None:
    assert default_planner("eager") == (
        "host",
        "default in eager mode: in eager mode the device planner is not yet recorded at "
        "least as fast as the host planner",
    )
    # FP8 in piecewise graphs has no record of its own.
    assert default_planner("piecewise", quantization="fp8") == (
        "host",
        "default in piecewise graphs, quantization 'fp8': the device planner's tokens against "
        "no offload are not yet recorded with exact passes",
    )


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        (
            "full",
            "default in full graphs: tokens_exact in vLLM 0.25.0 on H200, 2026-12-01 at 25f83b1",
        ),
        (
            "piecewise",
            "default in piecewise graphs: tokens_exact in vLLM 0.25.0 on H200, 2026-12-02 at "
            "4f4b1ef",
        ),
    ],
)
def test_today_device_in_graphs_citing_its_record(mode: GraphMode, reason: str) -> None:
    assert default_planner(mode) == ("device", reason)


@pytest.mark.parametrize("quantization", ["fp8", "fp8_per_tensor"])
def test_a_record_covers_only_the_quantizations_it_ran(quantization: str) -> None:
    """A record of an unquantized model: an FP8 engine keeps the host planner, saying so,
    until a run of its own is recorded."""
    unquantized = tuple(e for e in EVIDENCE if e.quantizations == (None,))
    planner, reason = default_planner("full", quantization=quantization, evidence=unquantized)
    assert planner == "host"
    assert reason == f"default in full graphs, quantization {quantization!r}: {NO_TOKENS}"
    fp8_run = _evidence(TOKENS_EXACT, "full", quantizations=(quantization,))
    assert default_planner("full", quantization=quantization, evidence=(fp8_run,))[0] == "device"
    assert default_planner("full", evidence=(fp8_run,))[0] == "host"
    other = "fp8_per_tensor" if quantization == "fp8" else "fp8"
    assert default_planner("full", quantization=other, evidence=(fp8_run,))[0] == "host"


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_cached_provider_and_token_split_rule_the_device_planner_out(mode: GraphMode) -> None:
    everything = (TOKENS_ALL, EAGER_SPEED)
    assert default_planner(mode, provider="cached", evidence=everything)[0] == "host"
    assert default_planner(mode, token_split_set=True, evidence=everything)[0] == "host"
    base = {"moe_expert_cache_size": 16}
    token = parse_settings({"rowcache": {**base, "moe_expert_cache_split": "token"}}, {})
    assert choose_planner(token, mode, evidence=everything).planner == "host"
    expert = parse_settings({"rowcache": {**base, "moe_expert_cache_split": "expert"}}, {})
    assert choose_planner(expert, mode, evidence=everything).planner == "device"
    # Unset split and a device default: the device planner's split by expert groups.
    unset = choose_planner(parse_settings({"rowcache": base}, {}), mode, evidence=everything)
    assert (unset.planner, unset.split, unset.planner_source) == ("device", "expert", "default")


@pytest.mark.parametrize("mode", GRAPH_MODES)
@pytest.mark.parametrize("setting", ["host", "device"])
@pytest.mark.parametrize("source", ["config", "env"])
def test_a_setting_overrides_every_default(mode: GraphMode, setting: str, source: str) -> None:
    knob: dict[str, object] = {"moe_expert_cache_size": 16}
    env: dict[str, str] = {}
    if source == "config":
        knob[PLANNER] = setting
    else:
        env[PLANNER_ENV] = setting
    settings = parse_settings({"rowcache": knob}, env)
    for evidence in ((), (TOKENS_ALL, EAGER_SPEED)):
        chosen = choose_planner(settings, mode, evidence=evidence)
        assert chosen.planner == setting and chosen.planner_source == "setting"
        name = PLANNER if source == "config" else PLANNER_ENV
        assert chosen.planner_line() == f"rowcache: planner {setting} (set by {name})"


def test_cache_off_chooses_nothing() -> None:
    off = parse_settings({}, {})
    assert choose_planner(off, "full", evidence=(TOKENS_ALL,)) is off


def test_the_chosen_record_is_read_back_and_checked() -> None:
    chosen = {"planner": "device", "reason": "default in full graphs: x"}
    settings = parse_settings(
        {"rowcache": {"moe_expert_cache_size": 8, PLANNER_CHOSEN: chosen}}, {}
    )
    assert (settings.planner, settings.split, settings.planner_source) == (
        "device",
        "expert",
        "default",
    )
    assert settings.planner_line() == "rowcache: planner device (default in full graphs: x)"
    # Already chosen: no evidence changes it.
    assert choose_planner(settings, "eager", evidence=()).planner == "device"
    # A setting still wins over a recorded default.
    over = parse_settings(
        {"rowcache": {"moe_expert_cache_size": 8, PLANNER_CHOSEN: chosen, PLANNER: "host"}}, {}
    )
    assert (over.planner, over.planner_source) == ("host", "setting")
    with pytest.raises(KnobError, match=PLANNER_CHOSEN):
        parse_settings({"rowcache": {"moe_expert_cache_size": 8, PLANNER_CHOSEN: "device"}}, {})


# -- the host planner's split -----------------------------------------------------------------


def test_the_host_planners_split_waits_for_its_record() -> None:
    """The token split until a run records the host planner's expert split exact in that mode
    (full graphs count as the piecewise graphs the host planner runs between) and for that
    quantization; provider 'cached' keeps the token split."""
    places = {
        "eager": "eager mode",
        "piecewise": "piecewise graphs",
        "full": "piecewise graphs (full graphs lowered for the host planner)",
    }
    for mode in GRAPH_MODES:
        assert default_split(mode, evidence=()) == (
            "token",
            f"default in {places[mode]}: {NO_HOST_EXPERT}",
        )
    cite = "host_expert_exact in vLLM 0.25.0 on H200, 2026-12-02 at abc1234"
    assert default_split("eager", evidence=(HOST_EXPERT,)) == (
        "expert",
        f"default in eager mode: {cite}",
    )
    assert default_split("piecewise", evidence=(HOST_EXPERT,))[0] == "token"
    piecewise = _evidence(HOST_EXPERT_EXACT, "piecewise")
    assert default_split("full", evidence=(piecewise,))[0] == "expert"
    assert default_split("eager", quantization="fp8", evidence=(HOST_EXPERT,))[0] == "token"
    assert default_split("eager", provider="cached", evidence=(HOST_EXPERT,)) == (
        "token",
        "default for provider 'cached'",
    )


def test_the_split_is_chosen_for_the_host_planner_only_where_unset() -> None:
    base: dict[str, object] = {"moe_expert_cache_size": 16}
    evidence = (HOST_EXPERT,)  # no device record: the host planner in every mode
    unset = choose_planner(parse_settings({"rowcache": base}, {}), "eager", evidence=evidence)
    assert (unset.planner, unset.split, unset.split_source) == ("host", "expert", "default")
    assert unset.split_line() == (
        "rowcache: split expert (default in eager mode: host_expert_exact in vLLM 0.25.0 on "
        "H200, 2026-12-02 at abc1234)"
    )
    assert choose_planner(unset, "eager", evidence=()).split == "expert"  # chosen once
    host = parse_settings({"rowcache": {**base, PLANNER: "host"}}, {})
    assert choose_planner(host, "eager", evidence=evidence).split == "expert"
    given = parse_settings({"rowcache": {**base, SPLIT: "token"}}, {})
    kept = choose_planner(given, "eager", evidence=evidence)
    assert (kept.split, kept.split_source, kept.split_line()) == ("token", "setting", None)
    device = choose_planner(
        parse_settings({"rowcache": base}, {}), "full", evidence=(TOKENS_GRAPHS, HOST_EXPERT)
    )
    assert (device.planner, device.split, device.split_source) == ("device", "expert", "unset")
    assert device.split_line() is None
    host_set = parse_settings({"rowcache": {**base, PLANNER: "host"}}, {})
    today = choose_planner(host_set, "piecewise")
    assert (today.split, today.split_source) == ("token", "default")
    assert today.split_line() == (
        f"rowcache: split token (default in piecewise graphs: {NO_HOST_EXPERT})"
    )
    eager = choose_planner(parse_settings({"rowcache": base}, {}), "eager")
    assert (eager.planner, eager.split, eager.split_source) == ("host", "expert", "default")
    assert eager.split_line() == (
        "rowcache: split expert (default in eager mode: host_expert_exact in vLLM 0.25.0 on "
        "H200, 2026-12-02 at 17fd5a4)"
    )


def test_the_split_record_is_read_back_and_checked() -> None:
    record = {"split": "expert", "reason": "default in eager mode: x"}
    base: dict[str, object] = {"moe_expert_cache_size": 8}
    settings = parse_settings({"rowcache": {**base, SPLIT_CHOSEN: record}}, {})
    assert (settings.split, settings.split_source, settings.split_reason) == (
        "expert",
        "default",
        "default in eager mode: x",
    )
    assert choose_planner(settings, "eager", evidence=()).split == "expert"
    over = parse_settings({"rowcache": {**base, SPLIT_CHOSEN: record, SPLIT: "token"}}, {})
    assert (over.split, over.split_source) == ("token", "setting")
    for bad in ("expert", {"split": "rows", "reason": "x"}, {"split": "expert"}):
        with pytest.raises(KnobError, match=SPLIT_CHOSEN):
            parse_settings({"rowcache": {**base, SPLIT_CHOSEN: bad}}, {})


# -- through the config hook ------------------------------------------------------------------


def _planner_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "rowcache.vllm" and r.getMessage().startswith("rowcache: planner ")
    ]


@pytest.fixture
def said() -> None:
    from rowcache.vllm import _config as config_hook

    config_hook._said.clear()


def test_hook_chooses_from_the_resolved_mode_and_logs_once(
    fake_vllm: Any,  # noqa: F811
    said: None,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(PLANNER_ENV, raising=False)
    # Without a record the default is the host planner, and full graphs are lowered for it.
    monkeypatch.setattr(defaults, "EVIDENCE", ())
    plugin.register()
    from vllm.config.compilation import CUDAGraphMode

    caplog.set_level(logging.INFO, logger="rowcache.vllm")
    section = {"moe_expert_cache_size": 16}
    configs = [_config(fake_vllm, dict(section)) for _ in range(3)]
    # vLLM's default mode is FULL_AND_PIECEWISE (resolved in its post-init): host, lowered.
    for config in configs:
        assert config.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
        assert config.additional_config["rowcache"][PLANNER_CHOSEN]["planner"] == "host"
    lines = _planner_lines(caplog)
    assert lines == [f"rowcache: planner host (default in full graphs: {NO_TOKENS})"]
    active = [m for m in caplog.messages if m.startswith("rowcache: 16 slots")]
    assert active == [
        "rowcache: 16 slots per MoE layer, provider 'row', split 'token', planned on the host"
    ]
    # The caller's section is not changed; a copy re-validated keeps the recorded choice.
    assert PLANNER_CHOSEN not in section
    fake_vllm.config.VllmConfig.__post_init__(configs[0])
    assert len(_planner_lines(caplog)) == 1
    from rowcache.vllm._config import settings_of

    assert settings_of(configs[0]).planner_source == "default"


def test_hook_records_and_logs_the_host_planners_split(
    fake_vllm: Any,  # noqa: F811
    said: None,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the host planner's expert split recorded for the piecewise graphs it runs between,
    an engine in vLLM's default (full) mode without a device record takes the host planner and
    the expert split; the choice is written back and said once; a given split stays."""
    monkeypatch.delenv(PLANNER_ENV, raising=False)
    monkeypatch.delenv(ENV[SPLIT], raising=False)
    monkeypatch.setattr(defaults, "EVIDENCE", (_evidence(HOST_EXPERT_EXACT, "piecewise"),))
    plugin.register()
    caplog.set_level(logging.INFO, logger="rowcache.vllm")
    configs = [_config(fake_vllm, {"moe_expert_cache_size": 16}) for _ in range(2)]
    for config in configs:
        assert config.additional_config["rowcache"][SPLIT_CHOSEN]["split"] == "expert"
    splits = [m for m in caplog.messages if m.startswith("rowcache: split ")]
    assert splits == [
        "rowcache: split expert (default in piecewise graphs (full graphs lowered for the host "
        "planner): host_expert_exact in vLLM 0.25.0 on H200, 2026-12-02 at abc1234)"
    ]
    from rowcache.vllm._config import settings_of

    fake_vllm.config.VllmConfig.__post_init__(configs[0])
    assert settings_of(configs[0]).split == "expert"
    given = _config(fake_vllm, {"moe_expert_cache_size": 16, SPLIT: "token"})
    assert SPLIT_CHOSEN not in given.additional_config["rowcache"]
    assert settings_of(given).split == "token"


def test_hook_with_device_evidence_keeps_full_graphs(
    fake_vllm: Any,  # noqa: F811
    said: None,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(PLANNER_ENV, raising=False)
    # Flipping the default is one data change: a record in EVIDENCE.
    monkeypatch.setattr(defaults, "EVIDENCE", (TOKENS_GRAPHS,))
    plugin.register()
    from vllm.config.compilation import CUDAGraphMode

    caplog.set_level(logging.INFO, logger="rowcache.vllm")
    config = _config(fake_vllm, {"moe_expert_cache_size": 16})
    cc = config.compilation_config
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert cc.splitting_ops == ["vllm::unified_attention_with_output"]
    chosen = config.additional_config["rowcache"][PLANNER_CHOSEN]
    assert chosen["planner"] == "device"
    # Re-validating the copy (graphs unchanged) keeps the device planner.
    fake_vllm.config.VllmConfig.__post_init__(config)
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    [line] = _planner_lines(caplog)
    assert line.startswith("rowcache: planner device (default in full graphs: tokens_exact")


def test_hook_override_is_logged_as_set(
    fake_vllm: Any,  # noqa: F811
    said: None,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plugin.register()
    caplog.set_level(logging.INFO, logger="rowcache.vllm")
    monkeypatch.setenv(PLANNER_ENV, "device")
    monkeypatch.setenv(ENV["moe_expert_cache_size"], "16")
    for _ in range(2):
        config = _config(fake_vllm, None)
        assert PLANNER_CHOSEN not in config.additional_config.get("rowcache", {})
    assert _planner_lines(caplog) == [f"rowcache: planner device (set by {PLANNER_ENV})"]


def test_env_only_configuration_carries_the_choice(
    fake_vllm: Any,  # noqa: F811
    said: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(PLANNER_ENV, raising=False)
    monkeypatch.setenv(ENV["moe_expert_cache_size"], "16")
    plugin.register()
    from vllm.config.compilation import CompilationMode

    config = _config(fake_vllm, None, mode=CompilationMode.NONE)
    assert config.additional_config == {
        "rowcache": {
            PLANNER_CHOSEN: {
                "planner": "device",
                "reason": "default in full graphs: tokens_exact in vLLM 0.25.0 on H200, "
                "2026-12-01 at 25f83b1",
            },
            # The fake configuration has no dtype: auto stays raw bytes, saying why.
            COMPRESS_CHOSEN: {
                "compress": "off",
                "reason": "default: planes hold bf16 experts and the model's dtype is not known",
            },
        }
    }


def test_plugin_logger_follows_vllms_handlers(fake_vllm: Any) -> None:  # noqa: F811
    from rowcache.vllm._config import follow_vllm_logging

    ours = logging.getLogger("rowcache.vllm")
    theirs = logging.getLogger("vllm")
    saved = (list(ours.handlers), ours.level, ours.propagate, theirs.level)
    handler = logging.StreamHandler()
    try:
        follow_vllm_logging()  # vLLM configured nothing: unchanged
        assert ours.handlers == saved[0] and ours.propagate == saved[2]
        theirs.addHandler(handler)
        theirs.setLevel(logging.INFO)
        follow_vllm_logging()
        assert ours.handlers == [handler] and ours.level == logging.INFO and not ours.propagate
        follow_vllm_logging()  # once
        assert ours.handlers == [handler]
    finally:
        ours.removeHandler(handler)
        for h in saved[0]:
            ours.addHandler(h)
        ours.setLevel(saved[1])
        ours.propagate = saved[2]
        theirs.removeHandler(handler)
        theirs.setLevel(saved[3])


# -- compress: auto -----------------------------------------------------------------------------

PLANES = _evidence(PLANES_FASTER, "full")


def test_compress_auto_is_resolved_by_planner_mode_quantization_and_dtype() -> None:
    """``on`` only for the device planner's bf16 experts in a mode and quantization with a
    planes record; every other case ``off``, each with its reason."""
    cite = "planes_faster in vLLM 0.25.0 on H200, 2026-12-02 at abc1234"
    evidence = (PLANES,)
    assert default_compress("full", planner="device", dtype="bfloat16", evidence=evidence) == (
        "on",
        f"default in full graphs: {cite}",
    )
    assert default_compress("full", planner="host", dtype="bfloat16", evidence=evidence) == (
        "off",
        f"default: {NO_HOST_PLANES}",
    )
    assert default_compress("full", planner="device", dtype="float16", evidence=evidence) == (
        "off",
        "default: planes hold bf16 experts and the model's dtype is float16",
    )
    assert default_compress("piecewise", planner="device", dtype="bfloat16", evidence=evidence) == (
        "off",
        f"default in piecewise graphs: {NO_PLANES}",
    )
    quantized = "default: planes hold bf16 experts; quantization 'fp8' does not"
    assert default_compress(
        "full", planner="device", quantization="fp8", dtype="bfloat16", evidence=evidence
    ) == ("off", quantized)
    # Not even a record naming FP8 turns planes on for it (its experts are not bf16).
    fp8_planes = _evidence(PLANES_FASTER, "full", quantizations=("fp8",))
    assert default_compress(
        "full", planner="device", quantization="fp8", dtype="bfloat16", evidence=(fp8_planes,)
    ) == ("off", quantized)
    assert default_compress("full", planner="device", dtype="bfloat16", evidence=()) == (
        "off",
        f"default in full graphs: {NO_PLANES}",
    )


def test_choose_planner_resolves_auto_after_the_planner() -> None:
    """``auto`` follows the planner chosen (or set) for the engine; ``on`` and ``off`` given
    stay as given; the resolved value and its reason are what the start-up line says."""
    base: dict[str, object] = {"moe_expert_cache_size": 16}
    evidence = (TOKENS_GRAPHS, PLANES)
    auto = parse_settings({"rowcache": base}, {})
    assert auto.compress == "auto" and not auto.compress_planes and auto.compress_line() is None
    full = choose_planner(auto, "full", evidence=evidence, dtype="bfloat16")
    assert (full.planner, full.compress, full.compress_source) == ("device", "on", "default")
    assert full.compress_planes and full.describe().endswith("experts held as bf16 planes")
    assert full.compress_line() == (
        "rowcache: compress on (default in full graphs: planes_faster in vLLM 0.25.0 on H200, "
        "2026-12-02 at abc1234)"
    )
    eager = choose_planner(auto, "eager", evidence=evidence, dtype="bfloat16")
    assert (eager.planner, eager.compress, eager.compress_source) == ("host", "off", "default")
    assert eager.compress_line() == f"rowcache: compress off (default: {NO_HOST_PLANES})"
    half = choose_planner(auto, "full", evidence=evidence, dtype="float16")
    assert (half.planner, half.compress) == ("device", "off")
    for given in ("on", "off"):
        settings = parse_settings({"rowcache": {**base, PLANNER: "device", COMPRESS: given}}, {})
        kept = choose_planner(settings, "full", evidence=(PLANES,), dtype="float16")
        assert (kept.compress, kept.compress_source, kept.compress_line()) == (
            given,
            "setting",
            None,
        )
    # Resolved once: later evidence does not change it.
    assert choose_planner(full, "full", evidence=(), dtype="bfloat16").compress == "on"


def test_the_compress_record_is_read_back_and_checked() -> None:
    record = {"compress": "on", "reason": "default in full graphs: x"}
    base: dict[str, object] = {"moe_expert_cache_size": 8, PLANNER: "device"}
    settings = parse_settings({"rowcache": {**base, COMPRESS_CHOSEN: record}}, {})
    assert (settings.compress, settings.compress_source, settings.compress_reason) == (
        "on",
        "default",
        "default in full graphs: x",
    )
    assert settings.compress_planes
    assert choose_planner(settings, "full", evidence=(), dtype="bfloat16").compress == "on"
    over = parse_settings({"rowcache": {**base, COMPRESS_CHOSEN: record, COMPRESS: "off"}}, {})
    assert (over.compress, over.compress_source) == ("off", "setting")
    for bad in ("on", {"compress": "auto", "reason": "x"}, {"compress": "on"}):
        with pytest.raises(KnobError, match=COMPRESS_CHOSEN):
            parse_settings({"rowcache": {**base, COMPRESS_CHOSEN: bad}}, {})
    # A record of "on" where the device planner does not serve (a stale configuration) is
    # refused, naming what serves; "off" stands anywhere.
    size: dict[str, object] = {"moe_expert_cache_size": 8}
    for section, served in (
        ({**size, PLANNER: "host"}, "moe_expert_cache_planner 'host'"),
        (size, "moe_expert_cache_planner 'host'"),  # no planner chosen yet
        ({**size, "moe_expert_cache_provider": "cached"}, "provider 'cached'"),
    ):
        with pytest.raises(KnobError, match=f"'on' needs the device planner.*has {served}"):
            parse_settings({"rowcache": {**section, COMPRESS_CHOSEN: record}}, {})
        off = {"compress": "off", "reason": "x"}
        kept = parse_settings({"rowcache": {**section, COMPRESS_CHOSEN: off}}, {})
        assert not kept.compress_planes
    chosen_device = {"planner": "device", "reason": "default in full graphs: x"}
    by_record = parse_settings(
        {"rowcache": {**size, PLANNER_CHOSEN: chosen_device, COMPRESS_CHOSEN: record}}, {}
    )
    assert by_record.compress_planes and by_record.planner == "device"


def test_hook_holds_bf16_experts_as_planes_in_full_graphs(
    fake_vllm: Any,  # noqa: F811
    said: None,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bf16 model in vLLM's default full graphs with the slot count alone set: the device
    planner and the planes, both written back and said once, and read back by
    ``settings_of`` (what the method builds its provider from); a float16 model keeps raw
    bytes."""
    import torch

    monkeypatch.delenv(PLANNER_ENV, raising=False)
    monkeypatch.delenv(ENV[COMPRESS], raising=False)
    plugin.register()
    caplog.set_level(logging.INFO, logger="rowcache.vllm")
    configs = [
        _config(fake_vllm, {"moe_expert_cache_size": 16}, dtype=torch.bfloat16) for _ in range(2)
    ]
    for config in configs:
        assert config.additional_config["rowcache"][COMPRESS_CHOSEN]["compress"] == "on"
    said_lines = [m for m in caplog.messages if m.startswith("rowcache: compress ")]
    assert said_lines == [
        "rowcache: compress on (default in full graphs: planes_faster in vLLM 0.25.0 on H200, "
        "2026-12-04 at 9d4f84f)"
    ]
    described = (
        "rowcache: 16 slots per MoE layer, provider 'row', planned on the device, experts held "
        "as bf16 planes"
    )
    assert described in caplog.messages
    from rowcache.vllm._config import settings_of

    fake_vllm.config.VllmConfig.__post_init__(configs[0])
    assert settings_of(configs[0]).compress_planes
    half = _config(fake_vllm, {"moe_expert_cache_size": 16}, dtype=torch.float16)
    assert half.additional_config["rowcache"][COMPRESS_CHOSEN] == {
        "compress": "off",
        "reason": "default: planes hold bf16 experts and the model's dtype is float16",
    }
    assert not settings_of(half).compress_planes
