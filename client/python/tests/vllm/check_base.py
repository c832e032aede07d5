"""Checks `orbitkv.vllm.OrbitKVConnector` against another vLLM release's `KVConnectorBase_V1`
(its base.py alone, taken from that release's wheel, loaded beside the installed vLLM): every
abstract method is implemented, every method the connector overrides keeps the base's
parameters, and so does its `SupportsHMA` method.

usage: check_base.py VLLM_WHEEL_OR_BASE_PY VERSION
"""

import importlib.util
import inspect
import sys
import types
import zipfile

MEMBER = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"


def main() -> int:
    path, version = sys.argv[1], sys.argv[2]
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as z:
            source = z.read(MEMBER).decode()
    else:
        source = open(path).read()
    spec = importlib.util.spec_from_loader(f"vllm_base_{version.replace('.', '_')}", loader=None)
    module = importlib.util.module_from_spec(spec)
    # A name the base imports that the installed vLLM lacks (a newer release's config type):
    # a placeholder class of that name stands in while the base loads (only the base's own
    # methods and their parameters are compared).
    saved = {}
    try:
        for _ in range(16):
            try:
                exec(compile(source, f"vllm-{version}/{MEMBER}", "exec"), module.__dict__)
                break
            except ImportError as e:
                missing = e.msg.split("'")[1] if e.msg.startswith("cannot import name") else None
                if not missing or not e.name or not e.name.startswith("vllm."):
                    raise
                installed = importlib.import_module(e.name)
                saved.setdefault(e.name, installed)
                stand_in = types.ModuleType(e.name)
                stand_in.__dict__.update(vars(sys.modules[e.name]))
                setattr(stand_in, missing, type(missing, (), {}))
                sys.modules[e.name] = stand_in
                print(f"  {e.name}.{missing}: a placeholder (the installed vLLM has no such name)")
    finally:
        sys.modules.update(saved)
    base = module.KVConnectorBase_V1

    from orbitkv.vllm import OrbitKVConnector

    problems = []
    for name in sorted(base.__abstractmethods__):
        impl = getattr(OrbitKVConnector, name, None)
        if impl is None or getattr(impl, "__isabstractmethod__", False):
            problems.append(f"abstract method {name} is not implemented")
    for name, member in vars(OrbitKVConnector).items():
        theirs = getattr(base, name, None)
        if name.startswith("_") or not callable(member) or theirs is None or not callable(theirs):
            continue
        ours_params = list(inspect.signature(member).parameters)
        their_params = list(inspect.signature(theirs).parameters)
        ours_fixed = [p for p in ours_params if p not in ("kwargs", "args")]
        their_fixed = [p for p in their_params if p not in ("kwargs", "args")]
        if ours_fixed != their_fixed:
            problems.append(
                f"{name}{inspect.signature(member)} differs from vLLM {version}'s {name}{inspect.signature(theirs)}"
            )
    hma = getattr(module, "SupportsHMA", None)
    if hma is not None:
        # The hybrid KV cache manager stays on only for a connector of the base's SupportsHMA.
        for name in sorted(hma.__abstractmethods__):
            impl = getattr(OrbitKVConnector, name, None)
            if impl is None or getattr(impl, "__isabstractmethod__", False):
                problems.append(f"SupportsHMA's {name} is not implemented")
            elif list(inspect.signature(impl).parameters) != list(inspect.signature(getattr(hma, name)).parameters):
                problems.append(f"{name}{inspect.signature(impl)} differs from vLLM {version}'s "
                                f"{name}{inspect.signature(getattr(hma, name))}")
    new = sorted(n for n in vars(base) if not n.startswith("_") and callable(getattr(base, n))
                 and n not in vars(OrbitKVConnector))
    print(f"vLLM {version} KVConnectorBase_V1: {len(base.__abstractmethods__)} abstract methods, all implemented"
          if not problems else f"vLLM {version}: {len(problems)} problems")
    print(f"  base methods the connector leaves to the base's defaults: {', '.join(new)}")
    for p in problems:
        print("  PROBLEM:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
