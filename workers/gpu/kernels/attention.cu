// Fused split-key attention kernels for workers/gpu/backend.py.
//
// The math is README.md, "The math"; the design (launch shapes, partition plan,
// combine order, precision) is docs/GPU.md. Two kernels:
//
// * attend_chunks<FMT, D, DV, ROWS, DMAJOR, MMA>: block (chunk c, kv head h,
//   row tile z) streams keys [c * chunk_keys, (c + 1) * chunk_keys) of head h in
//   tiles of KEY_TILE keys for ROWS query rows and writes that chunk's state
//   (m, l, acc) with natural-log m. ROWS <= 32 is the split-K decode kernel
//   (CUDA-core dot products); ROWS = 64 is the tiled prefill kernel (q.k on
//   tensor cores through mma.sync for 16-bit inputs when MMA = 1).
// * combine_chunks: merges the chunk states of every (head, row) in chunk order
//   (merge.merge_group's order) and writes the contract layout [n_q, h_q, ...].
//
// Header-free on purpose: NVRTC (CuPy RawModule) compiles this with no include
// path, so float16/bfloat16 are raw 16-bit storage widened by cvt.f32.f16 or a
// shift, and tensor cores are reached through inline PTX (sm_80 or newer).
//
// Row space (workers/rows.py prepare_rows): row r of kv head h is query r / g and
// query head h * g + r % g, for r < n_rows = n_q * g.

typedef long long i64;

// Must match THREADS and KEY_TILE in workers/gpu/plan.py.
constexpr int THREADS = 128;  // threads per block: 4 warps
constexpr int WARPS = THREADS / 32;
constexpr int KEY_TILE = 64;  // keys per tile inside a block

// Must match FORMATS in workers/gpu/launch.py.
enum { FMT_F16 = 0, FMT_BF16 = 1, FMT_F32 = 2 };

__host__ __device__ constexpr unsigned sk_align16(unsigned x) { return (x + 15u) & ~15u; }

// ---------------------------------------------------------------- device intrinsics

// The only inline PTX. workers/gpu/kernels/cpu_emulation.hpp defines SK_HOST_EMULATION and
// supplies CPU versions of these three, so that tests/test_workers_gpu_emulation.py can run
// the kernels below on CPU threads.
#ifndef SK_HOST_EMULATION
__device__ __forceinline__ float sk_f16_to_float(unsigned short x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
}

// Bytes of dynamic shared memory this launch was given.
__device__ __forceinline__ unsigned sk_dynamic_smem() {
  unsigned x;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(x));
  return x;
}

