"""The linear-head and cross-entropy kernels compile for a 99 KB-shared-memory GPU (sm_86: RTX 30xx, A10; sm_89
and sm_120 have the same limit) within that limit: tools/compile_check.py records every launch of the public
functions under the interpreter with the tiles such a GPU gets, and compiles each for sm_86 (no GPU needed)."""

import os
import subprocess
import sys

import pytest
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="this Triton has no bundled ptxas")
@pytest.mark.slow  # compiles every kernel specialisation for sm_86 (~30 s of CPU)
def test_kernels_fit_sm86():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "compile_check.py"), "--arch", "86",
                        "--shapes", "200,48,700", "--dtypes", "bf16"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "all fit" in r.stdout
    assert r.stdout.count("  ok ") >= 10  # every kernel of the calls: forward, combine, dz, products, cross_entropy
