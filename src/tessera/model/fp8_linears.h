#pragma once
// FP8 linear layers with per-tensor scaling (docs/fp8.md), after Transformer Engine:
// every FP8 linear has three scaled tensors, its input x and weight W (E4M3) and its output
// gradient dY (E5M2 in hybrid, E4M3 in e4m3 mode), each with a scale, its inverse and (delayed
// scaling) an amax history. The GEMMs:
//   forward  Y  = X  @ W^T   a = X (N, in),    b = W (out, in)     fast accumulation
//   dgrad    dX = dY @ W     a = dY (N, out),  b = W^T (in, out)
//   wgrad    dW += dY^T @ X  a = dY^T (out, N), b = X^T (in, N)     fp32, accumulating
// FP8 tensor cores take only K-major operands, hence the transposed copies: dY is cast once
// into both layouts, W (with the transpose cache) once per optimizer step into both, and X
// forward into its copy and again in backward into its transpose, from the bf16 activation
// the model stores anyway; or, where X's producer writes its codes (delayed scaling) and
// nothing else reads X, its transpose is written in the forward and kept in X's place.
//
// Delayed scaling: a cast uses the scale from earlier steps and records this tensor's amax
// in history row 0; end_step() turns the histories into new scales. Until the first
// end_step() there is no history, so casts then scale just in time from their own amax, as
// tensorwise (current) scaling always does.
// Blockwise scaling (DeepSeek-V3's recipe) keeps no state: X and dY are cast in 1x128 tiles
// along each GEMM's K (rows for the forward and dgrad, tokens, transposed, for wgrad), W in
// 128x128 blocks, each with its own power-of-two scale (Backend::fp8_block_cast), and the GEMMs
// take the scale arrays (1x128 x 128x128 for fprop and dgrad, 1x128 x 1x128 for wgrad).
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tessera/config/config.h"
#include "tessera/model/linear_operand.h"
#include "tessera/model/step_hook.h"
#include "tessera/ops/backend.h"
#include "tessera/ops/device_buffer.h"

namespace tessera {

struct Fp8Options {
  Fp8Mode mode = Fp8Mode::Off;
  Fp8Recipe recipe = Fp8Recipe::Delayed;
  int64_t amax_history_len = 1024;
  Fp8AmaxAlgo amax_algo = Fp8AmaxAlgo::Max;
  int margin = 0;
  bool lm_head = false;
  bool weight_cache = true;
  // Fast (reduced-precision) tensor-core accumulation per GEMM kind, the inverse of Transformer
  // Engine's use_split_accumulator; TE's default, the forward only: with fast accumulation the
  // head's data gradient (K = 128,256) misses its check by 2.5% (docs/fp8.md).
  bool fast_accum_fprop = true;
  bool fast_accum_dgrad = false;
  bool fast_accum_wgrad = false;
  bool enabled() const { return mode != Fp8Mode::Off; }
  DType grad_format() const { return mode == Fp8Mode::Hybrid ? DType::E5M2 : DType::E4M3; }
};

Fp8Options fp8_options(const TrainingConfig& t);
// The GEMM kinds with fast accumulation joined by separator, e.g. "fprop" or
// "fprop, dgrad, wgrad"; "none" when there are none.
std::string fast_accumulation_kinds(const Fp8Options& o, std::string_view separator = ", ");

// One FP8 linear: its weight is (out, in); or an MoE layer's expert stack (experts, out, in),
// whose grouped GEMMs run over the experts' row groups (expert_forward / expert_backward).
struct Fp8LinearShape {
  std::string name;
  int64_t out = 0, in = 0;
  int64_t experts = 0;  // > 0: an expert stack with a weight scale per expert
  int64_t local_experts =
      0;             // the experts this rank runs (expert parallelism), whose codes it casts
  int64_t rows = 0;  // the most rows its GEMMs see when that is not the tokens (experts)
  bool expert_stack() const { return experts > 0; }
};

// The row groups of an expert stack's grouped GEMMs (GroupedMatmulArgs), and the stack's
// global index of the first expert in `weight` (this rank's experts under expert parallelism).
struct ExpertGroups {
  Tensor offsets;
  std::span<const int32_t> host_offsets, group_weights;
  int64_t first_expert = 0;
};

// A step hook (model/step_hook.h): its amaxes are maxed over the replicas and its status
// summed over the job at each step's end, its scaling state checkpointed, a non-finite amax
// named when it skips a step.
class Fp8Linears final : public StepHook {
 public:
  // rows: the most rows (tokens) any call passes.
  Fp8Linears(Backend& backend, const Fp8Options& options, std::vector<Fp8LinearShape> linears,
             int64_t rows);
  // Device bytes the constructor allocates.
  static size_t plan_bytes(const Fp8Options& options, const std::vector<Fp8LinearShape>& linears,
                           int64_t rows);

