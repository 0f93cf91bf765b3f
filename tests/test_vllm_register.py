"""Plugin registration without vLLM: one warning when vLLM is missing; against a fake vLLM
(the registry, the config class and the MoE method reduced to what the plugin touches):
idempotence, the config hook's guards and graph lowering, and no double registration."""

from __future__ import annotations

import logging
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import rowcache.vllm as plugin
from rowcache.vllm._post_import import forget, pending
from rowcache.vllm.knob import PLANNER_CHOSEN, KnobError
from rowcache.vllm.memory_line import take_line

FAKE_VLLM = {
    "vllm/__init__.py": "",
    "vllm/config/__init__.py": "",
    "vllm/config/compilation.py": """
        import enum

        class CompilationMode(enum.IntEnum):
            NONE = 0
            VLLM_COMPILE = 3

        class CUDAGraphMode(enum.Enum):
            NONE = 0
            PIECEWISE = 1
            FULL = 2
            FULL_AND_PIECEWISE = 3

            def has_full_cudagraphs(self):
                return self in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE)
        """,
    "vllm/config/vllm.py": """
        from vllm.config.compilation import CompilationMode, CUDAGraphMode

        POST_INIT_CALLS = []

        class VllmConfig:
            def __init__(self, additional_config=None, compilation_config=None,
                         parallel_config=None, lora_config=None, model_config=None,
                         kernel_config=None, offload_config=None):
                self.additional_config = additional_config or {}
                self.compilation_config = compilation_config
                self.parallel_config = parallel_config
                self.lora_config = lora_config
                self.model_config = model_config
                self.kernel_config = kernel_config
                self.offload_config = offload_config
                self.__post_init__()

            def __post_init__(self):
                POST_INIT_CALLS.append(self)
                cc = self.compilation_config
                # vLLM fills the default splitting ops and graph mode in its own post-init.
                if cc.splitting_ops is None:
                    cc.splitting_ops = ["vllm::unified_attention_with_output"]
                if cc.cudagraph_mode is None:
                    cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE

        CURRENT = []

        def get_current_vllm_config():
            if not CURRENT:
                raise RuntimeError("not in an engine")
            return CURRENT[-1]
        """,
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/custom_op.py": """
        op_registry_oot = {}

        class CustomOp:
            def __new__(cls, *args, **kwargs):
                # As vLLM's: the out-of-tree class registered under this class's name.
                return super().__new__(op_registry_oot.get(cls.__name__, cls))

            @classmethod
            def register_oot(cls, _decorated_op_cls=None, name=None):
                reg_name = name if name is not None else cls.__name__
                assert reg_name not in op_registry_oot, f"Duplicate op name: {reg_name}"
                _decorated_op_cls.name = reg_name
                op_registry_oot[reg_name] = _decorated_op_cls
                return _decorated_op_cls
        """,
    "vllm/model_executor/utils.py": """
        def set_weight_attrs(weight, attrs):
            for key, value in (attrs or {}).items():
                setattr(weight, key, value)
        """,
    "vllm/model_executor/layers/__init__.py": "",
    # As vLLM's: the package imports the method's module midway.
    "vllm/model_executor/layers/fused_moe/__init__.py": """
        from contextlib import contextmanager

        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )

        # As vLLM's: a module-level override of the kernel configuration lookup.
        _config = None

        @contextmanager
        def override_config(config):
            global _config
            old_config = _config
            _config = config
            yield
            _config = old_config

        def get_config():
            return _config
        """,
    "vllm/model_executor/layers/fused_moe/fused_moe.py": """
        def try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M, block_shape=None):
            # As vLLM's: the override first, else a choice by expert count (a tuned file is
            # looked up by E and N) and rows.
            from vllm.model_executor.layers.fused_moe import get_config

            override = get_config()
            if override:
                return override
            return {"E": w2_shape[0], "N": w2_shape[2], "M": M, "top_k": top_k,
                    "dtype": dtype, "block_shape": block_shape}
        """,
    "vllm/model_executor/layers/fused_moe/routed_experts.py": """
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
            UnquantizedFusedMoEMethod,
        )

        class RoutedExperts:
            def __init__(self, moe_config, quant_config=None, prefix="model.layers.0.mlp"):
                self.moe_config = moe_config
                self.quant_method = self._get_quant_method(prefix, quant_config, moe_config)

            def _get_quant_method(self, prefix, quant_config, moe_config):
                # As vLLM's: the quantization config's method, else the unquantized one.
                method = None
                if quant_config is not None:
                    method = quant_config.get_quant_method(self, prefix)
                if method is None:
                    method = UnquantizedFusedMoEMethod(moe_config)
                return method
        """,
    "vllm/model_executor/layers/fused_moe/experts/__init__.py": "",
    "vllm/model_executor/layers/fused_moe/experts/triton_moe.py": """
        class _QuantConfig:
            block_shape = None

            def config_name(self, dtype):
                return None  # as vLLM's for unquantized bf16

        class TritonExperts:
            # As vLLM's: apply (here the test's kernel) looks its tiles up and reduces
            # [M, top_k, H] through moe_sum.
            def __init__(self):
                self.quant_config = _QuantConfig()

            @property
            def block_shape(self):
                return self.quant_config.block_shape

            def moe_sum(self, input, output):
                output.copy_(input.sum(dim=1))
        """,
    "vllm/model_executor/layers/fused_moe/oracle/__init__.py": "",
    "vllm/model_executor/layers/fused_moe/oracle/unquantized.py": """
        import enum

        class UnquantizedMoeBackend(enum.Enum):
            TRITON = "TRITON"
            FLASHINFER_CUTLASS = "FlashInfer CUTLASS"
        """,
    "vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py": """
        from vllm.model_executor.custom_op import CustomOp

        from vllm.model_executor.layers.fused_moe.oracle.unquantized import (
            UnquantizedMoeBackend,
        )

        class UnquantizedFusedMoEMethod(CustomOp):
            BACKEND = UnquantizedMoeBackend.TRITON  # vLLM selects it from the platform

            def __init__(self, moe):
                self.moe = moe
                self.unquantized_backend = self.BACKEND
                self.moe_kernel = None

            def process_weights_after_loading(self, layer):
                pass  # vLLM pads and selects its kernel here; nothing the plugin reads

            def apply(self, layer, x, topk_weights, topk_ids, shared_experts,
                      shared_experts_input):
                return self.moe_kernel.apply(
                    hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight,
                    topk_weights=topk_weights, topk_ids=topk_ids,
                    activation=layer.activation,
                    global_num_experts=layer.global_num_experts, expert_map=None,
                    apply_router_weight_on_input=layer.apply_router_weight_on_input,
                    shared_experts=shared_experts,
                    shared_experts_input=shared_experts_input,
                )
        """,
    "vllm/utils/__init__.py": "",
    "vllm/utils/torch_utils.py": """
        def get_accelerator_view_from_cpu_tensor(cpu_tensor):
            return cpu_tensor
        """,
}


FUSED_MOE = "vllm.model_executor.layers.fused_moe"
HOST = {"moe_expert_cache_planner": "host"}
"""The host planner, named: its graph adjustments (full graphs lowered, the MoE ops split out)
are what a test of them needs, whatever the default planner in full graphs."""


def _forget_vllm() -> None:
    for name in list(sys.modules):
        if name == "vllm" or name.startswith("vllm.") or name in VLLM_SIDE:
            del sys.modules[name]
    # `from rowcache.vllm import _config` would otherwise find the old module's attribute.
    for name in VLLM_SIDE:
        if hasattr(plugin, name.rpartition(".")[2]):
            delattr(plugin, name.rpartition(".")[2])
    # A post-import hook left waiting by one test must not fire in another.
    for callback in pending(FUSED_MOE):
        forget(FUSED_MOE, callback)


VLLM_SIDE = (
    "rowcache.vllm._config",
    "rowcache.vllm._quantized",
    "rowcache.vllm._method",
    "rowcache.vllm._fp8",
    "rowcache.vllm._mxfp4",
)


@pytest.fixture
def fresh_plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(plugin._state, "registered", False)
    monkeypatch.setattr(plugin._state, "method", "pending")
    _forget_vllm()
    yield
    _forget_vllm()


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_plugin: None) -> Any:
    for rel, text in FAKE_VLLM.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    for key in ("SIZE", "PROVIDER", "SPLIT", "EAGER_BETWEEN_GRAPHS"):
        monkeypatch.delenv(f"ROWCACHE_MOE_{key}", raising=False)
        monkeypatch.delenv(f"ROWCACHE_MOE_EXPERT_CACHE_{key}", raising=False)
    import vllm.config.vllm as config_module
    import vllm.model_executor.custom_op as custom_op

    assert "site-packages" not in str(config_module.__file__)
    return SimpleNamespace(config=config_module, custom_op=custom_op, root=tmp_path)


def _rowcache_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "rowcache.vllm" and r.levelno >= logging.WARNING
    ]


def test_without_vllm_one_warning_and_no_error(
    fresh_plugin: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # None in sys.modules makes `import vllm` fail even where vLLM is installed.
    monkeypatch.setitem(sys.modules, "vllm", None)
    caplog.set_level(logging.DEBUG, logger="rowcache.vllm")
    plugin.register()
    plugin.register()
    plugin.register()
    warnings = _rowcache_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "vLLM runs without the expert cache" in warnings[0]
    assert "vllm" in warnings[0]


def test_installer_failure_is_not_fatal(
    fresh_plugin: None, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def broken() -> bool:
        calls.append(1)
        raise AttributeError("module 'vllm.config' has no attribute 'VllmConfig'")

    plugin.register(broken)
    plugin.register(broken)
    assert calls == [1]
    warnings = _rowcache_warnings(caplog)
    assert len(warnings) == 1 and "AttributeError" in warnings[0]


def test_register_is_idempotent_against_fake_registry(fake_vllm: Any) -> None:
    plugin.register()
    plugin.register()
    import vllm.model_executor.layers.fused_moe  # noqa: F401  (fires the hook)

    from rowcache.vllm import _config, _method

    registry = fake_vllm.custom_op.op_registry_oot
    assert registry == {"UnquantizedFusedMoEMethod": _method.RowcacheMoEMethod}
    post_init = fake_vllm.config.VllmConfig.__post_init__
    assert getattr(post_init, "_rowcache_wrapped", False)
    # A second install in the same process (a second plugin loader) changes nothing.
    assert _method.install() is False
    assert _config.install(lambda: True) is False
    assert fake_vllm.config.VllmConfig.__post_init__ is post_init
    assert post_init.__wrapped__.__name__ == "__post_init__"
    assert not getattr(post_init.__wrapped__, "_rowcache_wrapped", False)


def test_register_refuses_to_replace_another_plugin(
    fake_vllm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    class Other:
        pass

    fake_vllm.custom_op.op_registry_oot["UnquantizedFusedMoEMethod"] = Other
    plugin.register()
    import vllm.model_executor.layers.fused_moe  # noqa: F401  (the hook fires and fails)

    assert fake_vllm.custom_op.op_registry_oot["UnquantizedFusedMoEMethod"] is Other
    warnings = _rowcache_warnings(caplog)
    assert len(warnings) == 1 and "another plugin already substitutes" in warnings[0]


# -- when the substitution is installed ----------------------------------------------------------


def _registry(fake: Any) -> dict[str, Any]:
    registry: dict[str, Any] = fake.custom_op.op_registry_oot
    return registry


def test_register_defers_the_method_until_fused_moe_is_imported(fake_vllm: Any) -> None:
    plugin.register()
    # Cheap: the config hook only; neither vLLM's fused-MoE package nor our method module.
    assert getattr(fake_vllm.config.VllmConfig.__post_init__, "_rowcache_wrapped", False)
    assert FUSED_MOE not in sys.modules and "rowcache.vllm._method" not in sys.modules
    assert _registry(fake_vllm) == {}
    assert pending(FUSED_MOE) == [plugin._install_method]
    # A configuration without the knob does not import it either.
    _config(fake_vllm, None)
    assert FUSED_MOE not in sys.modules
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

    from rowcache.vllm._method import RowcacheMoEMethod

    assert _registry(fake_vllm) == {"UnquantizedFusedMoEMethod": RowcacheMoEMethod}
    assert pending(FUSED_MOE) == [] and plugin._state.method == "installed"
    _engine(fake_vllm, None)
    assert type(UnquantizedFusedMoEMethod(_moe())) is RowcacheMoEMethod


def test_register_installs_at_once_when_fused_moe_is_imported(fake_vllm: Any) -> None:
    import vllm.model_executor.layers.fused_moe  # noqa: F401

    plugin.register()
    from rowcache.vllm._method import RowcacheMoEMethod

    assert _registry(fake_vllm) == {"UnquantizedFusedMoEMethod": RowcacheMoEMethod}
    assert pending(FUSED_MOE) == []


def test_knob_on_config_installs_the_method_before_adjusting(fake_vllm: Any) -> None:
    from vllm.config.compilation import CUDAGraphMode

    plugin.register()
    config = _config(fake_vllm, {"moe_expert_cache_size": 8, **HOST})
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert FUSED_MOE in sys.modules and plugin._state.method == "installed"
    assert set(_registry(fake_vllm)) == {"UnquantizedFusedMoEMethod"}


@pytest.mark.parametrize("package_first", [True, False])
def test_failed_substitution_leaves_the_config_unchanged(
    fake_vllm: Any, caplog: pytest.LogCaptureFixture, package_first: bool
) -> None:
    """The MoE op split out of the graphs but run by vLLM's method gives wrong tokens, so a
    configuration is adjusted only when the substitution is in place."""
    from vllm.config.compilation import CUDAGraphMode

    class Other:
        pass

    _registry(fake_vllm)["UnquantizedFusedMoEMethod"] = Other
    plugin.register()
    if package_first:
        import vllm.model_executor.layers.fused_moe  # noqa: F401  (no exception escapes)
    for _ in range(2):
        config = _config(fake_vllm, {"moe_expert_cache_size": 8}, ep=True)
        cc = config.compilation_config
        assert cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
        assert cc.splitting_ops == ["vllm::unified_attention_with_output"]
    assert _registry(fake_vllm)["UnquantizedFusedMoEMethod"] is Other
    warnings = _rowcache_warnings(caplog)
    assert len(warnings) == 1 and "another plugin already substitutes" in warnings[0]


def test_without_wrapt_one_warning_and_the_config_unchanged(
    fake_vllm: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The hook waits through wrapt (the vllm extra installs it): without it the plugin stays
    off, with one warning that names it, and no configuration is adjusted."""
    monkeypatch.setitem(sys.modules, "wrapt", None)
    plugin.register()
    plugin.register()
    warnings = _rowcache_warnings(caplog)
    assert len(warnings) == 1 and "wrapt" in warnings[0], warnings
    assert plugin._state.method == "failed" and pending(FUSED_MOE) == []
    config = _config(fake_vllm, {"moe_expert_cache_size": 8})
    assert config.compilation_config.splitting_ops == ["vllm::unified_attention_with_output"]
    import vllm.model_executor.layers.fused_moe  # noqa: F401

    assert _registry(fake_vllm) == {}


