"""The `orbitkv` package's PEP 517 build backend: maturin, after the release build of the
commands the package installs.

`pip install ./client/python` (or `pip wheel`) builds the wheel here. Before maturin builds
the native module, `scripts/release-binaries` builds `orbitkv-server`, `orbitkv-ctl` and
`orbitkv-perf` (`cargo build --release --locked`, debug sections removed) into the folder that
`[tool.maturin] data` names; its `scripts/` go into the wheel's `.data/scripts/`, which pip
installs on the environment's PATH (its `bin/`). The Docker image ships the same build.

A source distribution is refused: the package is built from the workspace checkout, whose
server crates an sdist of `client/python` would not carry.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping

import maturin

COMMANDS = ("orbitkv-server", "orbitkv-ctl", "orbitkv-perf")

# What maturin answers as is: requirements need no binaries.
get_requires_for_build_wheel = maturin.get_requires_for_build_wheel
get_requires_for_build_editable = maturin.get_requires_for_build_editable


def _workspace_root() -> Path:
    # client/python/build_backend/orbitkv_build.py -> the repository root.
    return Path(__file__).resolve().parents[3]


def _data_dir() -> Path:
    """The folder `[tool.maturin] data` names, created (maturin requires it to exist)."""
    data = maturin.get_config().get("data")
    if not data:
        raise RuntimeError("pyproject.toml: [tool.maturin] data is not set; the commands have nowhere to go")
    path = (Path.cwd() / data).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def prepare_metadata_for_build_wheel(
    metadata_directory: str, config_settings: Mapping[str, Any] | None = None
) -> str:
    _data_dir()
    return maturin.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(
    metadata_directory: str, config_settings: Mapping[str, Any] | None = None
) -> str:
    _data_dir()
    return maturin.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def _stage_commands() -> None:
    """Builds the commands into `<data>/scripts/`, replacing what an earlier build left."""
    scripts = _data_dir() / "scripts"
    if scripts.exists():
        shutil.rmtree(scripts)
    build = _workspace_root() / "scripts" / "release-binaries"
    print(f"orbitkv: building {', '.join(COMMANDS)} (scripts/release-binaries)", file=sys.stderr, flush=True)
    # cargo's progress goes to stderr, which pip shows with -v.
    done = subprocess.run(["bash", str(build), str(scripts)], stdout=sys.stderr, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"scripts/release-binaries failed (exit {done.returncode}); its output says why")
    missing = [c for c in COMMANDS if not os.access(scripts / c, os.X_OK)]
    if missing:
        raise RuntimeError(f"scripts/release-binaries did not produce {', '.join(missing)} in {scripts}")


def build_wheel(
    wheel_directory: str,
    config_settings: Mapping[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    _stage_commands()
    return maturin.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(
    wheel_directory: str,
    config_settings: Mapping[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    _stage_commands()
    return maturin.build_editable(wheel_directory, config_settings, metadata_directory)


def get_requires_for_build_sdist(config_settings: Mapping[str, Any] | None = None) -> list[str]:
    return []


def build_sdist(sdist_directory: str, config_settings: Mapping[str, Any] | None = None) -> str:
    raise RuntimeError(
        "orbitkv has no source distribution: it is built from the OrbitKV checkout "
        "(`pip install ./client/python`, `pip wheel ./client/python`, or `python -m build --wheel client/python`)"
    )
