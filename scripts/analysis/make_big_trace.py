#!/usr/bin/env python3
# Writes a large synthetic PyTorch-profiler-style trace (Kineto JSON) for benchmarking
# `tessera report`: training steps of a Llama-like model with the event mix and argument
# shapes of a real torch.profiler(record_shapes=True) trace: cpu_op events with Input Dims /
# Input type / Concrete Inputs, cudaLaunchKernel runtime calls, kernels with launch args,
# ac2g flow events, NCCL all-reduces with collective args, memcpy and memset.
#
#   python3 scripts/analysis/make_big_trace.py --size-gb 1 -o /tmp/big.pt.trace.json
#
# Standard library only. The generated timeline is self-consistent (kernels never overlap on
# a stream, launches precede kernels) so report numbers are meaningful, not just parseable.
import argparse
import gzip
import json
import random

p = argparse.ArgumentParser()
p.add_argument("-o", "--out", required=True, help="output .json or .json.gz")
p.add_argument("--size-gb", type=float, default=1.0, help="approximate uncompressed size")
p.add_argument("--layers", type=int, default=32)
p.add_argument("--seed", type=int, default=0)
a = p.parse_args()
rng = random.Random(a.seed)

CPU_PID, CPU_TID, GPU_PID, STREAM, COMM_STREAM = 4242, 4242, 0, 7, 20
B, T, D, H, KV, HD, FFN, V = 1, 8192, 4096, 32, 8, 128, 14336, 128256
M = B * T

# (kernel name, op name, input dims, input types, kernel mean µs, category of work)
GEMM = "nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA_NNT"
GEMM_BWD = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopB_TNN"
NORM = ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, "
        "float, true>(int, float, c10::BFloat16 const*, c10::BFloat16 const*, "
        "c10::BFloat16 const*, float*, float*, c10::BFloat16*)")
NORM_BWD = ("void at::native::(anonymous namespace)::layer_norm_grad_input_kernel_vectorized"
            "<c10::BFloat16, float, true>(c10::BFloat16 const*, c10::BFloat16 const*, float "
            "const*, float const*, c10::BFloat16 const*, c10::BFloat16*, int)")
ATT_FWD = ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_"
           "cga1x1x1_kernel0_0")
ATT_BWD = ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x128x128_1x4x1_"
           "cga1x1x1_kernel0_0")
MUL = ("void at::native::vectorized_elementwise_kernel<8, at::native::BinaryFunctor<c10::"
       "BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> "
       ">, std::array<char*, 3ul> >(int, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16,"
       " c10::BFloat16, at::native::binary_internal::MulFunctor<float> >, std::array<char*, 3ul>)")
ADD = ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::"
       "BFloat16>, std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, "
       "std::array<char*, 3ul>)")
SILU = ("void at::native::vectorized_elementwise_kernel<8, at::native::(anonymous namespace)::"
        "silu_kernel(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#6}::"
        "operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, "
        "at::native::(anonymous namespace)::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}"
        "::operator()() const::{lambda()#6}::operator()() const::{lambda(c10::BFloat16)#1}, "
        "std::array<char*, 2ul>)")
ADAM = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
        "(anonymous namespace)::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous "
        "namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, float "
        "const*, double, double, double, double, double, bool, float const*, float const*>")
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
BF = "c10::BFloat16"


def mm(k, n, bwd=False):
    return (GEMM_BWD if bwd else GEMM, "aten::mm", [[M, k], [k, n]], [BF, BF],
            2.0 * M * k * n / 600e6)  # µs at ~600 TFLOP/s


