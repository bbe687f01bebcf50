"""scripts/gpu_te_setup.sh's part handling, run on a made-up file: parts carried over several calls are
collected (and stashed), joined in order and checked against a manifest, and a missing or corrupt part stops
it with one line that names the part. The install and build need the GPU machine and are not run here; the
committed manifest is checked for form and for agreeing with the script's pinned version."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_te_setup.sh"
MANIFEST = REPO / "scripts" / "te_files.sha256"
BIG = "fake_cu13-1.0-py3-none-any.whl"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def carried(tmp_path: Path) -> dict:
    """A TE_DIR holding a 'large' file as three parts of unequal content and one small file, and its
    manifest; the parts are also returned, so a test can carry them one at a time."""
    big = os.urandom(3000) + b"tail"
    parts = {f"parts/{BIG}.part-{i:02d}": big[i * 1200 : (i + 1) * 1200] for i in range(3)}
    small = {"small/meta-1.0-py3-none-any.whl": b"small file"}
    te_dir = tmp_path / "te"
    for rel, data in {**parts, **small}.items():
        (te_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (te_dir / rel).write_bytes(data)
    lines = ["# made-up manifest", f"{sha(big)}  joined/{BIG}"]
    # Listed out of order: the join must order parts by name, not by manifest line.
    for rel in [*reversed(parts), *small]:
        lines.append(f"{sha({**parts, **small}[rel])}  {rel}")
    manifest = tmp_path / "te_files.sha256"
    manifest.write_text("\n".join(lines) + "\n")
    return {"te_dir": te_dir, "manifest": manifest, "stash": tmp_path / "stash", "big": big, "parts": parts}


def run(c: dict, mode: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "TE_DIR": str(c["te_dir"]),
        "TE_MANIFEST": str(c["manifest"]),
        "TE_STASH": str(c["stash"]),
    }
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), mode], env=env, capture_output=True, text=True, timeout=60)


def test_join_rebuilds_the_file_in_part_order(carried):
    r = run(carried, "join")
    assert r.returncode == 0, r.stderr
    assert (carried["te_dir"] / "joined" / BIG).read_bytes() == carried["big"]
    assert "all 5 manifest entries verified" in r.stdout


def test_a_missing_part_fails_with_one_line_naming_it(carried):
    (carried["te_dir"] / f"parts/{BIG}.part-01").unlink()
    r = run(carried, "join")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("te_setup: FAILED:")
    assert f"missing: parts/{BIG}.part-01;" in lines[0]
    assert not (carried["te_dir"] / "joined" / BIG).exists()


def test_a_corrupt_part_fails_with_one_line_naming_it(carried):
    p = carried["te_dir"] / f"parts/{BIG}.part-02"
    data = bytearray(p.read_bytes())
    data[7] ^= 1
    p.write_bytes(bytes(data))
    r = run(carried, "all")  # fails at the check, before anything is installed
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1
    assert f"corrupt (sha256 mismatch): parts/{BIG}.part-02;" in lines[0]
    assert "missing: none" in lines[0]


def test_parts_collected_over_calls_survive_in_the_stash(carried):
    """Each device call carries one part; a part carried earlier may no longer be in the repo copy."""
    te_dir = carried["te_dir"]
    held = {rel: (te_dir / rel).read_bytes() for rel in carried["parts"]}
    for rel in held:
        (te_dir / rel).unlink()
    for i, (rel, data) in enumerate(held.items()):
        for other in held:  # only this call's part is in the tree
            (te_dir / other).unlink(missing_ok=True)
        (te_dir / rel).write_bytes(data)
        r = run(carried, "collect")
        assert r.returncode == 0, r.stderr
        assert f"have {i + 1}/3 parts" in r.stdout
        if i < 2:
            assert f"parts/{BIG}.part-{i + 1:02d}" in r.stdout.split("still to carry:")[1]
    assert "still to carry: nothing" in r.stdout
    r = run(carried, "join")
    assert r.returncode == 0, r.stderr
    assert (te_dir / "joined" / BIG).read_bytes() == carried["big"]


def test_collect_refuses_a_corrupt_part(carried):
    (carried["te_dir"] / f"parts/{BIG}.part-00").write_bytes(b"not the part")
    r = run(carried, "collect")
    assert r.returncode != 0
    assert f"corrupt (sha256 mismatch, carry again): parts/{BIG}.part-00" in r.stderr
    assert not (carried["stash"] / f"{BIG}.part-00").exists()


def test_the_committed_manifest_is_whole_and_matches_the_pin():
    entries = []
    for line in MANIFEST.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.fullmatch(r"([0-9a-f]{64})  ((?:joined|parts|small)/\S+)", line)
        assert m, line
        entries.append(m.group(2))
    assert len(entries) == len(set(entries))
    pin = re.search(r"^TE_VERSION=(\S+)$", SCRIPT.read_text(), re.M).group(1)
    names = {e.split("/", 1)[1] for e in entries}
    for needed in (
        f"transformer_engine_cu13-{pin}-py3-none-manylinux_2_28_x86_64.whl",
        f"transformer_engine-{pin}-py3-none-any.whl",
        f"transformer_engine_torch-{pin}.tar.gz",
    ):
        assert needed in names, needed
    joined = [e for e in entries if e.startswith("joined/")]
    for j in joined:
        parts = sorted(e for e in entries if e.startswith(f"parts/{j.split('/', 1)[1]}.part-"))
        assert parts and parts == [f"parts/{j.split('/', 1)[1]}.part-{i:02d}" for i in range(len(parts))]
