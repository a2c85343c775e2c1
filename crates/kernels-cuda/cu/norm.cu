// Embedding gather and RMSNorm. Grid: one block per row; block: a multiple of 32 threads.

// x[r, :] = fp32(table[ids[r], :]). The host checks every id against the vocabulary.
extern "C" __global__ void embed_rows(const bf16* __restrict__ table, const u32* __restrict__ ids,
                                      float* __restrict__ x, int hidden) {
    int r = blockIdx.x;
    const bf16* src = table + (u64)ids[r] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) x[(u64)r * hidden + i] = bf2f(src[i]);
}

// out[r, i] = bf16(x[r, i] * inv_rms(x[r, :]) * g[i]).
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ g,
                                    bf16* __restrict__ out, int hidden, float eps) {
    int r = blockIdx.x;
    const float* row = x + (u64)r * hidden;
    float s = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) s = fmaf(row[i], row[i], s);
    s = block_sum(s);
    float inv = rsqrtf(s / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        out[(u64)r * hidden + i] = f2bf(row[i] * inv * g[i]);
}
