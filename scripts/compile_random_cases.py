"""Compile for Hopper (sm_90a), without a GPU, every kernel the GPU random decode cases would launch.

``tests/ops/test_random_cases.py`` draws its ``gpu`` cases (tiles, switches, page sizes, widths) at random, and the
interpreter that runs the CPU cases never compiles anything: a tile that overflows shared memory or a switch
combination that does not lower shows up only on the GPU. This script takes each ``gpu`` draw through the real
launcher as it would run on an H200 (its tile choice, 132 SMs), records the launches instead of running them, and
compiles each distinct one for sm_90a, then reports shared memory, registers and spills from ptxas.

Run it with the Triton the GPU image has (3.6), from a side virtual environment with pytest (the draws live in the
test module):

    python3 -m venv /tmp/v36 && /tmp/v36/bin/pip install torch==2.13.0 triton==3.6.0 numpy pytest
    PYTHONPATH=. /tmp/v36/bin/python scripts/compile_random_cases.py [--seeds 100-115] [--out /tmp/sm90_random]

Exit status 1 when any kernel fails to compile, needs more than the H200's 232448 bytes of shared memory, or
ptxas fails. The Gluon MLA kernel, which the launcher picks on a GPU for H a multiple of 64, is not covered: these
are the Triton kernels.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys

if os.environ.get("TRITON_INTERPRET") == "1":  # nothing runs; the kernels must stay JIT functions to compile
    raise SystemExit("compile_random_cases: unset TRITON_INTERPRET (the launches are recorded, not run)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "ops"))
import test_decode_triton as cases_io  # noqa: E402
import test_random_cases as cases  # noqa: E402

from mla_attn.ops import _launch  # noqa: E402
from mla_attn.ops.decode import combine  # noqa: E402
from mla_attn.ops.decode import triton_decode as td  # noqa: E402

SMEM_LIMIT = 232448  # bytes a block may take on an H100 / H200
SMS = 132
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}
SHOWN = ("S", "BLOCK_H", "BLOCK_N", "BLOCK_D1", "BLOCK_D2", "BLOCK_DV", "BLOCK_DV2", "PAGE_SIZE", "TILE_IN_PAGE",
         "SPLIT_TAIL", "TAIL_PIPELINED", "UNCHAIN", "FUSED", "KV_MAJOR")


def _as_on_gpu() -> None:
    """Make the launcher pick what it picks on a CUDA device, and record launches instead of running them."""
    cuda = torch.device("cuda")
    default_config = td.default_config
    td.default_config = lambda rows, d_qk, d_v, dtype, *, mla, device: default_config(rows, d_qk, d_v, dtype,
                                                                                        mla=mla, device=cuda)
    paged_gqa_wide = td._paged_gqa_wide
    td._paged_gqa_wide = lambda mla, paged, page_size, cfg, programs, device: paged_gqa_wide(mla, paged, page_size, cfg,
                                                                                           programs, cuda)
    td._num_sms = lambda device: SMS  # the H200's, whatever device the rules are given

    def alloc(*shape, dtype=None, device=None):
        return torch.empty(*shape, dtype=dtype, device=device)

    td._alloc = combine._alloc = alloc


def _record(into: list, label: list):
    def call(self, *values):
        args, kwargs = self._fill(values)
        given = dict(zip(self.fn.arg_names, args)) | kwargs
        into.append((label[0], self.fn, given, dict(self.options)))
    return call


def _signature(fn, given: dict):
    """Triton's launch-time view of the arguments: constexprs, 16-divisible pointers and ints, ints equal to 1."""
    params = inspect.signature(fn.fn).parameters
    constexpr = {p.name for p in fn.params if p.is_constexpr}
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(params):
        value = given.get(name, params[name].default)
        if name in constexpr:
            sig[name], consts[(i,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:  # as a launch sees it (the rope view of an MLA buffer starts Dc in)
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            sig[name] = "fp32"
        elif value == 1:
            sig[name], consts[(i,)] = "constexpr", 1
        else:
            sig[name] = "i64" if abs(value) >= 2**31 else "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs


def _ptxas() -> str:
    """The ptxas this Triton compiles sm_90a with (Triton 3.9 ships a newer one as ptxas-blackwell and uses it)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default=f"{cases.GPU_SEEDS[0]}-{cases.GPU_SEEDS[-1]}",
                    help="FIRST-LAST: the gpu draws to take (default: those test_random_cases.py runs)")
    ap.add_argument("--out", default="/tmp/sm90_random", help="folder for the PTX and cubins")
    args = ap.parse_args()
    first, last = map(int, args.seeds.split("-"))
    os.makedirs(args.out, exist_ok=True)
    _as_on_gpu()
    launches, label = [], [None]
    _launch.Launch.__call__ = _record(launches, label)

    class Patch:  # test_random_cases._apply's monkeypatch, for good
        @staticmethod
        def setattr(obj, name, value):
            setattr(obj, name, value)

    saved = {name: getattr(td, name) for name in (*cases.DEFAULTS, "SPLIT_MAX_FILL")}
    for seed in range(first, last + 1):
        for kind in ("gqa", "mla"):
            c = (cases._gqa_draw if kind == "gqa" else cases._mla_draw)(seed, gpu=True)
            label[0] = f"{kind}{seed}"
            for name, value in saved.items():
                setattr(td, name, value)
            cases._apply(c["switches"], Patch)
            td._plans.clear()
            torch.manual_seed(seed)
            if kind == "gqa":
                q, k, v, seq_lens, table = cases_io._gqa_inputs(c["b"], c["hq"], c["hkv"], c["d"], c["dv"], c["s"],
                                                                c["lens"], c["page"], c["dtype"], c["qmul"],
                                                                c["strided"], seed=seed)
                td.gqa_decode(q, k, v, seq_lens, table, c["d"] ** -0.5, c["splits"], config=c["cfg"])
            else:
                ql, qr, kv, kr, seq_lens, table = cases_io._mla_inputs(c["b"], c["h"], c["dc"], c["dr"], c["s"],
                                                                       c["lens"], c["page"], c["dtype"], c["qmul"],
                                                                       seed=seed)
                td.mla_decode(ql, qr, kv, kr, seq_lens, table, 0.125, c["splits"], config=c["cfg"])

    done, bad = set(), 0
    for case, fn, given, options in launches:
        sig, consts, attrs = _signature(fn, given)
        key = json.dumps([fn.__name__, sig, sorted((i[0], repr(v)) for i, v in consts.items()), sorted(attrs),
                          sorted(options.items())])
        if key in done:
            continue
        done.add(key)
        names = list(inspect.signature(fn.fn).parameters)
        shown = " ".join(f"{names[i[0]]}={v}" for i, v in consts.items() if names[i[0]] in SHOWN)
        head = f"{case:8s} {fn.__name__:15s} w{options.get('num_warps')} s{options.get('num_stages', '-')}"
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                                    target=GPUTarget("cuda", 90, 32),
                                    options={k: v for k, v in options.items() if k in ("num_warps", "num_stages")})
        except Exception as e:  # noqa: BLE001 - any compile error is the finding
            bad += 1
            print(f"{head} COMPILE FAILED {shown}\n    {str(e).strip()[:600]}")
            continue
        ptx = os.path.join(args.out, f"{len(done)}.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        res = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", ptx, "-o", ptx[:-4] + ".cubin"],
                             capture_output=True, text=True)
        log = res.stdout + res.stderr
        regs = re.search(r"Used (\d+) registers", log)
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
        smem = kernel.metadata.shared
        ok = res.returncode == 0 and smem <= SMEM_LIMIT
        bad += not ok
        verdict = "ok" if ok else ("SHARED MEMORY OVER" if smem > SMEM_LIMIT else "PTXAS FAILED")
        print(f"{head} {verdict}: {smem} B shared, {regs.group(1) if regs else '?'} registers, spills "
              f"{spills.group(1) + '/' + spills.group(2) if spills else '?'} B  {shown}")
    print(f"{len(done)} distinct kernels from {len(launches)} launches (seeds {first}-{last}, Triton "
          f"{triton.__version__}, sm_90a): {bad} not ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
