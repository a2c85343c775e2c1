// Decode projections: y[r, n] (+)= sum_k w[n, k] * x[r, k] for up to GEMV_MAX_ROWS rows.
// Weights bf16 [N, K] row-major (the HF layout), activations bf16 [R, K], output fp32 [R, N].
// One warp per weight row: each lane reads 16 bytes of the row per step (coalesced across the
// warp), so every weight byte is read once per launch while the activation rows stay in L1/L2.
// `accumulate` adds into y (the residual stream: o_proj and down_proj fuse the residual add).
// Requires K % 8 == 0 and 16-byte aligned rows (the host checks both).

#define GEMV_MAX_ROWS 16

extern "C" __global__ void __launch_bounds__(256) gemv_bf16(
    const bf16* __restrict__ w, const bf16* __restrict__ x, float* __restrict__ y,
    int n_rows, int k, int batch, int accumulate) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= n_rows) return;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (u64)warp * k);
    const int k8 = k >> 3;
    float acc[GEMV_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) acc[r] = 0.0f;
#pragma unroll 4
    for (int c = lane; c < k8; c += 32) {
        uint4 wv = __ldg(wr + c);
#pragma unroll
        for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
            if (r < batch) {
                uint4 xv = __ldg(reinterpret_cast<const uint4*>(x + (u64)r * k) + c);
                acc[r] = dot8(wv, xv, acc[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r < batch) {
            float s = warp_sum(acc[r]);
            if (lane == 0) {
                float* dst = y + (u64)r * n_rows + warp;
                *dst = accumulate ? *dst + s : s;
            }
        }
    }
}
