// q/k RMSNorm per head, NeoX RoPE at each row's position, bf16 Q, and K/V written into the
// paged cache through the slot mapping (one kernel: the fused norm / RoPE / KV write).
// qkv fp32 [R, (Hq + 2 Hkv) * d] (the fused QKV projection's output, q heads then k then v);
// cos/sin fp32 [P, d] (halves repeated); pos, slots u32 [R]; q_out bf16 [R, Hq * d];
// pools bf16 [slots, Hkv * d]. Grid (R, Hq + 2 Hkv); block d threads (d a multiple of 32,
// at most 256). The host checks positions against P and slots against the pool.

extern "C" __global__ void qk_norm_rope_kv(
    const float* __restrict__ qkv, const float* __restrict__ q_norm,
    const float* __restrict__ k_norm, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, const u32* __restrict__ pos, const u32* __restrict__ slots,
    bf16* __restrict__ q_out, bf16* __restrict__ k_pool, bf16* __restrict__ v_pool,
    int hq, int hkv, int d, float eps) {
    __shared__ float t[256];
    pdl_wait();
    pdl_trigger();
    int r = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
    int width = (hq + 2 * hkv) * d;
    float v = qkv[(u64)r * width + (u64)h * d + i];
    if (h >= hq + hkv) {
        int kvh = h - hq - hkv;
        v_pool[(u64)slots[r] * hkv * d + (u64)kvh * d + i] = f2bf(v);
        return;
    }
    const float* g = h < hq ? q_norm : k_norm;
    float s = block_sum(v * v);
    float inv = 1.0f / sqrtf(s / (float)d + eps);
    t[i] = v * inv * g[i];
    __syncthreads();
    int half = d / 2;
    const float* c = cos_t + (u64)pos[r] * d;
    const float* sn = sin_t + (u64)pos[r] * d;
    float o = i < half ? t[i] * c[i] - t[i + half] * sn[i]
                       : t[i] * c[i] + t[i - half] * sn[i];
    if (h < hq) {
        q_out[(u64)r * hq * d + (u64)h * d + i] = f2bf(o);
    } else {
        int kvh = h - hq;
        k_pool[(u64)slots[r] * hkv * d + (u64)kvh * d + i] = f2bf(o);
    }
}
