"""CI: every CUDA source under plugins/ compiles for sm_80 and sm_90 (.ci/compile_cuda.sh)."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed on this machine")
def test_cuda_sources_compile():
    r = subprocess.run(["bash", str(ROOT / ".ci" / "compile_cuda.sh")], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