// c += A B for one m16n8k16 tile (warp-wide): A row-major 16x16 in a0..a3, B
// column-major 16x8 in b0, b1, f32 accumulators c[4]; fragment layouts as in the
// PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type".
template <int FMT>
__device__ __forceinline__ void sk_mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                       unsigned b1) {
  if constexpr (FMT == FMT_BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}
#endif  // SK_HOST_EMULATION

// ---------------------------------------------------------------- formats

// 16-bit storage: float16 (BF = false) or bfloat16 (BF = true), widened exactly.
template <bool BF>
struct Bits16 {
  typedef unsigned short T;
  static constexpr int VEC = 8;  // elements per 16-byte vector
  static __device__ __forceinline__ float widen(unsigned short x) {
    if constexpr (BF) {
      return __uint_as_float(((unsigned)x) << 16);  // bfloat16 = top half of a float32
    } else {
      return sk_f16_to_float(x);
    }
  }
  static __device__ __forceinline__ void widen2(unsigned w, float* o) {
    o[0] = widen((unsigned short)(w & 0xffffu));  // little-endian: lower address in the low half
    o[1] = widen((unsigned short)(w >> 16));
  }
  static __device__ __forceinline__ void load4(const T* p, float* o) {  // 8-byte aligned
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    widen2(w.x, o);
    widen2(w.y, o + 2);
  }
  static __device__ __forceinline__ void load_vec(const T* p, float* o) {  // 16-byte aligned
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    widen2(w.x, o);
    widen2(w.y, o + 2);
    widen2(w.z, o + 4);
    widen2(w.w, o + 6);
  }
};

template <int FMT>
struct Fmt;
template <>
struct Fmt<FMT_F16> : Bits16<false> {};
template <>
struct Fmt<FMT_BF16> : Bits16<true> {};
template <>
struct Fmt<FMT_F32> {
  typedef float T;
  static constexpr int VEC = 4;
  static __device__ __forceinline__ float widen(float x) { return x; }
  static __device__ __forceinline__ void load4(const T* p, float* o) {  // 16-byte aligned
    const float4 w = *reinterpret_cast<const float4*>(p);
    o[0] = w.x, o[1] = w.y, o[2] = w.z, o[3] = w.w;
  }
  static __device__ __forceinline__ void load_vec(const T* p, float* o) { load4(p, o); }
};

// ---------------------------------------------------------------- shared memory

// Byte layout of attend_chunks' dynamic shared memory; mirrored by
// KernelKey.shared_bytes in workers/gpu/launch.py (tests/test_workers_gpu_compile.py
// checks that the two agree). Leading dimensions are padded by one 16-byte
// vector so that rows fall in different banks.
template <int FMT, int D, int DV, int ROWS, int DMAJOR, int MMA>
struct Layout {
  typedef typename Fmt<FMT>::T T;
  static constexpr int ESZ = (int)sizeof(T);
  static constexpr int VEC = 16 / ESZ;
  static constexpr int K_ROWS = DMAJOR ? D : KEY_TILE;     // k tile: [KEY_TILE][K_LD] or d-major [D][K_LD]
  static constexpr int K_LD = DMAJOR ? KEY_TILE + VEC : D + VEC;
  static constexpr int V_LD = DV + VEC;                    // v tile: [KEY_TILE][V_LD]
  static constexpr int Q_LD = MMA ? D + VEC : D;           // q tile: raw [ROWS][Q_LD] (MMA) or float [ROWS][D]
  static constexpr int Q_ESZ = MMA ? ESZ : 4;
  static constexpr int S_LD = KEY_TILE + 4;                // scores, then p: float [ROWS][S_LD]
  static constexpr unsigned K_OFF = 0;
  static constexpr unsigned V_OFF = K_OFF + sk_align16(K_ROWS * K_LD * ESZ);
  static constexpr unsigned Q_OFF = V_OFF + sk_align16(KEY_TILE * V_LD * ESZ);
  static constexpr unsigned S_OFF = Q_OFF + sk_align16(ROWS * Q_LD * Q_ESZ);
  static constexpr unsigned ROW_OFF = S_OFF + sk_align16(ROWS * S_LD * 4);  // float m, l, alpha, slope [ROWS] each
  static constexpr unsigned QPOS_OFF = ROW_OFF + sk_align16(4 * ROWS * 4);  // i64 [ROWS]
  static constexpr unsigned KPOS_OFF = QPOS_OFF + sk_align16(ROWS * 8);     // i64 [KEY_TILE]
  static constexpr unsigned BYTES = KPOS_OFF + sk_align16(KEY_TILE * 8);
};

// ---------------------------------------------------------------- small helpers

__device__ __forceinline__ float sk_neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float sk_warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float sk_warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ unsigned sk_ld32(const unsigned short* p) {  // 4-byte aligned pair
  return *reinterpret_cast<const unsigned*>(p);
}

__device__ __forceinline__ unsigned sk_pack(unsigned short lo, unsigned short hi) {
  return (unsigned)lo | ((unsigned)hi << 16);
}

// ---------------------------------------------------------------- tile loads

// dst[r * LD + c] = src[r * sn + c] for r < n, zeros for n <= r < KEY_TILE (c < W, unit stride in c).
// vec: src and sn allow 16-byte vectors (checked by the launcher).
template <typename T, int W, int LD>
__device__ __forceinline__ void sk_load_rows(T* dst, const T* __restrict__ src, i64 sn, int n, int vec) {
  constexpr int VEC = 16 / (int)sizeof(T);
  if (vec) {
    constexpr int NV = W / VEC;
    constexpr int TOTAL = KEY_TILE * NV;  // 16-byte vectors in the tile
    constexpr int ITERS = (TOTAL + THREADS - 1) / THREADS;
    constexpr int BATCH = 8;  // loads in flight per thread before their stores
#pragma unroll
    for (int i0 = 0; i0 < ITERS; i0 += BATCH) {
      uint4 x[BATCH];
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        const int e = threadIdx.x + (i0 + i) * THREADS, r = e / NV, c = (e % NV) * VEC;
        x[i] = make_uint4(0u, 0u, 0u, 0u);
        if (i0 + i < ITERS && e < TOTAL && r < n) x[i] = *reinterpret_cast<const uint4*>(src + r * sn + c);
      }
#pragma unroll
      for (int i = 0; i < BATCH; ++i) {
        const int e = threadIdx.x + (i0 + i) * THREADS, r = e / NV, c = (e % NV) * VEC;
        if (i0 + i < ITERS && e < TOTAL) *reinterpret_cast<uint4*>(dst + r * LD + c) = x[i];
      }
    }
  } else {
    for (int e = threadIdx.x; e < KEY_TILE * W; e += THREADS) {
      const int r = e / W, c = e % W;
      dst[r * LD + c] = r < n ? src[r * sn + c] : T(0);
    }
  }
}

