"""Compile a Triton kernel for a real GPU target with no GPU at hand, and
read what ptxas made of it: registers, spill (stack / local) bytes and
shared memory, from the cubin Triton would load (cuobjdump's resource
report). The interpreter skips Triton's type checks and lowering; this
catches what only the GPU build sees.

    compiled([spec("kvcache.tq_triton_kernels:tq_decode_kernel", 90, const, ptrs, warps=4), ...])
    -> [{"regs": 183, "spill": 0, "shared": 73728}, ...]

In subprocesses (one per core) without TRITON_INTERPRET (set for the tests'
own process before triton is imported)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMEM = {90: 232448, 121: 101376}     # max shared memory per block: H100/H200, GB10


def spec(kernel: str, arch: int, const: dict, ptrs: dict, warps: int, stages: int | None = None,
         floats: tuple = (), divisible: tuple = ()) -> dict:
    """One compile: kernel "module:name"; const: its constexprs; ptrs:
    pointer arguments -> element type ("bf16", "u8", ...); floats: fp32
    scalar arguments; every other argument an i32; divisible: arguments
    specialised as multiples of 16 (as a launch does for such ints and
    aligned pointers)."""
    return dict(kernel=kernel, arch=arch, const=const, ptrs=ptrs, warps=warps, stages=stages, floats=list(floats),
                divisible=list(divisible))


def compiled(specs: list[dict]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    # One subprocess per core, each a share of the specs: compiling is CPU-bound.
    n = max(1, min(len(specs), os.cpu_count() or 1, 4))
    procs = [subprocess.Popen([sys.executable, __file__, json.dumps(specs[i::n])], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT) for i in range(n)]
    results: list = [None] * len(specs)
    for i, p in enumerate(procs):
        out, err = p.communicate()
        assert p.returncode == 0, err[-3000:]
        results[i::n] = json.loads(out.strip().splitlines()[-1])
    return results


def assert_fit(cases: list, specs: list[dict], max_spill: int = 0) -> None:
    """Compile specs (one per case) and assert at most max_spill bytes of
    register spills and shared memory within each target's limit."""
    for case, sp, r in zip(cases, specs, compiled(specs)):
        assert r["spill"] <= max_spill and r["shared"] <= SMEM[sp["arch"]], (case, sp["arch"], r)


def _main(spec: dict) -> dict:
    import importlib
    import re
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    mod, name = spec["kernel"].split(":")
    fn = getattr(importlib.import_module(mod), name)
    const, ptrs = spec["const"], spec["ptrs"]
    sig = {n: "constexpr" if n in const else "*" + ptrs[n] if n in ptrs else "fp32" if n in spec["floats"]
           else "i32" for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in const.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in spec["divisible"]})
    opts = {"num_warps": spec["warps"]} | ({"num_stages": spec["stages"]} if spec["stages"] else {})
    c = triton.compile(src, target=GPUTarget("cuda", spec["arch"], 32), options=opts)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        out = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    use = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", out)}
    return {"regs": use["REG"], "spill": use["STACK"] + use["LOCAL"], "shared": c.metadata.shared}


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    print(json.dumps([_main(s) for s in json.loads(sys.argv[1])]))
