// Test harness, not shipped: runs attention.cu's kernels on CPU threads.
//
// tests/test_workers_gpu_emulation.py includes this header and then attention.cu in one
// C++20 translation unit, compiled with g++ into a shared library. Every CUDA
// thread of a block is a std::thread; __syncthreads is a barrier over the block,
// warp shuffles and mma.sync exchange registers through per-warp buffers and
// barriers over the warp. Blocks run one after another, each on shared memory
// poisoned with 0xFF bytes (NaN floats), so a read of shared memory that the
// kernel never wrote shows up in the results. What this cannot check: timing,
// memory coalescing, bank conflicts, and whether the mma fragment layout below
// (from the PTX ISA) is the hardware's; that needs a GPU (docs/GPU.md).
#pragma once

#define SK_HOST_EMULATION 1

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n)

struct sk_dim3 {
  unsigned x, y, z;
};
inline thread_local sk_dim3 threadIdx, blockIdx, blockDim, gridDim;

struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline int min(int a, int b) { return a < b ? a : b; }
[[noreturn]] inline void __trap() { std::abort(); }

// The one block of shared memory (blocks run one at a time).
constexpr unsigned SK_EMU_SMEM = 256 * 1024;
alignas(64) unsigned char smem[SK_EMU_SMEM];

namespace sk_emu {
inline unsigned dynamic_smem = 0;
inline std::barrier<>* block_barrier = nullptr;
inline std::vector<std::barrier<>*> warp_barriers;
inline int or_flag[2] = {0, 0};
inline thread_local int or_parity = 0;
inline float shuffle_buf[32][32];           // [warp][lane]
inline unsigned mma_a[32][32][4], mma_b[32][32][2];  // [warp][lane][register]

inline void warp_sync() { warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }
}  // namespace sk_emu

inline void __syncthreads() { sk_emu::block_barrier->arrive_and_wait(); }

inline int __syncthreads_or(int pred) {
  // Two flags used alternately: after the first barrier every thread has left the
  // previous call, so the other flag can be cleared for the next one.
  const int slot = sk_emu::or_parity;
  sk_emu::or_parity ^= 1;
  if (pred) __atomic_store_n(&sk_emu::or_flag[slot], 1, __ATOMIC_SEQ_CST);
  __syncthreads();
  const int any = __atomic_load_n(&sk_emu::or_flag[slot], __ATOMIC_SEQ_CST);
  if (threadIdx.x == 0) __atomic_store_n(&sk_emu::or_flag[slot ^ 1], 0, __ATOMIC_SEQ_CST);
  __syncthreads();
  return any;
}

inline float __shfl_xor_sync(unsigned, float x, int mask) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  sk_emu::shuffle_buf[w][lane] = x;
  sk_emu::warp_sync();
  const float y = sk_emu::shuffle_buf[w][lane ^ mask];
  sk_emu::warp_sync();
  return y;
}

inline float sk_f16_to_float(unsigned short h) {
  const unsigned sign = h >> 15, e = (h >> 10) & 0x1f, man = h & 0x3ff;
  float v;
  if (e == 0) {
    v = std::ldexp((float)man, -24);  // zero or subnormal
  } else if (e == 31) {
    v = man ? NAN : INFINITY;
  } else {
    v = std::ldexp((float)(man | 0x400), (int)e - 25);
  }
  return sign ? -v : v;
}

inline unsigned sk_dynamic_smem() { return sk_emu::dynamic_smem; }

// mma.sync.m16n8k16 (row.col, f32 accumulate) by its PTX ISA fragment layout:
// lane = 4 * group + t; a0: A[group][2t, 2t+1], a1: A[group+8][2t, 2t+1],
// a2: A[group][2t+8, 2t+9], a3: A[group+8][2t+8, 2t+9]; b0: B[2t, 2t+1][group],
// b1: B[2t+8, 2t+9][group]; c0, c1: C[group][2t, 2t+1], c2, c3: C[group+8][2t, 2t+1].
template <int FMT>
inline void sk_mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
  auto widen = [](unsigned short x) {
    return FMT == 1 ? __uint_as_float((unsigned)x << 16) : sk_f16_to_float(x);  // 1: FMT_BF16
  };
  unsigned* ra = sk_emu::mma_a[w][lane];
  ra[0] = a0, ra[1] = a1, ra[2] = a2, ra[3] = a3;
  sk_emu::mma_b[w][lane][0] = b0, sk_emu::mma_b[w][lane][1] = b1;
  sk_emu::warp_sync();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int gr = l >> 2, t = l & 3;
    const unsigned* a = sk_emu::mma_a[w][l];
    const unsigned* b = sk_emu::mma_b[w][l];
    for (int h = 0; h < 2; ++h) {  // h: low (0) or high (1) half of a register
      const auto part = [h](unsigned r) { return (unsigned short)(h ? r >> 16 : r & 0xffffu); };
      A[gr][2 * t + h] = widen(part(a[0]));
      A[gr + 8][2 * t + h] = widen(part(a[1]));
      A[gr][2 * t + 8 + h] = widen(part(a[2]));
      A[gr + 8][2 * t + 8 + h] = widen(part(a[3]));
      B[2 * t + h][gr] = widen(part(b[0]));
      B[2 * t + 8 + h][gr] = widen(part(b[1]));
    }
  }
  sk_emu::warp_sync();
  const int gr = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = gr + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
    float s = c[i];
    for (int kk = 0; kk < 16; ++kk) s += A[row][kk] * B[kk][col];
    c[i] = s;
  }
}

namespace sk_emu {
// Run body() as every thread of every block of the grid, blocks in order.
template <class Body>
void launch(Body body, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned smem_bytes) {
  if (smem_bytes > SK_EMU_SMEM || bx % 32 != 0 || bx / 32 > 32) std::abort();
  dynamic_smem = smem_bytes;
  std::barrier<> block(bx);
  block_barrier = &block;
  std::vector<std::barrier<>*> warps;
  for (unsigned w = 0; w < bx / 32; ++w) warps.push_back(new std::barrier<>(32));
  warp_barriers = warps;
  or_flag[0] = or_flag[1] = 0;
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < bx; ++t) {
    threads.emplace_back([&, t] {
      threadIdx = {t, 0, 0};
      blockDim = {bx, 1, 1};
      gridDim = {gx, gy, gz};
      or_parity = 0;
      for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
          for (unsigned x = 0; x < gx; ++x) {
            blockIdx = {x, y, z};
            if (t == 0) std::memset(smem, 0xff, SK_EMU_SMEM);  // poison: unwritten reads give NaN
            __syncthreads();
            body();
            __syncthreads();
          }
    });
  }
  for (auto& th : threads) th.join();
  for (auto* b : warps) delete b;
}

// Call kernel(args...) with argv[i] pointing at argument i, as cuLaunchKernel takes them.
template <class... A, std::size_t... I>
void call(void (*kernel)(A...), void** argv, std::index_sequence<I...>) {
  kernel(*static_cast<std::remove_reference_t<A>*>(argv[I])...);
}
template <class... A>
void call(void (*kernel)(A...), void** argv) {
  call(kernel, argv, std::index_sequence_for<A...>{});
}
}  // namespace sk_emu
