"""scripts/device_bundle.sh: the offline vLLM bundle cut into pieces that fit one device call
each, joined and checked on the GPU machine before anything unpacks."""

from __future__ import annotations

import hashlib
import io
import lzma
import math
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_bundle.sh"
PIECES = 5
"""How many pieces the tests ask ``split`` for (``BUNDLE_PIECES``), outside a git checkout."""
PARTS = ("core.tar.xz.partaa", "core.tar.xz.partab", "core.tar.xz.partac")

CALL_LIMIT = 64 << 20
"""What one device call carries: the tracked checkout and the ignored paths it names."""
BUNDLE_BYTES = 127_402_888
"""The shared builder's bundle for vLLM 0.25.0 (three parts of 42,467,629 to 42,467,630 bytes)."""
SMALL_PATHS = 3 << 20
"""What the last piece's call carries beside it: the rowcache wheel, the manifest and the two
FP8 wheels (0.5 MiB), or `vllm serve`'s seven wheels (1.0 MiB), with room to spare."""
MARGIN = 1 << 20
"""The script's margin for records committed after the pieces are cut (``BUNDLE_MARGIN``)."""


def _bundle(gpu: Path, payload: bytes, packed: bool = True, vllm: bool = True) -> None:
    """A bundle as the shared builder leaves it: a tar.xz cut in three, and its checksum
    (``packed=False``: bytes that are no tar.xz, under a checksum that matches them). It holds
    ``pkg/data.bin`` and a stand-in ``vllm`` package."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        members = [("pkg/data.bin", payload)] + ([("vllm/__init__.py", b"")] if vllm else [])
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    whole = lzma.compress(buf.getvalue(), preset=0) if packed else payload
    (gpu / "parts").mkdir(parents=True)
    (gpu / "tools").mkdir()
    cut = math.ceil(len(whole) / 3)
    for i, name in enumerate(PARTS):
        (gpu / "parts" / name).write_bytes(whole[i * cut : (i + 1) * cut])
    (gpu / "tools" / "SHA256").write_text(hashlib.sha256(whole).hexdigest() + "\n")


def _run(cmd: str, tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {
        **os.environ,
        "BUNDLE_GPU": str(tmp / ".gpu"),
        "BUNDLE_VP": str(tmp / "vp"),
        "BUNDLE_SITE": str(tmp / "site"),
        "BUNDLE_PIECES": str(PIECES),
        **env,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), cmd, *args],
        cwd=tmp,
        env=full,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture
def bundle(tmp_path: Path) -> tuple[Path, bytes]:
    payload = os.urandom(200_000)  # incompressible: the pieces carry real bytes
    _bundle(tmp_path / ".gpu", payload)
    return tmp_path, payload


def _largest_piece(size: int, pieces: int = PIECES) -> int:
    """``split -n`` cuts ``size // N`` bytes a piece and gives the remainder to the last."""
    return size // pieces + size % pieces


def _arrive(tmp: Path, skip: str = "") -> list[Path]:
    """The device calls: each piece copied to the machine's /tmp/vp."""
    vp = tmp / "vp"
    vp.mkdir(exist_ok=True)
    pieces = sorted((tmp / ".gpu" / "pieces").iterdir())
    for piece in pieces:
        if piece.name != skip:
            (vp / piece.name).write_bytes(piece.read_bytes())
    return pieces


def test_split_then_join_gives_back_the_bundle(bundle: tuple[Path, bytes]) -> None:
    tmp, payload = bundle
    out = _run("split", tmp)
    assert out.returncode == 0, out.stderr
    pieces = _arrive(tmp)
    assert [p.name for p in pieces] == [f"core.tar.xz.piece{i}" for i in range(PIECES)]
    whole = b"".join((tmp / ".gpu" / "parts" / n).read_bytes() for n in PARTS)
    assert b"".join(p.read_bytes() for p in pieces) == whole
    assert max(p.stat().st_size for p in pieces) == _largest_piece(len(whole))
    manifest = (tmp / ".gpu" / "tools" / "PIECES").read_text().split("\n")
    assert manifest[0] == f"core.tar.xz.piece0 {pieces[0].stat().st_size}"
    (tmp / "site").mkdir()  # an earlier call's site folder: replaced whole
    (tmp / "site" / "stale").write_text("old")
    out = _run("join", tmp)
    assert out.returncode == 0, out.stderr
    assert (tmp / "site" / "pkg" / "data.bin").read_bytes() == payload
    assert sorted(p.name for p in (tmp / "site").iterdir()) == ["pkg", "vllm"]
    assert not (tmp / "vp" / "core.tar.xz").exists()


