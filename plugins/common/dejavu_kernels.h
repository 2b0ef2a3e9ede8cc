/*
 * dejavu_kernels.h - C ABI of libdejavu_kernels (op contract v1, docs/ops.md).
 *
 * Rules shared by every entry point:
 *  - All pointers are device pointers. Weights, activations and caches are row-major and 16-byte aligned;
 *    d and every row length must be a multiple of 8 elements (16-byte vector loads).
 *  - dtype is DJV_FLOAT16 or DJV_BFLOAT16 for every floating tensor of a call; index tensors are int32.
 *  - Calls only enqueue work on `stream`: no allocation, no host synchronisation, CUDA-graph capturable.
 *  - `workspace` must hold at least the bytes the matching *_workspace_size() returns (the size for batch
 *    B also serves every batch below B), and must be
 *    ZERO-FILLED before its first use. The kernels return the small counter region they use to zero
 *    before they finish, so a workspace reserved for one op stays valid across calls. A caller that
 *    shares scratch memory between ops (TensorRT) must call djv_workspace_prepare() first.
 *  - Return value: 0 on success, a negative DJV_E* on a bad argument, or a positive cudaError_t from
 *    the launch.
 */
#ifndef DEJAVU_KERNELS_H
#define DEJAVU_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define DJV_API __declspec(dllexport)
#else
#define DJV_API __attribute__((visibility("default")))
#endif

#define DJV_ABI_VERSION 7  /* 2: optional residual input of the MLP and attention calls; 3: djv_norm;
                              4: norm folding (djv_row_stats, djv_*_folded); 5: djv_set_mlp_grid_slack;
                              6: djv_embed, djv_greedy_tail; 7: djv_set_indices_ready */

enum djv_dtype { DJV_FLOAT16 = 0, DJV_BFLOAT16 = 1 };
enum djv_activation { DJV_RELU = 0, DJV_GELU = 1, DJV_SILU_GLU = 2 };
enum djv_kv_policy { DJV_KV_DENSE = 0, DJV_KV_ACTIVE = 1 };
enum djv_norm_kind { DJV_LAYERNORM = 0, DJV_RMSNORM = 1 };

enum djv_status {
    DJV_OK = 0,
    DJV_E_SHAPE = -1,       /* a size is out of range or not a multiple it must be */
    DJV_E_DTYPE = -2,       /* unknown dtype / activation / policy */
    DJV_E_WORKSPACE = -3,   /* workspace NULL or smaller than required */
    DJV_E_POINTER = -4,     /* a required pointer is NULL or misaligned */
};

DJV_API int djv_abi_version(void);
DJV_API const char* djv_status_string(int status);

/* Zero the counter region of a workspace (one cudaMemsetAsync of a few hundred bytes at its start). */
DJV_API int djv_workspace_prepare(void* workspace, size_t workspace_bytes, cudaStream_t stream);

/* Size the fused MLP's grid (sm_90, batch <= 4) for `sms` fewer SMs than the device has, so that it fits
 * beside the CTAs of kernels on other streams (the predictor's top-k holds two whole SMs). Process-wide, read
 * when a call is enqueued (a captured CUDA graph keeps the grid it was captured with); the workspace a call
 * needs only shrinks with it. Default: DJV_MLP_SLACK from the environment, else 0. Returns the previous
 * value, or DJV_E_SHAPE when sms is outside [0, SM count / 2]. */
DJV_API int djv_set_mlp_grid_slack(int sms);

/* Promise (ready = 1) that the mlp_idx / head_idx inputs of the MLP and attention calls enqueued from now on
 * were written at least two kernels before each call on its stream, or on another stream that was joined
 * before the kernel just before the call. Then the batch <= 4 QKV projection and the fused sm_90 MLP read
 * their indices and first weight rows before waiting for the kernel before them (programmatic dependent
 * launch), which hides part of each kernel boundary. With ready = 0 (the default; DJV_INDICES_READY=1 in the
 * environment starts it on) the indices may come from the kernel just before. Process-wide, read when a call
 * is enqueued (a captured CUDA graph keeps what it captured); results are bit-identical either way. Returns
 * the previous value, or DJV_E_SHAPE when ready is not 0 or 1. */
