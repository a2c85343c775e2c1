// SwiGLU and the greedy argmax.

// act[r, i] = bf16(silu(gate) * up) from gu fp32 [R, 2 * inter], the fused gate/up
// projection's output in the weights' row order: groups of 16, the eight gate rows of
// i = 8 q .. 8 q + 7 then their eight up rows. Grid (ceil(inter / blockDim), R).
extern "C" __global__ void swiglu(const float* __restrict__ gu, bf16* __restrict__ act,
                                  int inter) {
    pdl_wait();
    pdl_trigger();
    int r = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= inter) return;
    u64 at = (u64)r * 2 * inter + (u64)(i >> 3) * 16 + (i & 7);
    float g = gu[at], u = gu[at + 8];
    act[(u64)r * inter + i] = f2bf(g * (1.0f / (1.0f + expf(-g))) * u);
}

// ids[r] = the index of the largest logits[r, :], ties to the lowest index, NaN never wins.
// Grid R; block 1024 threads.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, u32* __restrict__ ids,
                                       int vocab) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    pdl_wait();
    pdl_trigger();
    int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = logits[(u64)r * vocab + i];
        if (v > bv) { bv = v; bi = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { best_v[warp] = bv; best_i[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        int nw = blockDim.x >> 5;
        bv = lane < nw ? best_v[lane] : -INFINITY;
        bi = lane < nw ? best_i[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) ids[r] = bi == 0x7fffffff ? 0u : (u32)bi;
    }
}