def test_register_while_fused_moe_is_being_imported(
    fake_vllm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    init = fake_vllm.root / "vllm/model_executor/layers/fused_moe/__init__.py"
    init.write_text(init.read_text() + "\nimport rowcache.vllm\nrowcache.vllm.register()\n")
    import vllm.model_executor.layers.fused_moe  # noqa: F401

    warnings = _rowcache_warnings(caplog)
    assert len(warnings) == 1 and "is being imported" in warnings[0]
    assert _registry(fake_vllm) == {} and plugin._state.method == "failed"
    config = _config(fake_vllm, {"moe_expert_cache_size": 8})
    assert config.compilation_config.splitting_ops == ["vllm::unified_attention_with_output"]


def _config(fake: Any, section: dict[str, object] | None, **kw: Any) -> Any:
    from vllm.config.compilation import CompilationMode

    cc = SimpleNamespace(
        mode=kw.pop("mode", CompilationMode.VLLM_COMPILE),
        cudagraph_mode=kw.pop("cudagraph_mode", None),
        splitting_ops=kw.pop("splitting_ops", None),
    )
    parallel = SimpleNamespace(
        enable_expert_parallel=kw.pop("ep", False),
        data_parallel_size=kw.pop("dp", 1),
        tensor_parallel_size=kw.pop("tp", 1),
    )
    model = SimpleNamespace(
        quantization=kw.pop("quantization", None),
        # vLLM's resolved dtype (a torch.dtype); None: a configuration without one.
        dtype=kw.pop("dtype", None),
        # The checkpoint's own quantization config (vLLM: None for a bf16 checkpoint).
        model_arch_config=SimpleNamespace(quantization_config=kw.pop("checkpoint_quant", None)),
    )
    offload = SimpleNamespace(
        uva=SimpleNamespace(cpu_offload_gb=kw.pop("cpu_offload_gb", 0)),
        prefetch=SimpleNamespace(offload_group_size=kw.pop("offload_group_size", 0)),
    )
    return fake.config.VllmConfig(
        additional_config={} if section is None else {"rowcache": section},
        compilation_config=cc,
        parallel_config=parallel,
        lora_config=kw.pop("lora", None),
        model_config=model,
        kernel_config=SimpleNamespace(moe_backend=kw.pop("moe_backend", "auto")),
        offload_config=offload,
    )


def test_config_hook_off_leaves_vllm_unchanged(fake_vllm: Any) -> None:
    plugin.register()
    from vllm.config.compilation import CUDAGraphMode

    config = _config(fake_vllm, None)
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert config.compilation_config.splitting_ops == ["vllm::unified_attention_with_output"]


def test_config_hook_lowers_full_graphs_and_splits_moe(fake_vllm: Any) -> None:
    plugin.register()
    from vllm.config.compilation import CUDAGraphMode

    from rowcache.vllm._config import MOE_OPS

    config = _config(fake_vllm, {"moe_expert_cache_size": 32, **HOST})
    cc = config.compilation_config
    assert cc.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert cc.splitting_ops == ["vllm::unified_attention_with_output", *MOE_OPS]
    # Running the hook again (vLLM re-validates copies) adds nothing twice.
    fake_vllm.config.VllmConfig.__post_init__(config)
    assert cc.splitting_ops == ["vllm::unified_attention_with_output", *MOE_OPS]

    explicit = _config(
        fake_vllm, {"moe_expert_cache_size": 32, **HOST}, cudagraph_mode=CUDAGraphMode.FULL
    )
    assert explicit.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE


def test_device_planner_keeps_the_users_graph_modes(fake_vllm: Any) -> None:
    plugin.register()
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    knob = {"moe_expert_cache_size": 32, "moe_expert_cache_planner": "device"}
    config = _config(fake_vllm, knob, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    cc = config.compilation_config
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert cc.splitting_ops == ["vllm::unified_attention_with_output"]
    eager = _config(fake_vllm, knob, mode=CompilationMode.NONE, cudagraph_mode=CUDAGraphMode.FULL)
    assert eager.compilation_config.cudagraph_mode == CUDAGraphMode.FULL
    # The guards still run.
    with pytest.raises(RuntimeError, match="tensor parallelism"):
        _config(fake_vllm, knob, tp=2)


def test_config_hook_without_compile_drops_graphs(fake_vllm: Any) -> None:
    plugin.register()
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    config = _config(
        fake_vllm,
        {"moe_expert_cache_size": 8, **HOST},
        mode=CompilationMode.NONE,
        cudagraph_mode=CUDAGraphMode.FULL,
    )
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE


def test_config_hook_rejects_full_graph_splitting(fake_vllm: Any) -> None:
    plugin.register()
    with pytest.raises(RuntimeError, match=r"splitting_ops=\[\]"):
        _config(fake_vllm, {"moe_expert_cache_size": 8, **HOST}, splitting_ops=[])


def test_bad_knob_stops_config_before_vllm_post_init(fake_vllm: Any) -> None:
    plugin.register()
    calls = fake_vllm.config.POST_INIT_CALLS
    before = len(calls)
    with pytest.raises(KnobError, match=r"moe_expert_cache_split.*'rows'.*token, expert"):
        _config(fake_vllm, {"moe_expert_cache_size": 8, "moe_expert_cache_split": "rows"})
    assert len(calls) == before


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"ep": True}, "expert parallelism"),
        ({"dp": 2}, "data parallelism (data_parallel_size=2)"),
        ({"tp": 2}, "tensor parallelism yet (tensor_parallel_size=2)"),
        ({"lora": object()}, "LoRA"),
        ({"quantization": "modelopt_fp4"}, "quantization 'modelopt_fp4'"),
        ({"cpu_offload_gb": 6.75}, "vLLM's weight offload (cpu_offload_gb=6.75)"),
        ({"offload_group_size": 8}, "vLLM's weight offload (offload_group_size=8)"),
    ],
)
def test_guards(fake_vllm: Any, kw: dict[str, Any], fragment: str) -> None:
    plugin.register()
    with pytest.raises(RuntimeError) as info:
        _config(fake_vllm, {"moe_expert_cache_size": 8}, **kw)
    assert fragment in str(info.value)
    assert "moe_expert_cache_size=8" in str(info.value)
    # The same setup without the cache starts.
    _config(fake_vllm, None, **kw)