q_att = [[B, H, T, HD], [B, KV, T, HD], [B, KV, T, HD]]
LAYER_FWD = [
    (NORM, "aten::_fused_rms_norm", [[M, D], [D]], [BF, BF], 40.0),
    mm(D, H * HD), mm(D, 2 * KV * HD),
    (ATT_FWD, "aten::_cudnn_attention_forward", q_att, [BF, BF, BF], 2100.0),
    mm(H * HD, D), (ADD, "aten::add", [[M, D], [M, D]], [BF, BF], 25.0),
    (NORM, "aten::_fused_rms_norm", [[M, D], [D]], [BF, BF], 40.0),
    mm(D, 2 * FFN), (SILU, "aten::silu", [[M, FFN]], [BF], 60.0),
    (MUL, "aten::mul", [[M, FFN], [M, FFN]], [BF, BF], 70.0), mm(FFN, D),
    (ADD, "aten::add", [[M, D], [M, D]], [BF, BF], 25.0),
]
LAYER_BWD = [
    mm(D, FFN, True), mm(FFN, D, True), (MUL, "aten::mul", [[M, FFN], [M, FFN]], [BF, BF], 70.0),
    (SILU, "aten::silu_backward", [[M, FFN], [M, FFN]], [BF, BF], 80.0),
    mm(2 * FFN, D, True), mm(D, 2 * FFN, True),
    (NORM_BWD, "aten::_fused_rms_norm_backward", [[M, D], [M, D], [D]], [BF, BF, BF], 60.0),
    mm(D, H * HD, True), mm(H * HD, D, True),
    (ATT_BWD, "aten::_cudnn_attention_backward", [[B, H, T, HD]] + q_att, [BF] * 4, 5200.0),
    mm(H * HD, D, True), mm(D, H * HD, True),
    (NORM_BWD, "aten::_fused_rms_norm_backward", [[M, D], [M, D], [D]], [BF, BF, BF], 60.0),
]

out = gzip.open(a.out, "wt", compresslevel=3) if a.out.endswith(".gz") else open(a.out, "w")
limit = int(a.size_gb * 1e9)
written = 0
state = {"cpu": 1_000_000.0, "gpu": 1_000_000.0, "comm": 1_000_000.0, "ext": 1, "corr": 1}


def emit(text):
    global written
    out.write(text)
    written += len(text)


emit('{"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", '
     '"totalGlobalMem": 85029158912, "computeMajor": 9, "computeMinor": 0, "numSms": 132}], '
     '"distributedInfo": {"backend": "nccl", "rank": 0, "world_size": 8}, "record_shapes": 1, '
     '"displayTimeUnit": "ms", "baseTimeNanoseconds": 1700000000000000000, "traceEvents": [\n')
emit('{"name": "process_name", "ph": "M", "ts": 0, "pid": %d, "tid": 0, "args": {"name": '
     '"python"}},\n{"name": "process_name", "ph": "M", "ts": 0, "pid": %d, "tid": 0, "args": '
     '{"name": "python"}},\n' % (CPU_PID, GPU_PID))


def cpu_op(name, t, dur, dims):
    ext = state["ext"]
    state["ext"] += 1
    emit('{"ph": "X", "cat": "cpu_op", "name": "%s", "pid": %d, "tid": %d, "ts": %.3f, '
         '"dur": %.3f, "args": {"External id": %d, "Record function id": 0, "Input type": %s, '
         '"Input Dims": %s, "Ev Idx": %d}},\n'
         % (name, CPU_PID, CPU_TID, t, dur, ext, json.dumps([BF] * len(dims)), json.dumps(dims),
            ext))


# Real traces nest several CPU ops around each launching op (module ops, autograd nodes,
# views); these parents carry no kernels of their own.
PARENTS = {"aten::mm": ("aten::linear", "aten::t"),
           "aten::_cudnn_attention_forward": ("aten::scaled_dot_product_attention", "aten::view"),
           "aten::_cudnn_attention_backward": ("autograd::engine::evaluate_function: "
                                               "ScaledDotProductCudnnAttentionBackward0",
                                               "aten::view")}