DJV_API int djv_set_indices_ready(int ready);

/* ---- DejaVuLookaheadPredictor -------------------------------------------------------------
 * h [B,d]; mlp_a [d,r_m]; mlp_b [r_m,Nb]; head_a [d,r_h]; head_b [r_h,H] -> mlp_idx [K], head_idx [Kh]
 * (ascending, ties toward the lower index). head_a/head_b/head_idx may be NULL (MLP part only).
 * Limits: B <= 16, r_m and r_h <= 2048, Nb <= 65536, H <= 65536 (odd sizes use element loads).
 * mlp_scores (optional, may be NULL): [Nb] float32 batch-max scores, for tests/debugging. */
DJV_API size_t djv_predictor_workspace_size(int B, int d, int r_m, int Nb, int r_h, int H);
DJV_API int djv_lookahead_predictor(const void* h, const void* mlp_a, const void* mlp_b, const void* head_a,
                                    const void* head_b, int32_t* mlp_idx, int32_t* head_idx, float* mlp_scores,
                                    int B, int d, int r_m, int Nb, int K, int r_h, int H, int Kh, float eps,
                                    int dtype, void* workspace, size_t workspace_bytes, cudaStream_t stream);

/* ---- DejaVuSparseMLP ----------------------------------------------------------------------
 * x [B,d], idx [K] int32 (block indices, ascending), w_up [N,d], w_gate [N,d] (silu_glu only),
 * b_up [N] (relu/gelu, may be NULL), w_down_t [N,d], b_down [d] (relu/gelu, may be NULL),
 * residual [B,d] (may be NULL; may be y itself) -> y [B,d] = residual + MLP(x), summed in fp32 and rounded once.
 * Limits: 1 <= B <= 16, d % 8 == 0, 1 <= K, K*block_size <= N. */
DJV_API size_t djv_sparse_mlp_workspace_size(int B, int d, int N, int K, int block_size, int activation);
DJV_API int djv_sparse_mlp(const void* x, const int32_t* idx, const void* w_gate, const void* w_up, const void* b_up,
                           const void* w_down_t, const void* b_down, const void* residual, void* y, int B, int d,
                           int N, int K,
                           int block_size, int activation, int dtype, void* workspace, size_t workspace_bytes,
                           cudaStream_t stream);

/* ---- DejaVuHeadSparseAttention (decode step) ----------------------------------------------
 * x [B,d], head_idx [Kh] int32 ascending, position [B] int32 (0 <= position < T),
 * w_q [H*hd,d], w_k/w_v [Hkv*hd,d], w_o_t [H*hd,d], biases b_q [H*hd], b_k/b_v [Hkv*hd], b_o [d]
 * (each may be NULL = zero), rope_cos/rope_sin [T,hd/2] (used when rotary != 0),
 * k_cache/v_cache [B,Hkv,T,hd] updated in place at slot position[b], residual [B,d] (may be NULL; may be
 * y) -> y [B,d] = residual + attention output (fp32 sum, rounded once).
 * Limits: 1 <= B <= 16, d % 8 == 0, hd in {64, 128, 256}, H % Hkv == 0. */
DJV_API size_t djv_head_attention_workspace_size(int B, int d, int H, int Hkv, int hd, int Kh, int T, int kv_policy);
DJV_API int djv_head_sparse_attention(const void* x, const int32_t* head_idx, const int32_t* position,
                                      const void* w_q, const void* w_k, const void* w_v, const void* w_o_t,
                                      const void* b_q, const void* b_k, const void* b_v, const void* b_o,
                                      const void* rope_cos, const void* rope_sin, void* k_cache, void* v_cache,
                                      const void* residual, void* y, int B, int d, int H, int Hkv, int hd, int Kh, int T, int rotary,
                                      float scale, int kv_policy, int dtype, void* workspace,
                                      size_t workspace_bytes, cudaStream_t stream);

/* ---- Row normalisation (CUDA executor; not a plugin) --------------------------------------
 * x [rows,d], weight [d], bias [d] (LayerNorm only, may be NULL) -> y [rows,d] (may be x).
 * DJV_LAYERNORM: (x - mean) / sqrt(var + eps) * weight + bias in fp32, rounded once.
 * DJV_RMSNORM: as HF LlamaRMSNorm, round(x / sqrt(mean(x^2) + eps)) * weight, rounded again.
 * Limits: d % 8 == 0, 8 <= d <= 16384. No workspace. */
