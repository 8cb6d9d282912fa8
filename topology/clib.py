"""netweave's optional C libraries (``csrc/``, built by ``make``): where each is looked for, and loading with its ABI check.

Each library exports ``int <prefix>_version(void)``, the version of its
functions' ABI (as NCCL's plugin tables are versioned); a library built from
other sources is refused with the reason, and the caller falls back to its
Python loop. Nothing is loaded at import.

>>> path = library_path("libnetweave-replay.so", "NETWEAVE_REPLAY_LIB")
>>> path.name
'libnetweave-replay.so'
>>> lib, why = load_library(path.with_name("missing.so"), "nw_replay_version", 1)
>>> lib is None and why.endswith("missing.so not built (run make -C csrc)")
True
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

BUILD_DIR = Path(__file__).resolve().parents[1] / "csrc" / "build"


def library_path(name: str, env: str) -> Path:
    """Where library ``name`` is looked for: the path in environment variable ``env`` when set, else ``csrc/build/``."""
    override = os.environ.get(env)
    return Path(override) if override else BUILD_DIR / name


def load_library(path: Path, version_symbol: str, abi: int) -> tuple[ctypes.CDLL | None, str]:
    """The library at ``path`` and ``""``, or ``None`` and why not (not built, not loadable, or another ABI than ``abi``)."""
    if not path.exists():
        return None, f"{path} not built (run make -C csrc)"
    try:
        lib = ctypes.CDLL(str(path))
        version = getattr(lib, version_symbol)
    except (OSError, AttributeError) as e:
        return None, f"{path}: {e}"
    version.restype = ctypes.c_int
    if version() != abi:
        return None, f"{path} speaks ABI {version()}, expected {abi} (rebuild csrc)"
    return lib, ""
