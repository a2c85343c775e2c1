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
    pdl_wait();
    pdl_trigger();
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

// Split-KV decode, pass 1 on tensor cores: the same grid, arguments and outputs as
// `attn_decode_partial`, for head_dim 128 and up to 16 query heads per KV head. Each warp takes
// 16 tokens at a time (the warps of a block interleave over the chunk's 16-token tiles):
// S = Q K^T as two mma.m16n8k16 tiles (query heads as the 16 rows, tokens as the columns), an
// online softmax per head in registers, then O += P V with P as the A operand straight from
// S's accumulator layout. P is split into bf16 hi + lo parts (two products), so the weights
// keep ~16 bits where one bf16 would keep 8; Q and K are bf16 already, so S is exact up to
// fp32 accumulation.
//
// Operands come from global memory in 16-byte loads, with the k order chosen so no shuffle is
// needed (the same scheme as `gemv_bf16_mma`): for S, lane (g = lane / 4, t = lane % 4) loads
// head g's (and g + 8's) query and token g's key at d = 32 b + 8 t .. + 7, and k16 step j of
// block b takes words 2 j and 2 j + 1. For P V the lane needs tokens 2 t, 2 t + 1, 2 t + 8,
// 2 t + 9 at output column g of each of the 16 n8 tiles; tile i's column c is d = 8 c + i
// (i < 8) or 64 + 8 c + i - 8, so two 16-byte loads per token (d = 8 g .. and 64 + 8 g ..)
// hold all of them, paired across tokens with a byte permute.
#define ATTM_WARPS 4
#define ATTM_D 128
#define ATTM_GROUP 16

