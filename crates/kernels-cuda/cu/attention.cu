// Paged attention over a bf16 KV cache ([slots, Hkv * d] per layer; block tables u32
// [R, max_blocks]; tokens of a sequence at slots table[t / page] * page + t % page).
// Scores and softmax in fp32; GQA: query head h reads KV head h / (Hq / Hkv).

#define ATT_MAX_ELEMS 8   // d / 32 per lane: head_dim up to 256
#define ATT_MAX_GROUP 8   // query heads per KV head
#define ATT_WARPS 4

// Split-KV decode, pass 1: block (split s, KV head kvh, sequence r) attends every query head
// of the group over tokens [s * chunk, min((s + 1) * chunk, seq_len)) and writes the chunk's
// unnormalised output with its running max and sum:
// part_o [R, Hq, S, d], part_ml [R, Hq, S, 2]. An empty chunk writes max = -inf, sum = 0.
// Block: ATT_WARPS warps, tokens strided across warps; each lane holds d / 32 elements.
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32) attn_decode_partial(
    const bf16* __restrict__ q, const bf16* __restrict__ k_pool, const bf16* __restrict__ v_pool,
    const u32* __restrict__ block_table, const u32* __restrict__ seq_lens,
    float* __restrict__ part_o, float* __restrict__ part_ml, int hq, int hkv, int d, int page,
    int max_blocks, int chunk, float scale) {
    __shared__ float sm_m[ATT_WARPS][ATT_MAX_GROUP];
    __shared__ float sm_l[ATT_WARPS][ATT_MAX_GROUP];
    __shared__ float sm_o[ATT_WARPS][ATT_MAX_GROUP][ATT_MAX_ELEMS * 32];
    int s = blockIdx.x, kvh = blockIdx.y, r = blockIdx.z, n_split = gridDim.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int group = hq / hkv, epl = d / 32;
    u32 len = seq_lens[r];
    u32 t0 = (u32)s * chunk, t1 = min(t0 + (u32)chunk, len);
    const u32* table = block_table + (u64)r * max_blocks;
    float qv[ATT_MAX_GROUP][ATT_MAX_ELEMS], acc[ATT_MAX_GROUP][ATT_MAX_ELEMS];
    float m[ATT_MAX_GROUP], l[ATT_MAX_GROUP];
#pragma unroll
    for (int g = 0; g < ATT_MAX_GROUP; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int e = 0; e < ATT_MAX_ELEMS; ++e) {
            acc[g][e] = 0.0f;
            qv[g][e] = (g < group && e < epl)
                ? bf2f(q[(u64)r * hq * d + (u64)(kvh * group + g) * d + lane * epl + e]) : 0.0f;
        }
    }
    for (u32 t = t0 + warp; t < t1; t += ATT_WARPS) {
        u64 base = paged_slot(table, page, t) * hkv * d + (u64)kvh * d + lane * epl;
        float kv[ATT_MAX_ELEMS], vv[ATT_MAX_ELEMS];
#pragma unroll
        for (int e = 0; e < ATT_MAX_ELEMS; ++e) {
            kv[e] = e < epl ? bf2f(k_pool[base + e]) : 0.0f;
            vv[e] = e < epl ? bf2f(v_pool[base + e]) : 0.0f;
        }
#pragma unroll
        for (int g = 0; g < ATT_MAX_GROUP; ++g) {
            if (g >= group) continue;
            float dot = 0.0f;
#pragma unroll
            for (int e = 0; e < ATT_MAX_ELEMS; ++e) dot = fmaf(qv[g][e], kv[e], dot);
            float sc = warp_sum(dot) * scale;
            float nm = fmaxf(m[g], sc);
            float corr = __expf(m[g] - nm);
            float p = __expf(sc - nm);
            l[g] = l[g] * corr + p;
#pragma unroll
            for (int e = 0; e < ATT_MAX_ELEMS; ++e) acc[g][e] = fmaf(p, vv[e], acc[g][e] * corr);
            m[g] = nm;
        }
    }
