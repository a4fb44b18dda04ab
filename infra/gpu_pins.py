"""Check that the GPU install set (`requirements-gpu.txt`) is one set pip can install together on linux
x86_64 with CPython 3.12, without installing it.

Two checks, both against the package index pip uses (`PIP_INDEX_URL`, else PyPI):
1. **Published requirements.** For every pin, read its wheel's METADATA for that platform by HTTP range
   requests (only the zip directory and the METADATA entry travel, not the 0.3-1 GB wheels of vLLM or CUDA
   torch), or a source-only package's PKG-INFO; evaluate each `Requires-Dist` marker for linux x86_64 /
   CPython 3.12, and check that every requirement on another pinned package admits that pin.
2. **Resolver dry run.** `pip install --dry-run` of the whole set for that platform (`--only-binary`,
   `--platform`, `--python-version`): it proves the unpinned rest resolves too. A source-only package, or one
   the index lacks a file of for the target (this machine's mirror has gaps), gets an empty stand-in wheel so
   the resolver goes on; the outcome names the stand-ins. A conflict fails the check.

Usage: `python infra/gpu_pins.py [requirements-gpu.txt] [--no-resolver]`; exit 0 when consistent, 1 with one
line per conflict otherwise. Nothing downloaded is executed or installed.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import (
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version

PYTHON = (3, 12)
MANYLINUX = [f"manylinux_2_{m}_x86_64" for m in range(40, 16, -1)] + [
    "manylinux2014_x86_64",
    "linux_x86_64",
]
"""The platform tags a current x86_64 CUDA image (glibc ≥ 2.28) accepts, newest first."""
TIMEOUT_S = 60


def target_environment() -> dict[str, str]:
    """Marker variables of linux x86_64 with CPython 3.12 (what `Requires-Dist` markers are evaluated in)."""
    env = dict(default_environment())
    env.update(
        python_version="3.12",
        python_full_version="3.12.0",
        implementation_name="cpython",
        implementation_version="3.12.0",
        platform_python_implementation="CPython",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
    )
    return env


def supported_tags() -> list[Tag]:
    """Wheel tags the target accepts, most specific first."""
    return [
        *cpython_tags(PYTHON, platforms=MANYLINUX),
        *compatible_tags(PYTHON, "cp312", platforms=MANYLINUX),
    ]


def read_pins(path: Path) -> dict[str, Version]:
    """`name==version` lines of a requirements file (comments and blank lines ignored); anything else is an
    error naming the line."""
    pins: dict[str, Version] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        if len(spec) != 1 or spec[0].operator != "==" or req.marker is not None:
            raise ValueError(f"{path}:{n}: {line!r} is not an exact pin (name==version)")
        pins[canonicalize_name(req.name)] = Version(spec[0].version)
    return pins


@dataclass
class Report:
    conflicts: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    checked: int = 0
    resolver: str = "not run"


def check_requirements(
    pins: dict[str, Version], requires: Callable[[str, Version], list[str] | None]
) -> Report:
    """Check every pin's published requirements (`requires(name, version)`: its `Requires-Dist` lines, or
    None when the index has no wheel for the target) against the other pins."""
    env = target_environment()
    report = Report()
    for name, version in sorted(pins.items()):
        lines = requires(name, version)
        if lines is None:
            report.missing.append(f"{name}=={version}")
            continue
        report.checked += 1
        for line in lines:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            dep = canonicalize_name(req.name)
            if dep in pins and not req.specifier.contains(pins[dep], prereleases=True):
                report.conflicts.append(
                    f"{name}=={version} requires {req.name}{req.specifier}, "
                    f"but the set pins {dep}=={pins[dep]}"
                )
    return report


# -- the index ------------------------------------------------------------------------------------------
def index_url() -> str:
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def _get(url: str, headers: dict[str, str] | None = None) -> bytes:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        return bytes(r.read())


@functools.cache
def _files(name: str) -> list[dict]:
    page = json.loads(_get(f"{index_url()}/{name}/", {"Accept": "application/vnd.pypi.simple.v1+json"}))
    return list(page.get("files", []))


def sdist_url(name: str, version: Version) -> str | None:
    """The URL of `name==version`'s source archive (.tar.gz) on the index, or None."""
    for f in _files(name):
        fn = f["filename"]
        if fn.endswith(".tar.gz") and not f.get("yanked"):
            try:
                if parse_sdist_filename(fn)[1] == version:
                    return str(f["url"])
            except ValueError:
                continue
    return None


