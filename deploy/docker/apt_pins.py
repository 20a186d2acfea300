"""The apt pins of Dockerfile.cuda: each package at the newest version the Ubuntu archive holds.

    python deploy/docker/apt_pins.py            # print package=version for the Dockerfile's packages
    python deploy/docker/apt_pins.py --check    # exit 1 if a pin of the Dockerfile is not the archive's

The CUDA image installs shared libraries from Ubuntu 24.04 ("noble") with ``apt-get install``;
each is pinned (``package=version``, hadolint DL3008) so that two builds install the same
bytes. The version is the newest of the release and its ``-updates`` and ``-security``
pockets (what ``apt-get install`` would pick on the day), read from the archive's
``Packages`` indexes (``main``, amd64) and compared by ``dpkg --compare-versions``.
Ubuntu drops a superseded version from its pockets' indexes when a security update lands:
a pinned build then fails at ``apt-get install`` instead of installing other bytes, and
this script gives the new pins (``--check`` says which changed).
"""

from __future__ import annotations

import argparse
import lzma
import re
import subprocess
import sys
import urllib.request
from functools import cmp_to_key
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parent / "Dockerfile.cuda"
ARCHIVE = "http://archive.ubuntu.com/ubuntu"
SUITE = "noble"
POCKETS = (SUITE, f"{SUITE}-updates", f"{SUITE}-security")
#: ``name`` or ``name=version`` in the Dockerfile's ``apt-get install`` line(s).
PACKAGE = re.compile(r"^[a-z0-9][a-z0-9.+-]*(=[A-Za-z0-9.+:~-]+)?$")


def installed(dockerfile: Path = DOCKERFILE) -> dict[str, str | None]:
    """``{package: pinned version or None}`` of every ``apt-get install`` of ``dockerfile``."""
    text = dockerfile.read_text().replace("\\\n", " ")
    found: dict[str, str | None] = {}
    for command in re.findall(r"apt-get install ([^&;\n]*)", text):
        for word in command.split():
            if word.startswith("-"):
                continue
            if not PACKAGE.match(word):
                raise ValueError(f"an apt-get install argument must be a package or package=version, got {word!r}")
            name, _, version = word.partition("=")
            found[name] = version or None
    return found


def dpkg_compare(a: str, b: str) -> int:
    """-1, 0 or 1 as Debian orders versions ``a`` and ``b``."""
    if subprocess.run(["dpkg", "--compare-versions", a, "eq", b], check=False).returncode == 0:
        return 0
    return -1 if subprocess.run(["dpkg", "--compare-versions", a, "lt", b], check=False).returncode == 0 else 1


def newest(packages: set[str], archive: str = ARCHIVE) -> dict[str, str]:
    """The newest version of each of ``packages`` over :data:`POCKETS` of ``archive``."""
    versions: dict[str, list[str]] = {p: [] for p in packages}
    for pocket in POCKETS:
        url = f"{archive}/dists/{pocket}/main/binary-amd64/Packages.xz"
        with urllib.request.urlopen(url, timeout=60) as response:
            index = lzma.decompress(response.read()).decode()
        for stanza in index.split("\n\n"):
            name = re.search(r"^Package: (\S+)$", stanza, re.MULTILINE)
            if name and name.group(1) in versions:
                version = re.search(r"^Version: (\S+)$", stanza, re.MULTILINE)
                if version:
                    versions[name.group(1)].append(version.group(1))
    missing = sorted(p for p, v in versions.items() if not v)
    if missing:
        raise SystemExit(f"not in {SUITE} main: {', '.join(missing)}")
    return {p: max(v, key=cmp_to_key(dpkg_compare)) for p, v in versions.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare the Dockerfile's pins with the archive")
    ap.add_argument("--archive", default=ARCHIVE, help=f"Ubuntu archive mirror (default {ARCHIVE})")
    args = ap.parse_args(argv)
    pins = installed()
    latest = newest(set(pins), args.archive)
    if not args.check:
        print(" ".join(f"{p}={latest[p]}" for p in sorted(latest)))
        return 0
    stale = {p: (pins[p], latest[p]) for p in sorted(pins) if pins[p] != latest[p]}
    for p, (have, want) in stale.items():
        print(f"{p}: Dockerfile.cuda {have or 'unpinned'}, archive {want}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
