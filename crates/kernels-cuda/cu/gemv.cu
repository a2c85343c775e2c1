// Decode projections: y[r, n] (+)= s[r] * sum_k w[n, k] * x[r, k] for up to GEMV_MAX_ROWS rows.
// Weights bf16 [N, K] row-major (the HF layout), activations bf16 [R, K], output fp32 [R, N];
// `rscale` fp32 [R] or null: each row's deferred 1/rms (decode normalises after the product,
// as the golden does), applied before the residual add.
// `accumulate` adds into y (the residual stream: o_proj and down_proj fuse the residual add).
// Requires K % 8 == 0 and 16-byte aligned rows (the host checks both).

#define GEMV_MAX_ROWS 16

// The reference form: one warp per weight row, each lane reading 16 bytes of the row per step
// and every activation row beside it. Kept as the plain path the tensor-core one is checked and
// measured against (SIMPLER_CUDA_KERNELS=simple).
extern "C" __global__ void __launch_bounds__(256) gemv_bf16(
    const bf16* __restrict__ w, const bf16* __restrict__ x, float* __restrict__ y,
    const float* __restrict__ rscale, int n_rows, int k, int batch, int accumulate) {
    pdl_wait();
    pdl_trigger();
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
            if (rscale) s *= rscale[r];
            if (lane == 0) {
                float* dst = y + (u64)r * n_rows + warp;
                *dst = accumulate ? *dst + s : s;
            }
        }
    }
}

// The tensor-core form: a block of GEMV_WARPS warps owns 16 weight rows and splits K between
// its warps; each warp multiplies its 16 rows by the (up to 16) activation rows with
// mma.m16n8k16 (bf16 in, fp32 accumulate), so every weight byte is read once and each
// activation byte once per 16 weight rows (the plain form reads it once per weight row).
//
// The weights are in the tile layout the host writes at load time (`tile_layout` in the CUDA
// platform): rows padded to a multiple of 16 and k to a multiple of 32 with zeros, then for
// each 16-row tile T and 32-wide block kb of k, 1 KiB holding two halves of 32 lanes' 16-byte
// words: half 0, lane (g = lane / 4, t = lane % 4) is row 16 T + g at k = 32 kb + 8 t .. + 7,
// half 1 the same for row 16 T + g + 8. A warp's load of one half is 512 contiguous bytes, and
// a warp's step of U blocks reads U KiB in one run (row-major rows would scatter it over 16
// rows 2 K bytes apart).
//
// The activations come straight from global memory in 16-byte loads: lane (g, t) reads row g
// (and g + 8) at the same k as its weight words. The product's k order is free as long as both
// operands use the same one, so inside block kb the two k16 steps j = 0, 1 take the fragment's
// pair t from the word's 32-bit half 2 j and its pair t + 4 from 2 j + 1: every k of the block
// is taken exactly once, by the same lane and word on both sides.
#define GEMV_WARPS 4

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// c += a (16x16, row) * b (16x8, col), bf16 operands, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The epilogues: y fp32 [R, N] stored or accumulated (GEMV_STORE), or the SwiGLU of a gate/up
// pair (GEMV_SWIGLU): the weights' rows come in groups of 16, eight gate rows j0 .. j0 + 7 then
// the eight up rows of the same j (the host uploads them so), and y is act bf16 [R, N / 2] with
// act[r, j] = bf16(silu(gate) * up), both already scaled by rscale.
#define GEMV_STORE 0
#define GEMV_SWIGLU 1

