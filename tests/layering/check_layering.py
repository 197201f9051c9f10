#!/usr/bin/env python3
"""The source tree's layering rules (docs/architecture.md), checked on every test run:

1. Vendor headers (CUDA runtime, cuBLAS, cuDNN, NCCL, CUPTI, NVTX; HIP, hipBLAS, RCCL, roctx,
   rocprofiler) are included only under src/tessera/backend/cuda/, and that folder's headers
   only there and in the platform factory (backend/backend_factory.cpp): a second vendor is a
   vendor header there and a backend folder, nothing else. Outside those two places the code
   (comments and strings aside) names no vendor API or macro either (cudaMalloc, __CUDACC__,
   hipStream_t, ncclComm_t, a CudaBackend...): device choices and capabilities are neutral.
2. No code downcasts a backend (dynamic_cast to a backend type): callers ask supports().
3. The folders of src/tessera/ include each other without cycles, so each can be read, built
   and tested on top of the ones below it.

Usage: check_layering.py SOURCE_ROOT   (exit 1 and one line per violation when a rule fails)
"""
import collections
import os
import re
import sys

VENDOR_HEADER = re.compile(
    r'#\s*include\s*[<"](cuda|cublas|cudnn|nccl|cupti|nvtx|nvToolsExt|curand|cufft|nvrtc|cub/'
    r'|hip|rccl|roctx|roctracer|rocprof|rocblas|rocprim)[^>"]*[>"]')
VENDOR_NAME = re.compile(
    r'\b(__CUDACC__|__CUDA_ARCH__|__HIPCC__|__HIP_\w+|__NV_\w+|__nv_\w+'
    r'|(cuda|cublas|cublasLt|cudnn|cupti|nccl|nvtx|hip|hipblas|hipblasLt|rccl|roctx|rocprofiler)'
    r'[A-Z_]\w*|CUDA_\w+|CUBLAS\w*|NCCL_\w+|Cuda[A-Z]\w*|Cudnn\w*|Hip[A-Z]\w*|Cuda|Hip)\b')
COMMENT_OR_STRING = re.compile(
    r'//[^\n]*|/\*.*?\*/|R"([^(\s]*)\(.*?\)\1"|"(\\.|[^"\\\n])*"' + r"|'(\\.|[^'\\\n])*'",
    re.DOTALL)
PROJECT_INCLUDE = re.compile(r'#\s*include\s*"tessera/([^"]+)"')
BACKEND_DOWNCAST = re.compile(r'dynamic_cast\s*<[^>]*Backend\b')
VENDOR_DIR = "backend/cuda"
FACTORY = "backend/backend_factory.cpp"


def folder(rel):
    """The layering unit of a path under src/tessera: its top folder, or backend/<x>, obs/<x>
    (a family registry and its families are one unit: model/)."""
    parts = rel.split("/")
    if parts[0] in ("backend", "obs") and len(parts) > 2:
        return parts[0] + "/" + parts[1]
    return parts[0]


def cycles(graph):
    """Strongly connected components with more than one folder (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main():
    src = os.path.join(sys.argv[1], "src", "tessera")
    problems = []
    graph = collections.defaultdict(set)
    edges = collections.defaultdict(list)  # (from, to) -> files, for the message
    for directory, _, files in os.walk(src):
        for name in files:
            if not name.endswith((".h", ".cpp", ".cu", ".cuh", ".inc")):
                continue
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, src)
            text = open(path, encoding="utf-8").read()
            in_vendor_dir = rel.startswith(VENDOR_DIR + "/")
            if not in_vendor_dir and rel != FACTORY:
                code = COMMENT_OR_STRING.sub(lambda m: re.sub(r'[^\n]', ' ', m.group(0)), text)
                for line_no, line in enumerate(code.splitlines(), 1):
                    for m in VENDOR_NAME.finditer(line):
                        problems.append(f"{rel}:{line_no}: names a vendor ({m.group(0)}) outside "
                                        f"{VENDOR_DIR}/ and the platform factory")
            for line_no, line in enumerate(text.splitlines(), 1):
                if VENDOR_HEADER.search(line) and not in_vendor_dir:
                    problems.append(f"{rel}:{line_no}: vendor header outside {VENDOR_DIR}/: {line.strip()}")
                m = PROJECT_INCLUDE.search(line)
                if m:
                    target = m.group(1)
                    if (target.startswith(VENDOR_DIR + "/") and not in_vendor_dir and rel != FACTORY):
                        problems.append(f"{rel}:{line_no}: includes {target}: only the platform "
                                        f"factory ({FACTORY}) reaches into {VENDOR_DIR}/")
                    a, b = folder(rel), folder(target)
                    if a != b:
                        graph[a].add(b)
                        edges[(a, b)].append(f"{rel}:{line_no}")
                if BACKEND_DOWNCAST.search(line):
                    problems.append(f"{rel}:{line_no}: downcasts a backend: {line.strip()}")
    for component in cycles(graph):
        links = []
        for a in component:
            for b in component:
                if b in graph[a]:
                    links.append(f"{a} -> {b} ({edges[(a, b)][0]})")
        problems.append("folder cycle: " + "; ".join(links))
    for p in problems:
        print(p)
    print(f"{len(graph)} folders checked: {len(problems)} violation(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
