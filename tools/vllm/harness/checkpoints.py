"""Building the random-weight checkpoints the engines load.

The builder is ``tools/vllm/make_moe_checkpoint.py`` (``$ROWCACHE_CKPT_TOOL`` names another),
which makes the GPU bundle's checkpoints from the same seed and can skew the routers. A
checkpoint built whole before by this builder (a warm machine: ``BUILT`` in its directory,
holding ``BUILDER_VERSION``) is not built again; any other directory in its place is removed
and built anew. Foreground
checkpoints (seconds) are built before any engine starts; the others in one background process,
in the order the phases first need them, while the phases that do not need them run. An engine
of a budgeted phase starts once its own checkpoint is built (``Background.ready``); timed
sections start only once the whole build has ended.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from tools.vllm.harness.specs import Checkpoint

CKPT_TOOL = os.environ.get(
    "ROWCACHE_CKPT_TOOL", str(Path(__file__).resolve().parents[1] / "make_moe_checkpoint.py")
)


def location(work: Path, checkpoint: Checkpoint) -> Path:
    return work / checkpoint.directory


def command(work: Path, checkpoint: Checkpoint) -> list[str]:
    args = [sys.executable, CKPT_TOOL, str(location(work, checkpoint)), *checkpoint.builder_args()]
    if checkpoint.experts_from is not None:
        args += ["--experts-from", str(work / checkpoint.experts_from)]
    return args


BUILT = ".rowcache-built"
"""Written into a checkpoint's directory once its builder has returned: the checkpoint is
whole. ``config.json`` alone is no sign (transformers' ``save_pretrained`` writes it before the
weights, so a build stopped halfway leaves one)."""
BUILDER_VERSION = "2"
"""What ``BUILT`` holds: the builder's output format. A checkpoint whose marker holds another
(or none: before 2) is built again. 2: DeepSeek-V3's correction biases are zeros (drawn, they
decided its routing alone; docs/records/2026-12-06-deepseek-v3-reduced.md)."""


def is_built(directory: Path) -> bool:
    """Whether the checkpoint in ``directory`` was built whole by this builder (its ``BUILT``
    marker, holding ``BUILDER_VERSION``)."""
    marker = directory / BUILT
    return marker.is_file() and marker.read_text().strip() == BUILDER_VERSION


def mark_built(directory: Path) -> None:
    """Say that the checkpoint in ``directory`` is whole (after its builder returned)."""
    (directory / BUILT).write_text(BUILDER_VERSION + "\n")


def with_sources(needed: list[Checkpoint], known: list[Checkpoint]) -> list[Checkpoint]:
    """``needed`` with, before each checkpoint whose experts are another's
    (``experts_from``: a skewed twin links the plain checkpoint's shards), that other one
    from ``known``: a skewed phase run alone on a fresh machine builds its source first."""
    by_directory = {c.directory: c for c in known}
    out: list[Checkpoint] = []
    for checkpoint in needed:
        if checkpoint.experts_from is not None:
            source = by_directory.get(checkpoint.experts_from)
            if source is None:
                raise ValueError(
                    f"{checkpoint.directory} takes its experts from {checkpoint.experts_from}, "
                    "which no phase builds"
                )
            if source not in out:
                out.append(source)
        if checkpoint not in out:
            out.append(checkpoint)
    return out


def missing(work: Path, checkpoints: list[Checkpoint]) -> list[Checkpoint]:
    return [c for c in checkpoints if not is_built(location(work, c))]


def build_foreground(work: Path, checkpoints: list[Checkpoint]) -> None:
    """Build the foreground ones among ``checkpoints`` now (a failure stops the run)."""
    for checkpoint in missing(work, [c for c in checkpoints if c.foreground]):
        shutil.rmtree(location(work, checkpoint), ignore_errors=True)
        subprocess.run(command(work, checkpoint), check=True)
        mark_built(location(work, checkpoint))


class Background:
    """The background build: one process building its checkpoints one after the other,
    writing a ``date +%s`` line before, between and after them into its log, and ``BUILT``
    into each checkpoint once it is whole."""

    def __init__(self, work: Path, checkpoints: list[Checkpoint], log: Path) -> None:
        self.work = work
        self.checkpoints = missing(work, [c for c in checkpoints if not c.foreground])
        self.proc: subprocess.Popen[bytes] | None = None
        if not self.checkpoints:
            return
        steps = ["set -e", "date +%s"]
        for checkpoint in self.checkpoints:
            directory = shlex.quote(str(location(work, checkpoint)))
            built = shlex.quote(str(location(work, checkpoint) / BUILT))
            steps += [
                f"rm -rf {directory}",  # half built, or by another builder version
                shlex.join(command(work, checkpoint)),
                f"echo {BUILDER_VERSION} > {built}",
                "date +%s",
            ]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                ["bash", "-c", "; ".join(steps)], stdout=out, stderr=subprocess.STDOUT
            )

    def needed_by(self, checkpoints: list[Checkpoint]) -> bool:
        return any(c in self.checkpoints for c in checkpoints)

    def done(self) -> bool:
        """Whether the build has ended (built, or failed: the engines then fail to load)."""
        return self.proc is None or self.proc.poll() is not None

    def ready(self, checkpoint: Checkpoint) -> bool:
        """Whether an engine of ``checkpoint`` can start: not built here, built, or the build
        has ended (a failed build: the engine then fails to load, saying why)."""
        if checkpoint not in self.checkpoints or self.done():
            return True
        return is_built(location(self.work, checkpoint))

    def wait(self, timeout: float) -> bool:
        """Wait for the build to end, at most ``timeout`` seconds; whether it has."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            return False
        return True
