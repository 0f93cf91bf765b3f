"""Every vLLM internal the plugin relies on, as data, with a static checker.

vLLM has no stable API for what the plugin does, so each internal name it uses is listed here
once: the module, the name, why the plugin needs it and what breaks when it moves. The CI test
(``tests/test_vllm_seams.py``) reads the source of each supported vLLM wheel without installing
it and checks every row with ``check_seam``.

Name forms:

* ``"name"``: the module defines or assigns ``name`` at top level (def, class, assignment, or
  an import that re-exports it).
* ``"Class.attr"``: class ``Class`` (top level of the module) defines ``attr`` in its body
  (def, assignment, annotated field) or assigns ``self.attr`` in one of its methods.
* ``"Class.method(a, b)"``: ``Class`` defines ``method`` and it takes parameters ``a`` and
  ``b`` by those names (among others).
* ``"function(a, b)"``: the module defines ``function`` at top level and it takes parameters
  ``a`` and ``b`` by those names (among others).
* ``"op:name"``: the module registers a custom op named ``name`` (a call with the keyword
  ``op_name="name"``).
* ``"Class.method -> attr"``: ``Class`` defines ``method``, and its body calls
  ``self.attr(...)``, directly or through methods of ``Class`` it calls as ``self.other(...)``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

__all__ = ["SEAMS", "SUPPORTED_VLLM", "Seam", "check_seam", "check_source"]

SUPPORTED_VLLM = ("0.25.0", "0.33.0")
"""The vLLM releases whose source the seams test checks."""


@dataclass(frozen=True)
class Seam:
    module: str
    name: str
    why: str
    breaks: str


_MOE = "vllm.model_executor.layers.fused_moe"
_METHOD = f"{_MOE}.unquantized_fused_moe_method"
_CC = "vllm.config.compilation"
_TRITON = f"{_MOE}.experts.triton_moe"
_FP8 = "vllm.model_executor.layers.quantization.fp8"
_FP8_ONLINE = "vllm.model_executor.layers.quantization.online.fp8"
_FP8_ORACLE = f"{_MOE}.oracle.fp8"
_MXFP4 = "vllm.model_executor.layers.quantization.mxfp4"
_MXFP4_ORACLE = f"{_MOE}.oracle.mxfp4"
_OAI = f"{_MOE}.experts.gpt_oss_triton_kernels_moe"

SEAMS: tuple[Seam, ...] = (
    Seam(
        _MOE,
        "UnquantizedFusedMoEMethod",
        "registration substitutes the MoE method only once this package has executed "
        "(rowcache.vllm.FUSED_MOE, a post-import hook): it imports the method's module, so no "
        "MoE method is built before the substitution, and processes that never import it "
        "(API front end, dense models) never pay for vLLM's fused-MoE modules",
        "renamed: the hook never fires and the knob has no effect (one warning where a "
        "configuration turns it on); no longer importing the method's module: still correct, "
        "the hook imports it",
    ),
    Seam(
        "vllm.model_executor.custom_op",
        "CustomOp.register_oot(_decorated_op_cls, name)",
        "substitutes our MoE method for vLLM's, out of tree",
        "the plugin cannot install; vLLM runs without the cache (one warning)",
    ),
    Seam(
        "vllm.model_executor.custom_op",
        "op_registry_oot",
        "makes registration idempotent and detects another plugin holding the name",
        "the plugin cannot install; vLLM runs without the cache (one warning)",
    ),
    Seam(
        "vllm.model_executor.custom_op",
        "CustomOp.__new__",
        "instantiates the registered out-of-tree class wherever vLLM builds the in-tree one",
        "the substitution silently stops happening: the knob has no effect",
    ),
    Seam(
        _METHOD,
        "UnquantizedFusedMoEMethod",
        "the method we subclass (bf16/fp16 experts)",
        "the plugin cannot install; vLLM runs without the cache (one warning)",
    ),
    Seam(
        _METHOD,
        "UnquantizedFusedMoEMethod.create_weights(layer, num_experts, hidden_size, "
        "intermediate_size_per_partition, params_dtype)",
        "overridden to allocate w13/w2 in pinned host memory",
        "expert weights land on the GPU again, or loading fails on a signature mismatch",
    ),
    Seam(
        _METHOD,
        "UnquantizedFusedMoEMethod.process_weights_after_loading(layer)",
        "overridden to build the provider after vLLM set up the kernel",
        "no provider is built: the cache stays off or apply fails",
    ),
    Seam(
        _METHOD,
        "UnquantizedFusedMoEMethod.apply(layer, x, topk_weights, topk_ids, shared_experts, "
        "shared_experts_input)",
        "overridden to route the MoE forward through run_with_expert_cache",
        "forwards bypass the cache and read the (host) weights directly",
    ),
    Seam(
        _METHOD,
        "UnquantizedFusedMoEMethod.unquantized_backend",
        "the cache serves the Triton backend only; other backends re-layout weights",
        "an unsupported backend is not rejected",
    ),
    Seam(
        f"{_MOE}.fused_moe_method_base",
        "FusedMoEMethodBase.moe_kernel",
        "the modular kernel apply() calls with the provider's slots and expert_map",
        "cached forwards cannot run",
    ),
    Seam(
        f"{_MOE}.fused_moe_method_base",
        "FusedMoEMethodBase.moe",
        "FusedMoEConfig of the layer: top_k, experts, bias, gating",
        "the size and layer guards cannot run",
    ),
    Seam(
        f"{_MOE}.modular_kernel",
        "FusedMoEKernel.apply(hidden_states, w1, w2, topk_weights, topk_ids, activation, "
        "global_num_experts, expert_map, apply_router_weight_on_input, shared_experts, "
        "shared_experts_input)",
        "runs one chunk or group of a cached forward over the slot buffers",
        "cached forwards fail with a TypeError",
    ),
    Seam(
        f"{_MOE}.modular_kernel",
        "FusedMoEKernel.fused_experts",
        "the kernel's experts object, whose moe_sum the exact route of a cut step taps",
        "no tap: steps cut by experts fall back to the float32 sum (one warning), whose last "
        "bits differ from one call",
    ),
    Seam(
        _TRITON,
        "TritonExperts",
        "the experts class of the Triton backend: its apply writes each token's weighted "
        "per-entry outputs into intermediate_cache3 [M, top_k, H] and reduces them with "
        "moe_sum; the tap is installed only on its instances",
        "the plugin cannot install; vLLM runs without the cache (one warning)",
    ),
    Seam(
        _TRITON,
        "TritonExperts.moe_sum(input, output)",
        "overridden per instance (an attribute): during a cut step's kernel calls it hands "
        "the unreduced entries to the library instead of reducing; the library reduces the "
        "merged step buffer once with the original",
        "renamed: the tap is never called and a cut step fails (RuntimeError); a new "
        "signature: the tap forwards extra arguments outside cut steps, but the final "
        "reduction passes input and output only",
    ),
    Seam(
        _TRITON,
        "TritonExperts.apply -> moe_sum",
        "apply reduces through self.moe_sum (in 0.33.0 via self._finalize_expert_output), so "
        "the tap sees every call's unreduced output",
        "a cut step fails (RuntimeError: the MoE kernel returned without calling vLLM's "
        "TritonExperts.moe_sum)",
    ),
    # The kernel configuration of a cached forward: the one vLLM picks with every expert
    # resident (rowcache.vllm._method.full_set_config).
    Seam(
        _MOE,
        "override_config",
        "every kernel call of a cached forward runs under the configuration vLLM picks for "
        "the layer with every expert resident (vLLM's own override of its lookup)",
        "cached forwards fail at import (ImportError); without it, a kernel call over the "
        "slots picks tiles by the slot count and rounds differently from no offload",
    ),
    Seam(
        f"{_MOE}.fused_moe",
        "try_get_optimal_moe_config(w1_shape, w2_shape, top_k, dtype, M, block_shape)",
        "the lookup TritonExperts.apply runs per call with its weights' shapes and rows "
        "(tuned file by expert count and N, else defaults by rows and expert count; it "
        "honours override_config), asked here with the whole layer's shapes",
        "cached forwards fail at import or with a TypeError",
    ),
    Seam(
        f"{_MOE}.modular_kernel",
        "FusedMoEExperts.block_shape",
        "the block shape of the experts' quantization, an argument of the lookup",
        "cached forwards fail with an AttributeError",
    ),
    Seam(
        f"{_MOE}.config",
        "FusedMoEQuantConfig.config_name(dtype)",
        "the dtype name of the lookup (None for bf16, fp8_w8a8 for FP8), from the experts' "
        "quant config",
        "cached forwards fail with an AttributeError",
    ),
    # FP8 experts (docs/PLUGIN.md, "FP8 experts"): what vLLM builds for quantization="fp8".
    Seam(
        f"{_MOE}.routed_experts",
        "RoutedExperts._get_quant_method(prefix, quant_config, moe_config)",
        "where every MoE layer gets its method from the quantization config (both releases): "
        "the plugin wraps it to take over the FP8 methods it serves and to reject the others "
        "by name",
        "FP8 layers run vLLM's method with the whole expert set on the GPU, and other "
        "quantized methods are no longer rejected with their name",
    ),
    Seam(
        _FP8,
        "Fp8Config.get_quant_method(layer, prefix)",
        "gives a MoE layer Fp8MoEMethod for an FP8 checkpoint and (0.25.0) "
        "Fp8PerTensorOnlineMoEMethod for online quantization of a bf16 one",
        "the method the cache takes over may no longer be the one vLLM builds",
    ),
    Seam(
        _FP8,
        "Fp8MoEMethod",
        "the method of FP8 checkpoints; the cache serves its block-scaled variant",
        "FP8 checkpoints are rejected (no method to take over)",
    ),
    Seam(
        _FP8,
        "Fp8MoEMethod.create_weights(layer, num_experts, hidden_size, "
        "intermediate_size_per_partition, params_dtype)",
        "overridden to hold w13_weight, w2_weight and their block scales in pinned host memory",
        "the FP8 expert set lands on the GPU again, or loading fails on a signature mismatch",
    ),
    Seam(
        _FP8,
        "Fp8MoEMethod.process_weights_after_loading(layer)",
        "overridden to build the provider (weights and scales) before vLLM sets up its kernel",
        "no provider is built: the FP8 cache stays off or apply fails",
    ),
    Seam(
        _FP8,
        "Fp8MoEMethod._setup_kernel -> get_fused_moe_quant_config",
        "vLLM builds the kernel's quant config through this overridable method, which the "
        "cache points at its scale slots",
        "the kernel reads the host scales' device views instead of the slots: wrong scales "
        "for every slot",
    ),
    Seam(
        _FP8,
        "Fp8MoEMethod.get_fused_moe_quant_config(layer)",
        "overridden to pass the scale slot buffers to make_fp8_moe_quant_config",
        "the kernel reads the host scales instead of the slots",
    ),
    Seam(
        _FP8,
        "Fp8MoEMethod.fp8_backend",
        "the backend select_fp8_moe_backend picked: the cache serves TRITON only",
        "another backend (re-laid-out weights) is not rejected",
    ),
    Seam(
        _FP8,
        "Fp8MoEMethod.experts_cls",
        "the experts class the backend picked (TritonExperts on sm90 for both variants)",
        "another experts class is not rejected",
    ),
    Seam(
        _FP8,
        "Fp8MoEMethod.weight_block_size",
        "[128, 128] for block-scaled checkpoints, None for per-tensor ones",
        "the variant guard fails with AttributeError",
    ),
    Seam(
        _FP8,
        "Fp8MoEMethod.weight_scale_name",
        "weight_scale_inv (block) or weight_scale (per tensor): the names of the scale "
        "parameters the cache holds on the host",
        "the scale parameters are not found: FP8 layers fail to load",
    ),
    Seam(
        _FP8_ONLINE,
        "Fp8PerTensorOnlineMoEMethod",
        "online per-tensor FP8 of a bf16 checkpoint (0.25.0: quantization='fp8'; 0.33.0: "
        "'fp8_per_tensor')",
        "online FP8 layers are rejected (no method to take over)",
    ),
    Seam(
        _FP8_ONLINE,
        "Fp8PerTensorOnlineMoEMethod.process_weights_after_loading(layer)",
        "overridden: vLLM quantizes the materialized layer, then the FP8 weights and [E] "
        "scales move to pinned host memory and the provider is built",
        "the online FP8 cache holds the expert set on the GPU or fails to build",
    ),
    Seam(
        _FP8_ONLINE,
        "_Fp8OnlineMoEBase._setup_kernel -> get_fused_moe_quant_config",
        "the online method builds its kernel's quant config through the overridable method",
        "the kernel reads the scales from the layer instead of the slots",
    ),
    Seam(
        _FP8_ONLINE,
        "_Fp8OnlineMoEBase.get_fused_moe_quant_config(layer)",
        "overridden to pass the scale slot buffers",
        "the kernel reads the layer's scales instead of the slots",
    ),
    Seam(
        _FP8_ONLINE,
        "_Fp8OnlineMoEBase._setup_kernel(layer, w13, w2, w13_scale, w2_scale, "
        "w13_input_scale, w2_input_scale)",
        "called again once the quantized layer is in pinned host memory: vLLM's kernel "
        "set-up over device views of the host tensors and the scale slots",
        "the online FP8 cache fails to build (TypeError)",
    ),
    Seam(
        _FP8_ONLINE,
        "_Fp8OnlineMoEBase.weight_scale_name",
        "weight_scale: the names of the online method's [E] scale parameters",
        "the scale parameters are not found: online FP8 layers fail to load",
    ),
    Seam(
        _FP8_ONLINE,
        "_Fp8OnlineMoEBase.fp8_backend",
        "the backend the online method picked: the cache serves TRITON only",
        "another backend is not rejected",
    ),
    Seam(
        _FP8_ONLINE,
        "_Fp8OnlineMoEBase.experts_cls",
        "the experts class the online method picked (TritonExperts on sm90)",
        "another experts class is not rejected",
    ),
    Seam(
        "vllm.model_executor.layers.quantization.online.moe_base",
        "OnlineMoEMethodBase.apply(layer, x, topk_weights, topk_ids, shared_experts, "
        "shared_experts_input)",
        "overridden (through Fp8PerTensorOnlineMoEMethod) to route the forward through the cache",
        "online FP8 forwards bypass the cache",
    ),
    Seam(
        _FP8,
        "Fp8MoEMethod.apply(layer, x, topk_weights, topk_ids, shared_experts, "
        "shared_experts_input)",
        "overridden to route the FP8 forward through the cache",
        "FP8 forwards bypass the cache and read the host weights directly",
    ),
    Seam(
        _FP8_ORACLE,
        "Fp8MoeBackend",
        "Fp8MoeBackend.TRITON is the FP8 backend the cache serves",
        "the plugin cannot install its FP8 support; FP8 layers are rejected",
    ),
    Seam(
        _FP8_ORACLE,
        "_get_priority_backends",
        "on capability 9.0 it moves TRITON to the front for block FP8 without expert "
        "parallelism: why the H200 picks TritonExperts for block-scaled checkpoints",
        "the H200 may pick another backend, which the cache rejects by name",
    ),
    Seam(
        _MXFP4,
        "GptOssMxfp4MoEMethod._setup_kernel(layer, w13, w2, w13_scale, w2_scale, w13_bias, "
        "w2_bias)",
        "converts a gpt-oss layer's raw tensors (swizzle, float32 biases, precision configs) "
        "and builds its kernel; the cache runs it once per layer, then copies each expert's "
        "converted bytes out",
        "gpt-oss layers with the cache cannot be converted; they fail at load",
    ),
    Seam(
        _MXFP4,
        "GptOssMxfp4MoEMethod.get_fused_moe_quant_config(layer)",
        "builds the quant config over the layer's precision configs and biases, which the "
        "cache points at its slots",
        "the kernel would read the layer's converted tensors, not the slots",
    ),
    Seam(
        _MXFP4,
        "GptOssMxfp4MoEMethod.apply(layer, x, topk_weights, topk_ids, shared_experts, "
        "shared_experts_input)",
        "overridden to route gpt-oss's forward through the cache",
        "gpt-oss forwards bypass the cache",
    ),
    Seam(
        _MXFP4_ORACLE,
        "Mxfp4MoeBackend",
        "Mxfp4MoeBackend.TRITON_UNFUSED is the MXFP4 backend the cache serves",
        "the plugin cannot serve gpt-oss; its layers are rejected",
    ),
    Seam(
        _MXFP4_ORACLE,
        "make_mxfp4_moe_kernel(moe_quant_config, moe_config, experts_cls, mxfp4_backend, "
        "routing_tables)",
        "builds gpt-oss's kernel again over the quant config of the slots",
        "gpt-oss layers with the cache cannot build their kernel",
    ),
    Seam(
        _OAI,
        "UnfusedOAITritonExperts.apply(output, hidden_states, w1, w2, topk_weights, topk_ids, "
        "activation, global_num_experts, expert_map)",
        "the experts class whose apply takes the router's ids and an expert_map over the "
        "slots and reduces through masked_moe_sum",
        "the cache cannot run gpt-oss's experts over its slots",
    ),
    Seam(
        _OAI,
        "masked_moe_sum(intermediate, topk_ids, output)",
        "the module global UnfusedOAITritonExperts.apply reduces through: tapped for the "
        "exact route of a step cut by experts",
        "a step of gpt-oss cut by experts raises instead of reducing once",
    ),
    Seam(
        _MXFP4,
        "GptOssMxfp4MoEMethod.mxfp4_backend",
        "the backend vLLM chose for the layer: the cache serves TRITON_UNFUSED only",
        "gpt-oss layers are refused whatever their backend",
    ),
    Seam(
        _MXFP4,
        "GptOssMxfp4MoEMethod.experts_cls",
        "the experts class of that backend, UnfusedOAITritonExperts",
        "gpt-oss layers are refused whatever their backend",
    ),
    Seam(
        _MXFP4,
        "GptOssMxfp4MoEMethod.w13_precision_config",
        "where the Triton backends keep the swizzled scales; the cache replaces them with "
        "precision configs over its scale slots",
        "the kernel would read every expert's scales from the converted tensors",
    ),
    Seam(
        f"{_MOE}.routed_experts",
        "RoutedExperts._expert_routing_tables",
        "what vLLM's _setup_kernel hands make_mxfp4_moe_kernel; the cache builds the kernel "
        "again the same way",
        "gpt-oss layers with the cache cannot build their kernel",
    ),
    Seam(
        _OAI,
        "BaseOAITritonExperts._make_routing_data(topk_ids, topk_weights, num_local_experts)",
        "wrapped on each cached layer's experts to pin the row tiles to those of one call "
        "over every expert (expected_tokens_per_expt)",
        "calls over the slots may choose other tiles and round differently",
    ),
    Seam(
        "vllm.third_party.triton_kernels.routing",
        "RoutingData.expected_tokens_per_expt",
        "the field matmul_ogs's tile choice reads before the tokens over the local experts",
        "the tiles are not pinned: calls over the slots may round differently",
    ),
    Seam(
        "vllm.third_party.triton_kernels.matmul_ogs",
        "PrecisionConfig.weight_scale",
        "the dataclass field the cache replaces with its scale slots",
        "the kernel would read the converted scales",
    ),
    Seam(
        "vllm.third_party.triton_kernels.tensor",
        "Tensor.shape_max",
        "a field of the wrapper the cache rebuilds over its slots (with the slot count)",
        "the wrappers over the slots cannot be built",
    ),
    Seam(
        "vllm.third_party.triton_kernels.tensor",
        "Storage.data",
        "the torch tensor of a wrapper: the converted bytes the cache copies, and the slot "
        "view it puts in their place",
        "the wrappers over the slots cannot be built",
    ),
    Seam(
        "vllm.config.vllm",
        "VllmConfig.kernel_config",
        "holds moe_backend, which the config hook sets to triton_unfused for gpt-oss with the "
        "cache on",
        "gpt-oss engines with the cache are refused unless started with triton_unfused",
    ),
    Seam(
        "vllm.config.kernel",
        "KernelConfig.moe_backend",
        "the MoE backend setting vLLM's MXFP4 method selects its kernel by",
        "gpt-oss engines with the cache are refused unless started with triton_unfused",
    ),
    Seam(
        "vllm.model_executor.utils",
        "replace_parameter",
        "gives a gpt-oss layer its bias slots as parameters, which the quant config reads",
        "the kernel would read the layer's own biases, not the slots",
    ),
    Seam(
        _FP8_ORACLE,
        "make_fp8_moe_quant_config(fp8_backend, w1_scale, w2_scale, a1_scale, a2_scale, "
        "block_shape)",
        "builds the quant config the kernel reads the scales from; vLLM's method calls it "
        "with the scales the cache passes",
        "the kernel's quant config cannot be built over the scale slots",
    ),
    Seam(
        f"{_MOE}.config",
        "FusedMoEConfig.experts_per_token",
        "guard: size must be at least top_k",
        "the guard fails with AttributeError",
    ),
    Seam(
        f"{_MOE}.config",
        "FusedMoEConfig.num_local_experts",
        "slots are clamped to the layer's experts",
        "the clamp fails with AttributeError",
    ),
    Seam(
        f"{_MOE}.config",
        "FusedMoEConfig.has_bias",
        "guard: expert biases are not cached",
        "the guard fails with AttributeError",
    ),
    Seam(
        f"{_MOE}.config",
        "FusedMoEConfig.is_act_and_mul",
        "w13 holds two projections (gate and up) or one",
        "create_weights allocates the wrong w13 shape",
    ),
    Seam(
        f"{_MOE}.oracle.unquantized",
        "UnquantizedMoeBackend",
        "UnquantizedMoeBackend.TRITON is the backend the cache serves",
        "the plugin cannot install; vLLM runs without the cache (one warning)",
    ),
    Seam(
        f"{_MOE}.routed_experts",
        "RoutedExperts.activation",
        "passed to the kernel by the cached apply",
        "cached forwards fail with AttributeError",
    ),
    Seam(
        f"{_MOE}.routed_experts",
        "RoutedExperts.global_num_experts",
        "passed to the kernel with the provider's expert_map",
        "cached forwards fail with AttributeError",
    ),
    Seam(
        f"{_MOE}.routed_experts",
        "RoutedExperts.apply_router_weight_on_input",
        "passed to the kernel by the cached apply",
        "cached forwards fail with AttributeError",
    ),
    Seam(
        f"{_MOE}.runner.moe_runner",
        "op:moe_forward",
        "made a splitting op so the MoE layer runs eagerly between captured pieces",
        "the host-planned forward is captured into a graph (the apply guard then raises)",
    ),
    Seam(
        f"{_MOE}.runner.moe_runner",
        "op:moe_forward_shared",
        "the same op for models with shared experts",
        "the host-planned forward is captured into a graph (the apply guard then raises)",
    ),
    Seam(
        "vllm.model_executor.utils",
        "set_weight_attrs",
        "gives the host-backed parameters vLLM's weight_loader",
        "the plugin cannot install; vLLM runs without the cache (one warning)",
    ),
    Seam(
        "vllm.utils.torch_utils",
        "get_accelerator_view_from_cpu_tensor",
        "a device view of the pinned host weights, which vLLM's post-load processing leaves "
        "in place (it moves CPU parameters to the GPU)",
        "the plugin cannot install; vLLM runs without the cache (one warning)",
    ),
    Seam(
        "vllm.config.vllm",
        "VllmConfig.__post_init__",
        "wrapped: knob validation and guards before vLLM's checks, graph mode after",
        "bad knob values and unsupported setups are no longer rejected at start-up, and "
        "graphs are not made piecewise",
    ),
    Seam(
        "vllm.config.vllm",
        "VllmConfig.additional_config",
        "the first source of the knob (--additional-config), and what carries the default "
        "planner the config hook chose (moe_expert_cache_planner_chosen) to the engine's other "
        "processes and later copies of the configuration",
        "the knob is read from the environment only, and each process chooses the default "
        "planner from the graph mode it sees",
    ),
    Seam(
        "vllm.config.vllm",
        "VllmConfig.parallel_config",
        "guards: expert and data parallelism",
        "the guards fail with AttributeError",
    ),
    Seam(
        "vllm.config.vllm",
        "VllmConfig.lora_config",
        "guard: LoRA",
        "LoRA is not rejected",
    ),
    Seam(
        "vllm.config.vllm",
        "VllmConfig.model_config",
        "guard: quantization",
        "quantized models are not rejected",
    ),
    Seam(
        "vllm.config.vllm",
        "VllmConfig.compilation_config",
        "graph mode and splitting ops",
        "graphs are not made piecewise",
    ),
    Seam(
        "vllm.config.vllm",
        "get_current_vllm_config",
        "each MoE method reads the knob of the engine that builds it",
        "the plugin cannot install; vLLM runs without the cache (one warning)",
    ),
    Seam(
        "vllm.logger",
        "DEFAULT_LOGGING_CONFIG",
        "vLLM configures handlers on its own 'vllm' logger only; the plugin's logger writes "
        "through them (rowcache.vllm._config.follow_vllm_logging) so its start-up lines "
        "(settings, the planner chosen and why) reach the server log",
        "the plugin's INFO lines (planner chosen, settings) are dropped; warnings still reach "
        "stderr through Python's last-resort handler",
    ),
    Seam(
        "vllm.config.parallel",
        "ParallelConfig.enable_expert_parallel",
        "guard: expert parallelism",
        "expert parallelism is not rejected",
    ),
    Seam(
        "vllm.config.parallel",
        "ParallelConfig.data_parallel_size",
        "guard: data parallelism",
        "data parallelism is not rejected",
    ),
    Seam(
        "vllm.config.model",
        "ModelConfig.quantization",
        "guard: quantized MoE methods",
        "quantized models are not rejected",
    ),
    Seam(
        "vllm.config.model",
        "ModelConfig.model_arch_config",
        "the default planner tells an FP8 checkpoint from online FP8 by the checkpoint's own "
        "quantization config (rowcache.vllm._config.evidence_quantization)",
        "every FP8 model counts as online per-tensor FP8: the host planner by default, until "
        "a run records online FP8",
    ),
    Seam(
        "vllm.config.model_arch",
        "ModelArchitectureConfig.quantization_config",
        "the checkpoint's quantization config (None for a bf16 checkpoint), read by "
        "rowcache.vllm._config.evidence_quantization",
        "as ModelConfig.model_arch_config",
    ),
    Seam(
        _CC,
        "CompilationConfig.splitting_ops",
        "the MoE ops are appended to the splitting ops",
        "the MoE op is captured into graphs",
    ),
    Seam(
        _CC,
        "CompilationConfig.cudagraph_mode",
        "full graphs are lowered to piecewise ones",
        "full graphs freeze one step's expert plan",
    ),
    Seam(
        _CC,
        "CompilationConfig.mode",
        "piecewise graphs need torch.compile (VLLM_COMPILE)",
        "graph mode lowering fails",
    ),
    Seam(
        _CC,
        "CompilationConfig.max_cudagraph_capture_size",
        "rows of each layer's capture-stable output buffer",
        "the MoE output is not capture-stable: wrong tokens in piecewise mode",
    ),
    Seam(
        _CC,
        "CompilationMode.VLLM_COMPILE",
        "the compilation mode with piecewise graphs",
        "the plugin cannot install; vLLM runs without the cache (one warning)",
    ),
    Seam(
        _CC,
        "CUDAGraphMode.PIECEWISE",
        "the graph mode the cache runs in",
        "the plugin cannot install; vLLM runs without the cache (one warning)",
    ),
    Seam(
        _CC,
        "CUDAGraphMode.NONE",
        "no graphs (eager, or no torch.compile)",
        "the plugin cannot install; vLLM runs without the cache (one warning)",
    ),
    Seam(
        _CC,
        "CUDAGraphMode.has_full_cudagraphs()",
        "finds the modes that must be lowered",
        "full graphs are not lowered",
    ),
    Seam(
        "vllm.compilation.cuda_graph",
        "CUDAGraphWrapper.__call__",
        "replays captured pieces from their capture-time input addresses: the reason the MoE "
        "output must live in a capture-stable buffer",
        "if replay starts copying inputs, the stable buffer becomes an unneeded copy",
    ),
)


def _functions(node: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {
        item.name: item
        for item in node.body
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def _top_level_names(tree: ast.Module) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.ImportFrom | ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = node
    return names


def _class_defines(node: ast.ClassDef, attr: str) -> bool:
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if item.name == attr:
                return True
        elif isinstance(item, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == attr for t in item.targets):
                return True
        elif (
            isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Name)
            and item.target.id == attr
        ):
            return True
    for function in _functions(node).values():
        for sub in ast.walk(function):
            targets: list[ast.expr] = []
            if isinstance(sub, ast.Assign):
                targets = list(sub.targets)
            elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
                targets = [sub.target]
            flat: list[ast.expr] = []
            while targets:
                target = targets.pop()
                if isinstance(target, ast.Tuple | ast.List):
                    targets.extend(target.elts)
                else:
                    flat.append(target)
            for target in flat:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == attr
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                ):
                    return True
    return False


def _parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = function.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    return {a.arg for a in every}


def check_seam(seam: Seam, source: str | None) -> str | None:
    """None when ``source`` (the module's text, None if absent) provides the seam, else why not."""
    where = f"{seam.module}: {seam.name}"
    if source is None:
        return f"{where}: module not found"
    tree = ast.parse(source)
    name = seam.name
    if name.startswith("op:"):
        op = name[3:]
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for keyword in node.keywords:
                    value = keyword.value
                    if (
                        keyword.arg == "op_name"
                        and isinstance(value, ast.Constant)
                        and value.value == op
                    ):
                        return None
        return f"{where}: no custom op registered as {op!r}"
    if " -> " in name:
        return _check_calls(tree, where, name)
    params: list[str] = []
    is_method = name.endswith(")") and "(" in name
    if is_method:
        name, _, rest = name.partition("(")
        params = [p.strip() for p in rest[:-1].split(",") if p.strip()]
    head, _, attr = name.partition(".")
    top = _top_level_names(tree)
    if head not in top:
        return f"{where}: {head!r} is not defined at the top level of the module"
    if not attr:
        if not is_method:
            return None
        defined = top[head]
        if not isinstance(defined, ast.FunctionDef | ast.AsyncFunctionDef):
            return f"{where}: {head!r} is not a function defined in the module"
        missing = [p for p in params if p not in _parameters(defined)]
        if missing:
            return f"{where}: {head} has no parameter(s) {', '.join(missing)}"
        return None
    cls = top[head]
    if not isinstance(cls, ast.ClassDef):
        return f"{where}: {head!r} is not a class defined in the module"
    if not _class_defines(cls, attr):
        return f"{where}: class {head} does not define {attr!r}"
    if is_method:
        function = _functions(cls).get(attr)
        if function is None:
            return f"{where}: {head}.{attr} is not a method"
        missing = [p for p in params if p not in _parameters(function)]
        if missing:
            return f"{where}: {head}.{attr} has no parameter(s) {', '.join(missing)}"
    return None


def _self_calls(function: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names ``m`` of every ``self.m(...)`` call in ``function``'s body."""
    found: set[str] = set()
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
        ):
            found.add(node.func.attr)
    return found


def _check_calls(tree: ast.Module, where: str, name: str) -> str | None:
    """``"Class.method -> attr"``: ``method`` reaches a ``self.attr(...)`` call."""
    left, _, attr = name.partition(" -> ")
    head, _, method = left.partition(".")
    cls = _top_level_names(tree).get(head)
    if not isinstance(cls, ast.ClassDef):
        return f"{where}: {head!r} is not a class defined at the top level of the module"
    functions = _functions(cls)
    if method not in functions:
        return f"{where}: {head}.{method} is not a method"
    seen: set[str] = set()
    todo = [method]
    while todo:
        current = todo.pop()
        if current in seen or current not in functions:
            continue
        seen.add(current)
        calls = _self_calls(functions[current])
        if attr in calls:
            return None
        todo.extend(calls)
    return f"{where}: {head}.{method} never calls self.{attr}(...)"


def module_path(module: str) -> tuple[str, str]:
    """The two file paths a module can have inside a wheel: ``a/b.py`` and ``a/b/__init__.py``."""
    base = module.replace(".", "/")
    return f"{base}.py", f"{base}/__init__.py"


def check_source(read: dict[str, str]) -> list[str]:
    """Check every seam against ``read`` (file path in the wheel -> text); the failures."""
    failures = []
    for seam in SEAMS:
        plain, package = module_path(seam.module)
        source = read.get(plain, read.get(package))
        problem = check_seam(seam, source)
        if problem is not None:
            failures.append(f"{problem} (needed because: {seam.why}; breaks: {seam.breaks})")
    return failures
