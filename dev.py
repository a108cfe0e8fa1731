#!/usr/bin/env python3
"""One entry point for a fresh clone; needs only Python 3.11+.

    python3 dev.py up [genmesh up options]   run the mesh (NATS, routers, workers, frontend)
    python3 dev.py test [pytest options]     run the test suite
    python3 dev.py lint                      ruff check, ruff format --check, mypy, lint-imports
    python3 dev.py genmesh ARGS...           any genmesh command, in the project's venv

The first run creates ./.venv (or the directory GENMESH_VENV names) and installs the
project with its test tools; later runs reinstall only when pyproject.toml (or a codec
package's) changed. The fast test tier: python3 dev.py test -m "unit or inproc".
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("GENMESH_VENV", ROOT / ".venv"))
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"
STAMP = VENV / ".genmesh-installed"


def _install_inputs() -> list[Path]:
    return [ROOT / "pyproject.toml", *sorted(ROOT.glob("codecs/*/pyproject.toml"))]


def _digest() -> str:
    h = hashlib.sha256()
    for path in _install_inputs():
        h.update(path.read_bytes())
    return h.hexdigest()


def ensure_venv() -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 - dev.py must run on any python3
        sys.exit(f"genmesh needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    if not PY.exists():
        print(f"dev.py: creating {VENV}", file=sys.stderr)
        venv.EnvBuilder(with_pip=True).create(VENV)
    digest = _digest()
    if STAMP.exists() and STAMP.read_text() == digest:
        return
    print("dev.py: installing genmesh and its test tools", file=sys.stderr)
    # `bench`: the plotting extra, so the plot tests run wherever the tests do.
    packages = ["-e", f"{ROOT}[test,dev,bench]"]
    for codec in sorted(ROOT.glob("codecs/*/pyproject.toml")):
        packages += ["-e", str(codec.parent)]
    subprocess.run(
        [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q", *packages],
        check=True,
    )
    STAMP.write_text(digest)


def run(*args: str) -> int:
    return subprocess.call(list(args), cwd=ROOT)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    ensure_venv()
    if command in ("up", "genmesh"):
        # Become genmesh rather than wait on it: a terminal's Ctrl-C then reaches genmesh
        # alone, which stops its services in order (a waiting parent would kill it).
        args = ["up", *rest] if command == "up" else rest
        os.chdir(ROOT)
        os.execv(BIN / "genmesh", [str(BIN / "genmesh"), *args])
    if command == "test":
        return run(str(PY), "-m", "pytest", *rest)
    if command == "lint":
        for step in (
            [str(PY), "-m", "ruff", "check", "."],
            [str(PY), "-m", "ruff", "format", "--check", "."],
            # genmesh, then each codec package (its own distribution, same strict settings).
            [str(PY), "-m", "mypy", "src/", *(str(p) for p in sorted(ROOT.glob("codecs/*/src")))],
            # The layering contract in pyproject.toml: imports point down only.
            [str(BIN / "lint-imports"), "--no-cache"],
        ):
            code = run(*step)
            if code:
                return code
        return 0
    print(f"dev.py: unknown command {command!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