def test_a_missing_piece_is_named_and_the_site_kept(bundle: tuple[Path, bytes]) -> None:
    tmp, _ = bundle
    assert _run("split", tmp).returncode == 0
    _arrive(tmp, skip="core.tar.xz.piece2")
    (tmp / "site").mkdir()
    (tmp / "site" / "old").write_text("kept")
    out = _run("join", tmp)
    assert out.returncode == 2
    assert "pieces missing" in out.stderr and "core.tar.xz.piece2" in out.stderr
    assert (tmp / "site" / "old").read_text() == "kept"


def test_a_changed_byte_fails_the_checksum_and_nothing_unpacks(
    bundle: tuple[Path, bytes],
) -> None:
    tmp, _ = bundle
    assert _run("split", tmp).returncode == 0
    _arrive(tmp)
    piece = tmp / "vp" / "core.tar.xz.piece1"
    data = bytearray(piece.read_bytes())
    data[17] ^= 1
    piece.write_bytes(bytes(data))
    out = _run("join", tmp)
    assert out.returncode == 2
    assert "do not match" in out.stderr
    assert not (tmp / "site").exists()
    assert not (tmp / "vp" / "core.tar.xz").exists()


def test_a_short_piece_is_named_with_both_sizes(bundle: tuple[Path, bytes]) -> None:
    tmp, _ = bundle
    assert _run("split", tmp).returncode == 0
    _arrive(tmp)
    piece = tmp / "vp" / "core.tar.xz.piece3"
    size = piece.stat().st_size
    piece.write_bytes(piece.read_bytes()[:-1])
    out = _run("join", tmp)
    assert out.returncode == 2
    assert f"has {size - 1} bytes, the manifest says {size}" in out.stderr


@pytest.mark.parametrize("command", ["join", "setup"])
def test_a_failed_unpack_keeps_the_earlier_site(tmp_path: Path, command: str) -> None:
    """Bytes that pass the checksum but do not unpack: the earlier site folder stays, nothing
    half-unpacked or joined is left, and set-up stops with the reason on its stderr."""
    _bundle(tmp_path / ".gpu", os.urandom(50_000), packed=False)
    assert _run("split", tmp_path).returncode == 0
    _arrive(tmp_path)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "old").write_text("kept")
    log = [str(tmp_path / "log")] if command == "setup" else []
    out = _run(command, tmp_path, *log)
    assert out.returncode == (2 if command == "join" else 3)
    assert "unpacking the bundle" in out.stderr and "is as it was" in out.stderr
    left = {".gpu", "site", "vp", *(["log"] if log else [])}
    assert {p.name for p in tmp_path.iterdir()} == left
    assert [p.name for p in (tmp_path / "site").iterdir()] == ["old"]
    assert not (tmp_path / "vp" / "core.tar.xz").exists()


def test_setup_shows_why_a_join_failed(bundle: tuple[Path, bytes]) -> None:
    tmp, _ = bundle
    assert _run("split", tmp).returncode == 0
    _arrive(tmp, skip="core.tar.xz.piece0")
    out = _run("setup", tmp, str(tmp / "log"))
    assert out.returncode == 3
    assert "pieces missing" in out.stderr and "core.tar.xz.piece0" in out.stderr
    assert "core.tar.xz.piece0" in (tmp / "log" / "join.log").read_text()
    assert not (tmp / "site").exists()


def test_split_refuses_parts_that_fail_their_checksum(bundle: tuple[Path, bytes]) -> None:
    tmp, _ = bundle
    (tmp / ".gpu" / "parts" / PARTS[1]).write_bytes(b"not the part")
    out = _run("split", tmp)
    assert out.returncode == 2
    assert "do not match" in out.stderr
    assert not (tmp / ".gpu" / "pieces").exists()
    assert not (tmp / ".gpu" / "pieces.new").exists()  # the joined parts not left behind
    assert not (tmp / ".gpu" / "tools" / "PIECES").exists()


@pytest.mark.parametrize("count", ["1", "10", "four"])
def test_split_names_a_bad_piece_count(bundle: tuple[Path, bytes], count: str) -> None:
    tmp, _ = bundle
    out = _run("split", tmp, BUNDLE_PIECES=count)
    assert out.returncode == 2
    assert count in out.stderr and "2 to 9" in out.stderr
    assert not (tmp / ".gpu" / "pieces").exists()