  // out (rows, out) = in (rows, in) @ W^T (+ bias) (+ beta * residual) for linear i; with
  // in.cast its input's codes are already in input_cast(i, rows)'s target.
  void forward(int i, const Tensor& out, const LinearOperand& in, const Tensor& weight,
               const Tensor& bias, float beta, const Tensor& residual);
  // Where linear i's forward reads its input's codes, for a producer that writes them on the
  // way (swiglu_forward_cast): out (rows, in), the scale and the amax slot the forward's own
  // cast would use (x, out_t undefined). Undefined out where the forward must cast itself:
  // blockwise scaling, and scales computed just in time from the tensor's amax (tensorwise,
  // or delayed before its first history), which needs the amax before any code.
  Fp8CastArgs input_cast(int i, int64_t rows) const;
  // din (rows, in) = dout @ W when din is defined; dweight (out, in), fp32 or bf16 (the
  // gradient buffer's dtype) = dout^T @ in + dweight_beta * dweight when dweight is defined
  // (undefined: a frozen weight). With dout.cast its codes (both layouts) are already in
  // output_grad_cast(i, rows)'s target. With in.codes_t (only where input_cast(i, rows) is
  // defined) the input's transposed codes were written in the forward with its scale.
  void backward(int i, const Tensor& din, const LinearOperand& dout, const LinearOperand& in,
                const Tensor& weight, const Tensor& dweight, float dweight_beta);
  // Where linear i's backward reads its output gradient's codes, for a producer that writes
  // them on the way (swiglu_backward_cast): out (rows, out) and out_t (out, rows), the scale
  // and the amax slot the backward's own cast would use (x undefined). Undefined out where the
  // backward must cast itself, as for input_cast.
  Fp8CastArgs output_grad_cast(int i, int64_t rows) const;

  // Expert stack i over its row groups: out (R, out) = in (R, in) @ W[e]^T per group of expert
  // e, rows past the groups zeroed. weight (local_experts, out, in): this rank's experts. The
  // input has one scale (all experts' rows), every expert's weight its own.
  void expert_forward(int i, const Tensor& out, const Tensor& in, const Tensor& weight,
                      const ExpertGroups& groups);
  // din (R, in) = dout @ W[e] per group when din is defined; dweight (local_experts, out, in)
  // fp32 or bf16 = dout_g^T @ in_g + dweight_beta * dweight (an expert without rows: the
  // second term alone).
  void expert_backward(int i, const Tensor& din, const Tensor& dout, const Tensor& in,
                       const Tensor& weight, const Tensor& dweight, const ExpertGroups& groups,
                       float dweight_beta);

  // The weights changed (optimizer step, loading): cached FP8 weights are stale.
  void weights_changed();
  // Whether linear i's FP8 codes are cached for the current weights: its GEMMs then take no
  // weight (an undefined one).
  bool weight_cached(int i) const { return options_.weight_cache && cache_valid_[i]; }
  // After the step's last backward: sums status() over the job (attached), reduces the
  // amaxes (amax reducer), updates the delayed scales and adds status() into grad_norm_sq, so
  // that a non-finite amax (a NaN or Inf in an activation, weight or gradient, which the
  // saturating cast would otherwise hide) makes AdamW skip the step like a non-finite gradient
  // does.
  void end_step(const Tensor& grad_norm_sq) override;
  // The amaxes are maxed over the replicas, the status summed over the job.
  void attach(StepCollectives& collectives) override;
  void read_step(int64_t passes) override;
  std::string non_finite_cause() const override;
  // (1) fp32 on the device: 0, or NaN when an amax since clear_status() was non-finite.
  Tensor status() const { return status_; }
  void clear_status();

  // Data parallelism: every rank must use the same scales, so the amaxes recorded in a step
  // (history row 0 of each group, (S) fp32 on the device) are max-reduced over the ranks at
  // this one place before the scales are updated. The reducer runs an in-place all-reduce
  // (max) on the tensor it is given; none is set on one device.
  using AmaxReducer = std::function<void(const Tensor& amaxes)>;
  void set_amax_reducer(AmaxReducer reducer) { amax_reducer_ = std::move(reducer); }

  // The scaling state a checkpoint keeps, by name: fp8.{forward,backward}.{amax_history,
  // scale,scale_inv}. Forward columns are (input, weight) per linear, (input, the weight of
  // every expert) per expert stack, backward columns the output gradients, in model order
  // (linears()).
  std::vector<std::pair<std::string, Tensor>> state_tensors() const;
  std::vector<std::pair<std::string, Tensor>> state() const override { return state_tensors(); }
  // The state was overwritten from a checkpoint: its histories are valid from now on.
  void state_restored() override;
  const std::vector<Fp8LinearShape>& linears() const { return linears_; }
  // Floats between consecutive slots of the scale_invs the GEMMs read (16 bytes).
  static constexpr int64_t kScaleInvPitch = 4;