def test_env_turns_cache_on(fake_vllm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin.register()
    from vllm.config.compilation import CUDAGraphMode

    monkeypatch.setenv("ROWCACHE_MOE_EXPERT_CACHE_SIZE", "16")
    config = _config(fake_vllm, None)
    # On: the planner is chosen (the device planner, by default in full graphs) and recorded.
    assert config.additional_config["rowcache"][PLANNER_CHOSEN]["planner"] == "device"
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    monkeypatch.setenv("ROWCACHE_MOE_EXPERT_CACHE_PLANNER", "host")
    assert _config(fake_vllm, None).compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    with pytest.raises(RuntimeError, match="expert parallelism"):
        _config(fake_vllm, None, ep=True)


@pytest.mark.parametrize(
    ("quantization", "checkpoint_quant", "planner", "why"),
    [
        # An FP8 checkpoint: FP8 run 2 of 2026-12-02 recorded the device planner's tokens.
        ("fp8", {"quant_method": "fp8"}, "device", "2026-12-02 at 0a40184"),
        # vLLM 0.25.0's online FP8 (a bf16 checkpoint): no record of its own yet.
        ("fp8", None, "host", "quantization 'fp8_per_tensor'"),
        # vLLM 0.33.0's name for it.
        ("fp8_per_tensor", None, "host", "quantization 'fp8_per_tensor'"),
        # gpt-oss: the models run of 2026-12-04 recorded the device planner's tokens.
        ("gpt_oss_mxfp4", None, "device", "2026-12-04 at 02d9512"),
    ],
)
def test_the_default_planner_follows_each_quantizations_record(
    fake_vllm: Any,
    quantization: str,
    checkpoint_quant: dict[str, str] | None,
    planner: str,
    why: str,
) -> None:
    """A record covers the quantization it ran. vLLM 0.25.0 calls both FP8 variants ``fp8``;
    the default planner's records must not: online per-tensor FP8 quantizes each kernel call's
    input with one scale, so the record of FP8 checkpoints says nothing of it."""
    plugin.register()
    config = _config(
        fake_vllm,
        {"moe_expert_cache_size": 32},
        quantization=quantization,
        checkpoint_quant=checkpoint_quant,
    )
    chosen = config.additional_config["rowcache"][PLANNER_CHOSEN]
    assert chosen["planner"] == planner
    assert why in chosen["reason"]


# -- the substituted MoE method, with a reference kernel on the CPU ------------------------------

E, TOP_K, HIDDEN, INTER = 8, 2, 16, 8


class ReferenceKernel:
    """vLLM's modular kernel reduced to its contract: experts mapped to -1 contribute nothing."""

    def __init__(self) -> None:
        self.shared_calls: list[object] = []
        self.chunks: list[int] = []

    def apply(self, **kw: Any) -> Any:
        import torch.nn.functional as F

        x, w1, w2 = kw["hidden_states"], kw["w1"], kw["w2"]
        ids, weights, expert_map = kw["topk_ids"], kw["topk_weights"], kw["expert_map"]
        if kw["shared_experts"] is not None:
            self.shared_calls.append(kw["shared_experts"])
        self.chunks.append(x.shape[0])
        out = x.new_zeros(x.shape)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                slot = e if expert_map is None else int(expert_map[e])
                if slot < 0:
                    continue
                gate, up = (x[t] @ w1[slot].t()).chunk(2)
                out[t] += weights[t, j] * ((F.silu(gate) * up) @ w2[slot].t())
        return out


def _engine(
    fake: Any,
    section: dict[str, object] | None,
    graph_rows: int = 0,
    quantization: str | None = None,
) -> None:
    """The current engine's configuration as the method reads it: eager, or piecewise graphs
    up to ``graph_rows``; ``quantization``: the model's (the defaults depend on it)."""
    from vllm.config.compilation import CUDAGraphMode

    mode = CUDAGraphMode.PIECEWISE if graph_rows else CUDAGraphMode.NONE
    config = SimpleNamespace(
        additional_config={} if section is None else {"rowcache": section},
        compilation_config=SimpleNamespace(
            cudagraph_mode=mode, max_cudagraph_capture_size=graph_rows
        ),
        model_config=SimpleNamespace(quantization=quantization),
    )
    fake.config.CURRENT.append(config)


def _moe(top_k: int = TOP_K) -> SimpleNamespace:
    return SimpleNamespace(
        experts_per_token=top_k, num_local_experts=E, has_bias=False, is_act_and_mul=True
    )


def _layer_and_inputs(tokens: int) -> tuple[SimpleNamespace, Any, Any, Any]:
    import torch
    from moe_reference import make_layer, make_routing

    weights = make_layer(E, HIDDEN, INTER, shared=False, seed=3)
    layer = SimpleNamespace(
        w13_weight=weights.w13,
        w2_weight=weights.w2,
        activation="silu",
        global_num_experts=E,
        apply_router_weight_on_input=False,
    )
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(5))
    ids, topk_weights = make_routing(tokens, E, TOP_K, seed=7)
    return layer, x, ids, topk_weights


