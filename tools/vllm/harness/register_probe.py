"""``e2e.py register-probe OUT.json [--fused-moe-first]``: the plugin's registration cost in a
fresh process (run twice by ``run``, before the phases)."""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path


def main(path: str, fused_moe_first: bool) -> None:
    """Time register() alone, then the fused-MoE import that installs the MoE method."""
    # What vLLM has imported when it loads plugins: its configuration (``import vllm`` alone is
    # lazy and would leave vllm.config to be timed as part of register()).
    import vllm.config  # noqa: F401

    fused_moe = "vllm.model_executor.layers.fused_moe"
    if fused_moe_first:
        importlib.import_module(fused_moe)
    preloaded = fused_moe in sys.modules
    t = time.perf_counter()
    import rowcache.vllm as plugin

    plugin.register()
    register_s = time.perf_counter() - t
    imported_by_register = not preloaded and fused_moe in sys.modules
    state_after_register = plugin._state.method
    t = time.perf_counter()
    importlib.import_module(fused_moe)  # fires the post-import hook when it was deferred
    fused_moe_s = time.perf_counter() - t
    from vllm.model_executor.custom_op import op_registry_oot

    Path(path).write_text(
        json.dumps(
            {
                "register_ms": round(register_s * 1000, 1),
                "fused_moe_imported_first": preloaded,
                "fused_moe_imported_by_register": imported_by_register,
                "method_after_register": state_after_register,
                "fused_moe_import_after_register_ms": round(fused_moe_s * 1000, 1),
                "method_after_fused_moe": plugin._state.method,
                "oot": {k: f"{v.__module__}.{v.__qualname__}" for k, v in op_registry_oot.items()},
            }
        )
    )
