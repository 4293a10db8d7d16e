"""Write sha256 hashes into the requirement locks, so that installs run in pip's hash-checking mode.

A lock (`requirements/*.txt`) pins every package `name==version`. This script adds under each pin a
`--hash=sha256:...` for every file the package indexes publish for that exact version (each wheel for
each Python and platform, and the sdist), so one lock verifies on this machine, in the Docker images and
on other platforms. `pip install --require-hashes` then refuses any file whose hash the lock does not
list (a tampered mirror, a re-uploaded file), and any package the lock does not pin.

    .venv/bin/python scripts/lock.py                             # rehash every requirements/*.txt
    .venv/bin/python scripts/lock.py requirements/torch-cpu.txt  # rehash one lock

It changes no version: edit the pins (`name==version`, e.g. from `pip freeze` of a venv that works)
and run it again. The comment lines at the top of a lock are kept as they are.

Where the hashes come from: PyPI's simple index, the PyTorch CPU index (torch's `+cpu` builds), and
the indexes and find-links folders of pip's own configuration (`pip config list`: this machine's
local mirrors). An index that cannot be reached is skipped with a warning naming it; a pin that gets
no hash at all is an error and no file is written. A file whose hash two sources disagree on is
reported (both hashes are written: the install may fetch it from either).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shlex
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
INDEXES = ("https://pypi.org/simple", "https://download.pytorch.org/whl/cpu")


@dataclass
class Pin:
    """One `name==version[; marker]` entry of a lock, and the files found for it."""

    line: str  # the requirement as written, without its hashes
    name: str
    version: Version
    files: dict[str, set[str]] = field(default_factory=dict)  # filename → sha256 digests seen


def read_lock(path: Path) -> tuple[list[str], list[Pin]]:
    """The lock's leading comment lines and its pins; anything but an exact `==` pin is an error."""
    header: list[str] = []
    pins: list[Pin] = []
    logical = "\n".join(path.read_text().splitlines()).replace("\\\n", " ")
    for number, raw in enumerate(logical.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            if not pins:
                header.append(raw)
            continue
        text = " ".join(re.sub(r"(^|\s)(--hash[= ]\S+|#.*)", " ", line).split())
        req = Requirement(text)
        specs = list(req.specifier)
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            sys.exit(f"{path}:{number}: {text!r} is not pinned with one `==version`; pin it (see the docstring)")
        pins.append(Pin(text, canonicalize_name(req.name), Version(specs[0].version)))
    return header, pins


def pip_sources() -> tuple[list[str], list[str]]:
    """The index URLs and find-links entries of pip's configuration (files and PIP_* variables)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    indexes, links = [], []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        values = shlex.split(value)[0].split() if value else []
        if key.endswith((".index-url", ".extra-index-url")):
            indexes += values
        elif key.endswith(".find-links"):
            links += values
    return indexes, links


class _Anchors(HTMLParser):
    """The (href, text) of every link of a PEP 503 project page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((self._href, data.strip()))
            self._href = None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def index_files(index: str, name: str) -> list[tuple[str, str]]:
    """(filename, sha256) of every file on `index`'s page for project `name`; [] when it has none.

    The digest is the link's `#sha256=` fragment (PEP 503); a local (file://) index without one is
    hashed from the file. Raises OSError when the index cannot be reached."""
    url = f"{index.rstrip('/')}/{name}/"
    if url.startswith("file://"):
        page = Path(urllib.parse.unquote(urllib.parse.urlparse(url).path))
        if not (page / "index.html").is_file():
            return []
        html = (page / "index.html").read_text()
    else:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": "text/html"}), timeout=120) as r:
                html = r.read().decode()
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return []
            raise
    parser = _Anchors()
    parser.feed(html)
    found = []
    for href, text in parser.links:
        target, _, fragment = href.partition("#")
        filename = urllib.parse.unquote(text or target.rsplit("/", 1)[-1])
        digest = urllib.parse.parse_qs(fragment).get("sha256", [""])[0]
        link = urllib.parse.urljoin(url, target)
        if not digest and link.startswith("file://"):
            local = Path(urllib.parse.unquote(urllib.parse.urlparse(link).path))
            digest = _sha256(local) if local.is_file() else ""
        if digest:
            found.append((filename, digest))
    return found


def link_files(folder: str, name: str) -> list[tuple[str, str]]:
    """(filename, sha256) of the files of project `name` in a find-links folder."""
    path = Path(folder)
    if not path.is_dir():
        return []
    return [(p.name, _sha256(p)) for p in sorted(path.iterdir())
            if p.is_file() and _project_version(p.name)[0] == name]


def _project_version(filename: str) -> tuple[str | None, Version | None]:
    """(project, version) a wheel's or sdist's file name states; (None, None) for anything else."""
    try:
        if filename.endswith(".whl"):
            name, version, _, _ = parse_wheel_filename(filename)
        elif filename.endswith((".tar.gz", ".zip")):
            name, version = parse_sdist_filename(filename)
        else:
            return None, None
    except ValueError:  # packaging's Invalid*Filename and InvalidVersion both derive from it
        return None, None
    return name, version


def collect(pins: list[Pin], indexes: list[str], links: list[str]) -> list[str]:
    """Fill each pin's files from every source; returns a warning per unreachable source."""
    sources = [(index_files, i) for i in indexes] + [(link_files, f) for f in links]
    jobs = [(pin, fn, source) for pin in pins for fn, source in sources]
    dead: dict[str, str] = {}

    def fetch(job):
        pin, fn, source = job
        if source in dead:
            return pin, []
        try:
            return pin, fn(source, pin.name)
        except OSError as e:
            dead.setdefault(source, str(getattr(e, "reason", e)))
            return pin, []

    with ThreadPoolExecutor(max_workers=8) as pool:
        for pin, found in pool.map(fetch, jobs):
            for filename, digest in found:
                if _project_version(filename) == (pin.name, pin.version):
                    pin.files.setdefault(filename, set()).add(digest)
    return [f"skipped {source}: {reason}" for source, reason in dead.items()]


def render(header: list[str], pins: list[Pin]) -> str:
    lines = list(header)
    for pin in pins:
        digests = sorted({d for ds in pin.files.values() for d in ds})
        lines.append(" \\\n".join([pin.line] + [f"    --hash=sha256:{d}" for d in digests]))
    return "\n".join(lines) + "\n"


def _builds_here(pin: Pin) -> bool:
    """Whether this interpreter would install a wheel of the pin (else pip builds its sdist)."""
    here = set(sys_tags())
    return any(set(parse_wheel_filename(f)[3]) & here for f in pin.files if f.endswith(".whl"))


def sources(indexes: list[str], links: list[str], defaults: bool = True) -> tuple[list[str], list[str]]:
    """The indexes and find-links folders to hash from: those given, then (defaults) PyPI, the PyTorch
    CPU index and pip's configured ones."""
    indexes, links = list(indexes), list(links)
    if defaults:
        configured = pip_sources()
        indexes += [i for i in (*INDEXES, *configured[0]) if i not in indexes]
        links += [f for f in configured[1] if f not in links]
    return indexes, links


def rehash(paths: list[Path], indexes: list[str], links: list[str]) -> int:
    """Rewrite each lock with its hashes; returns the exit status."""
    locks = {path: read_lock(path) for path in paths}
    every = [pin for _, pins in locks.values() for pin in pins]
    for warning in collect(every, indexes, links):
        print(f"[lock] WARNING: {warning}", file=sys.stderr)
    missing = [f"{path}: {pin.line}" for path, (_, pins) in locks.items() for pin in pins if not pin.files]
    if missing:
        print("[lock] no published file found for:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    for pin in every:
        for filename, digests in pin.files.items():
            if len(digests) > 1:
                print(f"[lock] WARNING: sources disagree on {filename}'s sha256: {sorted(digests)}", file=sys.stderr)
    for path, (header, pins) in locks.items():
        path.write_text(render(header, pins))
        sdists = [p.line for p in pins if not _builds_here(p)]
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        print(f"[lock] {shown}: {len(pins)} pins, "
              f"{sum(len(p.files) for p in pins)} files hashed"
              + (f"; no wheel for this Python (built from the sdist): {', '.join(sdists)}" if sdists else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("locks", nargs="*", type=Path, help="lock files (default: every requirements/*.txt)")
    parser.add_argument("--index", action="append", default=[], help="a further simple index URL (repeatable)")
    parser.add_argument("--find-links", action="append", default=[], help="a further wheel folder (repeatable)")
    parser.add_argument("--no-default-sources", action="store_true",
                        help="only the --index/--find-links given: neither PyPI, the PyTorch index nor pip's config")
    args = parser.parse_args(argv)
    indexes, links = sources(args.index, args.find_links, defaults=not args.no_default_sources)
    paths = [p.resolve() for p in args.locks] or sorted((ROOT / "requirements").glob("*.txt"))
    return rehash(paths, indexes, links)


if __name__ == "__main__":
    sys.exit(main())