def _method(fake: Any, section: dict[str, object] | None, graph_rows: int = 0) -> Any:
    plugin.register()
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    _engine(fake, section, graph_rows)
    # vLLM builds the in-tree class; the registry hands back ours.
    return UnquantizedFusedMoEMethod(_moe())


@pytest.mark.parametrize("provider", ["row", "cached"])
@pytest.mark.parametrize("split", ["token", "expert"])
def test_cached_apply_matches_uncached(fake_vllm: Any, provider: str, split: str) -> None:
    import torch

    from rowcache.cached import CachedWeightProvider
    from rowcache.row_provider import RowCacheWeightProvider
    from rowcache.vllm._method import RowcacheMoEMethod

    section = {
        "moe_expert_cache_size": 3,
        "moe_expert_cache_provider": provider,
        "moe_expert_cache_split": split,
    }
    method = _method(fake_vllm, section)
    assert type(method) is RowcacheMoEMethod
    layer, x, ids, topk_weights = _layer_and_inputs(tokens=6)
    kernel = ReferenceKernel()
    method.moe_kernel = kernel
    expected = kernel.apply(
        hidden_states=x,
        w1=layer.w13_weight,
        w2=layer.w2_weight,
        topk_ids=ids,
        topk_weights=topk_weights,
        expert_map=None,
        shared_experts=None,
    )
    kernel.chunks.clear()
    cls = RowCacheWeightProvider if provider == "row" else CachedWeightProvider
    method.rowcache_provider = cls(
        layer.w13_weight, layer.w2_weight, capacity=3, split=split, device="cpu"
    )
    shared = object()
    out = method.apply(layer, x, topk_weights, ids, shared, x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # 6 tokens over 8 experts with 3 slots: the forward was cut, shared experts ran once.
    assert len(kernel.chunks) > 1
    assert kernel.shared_calls == [shared]
    stats = plugin.expert_cache_stats(SimpleNamespace(named_modules=lambda: [("l0", layer)]))
    assert stats == []
    layer.quant_method = method
    (only,) = plugin.expert_cache_stats(SimpleNamespace(named_modules=lambda: [("l0", layer)]))
    assert only["layer"] == "l0" and only["capacity"] == 3 and only["misses"] > 0
    assert only["forwards"] == 1 and only["prepare_calls"] == len(kernel.chunks) > 1


def test_device_planned_apply_matches_uncached(fake_vllm: Any) -> None:
    import torch

    from rowcache.device_plan.provider import DevicePlannedProvider
    from rowcache.row_provider import RowCacheWeightProvider

    section = {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"}
    method = _method(fake_vllm, section)
    assert method.rowcache_settings.planner == "device"
    layer, x, ids, topk_weights = _layer_and_inputs(tokens=6)
    kernel = RecordingKernel()
    method.moe_kernel = kernel
    expected = ReferenceKernel().apply(
        hidden_states=x,
        w1=layer.w13_weight,
        w2=layer.w2_weight,
        topk_ids=ids,
        topk_weights=topk_weights,
        expert_map=None,
        shared_experts=None,
    )
    method.rowcache_provider = RowCacheWeightProvider(
        layer.w13_weight, layer.w2_weight, capacity=3, device="cpu", planner="device"
    )
    assert isinstance(method.rowcache_provider, DevicePlannedProvider)
    shared = object()
    out = method.apply(layer, x, topk_weights, ids, shared, x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # 6 tokens x top-2 over 8 experts with 3 slots: ceil(min(12, 8) / 3) = 3 passes, each over
    # vLLM's own tensors (no rows sliced, nothing read back), shared experts once.
    assert len(kernel.inputs) == 3
    assert all(h is x and w is topk_weights and i is ids for h, w, i in kernel.inputs)
    assert kernel.shared_calls == [shared]


class RecordingKernel(ReferenceKernel):
    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[tuple[Any, Any, Any]] = []

    def apply(self, **kw: Any) -> Any:
        self.inputs.append((kw["hidden_states"], kw["topk_weights"], kw["topk_ids"]))
        return super().apply(**kw)


def test_a_forward_that_fits_passes_vllms_tensors_unsliced(fake_vllm: Any) -> None:
    from rowcache.row_provider import RowCacheWeightProvider

    method = _method(fake_vllm, {"moe_expert_cache_size": 3})
    layer, x, ids, topk_weights = _layer_and_inputs(tokens=6)
    method.rowcache_provider = RowCacheWeightProvider(
        layer.w13_weight, layer.w2_weight, capacity=3, split="token", device="cpu"
    )
    kernel = RecordingKernel()
    method.moe_kernel = kernel
    # One token routes to two experts, which fit the three slots: one kernel call, given the
    # very tensors vLLM passed, not views of them.
    first_x, first_w, first_ids = x[:1], topk_weights[:1], ids[:1]
    method.apply(layer, first_x, first_w, first_ids, None, None)
    ((hidden, weights, routed),) = kernel.inputs
    assert hidden is first_x and weights is first_w and routed is first_ids
    # Six tokens over eight experts: cut into chunks, each given its own rows.
    kernel.inputs.clear()
    method.apply(layer, x, topk_weights, ids, None, None)
    assert len(kernel.inputs) > 1
    assert sum(hidden.shape[0] for hidden, _, _ in kernel.inputs) == x.shape[0]
    assert all(hidden is not x for hidden, _, _ in kernel.inputs)


def test_output_is_capture_stable(fake_vllm: Any) -> None:
    import torch

    method = _method(fake_vllm, {"moe_eager_between_graphs": True}, graph_rows=8)
    assert method.rowcache_provider is None
    layer, x, ids, topk_weights = _layer_and_inputs(tokens=12)
    method.moe_kernel = ReferenceKernel()
    first = method.apply(layer, x[:4], topk_weights[:4], ids[:4], None, None)
    second = method.apply(layer, x[4:8], topk_weights[4:8], ids[4:8], None, None)
    # The same address for the same number of rows, and each call's own values.
    assert first.data_ptr() == second.data_ptr()
    expected = ReferenceKernel().apply(
        hidden_states=x[4:8],
        w1=layer.w13_weight,
        w2=layer.w2_weight,
        topk_ids=ids[4:8],
        topk_weights=topk_weights[4:8],
        expert_map=None,
        shared_experts=None,
    )
    torch.testing.assert_close(second, expected)
    # Batches larger than any captured size are not copied.
    big = method.apply(layer, x, topk_weights, ids, None, None)
    assert big.data_ptr() != first.data_ptr()


def test_knob_off_is_vllm_method(fake_vllm: Any) -> None:
    method = _method(fake_vllm, None, graph_rows=8)
    assert method.rowcache_settings is None
    layer, x, ids, topk_weights = _layer_and_inputs(tokens=3)
    method.moe_kernel = ReferenceKernel()
    out = method.apply(layer, x, topk_weights, ids, None, None)
    assert method._stable is None and out.shape == x.shape


def test_size_below_top_k_is_rejected(fake_vllm: Any) -> None:
    with pytest.raises(KnobError) as info:
        _method(fake_vllm, {"moe_expert_cache_size": 1})
    message = str(info.value)
    assert "moe_expert_cache_size=1" in message and "top_k=2" in message
    assert "allowed: 0 (off) or an integer >= 2" in message


def test_size_above_experts_is_clamped(fake_vllm: Any) -> None:
    method = _method(fake_vllm, {"moe_expert_cache_size": 100})
    assert method._capacity == E


def test_other_backend_is_rejected(fake_vllm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    monkeypatch.setattr(
        UnquantizedFusedMoEMethod, "BACKEND", UnquantizedMoeBackend.FLASHINFER_CUTLASS
    )
    with pytest.raises(RuntimeError, match="selected FLASHINFER_CUTLASS"):
        _method(fake_vllm, {"moe_expert_cache_size": 4})
    # Without the cache the backend is vLLM's business.
    assert _method(fake_vllm, None).rowcache_settings is None


def test_lowering_is_logged_once(fake_vllm: Any, caplog: pytest.LogCaptureFixture) -> None:
    plugin.register()
    from rowcache.vllm import _config as config_hook

    config_hook._said.clear()
    caplog.set_level(logging.WARNING, logger="rowcache.vllm")
    for _ in range(3):
        _config(fake_vllm, {"moe_expert_cache_size": 16, **HOST})
    lowered = [m for m in _rowcache_warnings(caplog) if "lowered to PIECEWISE" in m]
    assert len(lowered) == 1
    assert "FULL_AND_PIECEWISE" in lowered[0] and "16 slots" in lowered[0]


def test_weight_loader_writes_the_host_tensor(fake_vllm: Any) -> None:
    import torch

    plugin.register()
    from rowcache.vllm._method import HostLoad

    host = torch.zeros(4, 3)
    param = torch.nn.Parameter(torch.full((4, 3), -1.0), requires_grad=False)
    view = param.data
    seen = []

    def vllm_loader(param: Any, loaded_weight: Any, expert_id: int) -> None:
        seen.append(param.data.data_ptr())
        param.data[expert_id].copy_(loaded_weight)

    load = HostLoad(vllm_loader, param, host)
    load(param=param, loaded_weight=torch.ones(3), expert_id=2)
    assert seen == [host.data_ptr()]
    assert host[2].tolist() == [1.0, 1.0, 1.0] and host[0].tolist() == [0.0, 0.0, 0.0]
    assert param.data.data_ptr() == view.data_ptr()  # the device view is back
    assert view[2].tolist() == [-1.0, -1.0, -1.0]

    def failing(**kw: Any) -> None:
        raise ValueError("bad shard")

    with pytest.raises(ValueError, match="bad shard"):
        HostLoad(failing, param, host)(param=param)
    assert param.data.data_ptr() == view.data_ptr()


# -- exact steps: vLLM's moe_sum tapped ---------------------------------------------------------


class TritonKernel:
    """vLLM's modular kernel around its TritonExperts, reduced to the arithmetic: each token's
    weighted per-entry outputs in [M, top_k, H] (zeros where the map says -1), then
    ``fused_experts.moe_sum(cache3, output)``, then the finalize copy."""

    def __init__(self, layer: Any) -> None:
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

        self.layer = layer
        self.fused_experts = TritonExperts()
        self.calls = 0
        self.shared_calls: list[object] = []
        self.configs: list[dict[str, Any]] = []

    def apply(self, **kw: Any) -> Any:
        import torch
        from moe_reference import UnreducedKernel
        from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

        from rowcache.types import ExpertWeightResult

        self.calls += 1
        if kw["shared_experts"] is not None:
            self.shared_calls.append(kw["shared_experts"])
        x, ids, expert_map = kw["hidden_states"], kw["topk_ids"], kw["expert_map"]
        experts = self.fused_experts
        if hasattr(experts, "quant_config"):  # TritonExperts (a test may swap in another)
            self.configs.append(
                try_get_optimal_moe_config(
                    kw["w1"].size(),
                    kw["w2"].size(),
                    ids.shape[1],
                    experts.quant_config.config_name(x.dtype),
                    x.shape[0],
                    block_shape=experts.block_shape,
                )
            )
        if expert_map is None:
            expert_map = torch.arange(kw["w1"].shape[0])
        entries = UnreducedKernel(self.layer, x, ids, kw["topk_weights"])
        cache3 = entries.run_unreduced(
            ExpertWeightResult(w1=kw["w1"], w2=kw["w2"], expert_map=expert_map),
            slice(0, x.shape[0]),
            False,
        )
        fused_out = x.new_empty(x.shape)
        self.fused_experts.moe_sum(cache3, fused_out)
        output = x.new_empty(x.shape)
        output.copy_(fused_out)
        return output


def _bf16_layer_and_inputs(
    tokens: int, top_k: int = TOP_K, seed: int = 7
) -> tuple[Any, Any, Any, Any, Any]:
    import torch
    from moe_reference import make_layer, make_routing

    weights = make_layer(E, HIDDEN, INTER, dtype=torch.bfloat16, shared=False, seed=3)
    layer = SimpleNamespace(
        w13_weight=weights.w13,
        w2_weight=weights.w2,
        activation="silu",
        global_num_experts=E,
        apply_router_weight_on_input=False,
    )
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    ids, topk_weights = make_routing(tokens, E, top_k, dtype=torch.bfloat16, seed=seed)
    return weights, layer, x, ids, topk_weights


@pytest.mark.parametrize("planner", ["device", "host"])
def test_a_cut_step_is_bit_identical_to_one_call(fake_vllm: Any, planner: str) -> None:
    import torch

    from rowcache.row_provider import RowCacheWeightProvider

    section: dict[str, object] = {"moe_expert_cache_size": 3, "moe_expert_cache_split": "expert"}
    if planner == "device":
        section["moe_expert_cache_planner"] = "device"
    method = _method(fake_vllm, section)
    weights, layer, x, ids, topk_weights = _bf16_layer_and_inputs(tokens=6)
    reductions: list[Any] = []
    kernel = TritonKernel(weights)
    vllm_moe_sum = kernel.fused_experts.moe_sum

    def counted(input: Any, output: Any) -> None:
        reductions.append(input.shape)
        vllm_moe_sum(input, output)

    kernel.fused_experts.moe_sum = counted
    expected = kernel.apply(
        hidden_states=x,
        w1=layer.w13_weight,
        w2=layer.w2_weight,
        topk_ids=ids,
        topk_weights=topk_weights,
        expert_map=None,
        shared_experts=None,
    )
    kernel.calls, reductions[:] = 0, []
    method.moe_kernel = kernel
    kw = {"capacity": 3, "device": "cpu", "planner": planner}
    if planner == "host":
        kw["split"] = "expert"
    method.rowcache_provider = RowCacheWeightProvider(layer.w13_weight, layer.w2_weight, **kw)
    shared = object()
    for _ in range(2):  # the tap is installed once and stays
        out = method.apply(layer, x, topk_weights, ids, shared, x)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    # Several kernel calls per step, one reduction of the merged [M, top_k, H] entries each,
    # shared experts with the first call of each step only.
    assert kernel.calls > 2 and len(reductions) == 2
    assert reductions == [(6, TOP_K, HIDDEN)] * 2
    assert kernel.shared_calls == [shared, shared]
    # Outside a cut step the tap calls vLLM's moe_sum as it is.
    fits = method.apply(layer, x[:1], topk_weights[:1], ids[:1], None, None)
    assert len(reductions) == 3 and fits.shape == (1, HIDDEN)


@pytest.mark.parametrize(
    ("planner", "split"), [("device", "expert"), ("host", "expert"), ("host", "token")]
)
def test_every_kernel_call_of_a_cached_forward_uses_the_full_sets_configuration(
    fake_vllm: Any, planner: str, split: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM looks its tiles up by expert count and rows: a call over 3 slots would pick another
    configuration than the call over all 8 experts without the cache (and round differently).
    Every kernel call of a cached forward, each pass and each chunk, runs under the one the
    whole forward gets with every expert resident; with the pin removed they do not."""
    from rowcache.row_provider import RowCacheWeightProvider
    from rowcache.vllm import _method as method_module

    section: dict[str, object] = {"moe_expert_cache_size": 3, "moe_expert_cache_split": split}
    if planner == "device":
        section = {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"}
    weights, layer, x, ids, topk_weights = _bf16_layer_and_inputs(tokens=6)
    reference = TritonKernel(weights)
    reference.apply(
        hidden_states=x,
        w1=layer.w13_weight,
        w2=layer.w2_weight,
        topk_ids=ids,
        topk_weights=topk_weights,
        expert_map=None,
        shared_experts=None,
    )
    (wanted,) = reference.configs
    assert wanted["E"] == E and wanted["M"] == 6

    def cached_configs() -> list[dict[str, Any]]:
        method = _method(fake_vllm, section)
        kernel = TritonKernel(weights)
        method.moe_kernel = kernel
        kw: dict[str, Any] = {"capacity": 3, "device": "cpu", "planner": planner}
        if planner == "host":
            kw["split"] = split
        method.rowcache_provider = RowCacheWeightProvider(layer.w13_weight, layer.w2_weight, **kw)
        method.apply(layer, x, topk_weights, ids, None, None)
        assert kernel.calls > 1  # a cut forward: several kernel calls
        return kernel.configs

    assert cached_configs() == [wanted] * len(cached_configs())
    monkeypatch.setattr(method_module, "full_set_config", lambda *_args: None)
    unpinned = cached_configs()
    assert all(c["E"] == 3 for c in unpinned) and wanted not in unpinned


def test_the_float32_sum_of_a_cut_step_is_not_bit_identical(
    fake_vllm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel whose experts are not TritonExperts: a cut step falls back to the float32 sum
    (one warning), which differs from the single call in the last bits on some routing."""
    import torch

    from rowcache.row_provider import RowCacheWeightProvider

    caplog.set_level(logging.WARNING, logger="rowcache.vllm")
    section = {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"}
    method = _method(fake_vllm, section)
    differing = 0
    for seed in range(8):
        weights, layer, x, ids, topk_weights = _bf16_layer_and_inputs(6, top_k=3, seed=seed)
        kernel = TritonKernel(weights)
        expected = kernel.apply(
            hidden_states=x,
            w1=layer.w13_weight,
            w2=layer.w2_weight,
            topk_ids=ids,
            topk_weights=topk_weights,
            expert_map=None,
            shared_experts=None,
        )

        class OtherExperts:  # reduces like TritonExperts, but is not one
            moe_sum = kernel.fused_experts.moe_sum

        kernel.fused_experts = OtherExperts()
        method.moe_kernel = kernel
        method.rowcache_provider = RowCacheWeightProvider(
            layer.w13_weight, layer.w2_weight, capacity=3, device="cpu", planner="device"
        )
        out = method.apply(layer, x, topk_weights, ids, None, None)
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
        differing += not torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert differing > 0
    warned = [m for m in _rowcache_warnings(caplog) if "not vLLM's TritonExperts" in m]
    assert len(warned) == 1 and "OtherExperts" in warned[0]


@pytest.mark.parametrize("route", ["exact", "float32 sum"])
def test_the_engines_exactness_probe_catches_an_inexact_route(fake_vllm: Any, route: str) -> None:
    """tools/vllm/harness/probes.exactness, which every cached engine of the e2e runs ends
    with, on the CPU: each cached layer against the kernel with every expert resident finds
    the exact route bit-identical, and the float32 sum of a cut step (a kernel whose experts
    are not TritonExperts) not, at row counts whose steps need several passes."""
    from rowcache.row_provider import RowCacheWeightProvider

    section = {"moe_expert_cache_size": 3, "moe_expert_cache_planner": "device"}
    layers = []
    for seed in range(2):
        method = _method(fake_vllm, section)
        method.moe = _moe(top_k=3)  # three entries a token: a pass's partial sum rounds
        weights, layer, *_ = _bf16_layer_and_inputs(6, top_k=3, seed=seed)
        kernel = TritonKernel(weights)
        if route == "float32 sum":

            class OtherExperts:  # reduces like TritonExperts, but is not one
                moe_sum = kernel.fused_experts.moe_sum

            kernel.fused_experts = OtherExperts()
        method.moe_kernel = kernel
        method._host = (layer.w13_weight, layer.w2_weight)
        method.rowcache_provider = RowCacheWeightProvider(
            layer.w13_weight, layer.w2_weight, capacity=3, device="cpu", planner="device"
        )
        layer.quant_method = method
        layers.append((f"layers.{seed}.experts", layer))
    check_probe(layers, route, rows=16, skipped=0)


def check_probe(layers: list[tuple[str, Any]], route: str, rows: int, skipped: int) -> None:
    """The in-engine exactness probe over two cached ``layers`` (and ``skipped`` it cannot
    check): one row is one pass, exact on either route; ``rows`` rows need several passes,
    bit-identical on the exact route and not on the float32 sum of a cut step."""
    from tools.vllm.harness import probes

    model = SimpleNamespace(named_modules=lambda: iter(layers))
    found = probes.exactness(model, device="cpu", row_counts=(1, rows))
    assert found["layers"] == 2 and found["skipped"] == skipped
    assert found["equal"]["1"] == 2
    if route == "exact":
        assert found["equal"][str(rows)] == 2 and found["max_abs"][str(rows)] == 0.0
    else:
        assert found["equal"][str(rows)] < 2 and found["max_abs"][str(rows)] > 0.0


def test_the_refusals_serve_refusals_looks_for(fake_vllm: Any) -> None:
    """``tools/vllm/serve_refusals.py`` expects these words in a refusing server's log: the
    plugin's own messages (the first with the fake model's top_k=2 for the real top_k=8)."""
    from tools.vllm import serve_refusals

    cases = {case.name: case.expect[0] for case in serve_refusals.CASES}
    with pytest.raises(KnobError) as info:
        _method(fake_vllm, {"moe_expert_cache_size": 1})
    below = cases["slots-below-top-k"].replace("=4", "=1").replace("top_k=8", "top_k=2")
    assert below in str(info.value)
    plugin.register()
    with pytest.raises(KnobError) as info:
        _config(fake_vllm, {"moe_expert_cache_size": 32, "moe_expert_cache_provider": "rows"})
    assert cases["unknown-provider"] in str(info.value)
    with pytest.raises(RuntimeError) as failed:
        _config(fake_vllm, {"moe_expert_cache_size": 32, **HOST}, splitting_ops=[])
    assert cases["host-planner-in-one-full-graph"] in str(failed.value)


def _loaded_planes_layer(fake_vllm: Any) -> tuple[Any, Any, Any, Any, Any, Any]:
    """A layer of the plugin's method with ``moe_expert_cache_compress='on'`` (device planner,
    3 slots), its pinned weights written by its loaders, not yet processed; with the weights
    and a batch: ``(method, layer, weights, x, ids, topk_weights)``."""
    import torch

    section = {
        "moe_expert_cache_size": 3,
        "moe_expert_cache_planner": "device",
        "moe_expert_cache_compress": "on",
    }
    method = _method(fake_vllm, section)
    weights, _, x, ids, topk_weights = _bf16_layer_and_inputs(8)
    layer = torch.nn.Module()
    layer.activation, layer.global_num_experts = "silu", E
    layer.apply_router_weight_on_input = False

    def load(param: torch.Tensor, loaded: torch.Tensor) -> None:  # vLLM's loader, in short
        param.data.copy_(loaded)

    method.create_weights(layer, E, HIDDEN, INTER, torch.bfloat16, weight_loader=load)
    layer.w13_weight.weight_loader(layer.w13_weight, weights.w13)
    layer.w2_weight.weight_loader(layer.w2_weight, weights.w2)
    return method, layer, weights, x, ids, topk_weights


def test_with_planes_the_layers_pinned_weights_are_released(
    fake_vllm: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``moe_expert_cache_compress='on'`` the planes hold every bit of w13 and w2, so the
    layer's own copies are freed once the provider is built: the parameters keep their shape
    and dtype on the meta device, the host tensors are gone, a reload is refused, and the
    cache still serves every expert exactly (the in-engine exactness probe compares with the
    planes decoded). The first forward logs what the cache holds where, once."""
    import gc
    import weakref

    import torch

    from rowcache.pinned import pinning_seconds
    from rowcache.vllm._config import RowcacheError
    from tools.vllm.harness import probes

    # Layers other tests built and never ran, and the pinning before this test.
    take_line(planes=False, pinning_seconds=pinning_seconds())
    method, layer, weights, x, ids, topk_weights = _loaded_planes_layer(fake_vllm)
    assert method._host is not None
    assert torch.equal(method._host[0], weights.w13)  # the loader wrote the host tensor
    held = [weakref.ref(t) for t in method._host]
    # vLLM keeps a copy of every parameter's attributes, its weight loader among them, for as
    # long as the model lives (its layerwise reload metadata, recorded after create_weights):
    # the loaders must not keep the host tensors pinned.
    reload_metadata = {n: dict(vars(getattr(layer, n))) for n in ("w13_weight", "w2_weight")}
    method.process_weights_after_loading(layer)
    gc.collect()
    assert method._host is None and all(r() is None for r in held)
    for name, attrs in reload_metadata.items():
        with pytest.raises(RowcacheError, match="reloading weights into this engine"):
            attrs["weight_loader"](getattr(layer, name), weights.w13)
    for name, want in (("w13_weight", weights.w13), ("w2_weight", weights.w2)):
        param = getattr(layer, name)
        assert param.device.type == "meta" and param.shape == want.shape
        assert param.dtype == torch.bfloat16
        with pytest.raises(RowcacheError, match="reloading weights into it is not supported"):
            param.weight_loader(param, want)
    provider = method.rowcache_provider
    assert provider.compressed == ("w13", "w2")
    kernel = TritonKernel(weights)
    method.moe_kernel = kernel
    expected = kernel.apply(
        hidden_states=x,
        w1=weights.w13,
        w2=weights.w2,
        topk_weights=topk_weights,
        topk_ids=ids,
        activation="silu",
        global_num_experts=E,
        expert_map=None,
        apply_router_weight_on_input=False,
        shared_experts=None,
        shared_experts_input=None,
    )
    caplog.set_level(logging.INFO, logger="rowcache.vllm")
    out = method.apply(layer, x, topk_weights, ids, None, None)
    method.apply(layer, x, topk_weights, ids, None, None)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert provider.slot_mismatches(provider.resident_experts()) == []
    said = [r.getMessage() for r in caplog.records if "MoE layer cached" in r.getMessage()]
    assert len(said) == 1
    holds, set_up = said[0].split("; set-up ")
    assert holds == (
        f"rowcache: 1 MoE layer cached, 3 of {E} experts a layer in slots: "
        + f"{provider.stats()['slot_bytes'] / 2**30:.2f} GiB of the experts' "
        + f"{provider.stats()['slot_bytes'] // 3 * E / 2**30:.2f} GiB on the GPU; "
        + f"{provider.stats()['host_bytes'] / 2**30:.2f} GiB held in pinned host memory ("
        + f"{provider.stats()['host_bytes'] / (provider.stats()['slot_bytes'] // 3 * E):.2f} "
        + "of the experts' bytes, as bf16 planes)"
    )
    # Host seconds; no pinned memory without a GPU.
    times = re.fullmatch(
        r"(\d+\.\d) s: 0\.0 s pinning host memory, (\d+\.\d) s building the providers",
        set_up,
    )
    assert times is not None and abs(float(times[1]) - float(times[2])) <= 0.1, set_up
    layer.quant_method = method
    model = SimpleNamespace(named_modules=lambda: iter([("layers.0.experts", layer)]))
    found = probes.exactness(model, device="cpu", row_counts=(1, 16))
    assert found["layers"] == 1 and found["skipped"] == 0 and found["equal"]["16"] == 1


def test_a_provider_s_build_time_leaves_out_its_pinning(
    fake_vllm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up line counts pinning once for the whole engine: each provider's build time
    is its host time less the pinning done inside it."""
    from types import SimpleNamespace

    import torch

    import rowcache.vllm._method as method_module
    from rowcache.vllm.knob import parse_settings

    clock, pinning = iter([100.0, 107.0]), iter([20.0, 24.5])
    monkeypatch.setattr(method_module, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(method_module, "pinning_seconds", lambda: next(pinning))
    noted: list[float] = []
    monkeypatch.setattr(
        method_module,
        "note_layer",
        lambda stats, num_experts, build_seconds: noted.append(build_seconds),
    )
    settings = parse_settings({"rowcache": {"moe_expert_cache_size": 2}}, {})
    w13 = torch.randn(4, 8, 16).to(torch.bfloat16)
    w2 = torch.randn(4, 16, 4).to(torch.bfloat16)
    method_module.build_provider(settings, 2, w13, w2)
    assert noted == [7.0 - 4.5]


def test_the_plugin_builds_a_compressing_provider(fake_vllm: Any) -> None:
    """What the unquantized method builds with the knob on: a device-planned provider over the
    layer's host tensors, w13 and w2 as planes (the scales and the rest shared)."""
    import torch

    from rowcache.device_plan.provider import DevicePlannedProvider
    from rowcache.vllm._method import build_provider
    from rowcache.vllm.knob import parse_settings

    def cfg(**section: object) -> dict[str, object]:
        return {"rowcache": section}

    settings = parse_settings(
        cfg(
            moe_expert_cache_size=2,
            moe_expert_cache_planner="device",
            moe_expert_cache_compress="on",
        ),
        {},
    )
    w13 = torch.randn(4, 8, 16).to(torch.bfloat16)
    w2 = torch.randn(4, 16, 4).to(torch.bfloat16)
    provider = build_provider(settings, 2, w13, w2)
    assert isinstance(provider, DevicePlannedProvider)
    assert set(provider._sources.planes) == {"w13", "w2"}
    plain = build_provider(
        parse_settings(cfg(moe_expert_cache_size=2, moe_expert_cache_planner="device"), {}),
        2,
        w13,
        w2,
    )
    assert isinstance(plain, DevicePlannedProvider) and plain._sources.planes == {}
    # The host planner too (eager mode's default): its copy step decodes the planes.
    from rowcache.row_provider import HostPlannedProvider

    host = build_provider(
        parse_settings(
            cfg(
                moe_expert_cache_size=2,
                moe_expert_cache_planner="host",
                moe_expert_cache_compress="on",
            ),
            {},
        ),
        2,
        w13,
        w2,
    )
    assert isinstance(host, HostPlannedProvider)
    assert set(host._sources.planes) == {"w13", "w2"}
    host.prepare(torch.tensor([[3, 1]]))
    assert host.slot_mismatches(host.resident_experts()) == []


def test_a_layer_s_host_tensors_are_dead_when_its_release_collects_them(
    fake_vllm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``release_host_cache`` lets go of the transient slabs nothing views and then empties
    torch's host cache; nothing collects after the last layer's. So the layer's checkpoint
    tensors must be dead by the time it runs (no name in the caller's frame, no cycle left for
    the garbage collector): else the last layer's slab stays pinned for the engine's life,
    as with the parameter vLLM's loading context holds (the test after the next)."""
    import weakref

    import rowcache.vllm._method as method_module

    method, layer, *_ = _loaded_planes_layer(fake_vllm)
    held = [weakref.ref(t) for t in method._host]
    alive_at_release: list[list[bool]] = []
    monkeypatch.setattr(
        method_module,
        "release_host_cache",
        lambda: alive_at_release.append([r() is not None for r in held]),
    )
    method.process_weights_after_loading(layer)
    assert alive_at_release == [[False, False]]


def test_the_release_of_the_load_time_blocks_counts_as_pinning(
    fake_vllm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver unlocks every page of a block it gets back: ``release_host_cache``'s host
    time is the start-up line's pinning, its collection of the slabs included."""
    from types import SimpleNamespace

    import rowcache.pinned as pinned
    import rowcache.vllm._method as method_module

    clock = [10.0]
    monkeypatch.setattr(pinned, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(pinned, "_pinning_seconds", 0.0)

    def slow_collect() -> None:
        clock[0] += 2.5

    monkeypatch.setattr(method_module, "collect_transient", slow_collect)
    method_module.release_host_cache()
    assert pinned.pinning_seconds() == 2.5


def _vllm_replaces_the_expert_parameters(fake_vllm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake parent's ``process_weights_after_loading`` does what vLLM 0.25.0's does on its
    Triton backend (``_setup_kernel``'s ``replace_parameter``): a new parameter over the same
    data, the old one's weight loader copied to it."""
    import torch
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    def replace(self: Any, layer: torch.nn.Module) -> None:
        for name in ("w13_weight", "w2_weight"):
            old = getattr(layer, name)
            new = torch.nn.Parameter(old.data, requires_grad=False)
            new.weight_loader = old.weight_loader
            setattr(layer, name, new)

    monkeypatch.setattr(UnquantizedFusedMoEMethod, "process_weights_after_loading", replace)


def _transient_arena(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The plugin's short-lived host tensors from an arena of plain memory, viewed as a CUDA
    view of pinned memory is (a view that keeps its host storage alive)."""
    import torch

    import rowcache.vllm._method as method_module
    from rowcache.pinned import PinnedArena

    arena = PinnedArena(slab_bytes=1 << 12, allocate=lambda n: torch.zeros(n, dtype=torch.uint8))
    real = method_module.pinned_empty
    monkeypatch.setattr(
        method_module,
        "pinned_empty",
        lambda shape, dtype, *, lasting: (
            real(shape, dtype, lasting=True) if lasting else arena.empty(shape, dtype)
        ),
    )
    monkeypatch.setattr(method_module, "collect_transient", arena.collect)
    monkeypatch.setattr(method_module, "get_accelerator_view_from_cpu_tensor", lambda t: t[:])
    monkeypatch.setattr(
        method_module,
        "pinned_memory",
        lambda: {
            "torch_host_bytes": None,
            "arena_bytes": 0,
            "transient_bytes": arena.reserved_bytes,
        },
    )
    return arena


def test_the_last_layer_s_slab_is_free_when_released_inside_vllms_loading_context(
    fake_vllm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.25.0 processes a layer inside ``device_loading_context``, whose loop variable
    holds the parameter the plugin registered last, after vLLM's own processing replaced it
    with a new parameter over the same device view: that view must not hold the layer's
    transient slab past the release (on the H200, 2026-12-05, 2 GiB stayed pinned for the
    engine's life: the last layer's slab, which nothing collects after)."""
    import contextlib

    import torch

    import rowcache.vllm._method as method_module

    arena = _transient_arena(monkeypatch)
    _vllm_replaces_the_expert_parameters(fake_vllm, monkeypatch)
    method, layer, *_ = _loaded_planes_layer(fake_vllm)
    assert arena.reserved_bytes > 0
    at_release: list[int] = []

    def release() -> None:
        arena.collect()
        at_release.append(arena.reserved_bytes)

    monkeypatch.setattr(method_module, "release_host_cache", release)

    @contextlib.contextmanager
    def device_loading_context(module: torch.nn.Module) -> Any:
        for _, param in module.named_parameters():  # as vLLM's loop: `param` stays bound
            param.requires_grad_(False)
        yield module

    with device_loading_context(layer):
        method.process_weights_after_loading(layer)
    assert at_release == [0]


def test_the_first_forward_lets_go_of_a_slab_freed_after_the_last_release(
    fake_vllm: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A transient slab whose last view died after the last layer's release (anything vLLM's
    loading code held then) is let go of at the first forward, and the start-up line says
    nothing of it; one still viewed then is a leak, and the line says so."""
    import torch

    take_line(planes=False)  # layers other tests built and never ran
    arena = _transient_arena(monkeypatch)
    method, layer, weights, x, ids, topk_weights = _loaded_planes_layer(fake_vllm)
    method.process_weights_after_loading(layer)
    method.moe_kernel = TritonKernel(weights)
    late = arena.empty((64,), torch.bfloat16)  # held past the release, dropped before a forward
    del late
    assert arena.reserved_bytes > 0
    caplog.set_level(logging.INFO, logger="rowcache.vllm")
    method.apply(layer, x, topk_weights, ids, None, None)
    said = [r for r in caplog.records if "MoE layer cached" in r.getMessage()]
    assert arena.reserved_bytes == 0
    assert len(said) == 1 and said[0].levelno == logging.INFO

    take_line(planes=False)
    caplog.clear()
    method, layer, weights, x, ids, topk_weights = _loaded_planes_layer(fake_vllm)
    method.process_weights_after_loading(layer)
    method.moe_kernel = TritonKernel(weights)
    held = arena.empty((1024,), torch.bfloat16)
    method.apply(layer, x, topk_weights, ids, None, None)
    said = [r for r in caplog.records if "MoE layer cached" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert (
        said[0]
        .getMessage()
        .endswith(
            f"; {arena.reserved_bytes / 2**30:.2f} GiB of pinned memory from loading the "
            "checkpoint still held (expected none: a leak)"
        )
    )
    assert held.numel() == 1024


def test_the_first_forward_warns_of_pinned_memory_left_from_loading(
    fake_vllm: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Once every layer is built, a transient slab still held is memory nothing will free: the
    start-up line becomes a warning that names it (2 GiB went unseen on the H200 until a probe
    read it)."""

    import rowcache.vllm._method as method_module

    take_line(planes=False)  # layers other tests built and never ran
    method, layer, weights, x, ids, topk_weights = _loaded_planes_layer(fake_vllm)
    method.process_weights_after_loading(layer)
    method.moe_kernel = TritonKernel(weights)
    monkeypatch.setattr(
        method_module,
        "pinned_memory",
        lambda: {"torch_host_bytes": None, "arena_bytes": 0, "transient_bytes": 2 << 30},
    )
    caplog.set_level(logging.INFO, logger="rowcache.vllm")
    method.apply(layer, x, topk_weights, ids, None, None)
    said = [r for r in caplog.records if "MoE layer cached" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    message = said[0].getMessage()
    assert message.endswith(
        "; 2.00 GiB of pinned memory from loading the checkpoint still held (expected none: a leak)"
    )


def test_a_device_view_of_memory_that_is_not_pinned_is_refused(
    fake_vllm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU machine vLLM's view op copies a tensor that is not pinned (the loader would
    write the copy's source, never the view): the plugin stops instead, before the op."""
    import torch

    import rowcache.vllm._method as method
    from rowcache.vllm._config import RowcacheError

    plugin.register()
    given: list[torch.Tensor] = []
    monkeypatch.setattr(method, "get_accelerator_view_from_cpu_tensor", given.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RowcacheError, match=r"shape \(2, 3\) that is not pinned"):
        method.device_view(torch.ones(2, 3))
    assert given == []
    method.device_view(torch.ones(0, 3))  # nothing to pin: as it is
    assert len(given) == 1


def test_only_a_replaced_parameter_lets_go_of_its_host_view(fake_vllm: Any) -> None:
    """``drop_replaced`` empties a parameter its layer no longer has (nothing reads it) and
    leaves one the layer still serves from (gpt-oss's raw tensors that vLLM's conversion kept)."""
    import torch

    import rowcache.vllm._method as method

    plugin.register()
    layer = torch.nn.Module()
    for name in ("w13_bias", "w2_bias"):
        layer.register_parameter(name, torch.nn.Parameter(torch.ones(4, 8), False))
    old = [(n, getattr(layer, n)) for n in ("w13_bias", "w2_bias")]
    layer.register_parameter("w2_bias", torch.nn.Parameter(torch.zeros(4, 8), False))
    method.drop_replaced(layer, old)
    assert old[1][1].numel() == 0  # replaced: emptied
    assert layer.w13_bias is old[0][1] and torch.equal(layer.w13_bias, torch.ones(4, 8))
    assert torch.equal(layer.w2_bias, torch.zeros(4, 8))


def test_the_plugin_s_short_lived_host_tensors_are_transient_and_collected(
    fake_vllm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer's checkpoint tensors, released once the planes or converted rows hold them,
    come from the transient arena, whose slabs ``release_host_cache`` lets go of first."""
    import torch

    import rowcache.vllm._method as method

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        method, "pinned_empty_transient", lambda s, d: calls.append("transient") or torch.empty(s)
    )
    monkeypatch.setattr(
        method, "pinned_empty_exact", lambda s, d: calls.append("lasting") or torch.empty(s)
    )
    monkeypatch.setattr(method, "collect_transient", lambda: calls.append("collect"))
    monkeypatch.setattr(method, "lookup", lambda seam: None)
    method.pinned_empty((2,), torch.float32, lasting=False)
    method.pinned_empty((2,), torch.float32, lasting=True)
    method.release_host_cache()
    assert calls == ["transient", "lasting", "collect"]


def test_a_device_view_of_an_arena_piece_is_cut_from_its_slab_s_view(
    fake_vllm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's UVA view asks the driver for the address of the tensor it is given: for a piece
    of an arena's slab the plugin gives it the slab (an allocation's start) and cuts the piece
    from that view; any other host tensor goes as it is."""
    import torch

    import rowcache.vllm._method as method
    from rowcache.pinned import PinnedArena

    given: list[torch.Tensor] = []

    def uva(t: torch.Tensor) -> torch.Tensor:  # stands in for the device view: the same bytes
        given.append(t)
        return t

    monkeypatch.setattr(method, "get_accelerator_view_from_cpu_tensor", uva)
    arena = PinnedArena(slab_bytes=4096, allocate=lambda n: torch.zeros(n, dtype=torch.uint8))
    first = arena.empty((100,), torch.uint8)  # kept: its slab stays in the arena
    piece = arena.empty((3, 5), torch.bfloat16)
    assert piece.data_ptr() == first.data_ptr() + 512
    piece.copy_(torch.arange(15.0).view(3, 5))
    view = method.device_view(piece)
    slab = given[-1]
    assert slab.dtype == torch.uint8 and slab.numel() == 4096
    assert slab.data_ptr() == piece.data_ptr() - 512  # the slab's start, the piece 512 in
    assert view.data_ptr() == piece.data_ptr() and view.shape == (3, 5)
    assert view.dtype == torch.bfloat16 and torch.equal(view, piece)
    plain = torch.ones(4, 2)
    assert method.device_view(plain) is plain and given[-1] is plain
    strided = plain.t()  # not contiguous: as it is (no piece of an arena is)
    assert method.device_view(strided) is strided


@pytest.mark.parametrize("planner", ["host", "device"])
def test_the_plugin_builds_the_policy_it_is_given(fake_vllm: Any, planner: str) -> None:
    """``moe_expert_cache_policy`` reaches the provider of either planner (and ``lru`` when
    absent)."""
    import torch

    from rowcache.vllm._method import build_provider
    from rowcache.vllm.knob import parse_settings

    w13 = torch.randn(4, 8, 16)
    w2 = torch.randn(4, 16, 4)
    for section, policy in (({}, "lru"), ({"moe_expert_cache_policy": "lfu"}, "lfu")):
        settings = parse_settings(
            {
                "rowcache": {
                    "moe_expert_cache_size": 2,
                    "moe_expert_cache_planner": planner,
                    **section,
                }
            },
            {},
        )
        provider = build_provider(settings, 2, w13, w2)
        assert provider.planner == planner and provider.policy == policy  # type: ignore[attr-defined]
        assert len(provider.request_counts()) == (4 if policy == "lfu" else 0)  # type: ignore[attr-defined]