// d-major keys: dst[c * LD + j] = src[c * sd + j] for j < n, zeros for n <= j < KEY_TILE (c < D).
template <typename T, int D, int LD>
__device__ __forceinline__ void sk_load_dmajor(T* dst, const T* __restrict__ src, i64 sd, int n, int vec) {
  constexpr int VEC = 16 / (int)sizeof(T);
  constexpr int NV = KEY_TILE / VEC;
  for (int e = threadIdx.x; e < D * NV; e += THREADS) {
    const int c = e / NV, j = (e % NV) * VEC;
    const T* s = src + c * sd + j;
    T* o = dst + c * LD + j;
    if (vec && j + VEC <= n) {
      *reinterpret_cast<uint4*>(o) = *reinterpret_cast<const uint4*>(s);
    } else {
#pragma unroll
      for (int u = 0; u < VEC; ++u) o[u] = j + u < n ? s[u] : T(0);
    }
  }
}

// ---------------------------------------------------------------- scores

// README "The math", Scores: the score of tile row r and tile key j from the raw q.k.
struct SkScore {
  float factor;  // scale, or scale / softcap when capped
  float softcap;
  int has_softcap, has_alibi, has_left, has_right;
  i64 left, right;
  const i64* qp;       // [ROWS] query position per row
  const i64* kp;       // [KEY_TILE] key position per tile key
  const float* slope;  // [ROWS] ALiBi slope per row
  int nr, nt;          // active rows of the block, keys of the tile

  __device__ __forceinline__ float operator()(float dot, int r, int j) const {
    if (r >= nr || j >= nt) return sk_neg_inf();
    const i64 diff = qp[r] - kp[j];  // q_pos - k_pos
    if ((has_left && diff > left) || (has_right && -diff > right)) return sk_neg_inf();
    float s = dot * factor;
    if (has_softcap) s = softcap * tanhf(s);
    if (has_alibi) s -= slope[r] * (float)(diff < 0 ? -diff : diff);
    return s;
  }
};

