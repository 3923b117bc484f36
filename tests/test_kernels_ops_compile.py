"""Every decode-path kernel compiles to a cubin for sm_70 (fp16, V100) and sm_90 (bf16 + fp16 dot paths, H200)
without a GPU: `python -m ninfer_kernels.ops_compile` in a subprocess with TRITON_INTERPRET unset (kernels
imported under the interpreter cannot be compiled)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ninfer_kernels.ops_compile import MODULES

COMPILE_TIMEOUT_S = 300


@pytest.mark.parametrize("cc", [70, 90], ids=["sm70", "sm90"])
def test_ops_kernels_compile(cc, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-m", "ninfer_kernels.ops_compile", "--cc", str(cc), "--json", "--no-summary"],
                       capture_output=True, text=True, env=env, timeout=COMPILE_TIMEOUT_S)
    rows = json.loads(r.stdout) if r.stdout.strip() else []
    failed = [f"{row['variant']}: {row['error']}" for row in rows if not row["ok"]]
    assert r.returncode == 0 and not failed, "\n".join(failed) or r.stderr[-2000:]
    compiled = {row["variant"].split(".")[0] for row in rows}
    assert compiled == set(MODULES)
    # every decode-step kernel follows the PDL protocol on sm_90 (ninfer_kernels.pdl): both griddepcontrol
    # instructions, the wait before any global load or store; never compiled in on sm_70
    pdl = {row["variant"]: row["pdl_ok"] for row in rows}
    assert all(v is (True if cc >= 90 else None) for v in pdl.values()), pdl
    acts = {row["variant"].rsplit("-", 1)[1] for row in rows}
    assert acts == ({"fp16"} if cc == 70 else {"bf16", "fp16"})