def sdist_requires(data: bytes) -> list[str] | None:
    """`Requires-Dist` of a source archive's top-level PKG-INFO; None when it does not declare them
    (requirements computed by its build script)."""
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        member = next(
            (m for m in tar.getmembers() if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")), None
        )
        f = tar.extractfile(member) if member is not None else None
        if f is None:
            return None
        text = f.read().decode("utf-8")
    from email.parser import Parser

    return list(Parser().parsestr(text).get_all("Requires-Dist") or []) or None


def wheel_url(name: str, version: Version, tags: Iterable[Tag] | None = None) -> str | None:
    """The URL of `name==version`'s best wheel for the target on the index (PEP 691 JSON), or None."""
    rank = {t: i for i, t in enumerate(tags or supported_tags())}
    best: tuple[int, str] | None = None
    for f in _files(name):
        fn = f["filename"]
        if not fn.endswith(".whl") or f.get("yanked"):
            continue
        try:
            _, v, _, wtags = parse_wheel_filename(fn)
        except InvalidWheelFilename:  # ancient uploads with tags packaging refuses
            continue
        if v != version:
            continue
        score = min((rank[t] for t in wtags if t in rank), default=None)
        if score is not None and (best is None or score < best[0]):
            best = (score, str(f["url"]))
    return None if best is None else best[1]


class RangeReader:
    """Byte ranges of a remote file (HTTP Range requests), enough to read one zip member."""

    def __init__(self, url: str, fetch: Callable[[str, dict[str, str]], bytes] = _get) -> None:
        self.url = url
        self.fetch = fetch

    def tail(self, n: int) -> bytes:
        return self.fetch(self.url, {"Range": f"bytes=-{n}"})

    def span(self, start: int, length: int) -> bytes:
        return self.fetch(self.url, {"Range": f"bytes={start}-{start + length - 1}"})


def remote_metadata(reader: RangeReader) -> str:
    """The `*.dist-info/METADATA` text of the wheel behind `reader`, from its zip central directory."""
    tail = reader.tail(65_536 + 22)
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0:
        raise ValueError(f"{reader.url}: no zip end-of-directory record in the last 64 KiB")
    cd_size, cd_offset = struct.unpack("<II", tail[eocd + 12 : eocd + 20])
    if cd_offset == 0xFFFFFFFF:  # zip64: the end-of-directory locator sits just before
        loc = tail.rfind(b"PK\x06\x07", 0, eocd)
        (z64_offset,) = struct.unpack("<Q", tail[loc + 8 : loc + 16])
        z64 = reader.span(z64_offset, 56)
        cd_size, cd_offset = struct.unpack("<QQ", z64[40:56])
    cd = reader.span(cd_offset, cd_size)
    pos = 0
    while pos + 46 <= len(cd) and cd[pos : pos + 4] == b"PK\x01\x02":
        method, _, _, _, csize, _, nlen, elen, clen = struct.unpack("<HHHIIIHHH", cd[pos + 10 : pos + 34])
        (local_offset,) = struct.unpack("<I", cd[pos + 42 : pos + 46])
        fname = cd[pos + 46 : pos + 46 + nlen].decode()
        extra = cd[pos + 46 + nlen : pos + 46 + nlen + elen]
        pos += 46 + nlen + elen + clen
        if not re.fullmatch(r"[^/]+\.dist-info/METADATA", fname):
            continue
        if 0xFFFFFFFF in (csize, local_offset):
            csize, local_offset = _zip64_sizes(extra, csize, local_offset)
        head = reader.span(local_offset, 30)
        lnlen, lelen = struct.unpack("<HH", head[26:30])
        data = reader.span(local_offset + 30 + lnlen + lelen, csize)
        if method == zipfile.ZIP_DEFLATED:
            data = zlib.decompress(data, -15)
        elif method != zipfile.ZIP_STORED:
            raise ValueError(f"{reader.url}: METADATA compressed with method {method}")
        return data.decode("utf-8")
    raise ValueError(f"{reader.url}: no *.dist-info/METADATA in the wheel")


def _zip64_sizes(extra: bytes, csize: int, offset: int) -> tuple[int, int]:
    """The compressed size and local-header offset from a zip64 extra field (only the overflowed ones are
    there, in the order uncompressed size, compressed size, offset; the uncompressed size is skipped only
    when present, which a METADATA member never needs)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack("<HH", extra[pos : pos + 4])
        if tag == 1:
            vals = list(struct.unpack(f"<{size // 8}Q", extra[pos + 4 : pos + 4 + size]))
            if csize == 0xFFFFFFFF:
                csize = vals.pop(1 if len(vals) > 1 else 0)
            if offset == 0xFFFFFFFF:
                offset = vals[-1]
            break
        pos += 4 + size
    return csize, offset


def requires_dist(metadata: str) -> list[str]:
    """The `Requires-Dist` values of a METADATA text."""
    from email.parser import Parser

    return list(Parser().parsestr(metadata).get_all("Requires-Dist") or [])


def published_requires(name: str, version: Version) -> list[str] | None:
    """`name==version`'s requirements for the target: its wheel's METADATA, else its source archive's
    PKG-INFO; None when the index has neither or the archive leaves them to its build script."""
    url = wheel_url(name, version)
    if url is not None:
        return requires_dist(remote_metadata(RangeReader(url)))
    src = sdist_url(name, version)
    return None if src is None else sdist_requires(_get(src))


# -- the resolver ---------------------------------------------------------------------------------------
def stub_wheel(folder: Path, name: str, version: str) -> Path:
    """An empty wheel of `name==version` (metadata only, no requirements) in `folder`: it stands in for a
    source-only package or a file the index lacks, so the dry run can go on to the rest of the set."""
    dist = f"{canonicalize_name(name).replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(
            f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def _stand_in_version(name: str, spec: str) -> str:
    """The newest version on the index (any file) that `spec` admits, else the first version it names."""
    from packaging.specifiers import SpecifierSet

    wanted = SpecifierSet(spec)
    found: list[Version] = []
    for f in _files(name):
        try:
            fn = f["filename"]
            v = parse_wheel_filename(fn)[1] if fn.endswith(".whl") else parse_sdist_filename(fn)[1]
        except (InvalidWheelFilename, ValueError):
            continue
        if wanted.contains(v, prereleases=False):
            found.append(v)
    if found:
        return str(max(found))
    named = re.findall(r"[\d][\w.]*", spec)
    return named[0].rstrip(".*") if named else "0"


def resolver_dry_run(
    pins: dict[str, Version], wheel_less: Iterable[str] = (), max_stand_ins: int = 12
) -> tuple[bool, str]:
    """`pip install --dry-run` of `pins` for the target: (ok, one line of outcome). Source-only packages
    (`wheel_less`, and any the resolver reports as having no file for the target) get an empty stand-in wheel
    and the run goes on, up to `max_stand_ins` of them; the line names them (the published-requirements check
    covers those that are pinned). A conflict fails."""
    stand_ins: list[str] = []
    with tempfile.TemporaryDirectory() as target:
        folder = Path(target)
        requirements = folder / "pins.txt"
        requirements.write_text("".join(f"{n}=={v}\n" for n, v in pins.items()))
        for n in wheel_less:
            stub_wheel(folder, n, str(pins[canonicalize_name(n)]))
            stand_ins.append(f"{n}=={pins[canonicalize_name(n)]}")
        while True:
            cmd = [
                sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                "--only-binary=:all:", "--implementation", "cp", "--python-version", "3.12",
                *[a for p in MANYLINUX for a in ("--platform", p)],
                "--find-links", str(folder), "--target", str(folder / "site"), "-r", str(requirements),
            ]  # fmt: skip
            env = {**os.environ, "PIP_CONSTRAINT": "", "PIP_FIND_LINKS": ""}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if proc.returncode == 0:
                extra = f"; stand-ins for {', '.join(stand_ins)}" if stand_ins else ""
                return True, f"the resolver accepts the whole set{extra}"
            missing = re.search(r"No matching distribution found for ([A-Za-z0-9_.\-]+)(\S*)", proc.stderr)
            if missing is None or "ResolutionImpossible" in proc.stderr or len(stand_ins) >= max_stand_ins:
                err = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR") or "requires" in ln]
                return False, " / ".join(err[-6:]) or proc.stderr.strip()[-800:]
            name, spec = missing.group(1), missing.group(2)
            version = _stand_in_version(name, spec)
            stub_wheel(folder, name, version)
            stand_ins.append(f"{name}=={version}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("requirements", nargs="?", default=str(Path(__file__).parents[1] / "requirements-gpu.txt"))
    p.add_argument("--no-resolver", action="store_true", help="only the published-requirements check")
    args = p.parse_args(argv)
    path = Path(args.requirements)
    pins = read_pins(path)
    report = check_requirements(pins, published_requires)
    ok = not report.conflicts
    if not args.no_resolver:
        wheel_less = [n for n, v in pins.items() if wheel_url(n, v) is None]
        resolved, report.resolver = resolver_dry_run(pins, wheel_less)
        ok = ok and resolved
    print(f"{path.name}: {len(pins)} pins, {report.checked} checked against their published requirements")
    for line in report.missing:
        print(f"  not on the index for linux x86_64 / cp312: {line} (checked only as others require it)")
    for line in report.conflicts:
        print(f"  CONFLICT: {line}")
    print(f"  resolver dry run: {report.resolver}")
    print("consistent" if ok else "NOT consistent: fix the pins above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "RangeReader",
    "Report",
    "check_requirements",
    "read_pins",
    "remote_metadata",
    "requires_dist",
    "resolver_dry_run",
    "target_environment",
    "wheel_url",
]
