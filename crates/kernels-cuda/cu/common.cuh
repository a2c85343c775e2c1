// Shared by every kernel source: prepended to each .cu file before NVRTC compiles it, so the
// sources need no include path and no CUDA header (bf16 is handled as raw bits).
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

// bf16 bits -> fp32 (exact).
__device__ __forceinline__ float bf2f(bf16 v) { return __uint_as_float(((u32)v) << 16); }

// fp32 -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ bf16 f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// fp32 rounded through bf16 (the golden's `rb`).
__device__ __forceinline__ float rb(float f) { return bf2f(f2bf(f)); }

// The two bf16 halves of a 32-bit word as fp32: low element first.
__device__ __forceinline__ float lo_bf(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf(u32 w) { return __uint_as_float(w & 0xffff0000u); }

// Dot product of 8 bf16 packed in `a` and 8 in `b`, added to `acc`.
__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
    acc = fmaf(lo_bf(a.x), lo_bf(b.x), acc);
    acc = fmaf(hi_bf(a.x), hi_bf(b.x), acc);
    acc = fmaf(lo_bf(a.y), lo_bf(b.y), acc);
    acc = fmaf(hi_bf(a.y), hi_bf(b.y), acc);
    acc = fmaf(lo_bf(a.z), lo_bf(b.z), acc);
    acc = fmaf(hi_bf(a.z), hi_bf(b.z), acc);
    acc = fmaf(lo_bf(a.w), lo_bf(b.w), acc);
    acc = fmaf(hi_bf(a.w), hi_bf(b.w), acc);
    return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the sum.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    float r = total;
    __syncthreads();
    return r;
}

// The slot of token `t` of a sequence whose block-table row is `table`.
__device__ __forceinline__ u64 paged_slot(const u32* table, u32 page, u32 t) {
    return (u64)table[t / page] * page + (t % page);
}

// Programmatic dependent launch (sm_90). A grid launched with the host's programmatic
// serialisation attribute may start before the grid before it ends; `pdl_wait` blocks until
// that grid has finished and its writes are visible, so every kernel calls it before it reads
// anything an earlier kernel of the step wrote, and before it writes anything (a kernel reads
// only weights before it: they are never written during a step). Since each grid waits for the
// one before it, finishing implies every earlier grid finished too. `pdl_trigger` lets the next
// grid launch once every block of this one has called it. Both are no-ops for a grid launched
// without the attribute, and compiled out below sm_90.
//
// Reads of step-written data through `__ldg` or `const __restrict__` pointers compile to the
// non-coherent `ld.global.nc`. They stay correct under programmatic launch because they come
// after `pdl_wait` in program order, and `griddepcontrol.wait` makes the prerequisite grids'
// writes visible to this grid before it returns. The volatile asm with a memory clobber keeps
// the compiler from moving them above it. The PTX NVRTC 13.0 emits for sm_90 was read to
// confirm this: every such load follows the wait, and only the GEMV's weight loads come
// before it.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Starts fetching the line holding `p` into L2 (no register, no wait).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
