"""infra/gpu_pins.py, offline: pins parsed strictly, published requirements checked against the other pins
under linux x86_64 / CPython 3.12 markers, and a wheel's METADATA read through byte ranges only."""

from __future__ import annotations

import importlib.util
import re
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[3]


def _load():
    spec = importlib.util.spec_from_file_location("gpu_pins", ROOT / "infra" / "gpu_pins.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_pins"] = mod
    spec.loader.exec_module(mod)
    return mod


gp = _load()


def test_the_gpu_set_is_exact_pins_with_vllm_torch_and_transformers():
    pins = gp.read_pins(ROOT / "requirements-gpu.txt")
    assert {"vllm", "torch", "transformers", "deepspeed", "prefect"} <= set(pins)


def test_a_range_is_refused_naming_the_line(tmp_path):
    f = tmp_path / "req.txt"
    f.write_text("# set\ntorch==2.14.0\nvllm>=0.33\n")
    with pytest.raises(ValueError, match=r"req.txt:3: 'vllm>=0.33' is not an exact pin"):
        gp.read_pins(f)


def test_conflicts_are_found_under_the_target_markers():
    pins = {"vllm": Version("0.33.0"), "torch": Version("2.13.0"), "numpy": Version("2.4.6")}
    published = {
        "vllm": [
            "torch==2.14.0",
            'numpy<2.4; python_version <= "3.12"',  # applies on 3.12
            'numpy<2.0; python_version < "3.12"',  # does not
            'torch<2; extra == "bench"',  # extras are not installed
            'numpy<1; sys_platform == "win32"',
        ],
        "torch": ["filelock"],
        "numpy": None,  # not on the index for the target: reported, still checked as others need it
    }
    report = gp.check_requirements(pins, lambda name, version: published[name])
    assert report.missing == ["numpy==2.4.6"]
    assert report.checked == 2
    assert report.conflicts == [
        "vllm==0.33.0 requires torch==2.14.0, but the set pins torch==2.13.0",
        "vllm==0.33.0 requires numpy<2.4, but the set pins numpy==2.4.6",
    ]


def _ranged(data: bytes, seen: list[str]):
    """A fetch over `data` that honours HTTP Range headers (the index's file server) and records them."""

    def fetch(url: str, headers: dict[str, str]) -> bytes:
        spec = headers["Range"]
        seen.append(spec)
        tail = re.fullmatch(r"bytes=-(\d+)", spec)
        if tail:
            return data[-int(tail.group(1)) :]
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", spec)
        assert m, spec
        return data[int(m.group(1)) : int(m.group(2)) + 1]

    return fetch


def test_metadata_is_read_from_byte_ranges_of_a_large_wheel(tmp_path):
    wheel = tmp_path / "big-1.0-py3-none-any.whl"
    payload = bytes(range(256)) * 20_000  # 5 MB of incompressible-ish data before the METADATA
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("big/blob.bin", payload, compress_type=zipfile.ZIP_STORED)
        z.writestr(
            "big-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: big\nRequires-Dist: torch==2.14.0\n"
        )
        z.writestr("big-1.0.dist-info/RECORD", "")
    data = wheel.read_bytes()
    seen: list[str] = []
    text = gp.remote_metadata(gp.RangeReader("https://index/big.whl", fetch=_ranged(data, seen)))
    assert gp.requires_dist(text) == ["torch==2.14.0"]
    fetched = 0
    for spec in seen:
        if spec.startswith("bytes=-"):
            fetched += int(spec[7:])
        else:
            a, b = map(int, spec[6:].split("-"))
            fetched += b - a + 1
    assert fetched < len(data) // 20, f"read {fetched} of {len(data)} bytes"


def test_a_stand_in_wheel_is_a_wheel_with_no_requirements(tmp_path):
    path = gp.stub_wheel(tmp_path, "antlr4-python3-runtime", "4.9.3")
    assert path.name == "antlr4_python3_runtime-4.9.3-py3-none-any.whl"
    text = gp.remote_metadata(gp.RangeReader(str(path), fetch=_ranged(path.read_bytes(), [])))
    assert "Version: 4.9.3" in text and gp.requires_dist(text) == []
