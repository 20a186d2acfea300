"""A compiler's output kept in pytest's cache folder under the hash of everything that goes into it.

The GPU tests compile attention.cu with nvcc (PTX) and g++ (the CPU emulation) on every run; an
unchanged tree reads the output back instead (seconds a run). Any change of the sources or the
command builds again, and without pytest's cache plugin every run builds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def kept_build(pytestconfig: Any, name: str, inputs: Sequence[str], sources: Path, out: Path,
               build: Callable[[], None]) -> Path:
    """``out`` after ``build()`` writes it, or the copy kept under ``name`` in pytest's cache by the
    sha256 of ``inputs`` (the generated source, the command) and every file of the folder ``sources``."""
    digest = hashlib.sha256("\n".join(inputs).encode())
    for path in sorted(sources.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    cache = getattr(pytestconfig, "cache", None)
    kept = cache.mkdir(name) / f"{digest.hexdigest()[:24]}{out.suffix}" if cache is not None else None
    if kept is not None and kept.exists():
        return kept
    build()
    if kept is not None:
        partial = kept.with_suffix(f".{os.getpid()}.part")
        shutil.copyfile(out, partial)
        os.replace(partial, kept)  # whole or absent, whichever process writes it
    return out
