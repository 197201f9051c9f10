#!/usr/bin/env python3
"""Builds and runs the host emulation of src/tessera/backend/cuda/attention.cu (no GPU).

The production source is copied with four mechanical edits: the inline-PTX wrappers become
calls into emu_runtime.h (lane-exact ldmatrix / mma.sync / shfl, deferred cp.async), the
`extern __shared__` array becomes the emulated dynamic shared memory, `k<<<g, b, s, st>>>(a)`
becomes `emu::launch(k, g, b, s, st, a)`, and the CUDA headers become emu_runtime.h. The
kernels' own code (indexing, masks, softmax, pipelines, epilogues) runs unchanged, driven
through the production entry points, and is compared with the float64 reference of
dev/attention/attention_lab.cu (copied verbatim from it).

usage: python3 dev/attention/emulator/make_emulation.py [--build-only] [out_dir]
"""

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
SRC = os.path.join(REPO, "src", "tessera", "backend", "cuda")

EMULATED_WRAPPERS = r'''// ---- PTX wrappers (emulated by dev/attention/emulator) ----

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
inline void cp_async_16(uint32_t dst, const void* src, bool valid) { emu::cp_async(dst, src, 16, valid); }
inline void cp_async_4(uint32_t dst, const void* src, bool valid) { emu::cp_async(dst, src, 4, valid); }
inline void cp_async_commit() { emu::cp_async_commit(); }
template <int kPending>
inline void cp_async_wait() { emu::cp_async_wait(kPending); }
inline void ldsm_x4(uint32_t (&r)[4], uint32_t addr) { emu::ldmatrix_x4(r, addr, false); }
inline void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) { emu::ldmatrix_x4(r, addr, true); }
inline void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emu::mma(c, a, b0, b1);
}
inline float fast_exp2(float x) { return std::exp2(x); }
inline uint32_t pack_bf16(float lo, float hi) {
  return static_cast<uint32_t>(emu_float_to_bf16(lo)) | (static_cast<uint32_t>(emu_float_to_bf16(hi)) << 16);
}

'''


def transform_source(text):
    start = text.index("// ---- PTX wrappers ----")
    end = text.index("// ---- end of PTX wrappers ----")
    text = text[:start] + EMULATED_WRAPPERS + text[end:]
    assert "asm" not in re.sub(r"//.*", "", text), "inline asm left outside the wrapper block"
    text = text.replace("#include <cuda_bf16.h>\n", "").replace("#include <nvtx3/nvToolsExt.h>\n", "")
    text, n = re.subn(r"extern __shared__ uint8_t smem_raw\[\];",
                      "uint8_t* const smem_raw = emu::dynamic_smem();", text)
    assert n == 3, n
    # kernel<<<grid, block, smem, stream>>>(args);  ->  emu::launch(kernel, grid, block, smem, stream, args);
    launch = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;]*>)?)\s*<<<(.*?)>>>\s*\((.*?)\);", re.S)
    text, n = launch.subn(lambda m: f"emu::launch({m.group(1)}, {m.group(2)}, {m.group(3)});", text)
    assert n == 7, n
    return text


def harness(lab_text):
    a = lab_text.index("// ---- reference (float64")
    b = lab_text.index("int g_failures")
    reference = lab_text[a:b]
    with open(os.path.join(HERE, "emu_harness.cpp.in")) as f:
        return f.read().replace("@REFERENCE@", reference)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = os.path.abspath(args[0] if args else "/tmp/attention_emulation")
    hdr_dir = os.path.join(out, "tessera", "backend", "cuda")
    os.makedirs(hdr_dir, exist_ok=True)
    with open(os.path.join(SRC, "attention.cuh")) as f:
        header = f.read().replace("#include <cuda_runtime.h>", '#include "emu_runtime.h"')
    with open(os.path.join(hdr_dir, "attention.cuh"), "w") as f:
        f.write(header)
    with open(os.path.join(SRC, "attention.cu")) as f:
        body = transform_source(f.read())
    with open(os.path.join(out, "attention_emulated.cpp"), "w") as f:
        f.write(body)
    with open(os.path.join(REPO, "dev", "attention", "attention_lab.cu")) as f:
        lab = f.read()
    with open(os.path.join(out, "emu_harness.cpp"), "w") as f:
        f.write(harness(lab))
    exe = os.path.join(out, "attention_emulation")
    # -fno-strict-aliasing: CUDA code reads bf16 buffers through uint4 / uint32_t pointers,
    # which nvcc compiles as written; g++ would otherwise be free to reorder those accesses.
    cmd = ["g++", "-O2", "-std=c++20", "-pthread", "-Wno-unknown-pragmas",
           "-fno-strict-aliasing",
           "-I", out, "-I", HERE, "-I", os.path.join(REPO, "src"),
           os.path.join(out, "attention_emulated.cpp"), os.path.join(out, "emu_harness.cpp"),
           "-o", exe]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    if "--build-only" in sys.argv:
        return 0
    return subprocess.run([exe]).returncode


if __name__ == "__main__":
    sys.exit(main())