def test_split_without_a_bundle_says_how_to_build_one(tmp_path: Path) -> None:
    out = _run("split", tmp_path)
    assert out.returncode == 2
    assert "build_vllm_bundle.sh" in out.stderr


def test_a_piece_fits_one_device_call_beside_the_checkout() -> None:
    """The checkout that travels (the raw outputs under docs/ grow with every record) plus the
    largest of at most nine pieces, the small paths of the last call and the script's margin
    stay within one call's 64 MiB: ``split`` can cut the real bundle."""
    listed = subprocess.run(  # what a call carries: tracked, and untracked but not ignored
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    paths = [ROOT / os.fsdecode(name) for name in listed if name]
    checkout = sum(path.stat().st_size for path in paths if path.exists())
    piece = _largest_piece(BUNDLE_BYTES, 9)
    assert checkout + piece + SMALL_PATHS + MARGIN <= CALL_LIMIT, (
        f"the checkout {checkout:,} B + the largest of nine pieces {piece:,} B + {SMALL_PATHS:,} B "
        f"+ {MARGIN:,} B exceed one device call's {CALL_LIMIT:,} B: pack the raw outputs"
    )


def _checkout(tmp: Path, tracked: int, untracked: int = 0) -> None:
    """A git checkout in ``tmp`` that ignores the bundle's folders: ``tracked`` bytes staged,
    ``untracked`` bytes in a file git neither tracks nor ignores."""
    (tmp / ".gitignore").write_text("/.gpu/\n/vp/\n/site/\n")
    (tmp / "data.bin").write_bytes(b"d" * (tracked - len("/.gpu/\n/vp/\n/site/\n")))
    subprocess.run(["git", "init", "-q"], cwd=tmp, check=True)
    subprocess.run(["git", "add", ".gitignore", "data.bin"], cwd=tmp, check=True)
    if untracked:
        (tmp / "notes.txt").write_bytes(b"n" * untracked)


def _fewest(tmp: Path, limit: int) -> subprocess.CompletedProcess[str]:
    return _run("split", tmp, BUNDLE_PIECES="", BUNDLE_CALL_LIMIT=str(limit))


@pytest.mark.parametrize("untracked", [0, 5_000])
def test_split_cuts_the_fewest_pieces_that_fit_beside_the_checkout(
    bundle: tuple[Path, bytes], untracked: int
) -> None:
    """Unset ``BUNDLE_PIECES``: the fewest pieces whose largest fits the call's limit beside
    what travels (tracked and untracked-not-ignored files), the last call's small paths and
    the margin; the limit met exactly still fits, a byte less takes one piece more."""
    tmp, _ = bundle
    _checkout(tmp, 40_000, untracked)
    whole = sum((tmp / ".gpu" / "parts" / n).stat().st_size for n in PARTS)
    small = sum(f.stat().st_size for f in (tmp / ".gpu" / "tools").iterdir())
    travels = 40_000 + untracked
    exact = travels + _largest_piece(whole, 3) + small + MARGIN
    out = _fewest(tmp, exact)
    assert out.returncode == 0, out.stderr
    assert len(list((tmp / ".gpu" / "pieces").iterdir())) == 3
    assert f"3 pieces: the checkout {travels} B" in out.stderr
    (tmp / ".gpu" / "tools" / "PIECES").unlink()  # the small paths as they were for `exact`
    out = _fewest(tmp, exact - 1)
    assert out.returncode == 0, out.stderr
    pieces = _arrive(tmp)
    assert [p.name for p in pieces] == [f"core.tar.xz.piece{i}" for i in range(4)]
    assert len((tmp / ".gpu" / "tools" / "PIECES").read_text().splitlines()) == 4
    assert _run("join", tmp).returncode == 0


def test_split_says_when_no_count_fits_and_leaves_the_pieces(bundle: tuple[Path, bytes]) -> None:
    tmp, _ = bundle
    _checkout(tmp, 40_000)
    assert _run("split", tmp, BUNDLE_PIECES="2").returncode == 0
    before = {p.name: p.read_bytes() for p in (tmp / ".gpu" / "pieces").iterdir()}
    out = _fewest(tmp, 40_000 + MARGIN)  # no room beside the checkout for any piece
    assert out.returncode == 2
    assert "even 9 pieces do not fit" in out.stderr
    assert " B <= " not in out.stderr  # no count's sum was announced as fitting
    assert "the checkout 40000 B" in out.stderr
    assert {p.name: p.read_bytes() for p in (tmp / ".gpu" / "pieces").iterdir()} == before
    assert not (tmp / ".gpu" / "pieces.new").exists()


def test_split_outside_a_checkout_asks_for_a_count(bundle: tuple[Path, bytes]) -> None:
    tmp, _ = bundle
    out = _fewest(tmp, CALL_LIMIT)
    assert out.returncode == 2
    assert "not in a git checkout" in out.stderr and "BUNDLE_PIECES" in out.stderr
    assert not (tmp / ".gpu" / "pieces").exists() and not (tmp / ".gpu" / "pieces.new").exists()


def test_setup_stops_where_pip_fails(bundle: tuple[Path, bytes]) -> None:
    """No rowcache wheel carried: the bundle is unpacked, then set-up stops with pip's reason."""
    tmp, payload = bundle
    assert _run("split", tmp).returncode == 0
    _arrive(tmp)
    out = _run("setup", tmp, str(tmp / "log"))
    assert out.returncode == 3
    assert "pip failed" in out.stderr and "setup ok" not in out.stdout
    assert (tmp / "site" / "pkg" / "data.bin").read_bytes() == payload


def _wheel(folder: Path, name: str, version: str, module: str) -> None:
    """A minimal wheel of one module (``module/__init__.py``), as pip installs it."""
    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f"NAME = {name!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


def _wheels(tmp: Path) -> str:
    """The rowcache wheel and the extras as the last call carries them; the PATH on which
    ``python3`` is this interpreter (one with pip)."""
    _wheel(tmp / ".gpu" / "tools", "rowcache", "0.1.0", "rowcache")
    _wheel(tmp / ".gpu" / "extra", "compressed_tensors", "0.17.0", "compressed_tensors")
    _wheel(tmp / ".gpu" / "extra", "loguru", "0.7.3", "loguru")
    _wheel(tmp / ".gpu" / "extra", "pkg_clash", "1.0", "pkg")  # the bundle has its own pkg
    return f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"


def test_setup_installs_the_wheels_beside_the_bundle(bundle: tuple[Path, bytes]) -> None:
    """The whole set-up: pieces joined and unpacked, the rowcache wheel installed into the site,
    the extras added where the bundle lacks them (never over its own files), vLLM found."""
    tmp, payload = bundle
    assert _run("split", tmp).returncode == 0
    _arrive(tmp)
    out = _run("setup", tmp, str(tmp / "log"), PATH=_wheels(tmp))
    assert out.returncode == 0, out.stderr
    assert "setup ok" in out.stdout and str(tmp / "site" / "rowcache") in out.stdout
    site = tmp / "site"
    for module in ("rowcache", "compressed_tensors", "loguru", "vllm"):
        assert (site / module / "__init__.py").exists(), module
    assert (site / "pkg" / "data.bin").read_bytes() == payload
    assert not (site / "pkg" / "__init__.py").exists()  # the extra's pkg did not go over it


def test_setup_without_vllm_in_the_bundle_stops(tmp_path: Path) -> None:
    _bundle(tmp_path / ".gpu", b"payload", vllm=False)
    assert _run("split", tmp_path).returncode == 0
    _arrive(tmp_path)
    out = _run("setup", tmp_path, str(tmp_path / "log"), PATH=_wheels(tmp_path))
    assert out.returncode == 3 and "setup ok" not in out.stdout
    assert "no vllm in" in out.stderr and "does not import" in out.stderr


def test_setup_stops_on_an_extra_that_does_not_install(bundle: tuple[Path, bytes]) -> None:
    tmp, _ = bundle
    assert _run("split", tmp).returncode == 0
    _arrive(tmp)
    path = _wheels(tmp)
    (tmp / ".gpu" / "extra" / "loguru-0.7.3-py3-none-any.whl").write_bytes(b"no zip")
    out = _run("setup", tmp, str(tmp / "log"), PATH=path)
    assert out.returncode == 3
    assert "pip failed" in out.stderr and "setup ok" not in out.stdout


def test_an_empty_manifest_is_named(bundle: tuple[Path, bytes]) -> None:
    tmp, _ = bundle
    assert _run("split", tmp).returncode == 0
    _arrive(tmp)
    (tmp / ".gpu" / "tools" / "PIECES").write_text("")
    out = _run("join", tmp)
    assert out.returncode == 2 and "lists no pieces" in out.stderr
    assert not (tmp / "site").exists()