DJV_API int djv_norm(const void* x, const void* weight, const void* bias, void* y, int rows, int d, int kind,
                     float eps, int dtype, cudaStream_t stream);

/* ---- Norm folding (CUDA executor; not a plugin) ------------------------------------------
 * Row statistics of z [rows,d]: stats [rows][djv_stats_blocks(d)] float32 pairs; pair j = (mean, M2) of
 * columns [64j, min(64j + 64, d)), M2 the sum of squared deviations from that mean. Limits: d <= 16384.
 * The *_folded calls are the calls above with, in addition:
 *  - x_stats (may be NULL): the statistics of x. The op then runs on the norm of x without its affine part,
 *    round((x - mean(x)) * rsqrt(var(x) + eps)) for DJV_LAYERNORM, round(x * rsqrt(mean(x^2) + eps)) for
 *    DJV_RMSNORM (rounded to the I/O dtype). The caller folds the norm's weight into the op's input-side
 *    weights (w_up, w_gate; w_q, w_k, w_v) and its bias into their biases.
 *  - y_stats (may be NULL, not x_stats): receives the statistics of y as written (after rounding).
 * The fused batch <= 4 MLP kernel on sm_90 normalises x itself and the partial-sum reductions write y_stats;
 * the other paths normalise x with an extra kernel into the workspace, or read y back for its statistics. */
DJV_API int djv_stats_blocks(int d);
DJV_API int djv_row_stats(const void* z, float* stats, int rows, int d, int dtype, cudaStream_t stream);
DJV_API int djv_sparse_mlp_folded(const void* x, const int32_t* idx, const void* w_gate, const void* w_up,
                                  const void* b_up, const void* w_down_t, const void* b_down, const void* residual,
                                  void* y, int B, int d, int N, int K, int block_size, int activation,
                                  const float* x_stats, int norm_kind, float norm_eps, float* y_stats, int dtype,
                                  void* workspace, size_t workspace_bytes, cudaStream_t stream);
DJV_API int djv_head_sparse_attention_folded(const void* x, const int32_t* head_idx, const int32_t* position,
                                             const void* w_q, const void* w_k, const void* w_v, const void* w_o_t,
                                             const void* b_q, const void* b_k, const void* b_v, const void* b_o,
                                             const void* rope_cos, const void* rope_sin, void* k_cache, void* v_cache,
                                             const void* residual, void* y, int B, int d, int H, int Hkv, int hd,
                                             int Kh, int T, int rotary, float scale, int kv_policy,
                                             const float* x_stats, int norm_kind, float norm_eps, float* y_stats,
                                             int dtype, void* workspace, size_t workspace_bytes, cudaStream_t stream);

/* ---- The decode step's first and last kernels (CUDA executor; not plugins) ---------------
 * djv_embed: y [rows,d] = emb[tokens[r]] + pos_emb[positions[r] + pos_offset] (pos_emb may be NULL: no
 * position term), added in fp32 and rounded once. tokens int64, positions int32; emb [V,d], pos_emb [Tp,d].
 * A token or position outside its table gives a row of NaN. No workspace.
 * djv_greedy_tail: for logits [B,V] (fp16/bf16): logits_out [B,V] float32 = logits (may be NULL),
 * tokens [B] int64 = argmax (NaN above every number, the lower index on ties, as torch.argmax), and
 * position [B] int32 += 1 (may be NULL). Limits: V <= 2^21. */
DJV_API int djv_embed(const int64_t* tokens, const int32_t* positions, const void* emb, const void* pos_emb,
                      int pos_offset, void* y, int rows, int d, int V, int Tp, int dtype, cudaStream_t stream);
DJV_API size_t djv_greedy_tail_workspace_size(int B, int V);
DJV_API int djv_greedy_tail(const void* logits, float* logits_out, int64_t* tokens, int32_t* position, int B, int V,
                            int dtype, void* workspace, size_t workspace_bytes, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* DEJAVU_KERNELS_H */
