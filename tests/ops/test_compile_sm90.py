"""Every Gluon kernel, and the Triton kernels, compile for sm_90a (Hopper) with the installed Triton, on a
machine without a GPU.

Gluon is experimental and its API moves between Triton releases: 3.9 renamed the TMA copies and removed
``gl.thread_barrier``, which made every Gluon kernel fail to compile there until ``_gluon_compat.py``
(session 16). Running the kernels needs a Hopper GPU (tests/ops/test_attention_gluon*.py,
test_decode_gluon_mla.py, through scripts/gpu_check.sh), but compiling them needs only Triton and its
bundled ptxas, so API drift shows up here, in CI. The Triton kernels' CPU tests run in the interpreter,
which never lowers them for a GPU; they are compiled here too. Each case runs ``scripts/compile_sm90.py``
(a fresh process: the kernel's constexpr environment is read at import) and checks that the PTX has its
tensor-core instructions (wgmma, or mma.sync for the 16-row decode tiles; the combine has none, only its stores).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton.experimental.gluon")
gluon_fwd = pytest.importorskip("mla_attn.ops.attention.gluon_fwd")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [  # compile_sm90.py arguments: the routed configurations, then the experimental ones
    "gluon 128,64,8,4 --pv-overlap --q-in-regs --tma-store --persistent --s1-early",  # d 128: persistent
    "gluon 128,64,8,4 --pv-overlap --q-in-regs --tma-store --persistent --s1-early --token-major",
    "gluon 128,64,8,4 --pv-overlap --q-in-regs --tma-store",  # the grid (d 128 with MLA_ATTN_GLUON_PERSISTENT=0)
    "gluon 128,64,8,4 --pv-overlap --q-in-regs --tma-store --persistent --s1-early --pair",  # GQA head pairs
    "gluon 128,64,8,4 --pv-overlap --q-in-regs --tma-store --dqk 192 --pair --token-major",
    "gluon 128,64,8,4 --pv-overlap --q-in-regs --tma-store --dqk 192 --token-major",
    "gluon 128,32,8,3 --dqk 256 --dv 256 --tma-store --full",
    "gluon_dkdv 64,64,4,2",
    "gluon_dkdv 64,128,8,2 --tma-store",  # d 128 as routed: dK/dV out by TMA
    "gluon_dkdv 32,128,8,3 --dqk 192 --dv 128 --tma-store --token-major",
    "gluon_dq 64,64,4,2",
    "gluon_mla 64,64,4,2 --s-once --dedicated 1 --paged",
    "gluon_mla 64,64,4,2 --s-once --dedicated 0",
    "gluon_mla 64,64,4,2 --s-once --dedicated 1 --gather 1",  # SMALL_PAGES: pages of 1 key
    "gluon_mla 64,64,4,2 --s-once --dedicated 1 --paged --rows 16",  # SMALL_HEADS (experimental)
    "gluon_ws 128,128,4,2",
    "gluon_dkdv 64,128,8,2 --tma-store --fresh-desc",  # K/V descriptors rebuilt each step (off)
    "gluon_fused 64,128,8,2",  # the one-pass backward (off): dQ by ordered atomic adds
    "gluon_fused 64,128,8,2 --bulk --token-major",  # ... by TMA store / reduce-add
    "gluon_fused 64,128,8,2 --bulk --cast --full",  # ... key block 0 adds too, a cast pass writes dq
    "gluon_fused 32,128,8,3 --full",  # ... 32-row tiles (dQ^T)
    "gluon 128,64,8,4 --pv-overlap --q-in-regs --tma-store --persistent --schedule 0 --block-trace",
    "fwd 128,64,8,3",  # the Triton kernels
    "dkdv 64,64,4,2",
    "dq 64,64,4,2",
    "decode 64,32,8,4 --unchain --paged",
    "decode 16,64,4,3",
    "decode 16,128,4,3 --gqa",  # GQA's tile
    "decode 16,64,8,3 --gqa --paged --unchain",  # paged-64 GQA at a full batch (8 warps)
    "decode 16,128,4,3 --gqa --fused 4,16",  # the fused merge (experimental)
    "decode 16,128,4,3 --gqa --dqk 72 --split",  # GQA d 72: score 64 + 16, value 64 + 32
    "decode 16,128,8,3 --gqa --dqk 96 --split --paged --unchain",  # ... with 8 warps: the value padded
    "decode 16,128,4,3 --gqa --dqk 72 --row-align 8 --stride-unit 8",  # d 72 rows, strides in units of 8
    "combine 8,256,4,1",  # the split combine (no tensor cores)
    "combine 1,128,4,16 --balanced",
]


@pytest.mark.skipif(not gluon_fwd.AVAILABLE, reason="this Triton has no Gluon")
@pytest.mark.parametrize("args", CASES, ids=lambda a: a.replace(" ", "_").replace("--", ""))
def test_kernel_compiles_for_hopper(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1"))
    env.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "compile_sm90.py"), *args.split(),
                          "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    # ptxas assembled it (session 44: with Triton 3.9 the script used to call the bundled ptxas that rejects 3.9's
    # PTX 9.x, and this went unnoticed: registers read "?")
    assert re.search(r"^registers: \d+ ", out, re.M), out[-3000:]
    ptx = (tmp_path / "kernel.ptx").read_text()
    if args.startswith("combine"):
        assert "st.global" in ptx, out[-3000:]
    else:
        assert "wgmma.mma_async" in ptx or re.search(r"\bmma\.sync", ptx), out[-3000:]
    if args.startswith("decode") and ("--stride-unit" in args or "--split" in args):  # the loads pipelined
        assert "cp.async.cg.shared.global" in ptx, out[-3000:]
    if "--bulk" in args:  # dQ_j added by the TMA unit, and the full (not only .read) wait before a release
        assert "cp.reduce.async.bulk.tensor" in ptx and "cp.async.bulk.wait_group 1;" in ptx, out[-3000:]


def test_random_gpu_cases_compile_for_hopper(tmp_path):
    """scripts/compile_random_cases.py on two of the gpu draws of tests/ops/test_random_cases.py (the whole set runs
    with the GPU image's Triton 3.6 by hand): the launcher's choices as on an H200, compiled and assembled."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    script = os.path.join(ROOT, "scripts", "compile_random_cases.py")
    res = subprocess.run([sys.executable, script, "--seeds", "100-101", "--out", str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    summary = re.search(r"^(\d+) distinct kernels from (\d+) launches .*: 0 not ok$", out, re.M)
    assert summary and int(summary.group(1)) >= 4, out[-3000:]  # each draw launches a decode kernel, most a combine
