"""The parts of ``tools/vllm/e2e.py``, one job each.

* ``specs``: what an engine is (typed: mode, plugin knob, checkpoint, workload, memory).
* ``engines``, ``model_engines`` (the models phases), ``reruns``: the engines of each phase;
  ``phases``: the phases, in run order, and the labels ``run --only`` takes.
* ``checkpoints``: building the random-weight checkpoints.
* ``orchestrate``: ``run`` (engines as child processes, phase by phase) and ``merge``.
* ``child``: what runs inside one engine's process; ``probes``: what it runs where the model is;
  ``measure``: what an engine with a workload measures, in turn, before its deadline.
* ``profiling``: the MoE forward's profile (``run --profile``).
* ``summary``: the printed summary (``steps_report``: the steps comparison's tables, token
  comparisons and targets; ``probe_lines``: one line a probe of an engine's record);
  ``records``: references of results recorded before specs carried their own.
* The probes an engine runs with ``--trace`` and beside it: ``trace``, ``slot_watch``,
  ``first_state``, ``replay``, ``shadow``, ``placement``, ``scale_tails``, ``expert_bytes``;
  ``scale_guard``: no offload's MXFP4 weight scales followed by zeros, as the slots are.
* ``register_probe``: the plugin's registration cost in a fresh process.

Every module imports only the standard library at import time; vLLM and torch are imported
inside the functions that run on the GPU machine.
"""