__device__ __forceinline__ void mma_bf16_att(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                             u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 word_of(uint4 v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// (lo, hi) as packed bf16 bits; `rest` gets what rounding left of each.
__device__ __forceinline__ u32 pack_hi(float lo, float hi, float* rest) {
    bf16 a = f2bf(lo), b = f2bf(hi);
    rest[0] = lo - bf2f(a);
    rest[1] = hi - bf2f(b);
    return (u32)a | ((u32)b << 16);
}

__device__ __forceinline__ u32 pack2(float lo, float hi) {
    return (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
}

// Output column c of n8 tile i of P V.
__device__ __forceinline__ int attm_col(int i, int c) {
    return i < 8 ? 8 * c + i : 64 + 8 * c + (i - 8);
}

extern "C" __global__ void __launch_bounds__(ATTM_WARPS * 32) attn_decode_partial_mma(
    const bf16* __restrict__ q, const bf16* __restrict__ k_pool, const bf16* __restrict__ v_pool,
    const u32* __restrict__ block_table, const u32* __restrict__ seq_lens,
    float* __restrict__ part_o, float* __restrict__ part_ml, int hq, int hkv, int d, int page,
    int max_blocks, int chunk, float scale) {
    __shared__ float sm_m[ATTM_WARPS][ATTM_GROUP];
    __shared__ float sm_l[ATTM_WARPS][ATTM_GROUP];
    __shared__ float sm_o[ATTM_WARPS][ATTM_GROUP][ATTM_D];
    pdl_wait();
    pdl_trigger();
    int s = blockIdx.x, kvh = blockIdx.y, r = blockIdx.z, n_split = gridDim.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, t = lane & 3;
    int group = hq / hkv;
    u32 len = seq_lens[r];
    u32 t0 = (u32)s * chunk, t1 = min(t0 + (u32)chunk, len);
    const u32* table = block_table + (u64)r * max_blocks;
    const u64 stride = (u64)hkv * ATTM_D;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const bf16* qh = q + (u64)r * hq * ATTM_D + (u64)kvh * group * ATTM_D;
    uint4 qa[4], qb[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        qa[b] = g < group ? *reinterpret_cast<const uint4*>(qh + g * ATTM_D + 32 * b + 8 * t) : zero;
        qb[b] = g + 8 < group
            ? *reinterpret_cast<const uint4*>(qh + (g + 8) * ATTM_D + 32 * b + 8 * t) : zero;
    }
    float o[16][4];
#pragma unroll
    for (int i = 0; i < 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    // The warp's next tile is fetched into L2 while this one is read and multiplied
    // (registers hold one tile; L2 holds what is in flight beyond it): lane l takes half of
    // token (l / 2)'s key row and half of its value row (256 bytes each).
    auto prefetch_tile = [&](u32 tile) {
        u32 tn = tile + (lane >> 1);
        if (tn < t1) {
            u64 at = paged_slot(table, page, tn) * stride + (u64)kvh * ATTM_D + 64 * (lane & 1);
            prefetch_l2(k_pool + at);
            prefetch_l2(v_pool + at);
        }
    };
    for (u32 tb = t0 + 16 * warp; tb < t1; tb += 16 * ATTM_WARPS) {
        prefetch_tile(tb + 16 * ATTM_WARPS);
        // Keys of tokens tb + g and tb + 8 + g; values of tb + 2t, +1, +8, +9. A token past the
        // chunk reads token tb's row (its weight is zero).
        u32 kt0 = tb + g, kt1 = tb + 8 + g;
        const bf16* ka = k_pool + paged_slot(table, page, kt0 < t1 ? kt0 : tb) * stride + (u64)kvh * ATTM_D + 8 * t;
        const bf16* kb = k_pool + paged_slot(table, page, kt1 < t1 ? kt1 : tb) * stride + (u64)kvh * ATTM_D + 8 * t;
        uint4 KA[4], KB[4], V[4][2];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            KA[b] = __ldg(reinterpret_cast<const uint4*>(ka + 32 * b));
            KB[b] = __ldg(reinterpret_cast<const uint4*>(kb + 32 * b));
        }
        u32 tk[4] = {tb + 2 * t, tb + 2 * t + 1, tb + 2 * t + 8, tb + 2 * t + 9};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const bf16* vp = v_pool + paged_slot(table, page, tk[i] < t1 ? tk[i] : tb) * stride + (u64)kvh * ATTM_D + 8 * g;
            V[i][0] = __ldg(reinterpret_cast<const uint4*>(vp));
            V[i][1] = __ldg(reinterpret_cast<const uint4*>(vp + 64));
        }
        float s0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            mma_bf16_att(s0, qa[b].x, qb[b].x, qa[b].y, qb[b].y, KA[b].x, KA[b].y);
            mma_bf16_att(s0, qa[b].z, qb[b].z, qa[b].w, qb[b].w, KA[b].z, KA[b].w);
            mma_bf16_att(s1, qa[b].x, qb[b].x, qa[b].y, qb[b].y, KB[b].x, KB[b].y);
            mma_bf16_att(s1, qa[b].z, qb[b].z, qa[b].w, qb[b].w, KB[b].z, KB[b].w);
        }
        // Head g's scores of tokens tk[0..4], and head g + 8's.
        float pg[4] = {s0[0], s0[1], s1[0], s1[1]}, ph[4] = {s0[2], s0[3], s1[2], s1[3]};
        float mg = -INFINITY, mh = -INFINITY;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            bool ok = tk[i] < t1;
            pg[i] = ok ? pg[i] * scale : -INFINITY;
            ph[i] = ok ? ph[i] * scale : -INFINITY;
            mg = fmaxf(mg, pg[i]);
            mh = fmaxf(mh, ph[i]);
        }
        mg = fmaxf(mg, __shfl_xor_sync(0xffffffffu, mg, 1));
        mg = fmaxf(mg, __shfl_xor_sync(0xffffffffu, mg, 2));
        mh = fmaxf(mh, __shfl_xor_sync(0xffffffffu, mh, 1));
        mh = fmaxf(mh, __shfl_xor_sync(0xffffffffu, mh, 2));
        float ng = fmaxf(m0, mg), nh = fmaxf(m1, mh);
        float bg = ng == -INFINITY ? 0.0f : ng, bh = nh == -INFINITY ? 0.0f : nh;
        float cg = __expf(m0 - bg), ch = __expf(m1 - bh);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            pg[i] = __expf(pg[i] - bg);
            ph[i] = __expf(ph[i] - bh);
        }
        l0 = l0 * cg + (pg[0] + pg[1]) + (pg[2] + pg[3]);
        l1 = l1 * ch + (ph[0] + ph[1]) + (ph[2] + ph[3]);
        m0 = ng;
        m1 = nh;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            o[i][0] *= cg;
            o[i][1] *= cg;
            o[i][2] *= ch;
            o[i][3] *= ch;
        }
        // P as the A operand (rows: heads g, g + 8; k: tokens 2t, 2t+1 | 2t+8, 2t+9), hi + lo.
        float rg[4], rh[4];
        u32 a0 = pack_hi(pg[0], pg[1], rg), a1 = pack_hi(ph[0], ph[1], rh);
        u32 a2 = pack_hi(pg[2], pg[3], rg + 2), a3 = pack_hi(ph[2], ph[3], rh + 2);
        u32 e0 = pack2(rg[0], rg[1]), e1 = pack2(rh[0], rh[1]);
        u32 e2 = pack2(rg[2], rg[3]), e3 = pack2(rh[2], rh[3]);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            int h = i >> 3, e = i & 7;
            u32 sel = (e & 1) ? 0x7632u : 0x5410u;
            u32 b0 = __byte_perm(word_of(V[0][h], e >> 1), word_of(V[1][h], e >> 1), sel);
            u32 b1 = __byte_perm(word_of(V[2][h], e >> 1), word_of(V[3][h], e >> 1), sel);
            mma_bf16_att(o[i], a0, a1, a2, a3, b0, b1);
            mma_bf16_att(o[i], e0, e1, e2, e3, b0, b1);
        }
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            int col = attm_col(i, 2 * t + c);
            if (g < group) sm_o[warp][g][col] = o[i][c];
            if (g + 8 < group) sm_o[warp][g + 8][col] = o[i][2 + c];
        }
    }
    if (t == 0) {
        if (g < group) {
            sm_m[warp][g] = m0;
            sm_l[warp][g] = l0;
        }
        if (g + 8 < group) {
            sm_m[warp][g + 8] = m1;
            sm_l[warp][g + 8] = l1;
        }
    }
    __syncthreads();
    // Merge the warps as `attn_decode_partial` does.
    for (int gi = 0; gi < group; ++gi) {
        float mm = -INFINITY;
        for (int w = 0; w < ATTM_WARPS; ++w) mm = fmaxf(mm, sm_m[w][gi]);
        int h = kvh * group + gi;
        u64 row = ((u64)r * hq + h) * n_split + s;
        for (int i = threadIdx.x; i < ATTM_D; i += blockDim.x) {
            float acc = 0.0f;
            for (int w = 0; w < ATTM_WARPS; ++w)
                if (sm_m[w][gi] != -INFINITY) acc += sm_o[w][gi][i] * __expf(sm_m[w][gi] - mm);
            part_o[row * ATTM_D + i] = acc;
        }
        if (threadIdx.x == 0) {
            float ll = 0.0f;
            for (int w = 0; w < ATTM_WARPS; ++w)
                if (sm_m[w][gi] != -INFINITY) ll += sm_l[w][gi] * __expf(sm_m[w][gi] - mm);
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
    pdl_wait();
    pdl_trigger();
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
    pdl_wait();
    pdl_trigger();
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