// CUDA cores: thread (j = tid % KEY_TILE, group rg = tid / KEY_TILE) computes key j
// against rows rg, rg + RG, ...; q_f is float [ROWS][D].
template <int FMT, int D, int ROWS, int DMAJOR, int K_LD, int S_LD>
__device__ __forceinline__ void sk_scores_fma(const typename Fmt<FMT>::T* k_s, const float* q_f, float* s_s,
                                              const SkScore& score) {
  typedef Fmt<FMT> F;
  constexpr int RG = THREADS / KEY_TILE;
  constexpr int RPT = ROWS / RG;
  const int j = threadIdx.x % KEY_TILE, rg = threadIdx.x / KEY_TILE;
  float dot[RPT];
#pragma unroll
  for (int i = 0; i < RPT; ++i) dot[i] = 0.f;
  for (int c = 0; c < D; c += F::VEC) {
    float kf[F::VEC];
    if constexpr (DMAJOR) {
#pragma unroll
      for (int u = 0; u < F::VEC; ++u) kf[u] = F::widen(k_s[(c + u) * K_LD + j]);
    } else {
      F::load_vec(k_s + j * K_LD + c, kf);
    }
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      const float* qr = q_f + (rg + RG * i) * D + c;
#pragma unroll
      for (int u = 0; u < F::VEC; u += 4) {
        const float4 qv = *reinterpret_cast<const float4*>(qr + u);
        dot[i] += qv.x * kf[u] + qv.y * kf[u + 1] + qv.z * kf[u + 2] + qv.w * kf[u + 3];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < RPT; ++i) {
    const int r = rg + RG * i;
    s_s[r * S_LD + j] = score(dot[i], r, j);
  }
}

// Tensor cores: warp w computes rows [16 w, 16 w + 16) x all KEY_TILE keys with
// m16n8k16 mma (exact 16-bit products, float32 accumulation); q_t is raw [ROWS][Q_LD].
template <int FMT, int D, int DMAJOR, int K_LD, int Q_LD, int S_LD>
__device__ __forceinline__ void sk_scores_mma(const unsigned short* k_s, const unsigned short* q_t, float* s_s,
                                              const SkScore& score) {
  constexpr int NT8 = KEY_TILE / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gid = lane >> 2, tig = lane & 3;  // fragment row group, thread in group (PTX ISA, mma.m16n8k16)
  float c[NT8][4];
#pragma unroll
  for (int n = 0; n < NT8; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.f;
  const unsigned short* qw = q_t + warp * 16 * Q_LD;
  for (int kk = 0; kk < D; kk += 16) {
    const unsigned a0 = sk_ld32(qw + gid * Q_LD + kk + tig * 2);
    const unsigned a1 = sk_ld32(qw + (gid + 8) * Q_LD + kk + tig * 2);
    const unsigned a2 = sk_ld32(qw + gid * Q_LD + kk + 8 + tig * 2);
    const unsigned a3 = sk_ld32(qw + (gid + 8) * Q_LD + kk + 8 + tig * 2);
#pragma unroll
    for (int n = 0; n < NT8; ++n) {
      const int key = n * 8 + gid;  // B[k][n] = K[key][dim]
      unsigned b0, b1;
      if constexpr (DMAJOR) {
        b0 = sk_pack(k_s[(kk + tig * 2) * K_LD + key], k_s[(kk + tig * 2 + 1) * K_LD + key]);
        b1 = sk_pack(k_s[(kk + tig * 2 + 8) * K_LD + key], k_s[(kk + tig * 2 + 9) * K_LD + key]);
      } else {
        b0 = sk_ld32(k_s + key * K_LD + kk + tig * 2);
        b1 = sk_ld32(k_s + key * K_LD + kk + tig * 2 + 8);
      }
      sk_mma<FMT>(c[n], a0, a1, a2, a3, b0, b1);
    }
  }
  const int row = warp * 16 + gid;
#pragma unroll
  for (int n = 0; n < NT8; ++n) {
    const int col = n * 8 + tig * 2;
    s_s[row * S_LD + col] = score(c[n][0], row, col);
    s_s[row * S_LD + col + 1] = score(c[n][1], row, col + 1);
    s_s[(row + 8) * S_LD + col] = score(c[n][2], row + 8, col);
    s_s[(row + 8) * S_LD + col + 1] = score(c[n][3], row + 8, col + 1);
  }
}

// ---------------------------------------------------------------- the chunk kernel

// Grid (n_chunks, h_kv, row tiles), THREADS threads, Layout::BYTES of dynamic shared memory.
// Strides are in elements. k: natural [n_k, h_kv, D] (k_stride = between keys, unit
// stride in d) or d-major [h_kv, D, n_k] (k_stride = between dims, unit stride in keys);
// v: [.., d_v] with unit stride in d_v. Outputs: m, l [n_chunks, h_kv, n_rows],
// acc [n_chunks, h_kv, n_rows, DV], float32.
template <int FMT, int D, int DV, int ROWS, int DMAJOR, int MMA>
__global__ void __launch_bounds__(THREADS)
    attend_chunks(const typename Fmt<FMT>::T* __restrict__ q, i64 q_sn, i64 q_sh,
                  const typename Fmt<FMT>::T* __restrict__ k, i64 k_sh, i64 k_stride, int k_vec,
                  const typename Fmt<FMT>::T* __restrict__ v, i64 v_sh, i64 v_sn, int v_vec,
                  const i64* __restrict__ q_pos, const i64* __restrict__ k_pos, int k_pos_given, i64 k_pos_start,
                  const float* __restrict__ slopes, int has_alibi, float factor, int has_softcap, float softcap,
                  int has_left, i64 left, int has_right, i64 right, int n_q, int g, i64 n_k, i64 chunk_keys,
                  float* __restrict__ m_out, float* __restrict__ l_out, float* __restrict__ acc_out) {
  typedef Fmt<FMT> F;
  typedef typename F::T T;
  typedef Layout<FMT, D, DV, ROWS, DMAJOR, MMA> L;
  static_assert(KEY_TILE == 64, "the softmax step gives each lane two keys of a tile");
  static_assert(D % F::VEC == 0 && DV % F::VEC == 0, "head dims must be whole 16-byte vectors");
  static_assert(ROWS % (THREADS / KEY_TILE) == 0, "rows must split evenly over the row groups");
  static_assert(!MMA || (FMT != FMT_F32 && ROWS == 16 * WARPS && D % 16 == 0), "mma needs 16-bit, 64 rows, d % 16");

  extern __shared__ __align__(16) unsigned char smem[];
  if (sk_dynamic_smem() < L::BYTES) __trap();  // launcher and Layout disagree: fail loudly, never read past
  T* k_s = reinterpret_cast<T*>(smem + L::K_OFF);
  T* v_s = reinterpret_cast<T*>(smem + L::V_OFF);
  T* q_t = reinterpret_cast<T*>(smem + L::Q_OFF);          // MMA: raw q rows
  float* q_f = reinterpret_cast<float*>(smem + L::Q_OFF);  // otherwise: widened q rows
  float* s_s = reinterpret_cast<float*>(smem + L::S_OFF);
  float* m_s = reinterpret_cast<float*>(smem + L::ROW_OFF);
  float* l_s = m_s + ROWS;
  float* a_s = l_s + ROWS;  // alpha: rescale of the old state by the current tile
  float* sl_s = a_s + ROWS;
  i64* qp_s = reinterpret_cast<i64*>(smem + L::QPOS_OFF);
  i64* kp_s = reinterpret_cast<i64*>(smem + L::KPOS_OFF);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int h = blockIdx.y, h_kv = gridDim.y;
  const int n_rows = n_q * g;
  const int r0 = blockIdx.z * ROWS;
  const int nr = min(ROWS, n_rows - r0);  // active rows (>= 1: the grid has ceil(n_rows / ROWS) row tiles)
  const i64 c0 = (i64)blockIdx.x * chunk_keys;
  const i64 c1 = c0 + chunk_keys < n_k ? c0 + chunk_keys : n_k;

  for (int r = tid; r < ROWS; r += THREADS) {
    const int row = r0 + r;
    const bool on = r < nr;
    qp_s[r] = on ? q_pos[row / g] : 0;
    sl_s[r] = (on && has_alibi) ? slopes[h * g + row % g] : 0.f;
    m_s[r] = sk_neg_inf();
    l_s[r] = 0.f;
    a_s[r] = 1.f;
  }
  for (int e = tid; e < ROWS * D; e += THREADS) {
    const int r = e / D, c = e % D, row = r0 + r;
    T x = T(0);
    if (r < nr) x = q[(i64)(row / g) * q_sn + (i64)(h * g + row % g) * q_sh + c];
    if constexpr (MMA) {
      q_t[r * L::Q_LD + c] = x;
    } else {
      q_f[r * D + c] = F::widen(x);
    }
  }
  __syncthreads();
  // Bounds of the rows' positions, for the conservative tile skip below.
  i64 qp_lo = qp_s[0], qp_hi = qp_s[0];
  for (int r = 1; r < nr; ++r) {
    qp_lo = qp_s[r] < qp_lo ? qp_s[r] : qp_lo;
    qp_hi = qp_s[r] > qp_hi ? qp_s[r] : qp_hi;
  }
  const SkScore score{factor, softcap, has_softcap, has_alibi, has_left, has_right, left, right,
                      qp_s, kp_s, sl_s, nr, 0};

  // Thread-owned accumulators: pair e = tid + THREADS * p is (row e / NQ, columns 4 (e % NQ) .. +3).
  constexpr int NQ = DV / 4;
  constexpr int PAIRS = ROWS * NQ;
  constexpr int PER = (PAIRS + THREADS - 1) / THREADS;
  float acc[PER][4];
#pragma unroll
  for (int p = 0; p < PER; ++p) acc[p][0] = acc[p][1] = acc[p][2] = acc[p][3] = 0.f;

  // Invariant after each tile, for every active row r, over the keys J of this
  // chunk seen so far that row r may see: m_s[r] = max_J s (-inf while J is
  // empty), l_s[r] = sum_J exp(s - m_s[r]), acc[r] = sum_J exp(s - m_s[r]) v.
  for (i64 t0 = c0; t0 < c1; t0 += KEY_TILE) {
    const int nt = (int)(c1 - t0 < KEY_TILE ? c1 - t0 : KEY_TILE);
    // (1) key positions; skip the tile when no row can see any of its keys.
    int any = 0;
    if (tid < nt) {
      const i64 kp = k_pos_given ? k_pos[t0 + tid] : k_pos_start + t0 + tid;
      kp_s[tid] = kp;
      any = (!has_left || kp >= qp_lo - left) && (!has_right || kp <= qp_hi + right);
    }
    if (!__syncthreads_or(any)) continue;  // the state is unchanged
    // (2) k and v tiles into shared memory, zeros past the chunk's end.
    if constexpr (DMAJOR) {
      sk_load_dmajor<T, D, L::K_LD>(k_s, k + h * k_sh + t0, k_stride, nt, k_vec);
    } else {
      sk_load_rows<T, D, L::K_LD>(k_s, k + h * k_sh + t0 * k_stride, k_stride, nt, k_vec);
    }
    sk_load_rows<T, DV, L::V_LD>(v_s, v + h * v_sh + t0 * v_sn, v_sn, nt, v_vec);
    __syncthreads();
    // (3) scores [ROWS][KEY_TILE]: -inf for masked pairs, inactive rows and keys past the end.
    SkScore sc = score;
    sc.nt = nt;
    if constexpr (MMA) {
      sk_scores_mma<FMT, D, DMAJOR, L::K_LD, L::Q_LD, L::S_LD>(k_s, q_t, s_s, sc);
    } else {
      sk_scores_fma<FMT, D, ROWS, DMAJOR, L::K_LD, L::S_LD>(k_s, q_f, s_s, sc);
    }
    __syncthreads();
    // (4) online softmax, one warp per row: the new max, p = exp(s - m_new) in place, alpha.
    for (int r = warp; r < nr; r += WARPS) {
      float* sr = s_s + r * L::S_LD;
      const float x0 = sr[lane], x1 = sr[lane + 32];
      const float m_old = m_s[r];
      const float m_new = fmaxf(m_old, sk_warp_max(fmaxf(x0, x1)));
      // Guard: a row with no visible key yet has m_new = -inf; measure against 0
      // so that exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
      const float m_ref = m_new == sk_neg_inf() ? 0.f : m_new;
      const float p0 = expf(x0 - m_ref), p1 = expf(x1 - m_ref);
      sr[lane] = p0;
      sr[lane + 32] = p1;
      const float psum = sk_warp_sum(p0 + p1);
      if (lane == 0) {
        const float alpha = expf(m_old - m_ref);  // 0 while the state was empty, 1 if the max held
        l_s[r] = l_s[r] * alpha + psum;
        m_s[r] = m_new;
        a_s[r] = alpha;
      }
    }
    __syncthreads();
    // (5) acc = acc * alpha + p v.
#pragma unroll
    for (int p = 0; p < PER; ++p) {
      const int e = tid + THREADS * p;
      if (e < PAIRS && e / NQ < nr) {
        const int r = e / NQ, cq = (e % NQ) * 4;
        const float alpha = a_s[r];
        acc[p][0] *= alpha, acc[p][1] *= alpha, acc[p][2] *= alpha, acc[p][3] *= alpha;
        const float* pr = s_s + r * L::S_LD;
#pragma unroll 4
        for (int j = 0; j < KEY_TILE; j += 4) {
          const float4 pj = *reinterpret_cast<const float4*>(pr + j);
          const float pw[4] = {pj.x, pj.y, pj.z, pj.w};
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            float vf[4];
            F::load4(v_s + (j + u) * L::V_LD + cq, vf);
            acc[p][0] += pw[u] * vf[0];
            acc[p][1] += pw[u] * vf[1];
            acc[p][2] += pw[u] * vf[2];
            acc[p][3] += pw[u] * vf[3];
          }
        }
      }
    }
    // The invariant holds for the keys [c0, t0 + nt).
  }
  __syncthreads();

  // (6) this chunk's state.
  const i64 base = ((i64)blockIdx.x * h_kv + h) * n_rows + r0;  // (chunk, head, row r0)
  for (int r = tid; r < nr; r += THREADS) {
    m_out[base + r] = m_s[r];
    l_out[base + r] = l_s[r];
  }
#pragma unroll
  for (int p = 0; p < PER; ++p) {
    const int e = tid + THREADS * p;
    if (e < PAIRS && e / NQ < nr) {
      const int r = e / NQ, cq = (e % NQ) * 4;
      *reinterpret_cast<float4*>(acc_out + (base + r) * DV + cq) = make_float4(acc[p][0], acc[p][1], acc[p][2], acc[p][3]);
    }
  }
}

// ---------------------------------------------------------------- combine

// Grid (n_rows, h_kv), any block size. Merges the n_chunks states of (head h, row r)
// as merge.merge_group does, in chunk order: m = max_c m_c, then l and acc summed
// over c = 0, 1, ... of l_c exp(m_c - m) and acc_c exp(m_c - m) (m taken as 0 when
// every chunk is empty). Writes m, l [n_q, h_q] and acc [n_q, h_q, dv].
extern "C" __global__ void __launch_bounds__(THREADS)
    combine_chunks(const float* __restrict__ m_c, const float* __restrict__ l_c, const float* __restrict__ acc_c,
                   int n_chunks, int n_rows, int g, int dv, float* __restrict__ m, float* __restrict__ l,
                   float* __restrict__ acc) {
  const int r = blockIdx.x, h = blockIdx.y, h_kv = gridDim.y;
  const i64 stride = (i64)h_kv * n_rows;                                    // between chunks
  const i64 first = (i64)h * n_rows + r;                                    // (chunk 0, head h, row r)
  const i64 out = (i64)(r / g) * h_kv * g + (i64)h * g + r % g;            // (query r / g, head h g + r % g)
  float mx = sk_neg_inf();
  for (int c = 0; c < n_chunks; ++c) mx = fmaxf(mx, m_c[first + c * stride]);
  const float m_ref = mx == sk_neg_inf() ? 0.f : mx;  // guard, as in merge.merge_group
  for (int col = threadIdx.x; col < dv; col += blockDim.x) {
    float a = 0.f;
    for (int c = 0; c < n_chunks; ++c) {
      const i64 i = first + c * stride;
      a += acc_c[i * dv + col] * expf(m_c[i] - m_ref);
    }
    acc[out * dv + col] = a;
  }
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int c = 0; c < n_chunks; ++c) {
      const i64 i = first + c * stride;
      s += l_c[i] * expf(m_c[i] - m_ref);
    }
    m[out] = mx;
    l[out] = s;
  }
}