#pragma unroll
    for (int g = 0; g < ATT_MAX_GROUP; ++g) {
        if (g >= group) continue;
        if (lane == 0) {
            sm_m[warp][g] = m[g];
            sm_l[warp][g] = l[g];
        }
#pragma unroll
        for (int e = 0; e < ATT_MAX_ELEMS; ++e)
            if (e < epl) sm_o[warp][g][lane * epl + e] = acc[g][e];
    }
    __syncthreads();
    // Merge the warps: thread i of the block handles element i of each head in the group.
    for (int g = 0; g < group; ++g) {
        float mm = -INFINITY;
        for (int w = 0; w < ATT_WARPS; ++w) mm = fmaxf(mm, sm_m[w][g]);
        int h = kvh * group + g;
        u64 row = ((u64)r * hq + h) * n_split + s;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            float o = 0.0f;
            for (int w = 0; w < ATT_WARPS; ++w)
                if (sm_m[w][g] != -INFINITY) o += sm_o[w][g][i] * __expf(sm_m[w][g] - mm);
            part_o[row * d + i] = o;
        }
        if (threadIdx.x == 0) {
            float ll = 0.0f;
            for (int w = 0; w < ATT_WARPS; ++w)
                if (sm_m[w][g] != -INFINITY) ll += sm_l[w][g] * __expf(sm_m[w][g] - mm);
            part_ml[row * 2] = mm;
            part_ml[row * 2 + 1] = ll;
        }
    }
}

// Split-KV decode, pass 2: out[r, h * d + i] = bf16(sum_s o_s * e^(m_s - M) / sum_s l_s e^(m_s - M)).
// Grid (Hq, R); block d threads.
extern "C" __global__ void attn_decode_combine(const float* __restrict__ part_o,
                                               const float* __restrict__ part_ml,
                                               bf16* __restrict__ out, int hq, int d,
                                               int n_split) {
    int h = blockIdx.x, r = blockIdx.y, i = threadIdx.x;
    u64 row0 = ((u64)r * hq + h) * n_split;
    float mm = -INFINITY;
    for (int s = 0; s < n_split; ++s) mm = fmaxf(mm, part_ml[(row0 + s) * 2]);
    float num = 0.0f, den = 0.0f;
    for (int s = 0; s < n_split; ++s) {
        float ms = part_ml[(row0 + s) * 2];
        if (ms == -INFINITY) continue;
        float f = __expf(ms - mm);
        den += part_ml[(row0 + s) * 2 + 1] * f;
        if (i < d) num += part_o[(row0 + s) * d + i] * f;
    }
    if (i < d) out[(u64)r * hq * d + (u64)h * d + i] = f2bf(num / den);
}

// Causal prefill attention: one warp per (token, query head); token t of the step belongs to
// sequence tok_seq[t] at position tok_pos[t] and attends to positions 0..=tok_pos[t] (its
// chunk's K/V already written to the cache). q, out bf16 [T, Hq * d]. Grid (T, Hq); block 32.
// A correctness path: prefill is compute-bound and the plan is a tiled tensor-core kernel.
extern "C" __global__ void attn_prefill(
    const bf16* __restrict__ q, const bf16* __restrict__ k_pool, const bf16* __restrict__ v_pool,
    const u32* __restrict__ block_table, const u32* __restrict__ tok_seq,
    const u32* __restrict__ tok_pos, bf16* __restrict__ out, int hq, int hkv, int d, int page,
    int max_blocks, float scale) {
    int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    int kvh = h / (hq / hkv), epl = d / 32;
    const u32* table = block_table + (u64)tok_seq[t] * max_blocks;
    float qv[ATT_MAX_ELEMS], acc[ATT_MAX_ELEMS];
#pragma unroll
    for (int e = 0; e < ATT_MAX_ELEMS; ++e) {
        acc[e] = 0.0f;
        qv[e] = e < epl ? bf2f(q[(u64)t * hq * d + (u64)h * d + lane * epl + e]) : 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (u32 p = 0; p <= tok_pos[t]; ++p) {
        u64 base = paged_slot(table, page, p) * hkv * d + (u64)kvh * d + lane * epl;
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < ATT_MAX_ELEMS; ++e)
            if (e < epl) dot = fmaf(qv[e], bf2f(k_pool[base + e]), dot);
        float sc = warp_sum(dot) * scale;
        float nm = fmaxf(m, sc);
        float corr = __expf(m - nm), pr = __expf(sc - nm);
        l = l * corr + pr;
#pragma unroll
        for (int e = 0; e < ATT_MAX_ELEMS; ++e)
            if (e < epl) acc[e] = fmaf(pr, bf2f(v_pool[base + e]), acc[e] * corr);
        m = nm;
    }
#pragma unroll
    for (int e = 0; e < ATT_MAX_ELEMS; ++e)
        if (e < epl) out[(u64)t * hq * d + (u64)h * d + lane * epl + e] = f2bf(acc[e] / l);
}