 private:
  // Tensors sharing a format: history (H, S), scale (S), scale_inv (S), and scale_inv_gemm (S,
  // kScaleInvPitch), scale_inv's slots 16 bytes apart, copied from it whenever it changes:
  // cuBLASLt reads a tensor scale from a 16-byte aligned address, and the GEMMs reading this
  // copy spare the backend a copy to an aligned slot for every GEMM (~5,600 a step of the full
  // Llama 3.1 8B).
  struct Group {
    Tensor history, scale, scale_inv, scale_inv_gemm;
    DType format = DType::E4M3;
  };
  // Casts x into out and/or out_t with the scale of `slot`. record: these are this step's
  // values of the tensor (not a re-cast in another layout), so its amax counts and, when
  // scaling just in time, the scale is first computed from it.
  void cast(const Group& g, int64_t slot, const Tensor& x, const Tensor& out, const Tensor& out_t,
            bool record);
  // Whether a producer of linear i's operands on `rows` rows can write their codes: the scale
  // known before the values (delayed, with a history), per tensor, not an expert stack.
  bool producer_casts(int i, int64_t rows) const;
  // The scales of g's slots [slot, slot + slots) from `history` (rows of those slots), and
  // their copy for the GEMMs.
  void update_scales(const Group& g, int64_t slot, int64_t slots, const Tensor& history,
                     bool most_recent, bool roll);
  void copy_scale_inv_to_gemm(const Group& g, int64_t slot, int64_t slots);
  Tensor weight_codes(int i, const Tensor& weight, bool transposed);
  // Expert stack i's codes of this rank's experts, (local, out, in) or transposed per expert
  // (local, in, out); their scale_invs are the forward columns expert_slot(i, first_expert)...
  Tensor expert_codes(int i, const Tensor& weight, int64_t first_expert, bool transposed);
  // cast() of x in row groups (c without scale and amax: backend.h's fp8_grouped_cast) with
  // the scales of `slots` consecutive slots from `slot`: one per group, or 1 for all.
  void cast_groups(const Group& g, int64_t slot, int64_t slots, Fp8GroupedCastArgs c, bool record);
  int64_t input_slot(int i) const { return fwd_column_[i]; }
  int64_t weight_slot(int i) const { return fwd_column_[i] + 1; }
  int64_t expert_slot(int i, int64_t expert) const { return fwd_column_[i] + 1 + expert; }
  // Blockwise: weight i's codes, (out, in) or transposed (in, out), and their block scales.
  std::pair<Tensor, Tensor> block_weight(int i, const Tensor& weight, bool transposed);
  void forward_blockwise(int i, const Tensor& out, const Tensor& in, const Tensor& weight,
                         const Tensor& bias, float beta, const Tensor& residual);
  void backward_blockwise(int i, const Tensor& din, const Tensor& dout, const Tensor& in,
                          const Tensor& weight, const Tensor& dweight, float dweight_beta);
  bool blockwise() const { return options_.recipe == Fp8Recipe::Blockwise; }
  // The scale_inv of g's slot as the GEMMs read it.
  Tensor scale_inv(const Group& g, int64_t slot) const {
    return g.scale_inv_gemm.flat_range(slot * kScaleInvPitch, 1);
  }
  bool just_in_time() const;

  Backend& backend_;
  Fp8Options options_;
  std::vector<Fp8LinearShape> linears_;
  std::vector<int64_t> fwd_column_;  // per linear: its input's forward column
  int64_t rows_;
  DeviceBuffer buffer_;
  Group fwd_, bwd_;
  Tensor status_;
  std::vector<Tensor> weight_cache_, weight_cache_t_;  // per linear (transpose cache)
  std::vector<bool> cache_valid_;
  Tensor weight_scratch_;  // without the cache: the one weight cast in flight
  Tensor x_codes_, dy_codes_, dy_codes_t_;
  // Blockwise: the scale_inv arrays (per linear with the cache, else of the weight in flight).
  std::vector<Tensor> cache_scales_, cache_t_scales_;
  Tensor weight_scales_, weight_t_scales_, x_scales_, dy_scales_, dy_t_scales_;
  bool have_history_ = false;
  AmaxReducer amax_reducer_;
  StepCollectives* collectives_ = nullptr;
  float read_status_ = 0;  // status() of the last read step
};

}  // namespace tessera
