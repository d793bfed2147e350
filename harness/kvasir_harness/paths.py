"""Where things are: the repository, the built artifacts (each overridable
by an environment variable), the benchmarks' trace and results, the served
model names, and loading a script (scripts/demo.py) as a module for its
tests."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

# harness/kvasir_harness/paths.py -> the repository root. The package is
# installed editable (scripts/setup.sh), so this file stays in the checkout.
REPO = Path(os.environ.get("KVASIR_REPO", Path(__file__).resolve().parents[2]))

TARGET = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
WASM = TARGET / "wasm32-wasip1" / "wasm-release" / "kvasir_filter.wasm"
COMPILE = TARGET / "release" / "examples" / "compile_policy"
SIM_BIN = Path(os.environ.get("VLLM_SIM_BIN", TARGET / "release" / "vllm-sim"))
INDEXER_BIN = Path(os.environ.get("KVASIR_INDEXER_BIN", TARGET / "release" / "cache-indexer"))
ENVOY_BIN = Path(os.environ.get("ENVOY_BIN", REPO / ".tools" / "bin" / "envoy"))
TOKENIZER = Path(os.environ.get("KVASIR_TOKENIZER_DIR", REPO / ".tools" / "tokenizers" / "qwen3"))
BENCH_BIN = Path(os.environ.get("KVASIR_BENCH_BIN", TARGET / "release" / "kvasir-bench"))
# The Mooncake-format trace the routing benchmark replays; it lives beside
# the checkout (shared/), not in it, as it is too large to commit.
TRACE = Path(os.environ.get("KVASIR_TRACE", REPO.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"))
# Where the benchmarks write their results (the committed summaries too).
RESULTS = REPO / "bench" / "results"

# The model the pools serve, and the one the external provider serves.
MODEL = "Qwen/Qwen3-8B"
PROVIDER_MODEL = "provider-model"


def load_script(path: Path | str, name: str | None = None) -> ModuleType:
    """A script such as scripts/demo.py, imported from its file (scripts
    are not packages: this replaces putting their folder on sys.path).
    Loaded once per name; `__name__` is not "__main__", so `main()` does not
    run."""
    path = Path(path)
    if not path.is_absolute():
        path = REPO / path
    name = name or path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path.resolve():
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    # Registered before running it: dataclasses and pickling look it up.
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod
