"""Checks the `orbitkv` wheel scripts/test built: its platform tag is the manylinux policy
asked for, auditwheel finds every ELF file in it (the native module and the three commands)
consistent with that policy, and the commands are there, executable, in `.data/scripts/`.
Prints the wheel's size.

usage: check_wheel.py WHEEL POLICY      (POLICY: e.g. manylinux_2_34)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile

COMMANDS = ("orbitkv-server", "orbitkv-ctl", "orbitkv-perf")


def glibc(policy: str) -> tuple[int, int]:
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)", policy)
    if not m:
        raise SystemExit(f"{policy!r} is not a manylinux_X_Y policy")
    return int(m.group(1)), int(m.group(2))


def main() -> None:
    wheel, policy = sys.argv[1], sys.argv[2]
    name = os.path.basename(wheel)
    tags = name[:-len(".whl")].split("-")[-1].split(".")
    assert any(t.startswith(policy + "_") for t in tags), f"{name}: no {policy} platform tag"

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        for c in COMMANDS:
            entry = [n for n in names if re.fullmatch(rf"orbitkv-[^/]+\.data/scripts/{c}", n)]
            assert entry, f"{name}: no .data/scripts/{c}"
            mode = z.getinfo(entry[0]).external_attr >> 16
            assert mode & 0o111, f"{entry[0]} is not executable (mode {oct(mode)})"

    out = subprocess.run([sys.executable, "-m", "auditwheel", "show", wheel], capture_output=True, text=True)
    text = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 0, f"auditwheel show failed:\n{out.stdout}{out.stderr}"
    m = re.search(r'consistent with the following platform tag: "(manylinux_\d+_\d+)_[a-z0-9_]+"', text)
    assert m, f"auditwheel finds no manylinux tag for {name}:\n{out.stdout}"
    assert glibc(m.group(1)) <= glibc(policy), f"auditwheel: {name} needs {m.group(1)}, newer than {policy}"
    size = os.path.getsize(wheel)
    print(f"check_wheel: {name}: {size / 1e6:.1f} MB, consistent with {m.group(1)} (auditwheel), "
          f"commands {', '.join(COMMANDS)} in .data/scripts")


if __name__ == "__main__":
    main()
