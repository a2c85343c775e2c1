// Prefill projections: c[m, n] (+)= sum_k a[m, k] * w[n, k]; a bf16 [M, K], w bf16 [N, K],
// c fp32 [M, N]. 64x64 output tiles, 16-wide K steps through shared memory, 256 threads with
// 4x4 outputs each, fp32 FMA. A correctness path: the plan is to measure it against cuBLAS
// (docs/gpu.md) and keep the faster.

#define GT 64
#define GK 16

extern "C" __global__ void __launch_bounds__(256) gemm_bf16(
    const bf16* __restrict__ a, const bf16* __restrict__ w, float* __restrict__ c,
    int m, int n, int k, int accumulate) {
    __shared__ float as[GK][GT + 1];
    __shared__ float ws[GK][GT + 1];
    pdl_wait();
    pdl_trigger();
    int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
    int m0 = blockIdx.y * GT, n0 = blockIdx.x * GT;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < k; k0 += GK) {
        for (int e = threadIdx.x; e < GT * GK; e += blockDim.x) {
            int row = e / GK, kk = e % GK;
            int gm = m0 + row, gn = n0 + row, gk = k0 + kk;
            as[kk][row] = (gm < m && gk < k) ? bf2f(a[(u64)gm * k + gk]) : 0.0f;
            ws[kk][row] = (gn < n && gk < k) ? bf2f(w[(u64)gn * k + gk]) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GK; ++kk) {
            float av[4], wv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) av[i] = as[kk][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; ++j) wv[j] = ws[kk][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], wv[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int gm = m0 + ty * 4 + i;
        if (gm >= m) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int gn = n0 + tx * 4 + j;
            if (gn >= n) continue;
            float* dst = c + (u64)gm * n + gn;
            *dst = accumulate ? *dst + acc[i][j] : acc[i][j];
        }
    }
}