def launch(kernel, op, dims, types, us, stream=STREAM, clock="gpu", extra_args=""):
    """One op with its launch, kernel and flow (the 5 events of a real trace), inside a
    parent op with a view op beside it."""
    parent, sibling = PARENTS.get(op, ("autograd::engine::evaluate_function: %sBackward0"
                                       % op.split("::")[-1], "aten::empty"))
    cpu_op(parent, state["cpu"], 40.0, dims)
    cpu_op(sibling, state["cpu"] + 1.0, 3.0, dims[:1])
    state["cpu"] += 6.0
    ext, corr = state["ext"], state["corr"]
    state["ext"] += 1
    state["corr"] += 1
    t = state["cpu"]
    op_dur = 12.0 + rng.random() * 6
    emit('{"ph": "X", "cat": "cpu_op", "name": "%s", "pid": %d, "tid": %d, "ts": %.3f, '
         '"dur": %.3f, "args": {"External id": %d, "Record function id": 0, '
         '"Concrete Inputs": %s, "Input type": %s, "Input Strides": %s, "Input Dims": %s, '
         '"Ev Idx": %d}},\n'
         % (op, CPU_PID, CPU_TID, t, op_dur, ext, json.dumps([""] * len(dims)),
            json.dumps(types), json.dumps([[1] * len(d) for d in dims]), json.dumps(dims), ext))
    lt = t + 4.0
    emit('{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": %d, "tid": %d, '
         '"ts": %.3f, "dur": 5.210, "args": {"External id": %d, "cbid": 211, "correlation": %d}},'
         '\n' % (CPU_PID, CPU_TID, lt, ext, corr))
    start = max(state[clock], lt + 8.0)
    dur = us * (0.9 + 0.2 * rng.random())
    state[clock] = start + dur + 1.5
    emit('{"ph": "X", "cat": "kernel", "name": "%s", "pid": %d, "tid": %d, "ts": %.3f, '
         '"dur": %.3f, "args": {"External id": %d, "queued": 0, "device": 0, "context": 1, '
         '"stream": %d, "correlation": %d, "registers per thread": 168, "shared memory": '
         '213000, "blocks per SM": 1.0, "warps per SM": 12.0, "grid": [132, 1, 1], "block": '
         '[384, 1, 1], "est. achieved occupancy %%": 0%s}},\n'
         % (kernel, GPU_PID, stream, start, dur, ext, stream, corr, extra_args))
    emit('{"ph": "s", "id": %d, "pid": %d, "tid": %d, "ts": %.3f, "cat": "ac2g", "name": '
         '"ac2g"},\n{"ph": "f", "id": %d, "pid": %d, "tid": %d, "ts": %.3f, "cat": "ac2g", '
         '"name": "ac2g", "bp": "e"},\n' % (corr, CPU_PID, CPU_TID, lt, corr, GPU_PID, stream,
                                            start))
    state["cpu"] = t + op_dur + 2.0


step = 0
while written < limit:
    for layer in range(a.layers):
        for k in LAYER_FWD:
            launch(*k)
    for layer in range(a.layers):
        for k in LAYER_BWD:
            launch(*k)
        if layer % 4 == 3:  # DDP buckets: all-reduce on the comm stream, overlapping compute
            n = 25_000_000
            state["comm"] = max(state["comm"], state["gpu"] - 3000)
            launch(NCCL, "record_param_comms", [[n]], [BF], 2 * n * 2 / 150e3 * 0.875,
                   COMM_STREAM, "comm",
                   ', "Collective name": "allreduce", "In msg nelems": %d, "Out msg nelems": '
                   '%d, "Group size": 8, "dtype": "BFloat16", "Process Group Name": "0"' % (n, n))
    launch(ADAM, "aten::_fused_adamw_", [[]], [""], 4500.0)
    emit('{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "pid": %d, '
         '"tid": %d, "ts": %.3f, "dur": 3.100, "args": {"External id": %d, "device": 0, '
         '"stream": %d, "correlation": %d, "bytes": 4, "memory bandwidth (GB/s)": 0.001}},\n'
         % (GPU_PID, STREAM, state["gpu"], state["ext"], STREAM, state["corr"]))
    state["gpu"] += 3.1 + 500.0  # host sync gap between steps: idle GPU time
    state["cpu"] = max(state["cpu"], state["gpu"])
    step += 1

emit('{"name": "Record Window End", "ph": "i", "s": "g", "pid": "", "tid": "", "ts": %.3f}\n'
     '], "traceName": "synthetic"}\n' % state["cpu"])
out.close()
print(f"wrote {a.out}: {written / 1e9:.2f} GB uncompressed, {step} steps, "
      f"{state['ext']} ops/kernels")