// U: 32-wide blocks of k per warp and step. NT: activation tiles of 8 rows (1: batch <= 8,
// whose registers then leave room for four blocks a multiprocessor, so the qkv projection's
// 448 blocks run in one wave; 2: up to 16 rows). The products of a step alternate between two
// accumulator sets, so the dependent chain of mma is half as long.
template <int U, int NT, int EPI>
__device__ __forceinline__ void gemv_mma_body(
    const bf16* __restrict__ w, const bf16* __restrict__ x, void* __restrict__ yv,
    const float* __restrict__ rscale, int n_rows, int k, int batch, int accumulate) {
    __shared__ float red[GEMV_WARPS][2][4][32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, t = lane & 3;
    int row0 = blockIdx.x * 16;
    const int k8 = k >> 3, nkb = (k + 31) >> 5;
    // This tile's words of this lane: block kb's half 0 at 64 kb, half 1 at 64 kb + 32.
    const uint4* wt = reinterpret_cast<const uint4*>(w) + (u64)blockIdx.x * nkb * 64 + lane;
    bool x0 = g < batch, x1 = NT > 1 && g + 8 < batch, two = NT > 1 && batch > 8;
    const uint4* xa = reinterpret_cast<const uint4*>(x + (u64)(x0 ? g : 0) * k) + t;
    const uint4* xb = reinterpret_cast<const uint4*>(x + (u64)(x1 ? g + 8 : 0) * k) + t;
    const int step = GEMV_WARPS * U;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    float c0[2][4], c1[2][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int i = 0; i < 4; ++i) c0[a][i] = c1[a][i] = 0.0f;
    uint4 A[U], B[U];
    // The weights never depend on the grid before this one: the first step's are loaded
    // before waiting for it (with programmatic launch this runs under that grid's tail).
#pragma unroll
    for (int u = 0; u < U; ++u) {
        int kb = warp * U + u;
        A[u] = kb < nkb ? ld_stream(wt + 64 * kb) : zero;
        B[u] = kb < nkb ? ld_stream(wt + 64 * kb + 32) : zero;
    }
    pdl_trigger();
    pdl_wait();
    for (int kb0 = warp * U; kb0 < nkb; kb0 += step) {
        uint4 X0[U], X1[NT > 1 ? U : 1];
        if (kb0 != warp * U) {
#pragma unroll
            for (int u = 0; u < U; ++u) {
                int kb = kb0 + u;
                A[u] = kb < nkb ? ld_stream(wt + 64 * kb) : zero;
                B[u] = kb < nkb ? ld_stream(wt + 64 * kb + 32) : zero;
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int i = (kb0 + u) * 4;
            bool ok = kb0 + u < nkb && i + t < k8;
            X0[u] = ok && x0 ? __ldg(xa + i) : zero;
            if (NT > 1) X1[u] = ok && x1 ? __ldg(xb + i) : zero;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float* a0 = c0[u & 1];
            float* a1 = c1[u & 1];
            mma_bf16(a0, A[u].x, B[u].x, A[u].y, B[u].y, X0[u].x, X0[u].y);
            mma_bf16(a0, A[u].z, B[u].z, A[u].w, B[u].w, X0[u].z, X0[u].w);
            if (NT > 1 && two) {
                mma_bf16(a1, A[u].x, B[u].x, A[u].y, B[u].y, X1[NT > 1 ? u : 0].x, X1[NT > 1 ? u : 0].y);
                mma_bf16(a1, A[u].z, B[u].z, A[u].w, B[u].w, X1[NT > 1 ? u : 0].z, X1[NT > 1 ? u : 0].w);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        red[warp][0][i][lane] = c0[0][i] + c0[1][i];
        red[warp][1][i][lane] = c1[0][i] + c1[1][i];
    }
    __syncthreads();
    // c[i] of lane (g, t) is output row g + 8 (i / 2), activation row 2 t + (i % 2) (+ 8 for
    // the second tile).
    if (EPI == GEMV_STORE) {
        float* y = reinterpret_cast<float*>(yv);
        for (int e = threadIdx.x; e < 256; e += blockDim.x) {
            int tile = e >> 7, i = (e >> 5) & 3, l = e & 31;
            int n = row0 + (l >> 2) + 8 * (i >> 1);
            int r = tile * 8 + 2 * (l & 3) + (i & 1);
            if (n >= n_rows || r >= batch) continue;
            float s = 0.0f;
#pragma unroll
            for (int wi = 0; wi < GEMV_WARPS; ++wi) s += red[wi][tile][i][l];
            if (rscale) s *= rscale[r];
            float* dst = y + (u64)r * n_rows + n;
            *dst = accumulate ? *dst + s : s;
        }
    } else {
        // Rows g (gate) and g + 8 (up) of lane l are the same j = blockIdx.x * 8 + g.
        bf16* act = reinterpret_cast<bf16*>(yv);
        int width = n_rows >> 1;
        for (int e = threadIdx.x; e < 128; e += blockDim.x) {
            int tile = e >> 6, l = (e >> 1) & 31, c = e & 1;
            int j = blockIdx.x * 8 + (l >> 2);
            int r = tile * 8 + 2 * (l & 3) + c;
            if (j >= width || r >= batch) continue;
            float gate = 0.0f, up = 0.0f;
#pragma unroll
            for (int wi = 0; wi < GEMV_WARPS; ++wi) {
                gate += red[wi][tile][c][l];
                up += red[wi][tile][2 + c][l];
            }
            if (rscale) {
                gate *= rscale[r];
                up *= rscale[r];
            }
            act[(u64)r * width + j] = f2bf(gate * (1.0f / (1.0f + expf(-gate))) * up);
        }
    }
}

// Up to 16 activation rows; eight 32-wide k blocks per warp and step.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_bf16_mma(
    const bf16* __restrict__ w, const bf16* __restrict__ x, float* __restrict__ y,
    const float* __restrict__ rscale, int n_rows, int k, int batch, int accumulate) {
    gemv_mma_body<8, 2, GEMV_STORE>(w, x, y, rscale, n_rows, k, batch, accumulate);
}

// The gate/up projection with the SwiGLU in its epilogue: act bf16 [R, n_rows / 2].
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) gemv_bf16_mma_swiglu(
    const bf16* __restrict__ w, const bf16* __restrict__ x, bf16* __restrict__ act,
    const float* __restrict__ rscale, int n_rows, int k, int batch, int accumulate) {
    gemv_mma_body<8, 2, GEMV_SWIGLU>(w, x, act, rscale, n_rows, k, batch, accumulate);
}

// At most 8 activation rows (batch <= 8), four blocks a multiprocessor.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 4) gemv_bf16_mma_n8(
    const bf16* __restrict__ w, const bf16* __restrict__ x, float* __restrict__ y,
    const float* __restrict__ rscale, int n_rows, int k, int batch, int accumulate) {
    gemv_mma_body<8, 1, GEMV_STORE>(w, x, y, rscale, n_rows, k, batch, accumulate);
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 4) gemv_bf16_mma_n8_swiglu(
    const bf16* __restrict__ w, const bf16* __restrict__ x, bf16* __restrict__ act,
    const float* __restrict__ rscale, int n_rows, int k, int batch, int accumulate) {
    gemv_mma_body<8, 1, GEMV_SWIGLU>(w, x, act, rscale, n_rows, k, batch, accumulate);
}
