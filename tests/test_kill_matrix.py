"""The kill matrix's rows (``model_check.cli.kill_row``), as ``python -m model_check mutants``
builds them: every applicable checker kills a catalogued mutant, the ``intended`` column finds
the property the mutant was seeded against in the first model that expresses it, and a mutant
declared against a property its bug does not break survives that column, so the matrix fails.
(z3's column is left out here: ``tests/test_z3_check.py`` kills the catalogue with z3; the machine's
column runs a few examples, since a kill needs only a failing one.)"""

from __future__ import annotations

import dataclasses

import pytest

from model_check import cli
from model_check.cli import kill_row
from model_check.config import Check
from model_check.report import survivors
from model_check.table import load_table
from model_check.table.mutants import device_mutant, mutant
from model_check.table.reference import Bounds
from model_check.table.schema import load_device_table

HOST, DEVICE = load_table(), load_device_table()


@pytest.mark.parametrize(
    "name",
    [
        "hit_path_ignores_handoff",  # neither search stops at its P1: searched for alone
        "wait_for_latest_record",  # P7: the summary cannot express it, the explicit model can
    ],
)
def test_a_host_mutant_is_killed_and_breaks_its_property(name: str) -> None:
    m = mutant(name)
    row = kill_row(m, HOST, examples=200, steps=30, use_z3=False)
    assert next(k for k in row if k.checker == "intended").found == m.breaks
    assert survivors([(m, row)]) == []


def test_the_intended_search_takes_the_first_model_that_expresses_the_property() -> None:
    host_path = mutant("hit_path_ignores_handoff").apply(HOST)
    summary_only = (Check("hb", Bounds(3, 2), 6),)
    assert cli.intended_search(host_path, "P1_no_overwrite_under_reader", summary_only) == (
        "P1_no_overwrite_under_reader"
    )
    deadlock = mutant("wait_for_latest_record").apply(HOST)
    assert cli.intended_search(deadlock, "P7_no_deadlock", summary_only) is None
    assert cli.intended_search(deadlock, "P7_no_deadlock", cli.INTENDED_CHECKS) == (
        "P7_no_deadlock"
    )


def test_a_device_mutant_is_killed_and_breaks_its_property() -> None:
    m = device_mutant("dp_next_pass_gather_unordered")  # the summary finds P10, not its P1
    row = kill_row(m, DEVICE, examples=200, steps=30, use_z3=False)
    assert next(k for k in row if k.checker == "intended").found == m.breaks
    assert survivors([(m, row)]) == []


def test_a_mutant_declared_against_another_property_survives_the_intended_column(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The intended search at a small bound: without the declared property to stop it, it
    # explores the mutant's whole space, which at the matrix's bound takes minutes.
    monkeypatch.setattr(cli, "INTENDED_CHECKS", (Check("hb", Bounds(3, 2), 3),))
    honest = mutant("ready_before_copies")
    assert honest.breaks == "P2_no_stale_read"
    assert kill_row(honest, HOST, examples=200, steps=30, use_z3=False)[2].found == honest.breaks
    wrong = dataclasses.replace(honest, breaks="P5_victim_protection")
    row = kill_row(wrong, HOST, examples=200, steps=30, use_z3=False)
    assert [k.checker for k in row] == [
        "hb/3e2c/d6",
        "interleavings/3e2c/d4",
        "intended",
        "hypothesis",
    ]
    assert survivors([(wrong, row)]) == [("ready_before_copies", "intended")]
