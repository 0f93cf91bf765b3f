"""The seams table against the source of every supported vLLM release, read from its wheel.

The wheels come from ``tests/vllm_wheels.py`` (downloaded once per machine, never installed)
and only the modules the table names are read from the zip. A failed download fails the test:
the check is never skipped.
"""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path

import pytest
import vllm_wheels

from rowcache.vllm import seams
from rowcache.vllm.seams import SEAMS, SUPPORTED_VLLM, Seam, check_seam, check_source, module_path

PLUGIN = sorted(Path(seams.__file__).parent.glob("*.py"))


@pytest.fixture(scope="session")
def wheel_sources() -> dict[str, dict[str, str]]:
    """vLLM version -> {path in the wheel -> source} for every module the table names."""
    wanted = {path for seam in SEAMS for path in module_path(seam.module)}
    sources: dict[str, dict[str, str]] = {}
    for version in SUPPORTED_VLLM:
        with zipfile.ZipFile(vllm_wheels.wheel(version)) as wheel:
            names = set(wheel.namelist())
            sources[version] = {
                path: wheel.read(path).decode("utf-8") for path in wanted if path in names
            }
    return sources


@pytest.mark.parametrize("version", SUPPORTED_VLLM)
def test_seams_hold_in_vllm_release(version: str, wheel_sources: dict[str, dict[str, str]]) -> None:
    failures = check_source(wheel_sources[version])
    assert not failures, f"vLLM {version}: {len(failures)} seam(s) moved:\n" + "\n".join(failures)


def test_table_is_complete_and_described() -> None:
    assert len({(s.module, s.name) for s in SEAMS}) == len(SEAMS)
    for seam in SEAMS:
        assert seam.module.startswith("vllm"), seam
        assert seam.why and seam.breaks, seam


def _vllm_imports(path: Path) -> set[tuple[str, str]]:
    tree = ast.parse(path.read_text())
    found: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm"):
            found |= {(node.module, alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {(a.name, "") for a in node.names if a.name.split(".")[0] == "vllm"}
    return found


def test_every_vllm_import_of_the_plugin_is_a_seam() -> None:
    listed = {(s.module, s.name.split(".")[0].split("(")[0]) for s in SEAMS}
    imported = set().union(*(_vllm_imports(path) for path in PLUGIN))
    assert imported, "the plugin imports nothing from vLLM?"
    missing = sorted(imported - listed)
    assert not missing, f"vLLM names the plugin imports but the seams table lacks: {missing}"


def test_the_hooked_package_is_a_seam() -> None:
    import rowcache.vllm as plugin

    assert plugin.FUSED_MOE in {s.module for s in SEAMS}


def test_registration_imports_only_vllm_config() -> None:
    """What register() imports at entry-point time: vllm.config (already imported by vLLM when
    it loads plugins) and nothing else of vLLM; the fused-MoE modules wait for the hook."""
    directory = Path(seams.__file__).parent
    for light in ("__init__.py", "_post_import.py", "knob.py", "seams.py"):
        assert _vllm_imports(directory / light) == set(), light
    config_hook = _vllm_imports(directory / "_config.py")
    assert config_hook and all(m.startswith("vllm.config.") for m, _ in config_hook)


# -- the checker itself must catch a moved seam -------------------------------------------------

SOURCE = """
from .other import reexported

LIMIT = 3

def lookup(w1_shape, w2_shape, M, block_shape=None):
    return {}

class Method(Base):
    field: int = 0

    def __init__(self, moe):
        self.backend, self.kind = pick(moe)

    def apply(self, layer, x, topk_ids):
        return x

    def run(self, x):
        self.finish(x)

    def finish(self, x):
        self.moe_sum(x, x)

direct_register_custom_op(op_name="moe_forward", op_func=f)
"""


@pytest.mark.parametrize(
    "name",
    [
        "LIMIT",
        "reexported",
        "Method",
        "Method.field",
        "Method.backend",
        "Method.kind",
        "Method.apply(layer, x, topk_ids)",
        "op:moe_forward",
        "Method.run -> moe_sum",
        "Method.finish -> moe_sum",
        "lookup(w1_shape, w2_shape, M, block_shape)",
    ],
)
def test_checker_accepts(name: str) -> None:
    assert check_seam(Seam("m", name, "why", "breaks"), SOURCE) is None


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("Gone", "'Gone' is not defined at the top level"),
        ("LIMIT.x", "'LIMIT' is not a class"),
        ("Method.missing", "class Method does not define 'missing'"),
        ("Method.apply(layer, x, topk_weights)", "has no parameter(s) topk_weights"),
        ("Method.field()", "Method.field is not a method"),
        ("op:moe_forward_shared", "no custom op registered as 'moe_forward_shared'"),
        ("Method.apply -> moe_sum", "Method.apply never calls self.moe_sum(...)"),
        ("Method.gone -> moe_sum", "Method.gone is not a method"),
        ("LIMIT.run -> moe_sum", "'LIMIT' is not a class"),
        ("lookup(w1_shape, top_k)", "lookup has no parameter(s) top_k"),
        ("LIMIT(x)", "'LIMIT' is not a function defined in the module"),
    ],
)
def test_checker_rejects_naming_the_seam(name: str, reason: str) -> None:
    problem = check_seam(Seam("vllm.some.module", name, "why", "breaks"), SOURCE)
    assert problem is not None
    assert problem.startswith(f"vllm.some.module: {name}")
    assert reason in problem


def test_check_source_reports_missing_module_with_why() -> None:
    failures = check_source({})
    assert len(failures) == len(SEAMS)
    first = SEAMS[0]
    assert failures[0].startswith(f"{first.module}: {first.name}: module not found")
    assert first.why in failures[0]


def test_check_source_finds_a_renamed_method() -> None:
    seam = next(s for s in SEAMS if s.name.startswith("UnquantizedFusedMoEMethod.apply("))
    path = module_path(seam.module)[0]
    moved = "class UnquantizedFusedMoEMethod:\n    def apply_moe(self, layer, x): ...\n"
    failures = [f for f in check_source({path: moved}) if "UnquantizedFusedMoEMethod.apply(" in f]
    assert len(failures) == 1 and "does not define 'apply'" in failures[0]
