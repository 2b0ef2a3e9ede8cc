"""Build libdejavu_kernels: ``python -m dejavu_trt.kernels.build [--trt-include DIR] [--jobs N]``.

Runs cmake + make in plugins/build (needs nvcc >= 12 and cmake >= 3.24) and prints the library path. With
``--trt-include`` the TensorRT adapters are compiled too, and linked into libdejavu_trt_plugins.so (printed
as well) when libnvinfer is found beside those headers.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from . import TRT_PLUGIN_LIBRARY

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"


def build(build_dir: Path | None = None, trt_include: str | None = None, jobs: int | None = None) -> Path:
    build_dir = build_dir or PLUGINS / "build"
    cfg = ["cmake", "-S", str(PLUGINS), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release"]
    if trt_include:
        cfg.append(f"-DTRT_INCLUDE_DIR={trt_include}")
    subprocess.run(cfg, check=True)
    subprocess.run(["cmake", "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 4)], check=True)
    lib = build_dir / "libdejavu_kernels.so"
    if not lib.exists():
        raise SystemExit(f"build finished but {lib} is missing")
    return lib


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-dir", type=Path, default=None)
    ap.add_argument("--trt-include", default=None, help="TensorRT include dir: also compile the adapters")
    ap.add_argument("--jobs", type=int, default=None)
    a = ap.parse_args(argv)
    lib = build(a.build_dir, a.trt_include, a.jobs)
    print(lib)
    plugins = lib.with_name(TRT_PLUGIN_LIBRARY)
    if plugins.exists():
        print(plugins)
    elif a.trt_include:
        print(f"{TRT_PLUGIN_LIBRARY} not linked: libnvinfer was not found beside the TensorRT headers",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
