// Random weights generated on the GPU, and the read-bandwidth probe.

// SplitMix64 of `x`: the per-element random stream (index-addressed, so any launch shape
// gives the same values).
__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Uniform in [-1, 1) from the top 24 bits of the element's hash.
__device__ __forceinline__ float uniform_pm1(u64 seed, u64 i) {
    return (float)(splitmix64(seed ^ (i * 0xd1b54a32d192ed03ull)) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

// p[i] = bf16(offset + scale * u_i), grid-stride.
extern "C" __global__ void fill_random_bf16(bf16* __restrict__ p, u64 n, u64 seed, float offset,
                                            float scale) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        p[i] = f2bf(offset + scale * uniform_pm1(seed, i));
}

// p[i] = offset + scale * u_i, grid-stride.
extern "C" __global__ void fill_random_f32(float* __restrict__ p, u64 n, u64 seed, float offset,
                                           float scale) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        p[i] = offset + scale * uniform_pm1(seed, i);
}

// Streams n16 16-byte words once (grid-stride, 16-byte loads) and writes one XOR per block,
// so the reads cannot be optimised away: the denominator of every bandwidth ratio.
extern "C" __global__ void read_probe(const uint4* __restrict__ p, u64 n16, u32* __restrict__ sink) {
    u32 x = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (u64)gridDim.x * blockDim.x) {
        uint4 v = __ldg(p + i);
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    for (int o = 16; o > 0; o >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, o);
    if ((threadIdx.x & 31) == 0) atomicXor(sink + blockIdx.x, x);
}
