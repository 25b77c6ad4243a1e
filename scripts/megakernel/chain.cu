// Milestone 1 of docs/megakernel.md: a synthetic decode chain as ONE persistent launch.
//
// A chain of phases, each a GEMV y_p = W_p x_p (bf16 weights; x rounded to bf16 as a bf16 model feeds it; fp32
// sums and y) whose input x_p is the output of an earlier phase (plus, elementwise, a second one's), a top-k over a
// router's output, or a GEMV over the rows of the experts that top-k chose. The tiles of all phases (ordered by
// phase) are dealt round robin to one block per SM. In each block three roles walk the block's tiles in the same
// order, phase by phase:
//   - a producer warp streams the weight rows of the tiles into a ring of shared-memory slots (NSLOT x SLOT_BYTES,
//     3 x 64 KB) with bulk copies (cp.async.bulk, completion on an mbarrier). It waits for nothing but a free slot,
//     except for routed tiles, which need the chosen expert (mode SERIAL also waits until each tile's input phases
//     are done: the launch-per-phase order without launch costs);
//   - a loader warp stages each (phase, slot)'s input x in shared memory (XWORDS words; a longer x in pieces) with
//     16-byte cp.async copies from L2, polling until every word is this launch's. It runs one x ahead of the
//     consumers: it loads the next phase's x while they compute the current one, outside their barriers;
//   - CONSUMER_WARPS (16) consumer warps copy the staged x into registers (rounded to bf16), hand the stage back,
//     take each tile from the ring and write its rows of y.
// Outputs are 8-byte words {value, epoch}, written in one store: a reader polls the words it reads until they carry
// this launch's epoch, so the data is its own ready flag (no fence, no counter, one L2 round trip from the writer's
// store to the reader's use). Per-phase counters (a block adds its tile count after its last tile of the phase)
// serve only mode SERIAL and the timeline. Every wait is bounded; a wait that runs out writes what it waited for to
// err[] and the kernel stops (the host reads err after the launch).

#include <cstdint>
#include <cuda_bf16.h>

#ifndef NSLOT
#define NSLOT 3                        // ring slots per block (-DNSLOT=...)
#endif
#ifndef SLOT_BYTES
#define SLOT_BYTES 65536               // bytes per slot: the largest tile
#endif
#ifndef INFLIGHT
#define INFLIGHT 0                     // tiles the producer keeps in flight at most (0: as many as the ring holds)
#endif
#ifndef SENTINEL
#define SENTINEL 0                     // the loader polls a stale x by one pair per lane (1) or by all stale pairs (0)
#endif
#ifndef TRACE_UNITS
#define TRACE_UNITS 256                // -DTRACE: per block, the first TRACE_UNITS staged pieces' times (trace[])
#endif
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 0               // GEMV tiles past the ring the producer asks L2 to fetch (measured slower)
#endif
// -DSKIP_COMPUTE: consumers take each tile and write zeros (a diagnostic: the streaming alone)
#define XMAX 8192                      // longest x of a GEMV (staged in pieces of XWORDS, or XWORDS / 2 with a second
#define XWORDS 2048                    // input); the stage holds XWORDS 8-byte words (a top-k's x: one piece)
#define TOPK_MAX 64                    // k of a top-k at most
#ifndef CONSUMER_WARPS
#define CONSUMER_WARPS 16              // (-DCONSUMER_WARPS=...)
#endif
#ifndef STEPS
#define STEPS 4                        // 16-byte steps per thread and row, at most (even; x kept in registers)
#endif
#define CONSUMERS (32 * CONSUMER_WARPS)
#define THREADS (CONSUMERS + 64)       // + the producer warp and the loader warp
#ifndef SPIN_LIMIT
#define SPIN_LIMIT (1u << 24)          // polls before a wait gives up (-DSPIN_LIMIT=...)
#endif

enum Kind : int64_t { GEMV = 0, TOPK = 1, ROUTED = 2 };
enum Mode : int { STREAM = 0, SERIAL = 1, NODEPS = 2 };

struct Phase {                          // 16 int64 fields, built by megakernel_chain.py (`Buffers.table`)
    int64_t kind, n, k, rows, ntiles, tile0;   // tile0: index of the phase's first tile in the global order
    int64_t src;                        // phase whose y is x (-1: the external input vector)
    int64_t xlen, xstride;              // x[j] = y_src[slot * xstride + j % xlen] (+ y_dep2[j % xlen2])
    int64_t route, ne;                  // ROUTED: the TOPK phase, rows per expert; TOPK: k in `ne`
    int64_t w, y;                       // addresses: weights (bf16) and output ({fp32 value, u32 epoch} words)
    int64_t n_experts;                  // ROUTED: experts in w (ids are clamped to it)
    int64_t dep2, xlen2;                // a second input phase, added to x elementwise (-1: none)
};

struct PhaseC {                         // the table as the kernel keeps it in shared memory (72 bytes a phase)
    int64_t w, y;
    int32_t kind, n, k, rows, ntiles, tile0, src, xlen, xstride, route, ne, n_experts, dep2, xlen2;
};
__device__ __forceinline__ PhaseC compact(const Phase& f) {
    return PhaseC{f.w, f.y, (int32_t)f.kind, (int32_t)f.n, (int32_t)f.k, (int32_t)f.rows, (int32_t)f.ntiles,
                  (int32_t)f.tile0, (int32_t)f.src, (int32_t)f.xlen, (int32_t)f.xstride, (int32_t)f.route,
                  (int32_t)f.ne, (int32_t)f.n_experts, (int32_t)f.dep2, (int32_t)f.xlen2};
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ bool mbar_test(uint64_t* bar, uint32_t parity) {
    uint32_t ok;
#ifdef TEST_WAIT    // never suspends (try_wait may suspend the thread for a time limit while the phase is open)
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
#else
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
#endif
    return ok != 0;
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar,
                                          uint64_t policy) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
        ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)), "l"(policy) : "memory");
}
__device__ __forceinline__ void prefetch_l2(const void* src, uint32_t bytes, uint64_t policy) {
    asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(src), "r"(bytes), "l"(policy)
                 : "memory");
}
__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t load_word(const uint64_t* p) {      // from L2, never a stale L1 line
    uint64_t v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_word(uint64_t* p, float value, uint32_t epoch) {
    const uint64_t v = (static_cast<uint64_t>(epoch) << 32) | __float_as_uint(value);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint32_t epoch_of(uint64_t v) { return static_cast<uint32_t>(v >> 32); }
__device__ __forceinline__ float value_of(uint64_t v) { return __uint_as_float(static_cast<uint32_t>(v)); }
__device__ __forceinline__ void add_release(uint32_t* p, uint32_t v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void add_relaxed(uint32_t* p, uint32_t v) {
    asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory"); }

// err[0] = what ran out (1 an input word, 2 a filled slot, 3 a free slot, 4 the top-k's words, 5 an input
// phase's counter, 6 a free stage, 7 a staged x), err[1..3] = block, phase, tile
__device__ bool give_up(uint32_t* err, uint32_t what, int64_t phase, int64_t tile) {
    if (atomicCAS(err, 0u, what) == 0u) {
        err[1] = blockIdx.x;
        err[2] = static_cast<uint32_t>(phase);
        err[3] = static_cast<uint32_t>(tile);
    }
    return false;
}
__device__ __forceinline__ bool stopped(const uint32_t* err) { return *(volatile const uint32_t*)err != 0u; }
// Called on every poll of a wait: true once the wait must end (it ran out: recorded; or another one did).
__device__ __forceinline__ bool out_of_time(uint32_t spin, uint32_t* err, uint32_t what, int64_t phase, int64_t tile) {
    if ((spin & 1023u) != 1023u) return false;
    if (spin >= SPIN_LIMIT) {
        give_up(err, what, phase, tile);
        return true;
    }
    return stopped(err);
}

__device__ bool wait_counter(const uint32_t* counter, uint32_t target, uint32_t* err, int64_t phase, int64_t tile) {
    for (uint32_t spin = 0; load_acquire(counter) < target; ++spin)
        if (out_of_time(spin, err, 5, phase, tile)) return false;
    return true;
}
__device__ bool wait_slot(uint64_t* bar, uint32_t parity, uint32_t* err, uint32_t what, int64_t phase, int64_t tile) {
    for (uint32_t spin = 0; !mbar_test(bar, parity); ++spin)
        if (out_of_time(spin, err, what, phase, tile)) return false;
    return true;
}
// The word at p once it carries `epoch` (any word if !wait). false: gave up.
__device__ __forceinline__ bool poll_word(const uint64_t* p, uint64_t& v, uint32_t epoch, bool wait, uint32_t* err,
                                          uint32_t what, int64_t phase, int64_t tile) {
    for (uint32_t spin = 0; wait && epoch_of(v) != epoch; ++spin) {
        if (out_of_time(spin, err, what, phase, tile)) return false;
        v = load_word(p);
    }
    return true;
}

// Wait until phase f's input phases (src, dep2) are done in this launch (mode SERIAL's producer).
__device__ bool wait_inputs(const PhaseC* ph, const PhaseC& f, const uint32_t* counters, uint32_t epoch, uint32_t* err,
                            int64_t p, int64_t t) {
    if (f.src >= 0 && !wait_counter(counters + f.src, epoch * (uint32_t)ph[f.src].ntiles, err, p, t)) return false;
    if (f.dep2 >= 0 && !wait_counter(counters + f.dep2, epoch * (uint32_t)ph[f.dep2].ntiles, err, p, t)) return false;
    return true;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {     // L2 only (.cg): never a stale L1 line
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// One piece of an x for the loader warp: words j in [q0, q0 + n) of the input (word j at base[j % len]) go to
// st[j - q0], and, with a second input, its words to st[half + j - q0]. Lane `lane` copies the 16-byte pairs
// i = lane + 32 t (t < 32; the inputs' pairs numbered one after the other); `mask` bit t: that pair is not yet
// this launch's.
struct Piece {
    uint64_t* st;
    const uint64_t *base, *base2;
    int len, len2, q0, pairs, half;     // pairs: of the first input (the second has as many when base2)
    __device__ __forceinline__ int total() const { return base2 ? 2 * pairs : pairs; }
    __device__ __forceinline__ void copy(int i) const {
        if (i < pairs) cp_async16(st + 2 * i, base + (q0 + 2 * i) % len);
        else cp_async16(st + half + 2 * (i - pairs), base2 + (q0 + 2 * (i - pairs)) % len2);
    }
    __device__ __forceinline__ bool fresh(int i, uint32_t epoch) const {    // (after cp_async_wait: its clobber)
        const uint4 w = *reinterpret_cast<const uint4*>(i < pairs ? st + 2 * i : st + half + 2 * (i - pairs));
        return w.y == epoch && w.w == epoch;
    }
    // the bits of `mask` whose pairs (this lane's) are not this launch's; the loads unrolled, issued together
    __device__ __forceinline__ uint32_t stale(uint32_t mask, uint32_t epoch) const {
        const int lane = threadIdx.x % 32;
        uint32_t out = 0;
#pragma unroll
        for (int u = 0; u < 32; ++u)
            if ((mask >> u & 1u) && !fresh(lane + 32 * u, epoch)) out |= 1u << u;
        return out;
    }
};

// Stage a piece (the loader warp, each lane its own pairs): copy every pair, then, while some are stale (wait),
// copy the stale ones again, every round trip; or (SENTINEL) only the lane's first stale pair until it is this
// launch's, then the rest of its stale pairs at once: one 16-byte load per lane and round trip while the input is
// not there, and one more round trip once the first pair lands. false: gave up.
__device__ bool stage_piece(const Piece& pc, uint32_t epoch, bool wait, uint32_t* err, int64_t p, int64_t t) {
    const int lane = threadIdx.x % 32, total = pc.total();
    uint32_t mask = 0;
    for (int u = 0; u < 32 && lane + 32 * u < total; ++u) {
        pc.copy(lane + 32 * u);
        mask |= 1u << u;
    }
    cp_async_wait();
    for (uint32_t spin = 0; wait; ++spin) {
        mask = pc.stale(mask, epoch);
        if (!mask) break;
        if (out_of_time(spin, err, 1, p, t)) return false;
        if (!SENTINEL) {
            for (uint32_t m = mask; m; m &= m - 1) pc.copy(lane + 32 * (__ffs(m) - 1));
            cp_async_wait();
            continue;
        }
        const int u0 = __ffs(mask) - 1;
        pc.copy(lane + 32 * u0);
        cp_async_wait();
        if (pc.fresh(lane + 32 * u0, epoch)) {
            for (uint32_t m = mask & (mask - 1); m; m &= m - 1) pc.copy(lane + 32 * (__ffs(m) - 1));
            cp_async_wait();
        }
    }
    return true;
}

__device__ __forceinline__ float dot8(uint4 w, float4 a, float4 b) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
    float2 f0 = __bfloat1622float2(h[0]), f1 = __bfloat1622float2(h[1]);
    float2 f2 = __bfloat1622float2(h[2]), f3 = __bfloat1622float2(h[3]);
    return f0.x * a.x + f0.y * a.y + f1.x * a.z + f1.y * a.w + f2.x * b.x + f2.y * b.y + f3.x * b.z + f3.y * b.w;
}

// This block's first tile of phase f (tiles are dealt round robin: tile g goes to block g % gridDim.x).
__device__ __forceinline__ int64_t first_tile(const PhaseC& f, int64_t nblk) {
    return f.tile0 + ((static_cast<int64_t>(blockIdx.x) - f.tile0) % nblk + nblk) % nblk;
}

// This block's tiles in order (phase p, global tile g; p == nphase past the last), for the L2 prefetches.
struct Cursor {
    int64_t p, g;
    __device__ void settle(const PhaseC* ph, int64_t nphase, int64_t nblk) {
        while (p < nphase && g >= ph[p].tile0 + ph[p].ntiles)
            if (++p < nphase) g = first_tile(ph[p], nblk);
    }
    __device__ void next(const PhaseC* ph, int64_t nphase, int64_t nblk) {
        g += nblk;
        settle(ph, nphase, nblk);
    }
};

// The (phase, slot) units of x this block reads, in the order producer, loader and consumers walk its tiles:
// phase by phase, this block's tiles of each phase; a unit starts where a tile's x (routed: per expert slot) is
// not the previous tile's. Calls unit(p, t, slot) for each; stops early when it returns false.
template <class F>
__device__ __forceinline__ bool each_unit(const PhaseC* ph, int64_t nphase, int64_t nblk, F unit) {
    for (int64_t p = 0; p < nphase; ++p) {
        const PhaseC& f = ph[p];
        int64_t have_slot = -1;
        for (int64_t g = first_tile(f, nblk); g < f.tile0 + f.ntiles; g += nblk) {
            const int64_t t = g - f.tile0, row0 = t * f.rows;
            const int64_t slot = f.kind == ROUTED && f.xstride ? row0 / f.ne : 0;
            if (slot == have_slot) continue;
            have_slot = slot;
            if (!unit(p, t, slot)) return false;
        }
    }
    return true;
}

// x is staged in pieces of piece_len(f) words (a second input takes the stage's second half).
__device__ __forceinline__ int piece_len(const PhaseC& f) { return f.dep2 >= 0 ? XWORDS / 2 : XWORDS; }
__device__ __forceinline__ int x_len(const PhaseC& f) { return f.kind == TOPK ? f.xlen : f.k; }

// Shared memory: the ring (NSLOT x SLOT_BYTES), the x stage (XWORDS words), the phase table (nphase x 72 bytes),
// the barriers (2 x NSLOT for the ring, 2 for the stage).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
chain_kernel(const Phase* __restrict__ ph_global, int64_t nphase, const float* __restrict__ x_in,
             uint32_t* counters, uint32_t epoch, int mode, uint32_t* err, unsigned long long* t_done,
             unsigned long long* t_start, unsigned long long* trace) {
    extern __shared__ __align__(128) unsigned char smem[];
    unsigned char* ring = smem;
    uint64_t* stage = reinterpret_cast<uint64_t*>(smem + NSLOT * SLOT_BYTES);     // {fp32 value, epoch} words
    PhaseC* ph = reinterpret_cast<PhaseC*>(stage + XWORDS);
    uint64_t* full = reinterpret_cast<uint64_t*>(ph + nphase);
    uint64_t* empty = full + NSLOT;
    uint64_t* xfull = empty + NSLOT;                // the loader's arrive: a piece of x is staged
    uint64_t* xempty = xfull + 1;                   // one arrive per consumer warp: done with the staged piece
    __shared__ float red[CONSUMERS / 32];
    __shared__ int experts[TOPK_MAX];          // the producer's: the experts top-k chose
    const int tid = threadIdx.x, lane = tid % 32;
    const int64_t nblk = gridDim.x;
    const bool wait = mode != NODEPS;

    for (int64_t p = tid; p < nphase; p += THREADS) ph[p] = compact(ph_global[p]);
    if (tid == 0) {
        for (int s = 0; s < NSLOT; ++s) {
            mbar_init(&full[s], 1);                 // the producer's arrive (with the tile's bytes)
            mbar_init(&empty[s], CONSUMERS / 32);   // one arrive per consumer warp
        }
        mbar_init(xfull, 1);
        mbar_init(xempty, CONSUMERS / 32);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        if (blockIdx.x == 0) *t_start = now_ns();
    }
    __syncthreads();

    if (tid >= CONSUMERS + 32) {            // ------------------------------------------------ loader warp
        uint32_t u = 0;                     // pieces staged so far
        each_unit(ph, nphase, nblk, [&](int64_t p, int64_t t, int64_t slot) {
            const PhaseC& f = ph[p];
            const int xn = x_len(f), len = piece_len(f);
            for (int q0 = 0; q0 < xn; q0 += len, ++u) {
                if (!wait_slot(xempty, (u & 1u) ^ 1u, err, 6, p, t)) return false;
#ifdef TRACE
                unsigned long long* tr = trace + (blockIdx.x * TRACE_UNITS + u) * 6;
                if (lane == 0 && u < TRACE_UNITS) { tr[0] = now_ns(); tr[5] = p; }
#endif
                const int n = min(len, xn - q0);
#ifdef LOADER_NOCOPY
                if (true) {                 // a diagnostic: x not staged (the handoffs alone, no loads)
                } else
#endif
                if (f.src >= 0) {
                    const Piece pc{stage, reinterpret_cast<const uint64_t*>(ph[f.src].y) + slot * f.xstride,
                                   f.dep2 >= 0 ? reinterpret_cast<const uint64_t*>(ph[f.dep2].y) : nullptr,
                                   f.xlen, f.xlen2, q0, n / 2, XWORDS / 2};
                    if (!stage_piece(pc, epoch, wait, err, p, t)) return false;
                } else {                    // the external input (fp32), as words of this launch
                    for (int j0 = 0; j0 < n; j0 += 8 * 32) {     // 8 loads in flight per lane
                        float v[8];
#pragma unroll
                        for (int q = 0; q < 8; ++q) {
                            const int j = j0 + lane + 32 * q;
                            v[q] = j < n ? x_in[(q0 + j) % f.xlen] : 0.f;
                        }
#pragma unroll
                        for (int q = 0; q < 8; ++q) {
                            const int j = j0 + lane + 32 * q;
                            if (j < n) stage[j] = (static_cast<uint64_t>(epoch) << 32) | __float_as_uint(v[q]);
                        }
                    }
                    if (f.dep2 >= 0) {
                        const Piece pc{stage + XWORDS / 2, reinterpret_cast<const uint64_t*>(ph[f.dep2].y), nullptr,
                                       f.xlen2, 0, q0, n / 2, 0};
                        if (!stage_piece(pc, epoch, wait, err, p, t)) return false;
                    }
                }
                __syncwarp();
                if (f.dep2 >= 0)            // x = first + second input, in the first half's values
                    for (int j = lane; j < n; j += 32) {
                        float* v = reinterpret_cast<float*>(stage + j);
                        *v += value_of(stage[XWORDS / 2 + j]);
                    }
                __syncwarp();
#ifdef TRACE
                if (lane == 0 && u < TRACE_UNITS) tr[1] = now_ns();
#endif
                if (lane == 0) mbar_arrive(xfull);
            }
            return true;
        });
        return;
    }
    if (tid >= CONSUMERS) {                 // ---------------------------------------------- producer warp
        if (tid != CONSUMERS) return;
        uint64_t policy, keep;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(keep));
        uint32_t i = 0;
        Cursor ahead{0, first_tile(ph[0], nblk)};               // the next tile to prefetch: NSLOT tiles on
        ahead.settle(ph, nphase, nblk);
        for (int q = 0; q < NSLOT; ++q) ahead.next(ph, nphase, nblk);
        uint32_t fetched = NSLOT;                               // tiles prefetched or loaded by the ring so far
        for (int64_t p = 0; p < nphase; ++p) {
            const PhaseC& f = ph[p];
            const __nv_bfloat16* w = reinterpret_cast<const __nv_bfloat16*>(f.w);
            int64_t have_slot = -1, e = 0;
            bool inputs_done = mode != SERIAL;
            for (int64_t g = first_tile(f, nblk); g < f.tile0 + f.ntiles; g += nblk, ++i) {
                const int64_t t = g - f.tile0, row0 = t * f.rows;
                const uint32_t s = i % NSLOT;
                // keep PREFETCH_TILES tiles past the ring on their way into L2 (GEMV tiles: routed ones wait for
                // their expert), so that HBM keeps streaming while the ring is full
                for (; PREFETCH_TILES && fetched < i + NSLOT + PREFETCH_TILES && ahead.p < nphase; ++fetched) {
                    const PhaseC& a = ph[ahead.p];
                    if (a.kind == GEMV) {
                        const int64_t r0 = (ahead.g - a.tile0) * a.rows;
                        prefetch_l2(reinterpret_cast<const __nv_bfloat16*>(a.w) + r0 * a.k,
                                    static_cast<uint32_t>(min(static_cast<int64_t>(a.rows), a.n - r0) * a.k * 2), keep);
                    }
                    ahead.next(ph, nphase, nblk);
                }
                if (!wait_slot(&empty[s], ((i / NSLOT) & 1u) ^ 1u, err, 3, p, t)) return;
                // at most INFLIGHT tiles on their way: bytes queued past the bandwidth-delay product only lengthen
                // every load's wait, the stage's x loads included
                if (INFLIGHT && i >= INFLIGHT && INFLIGHT < NSLOT &&
                    !wait_slot(&full[(i - INFLIGHT) % NSLOT], ((i - INFLIGHT) / NSLOT) & 1u, err, 2, p, t)) return;
                if (!inputs_done && !(inputs_done = wait_inputs(ph, f, counters, epoch, err, p, t))) return;
                if (f.kind == TOPK) {
                    mbar_arrive(&full[s]);      // nothing to load
                    continue;
                }
                int64_t wrow = row0;
                if (f.kind == ROUTED) {         // the expert top-k chose for this tile's slot
                    if (have_slot < 0) {        // the phase's first tile here: every chosen expert, 8 loads at once
                        have_slot = 0;
                        const uint64_t* id = reinterpret_cast<const uint64_t*>(ph[f.route].y);
                        const int kk = static_cast<int>(ph[f.route].ne);
                        for (int b = 0; b < kk; b += 8) {
                            uint64_t v[8];
#pragma unroll
                            for (int q = 0; q < 8; ++q) v[q] = b + q < kk ? load_word(id + b + q) : 0;
#pragma unroll
                            for (int q = 0; q < 8; ++q) {
                                if (b + q >= kk) continue;
                                if (!poll_word(id + b + q, v[q], epoch, wait, err, 4, p, t)) return;
                                const int x = static_cast<int>(value_of(v[q]));
                                experts[b + q] = x < 0 ? 0 : (x >= f.n_experts ? f.n_experts - 1 : x);
                            }
                        }
                    }
                    e = experts[row0 / f.ne];
                    wrow = e * f.ne + row0 % f.ne;
                }
                const uint32_t bytes =                  // (the last tile may be part of one)
                    static_cast<uint32_t>(min(static_cast<int64_t>(f.rows), f.n - row0) * f.k * 2);
                mbar_expect_tx(&full[s], bytes);
                bulk_load(ring + s * SLOT_BYTES, w + wrow * f.k, bytes, &full[s], policy);
            }
        }
        return;
    }

    // ------------------------------------------------------------------------------------------ consumer warps
    const int warp = tid / 32;
    uint32_t i = 0, u = 0;                  // tiles and staged pieces taken so far
    for (int64_t p = 0; p < nphase; ++p) {
        const PhaseC& f = ph[p];
        const int64_t g0 = first_tile(f, nblk), gend = f.tile0 + f.ntiles;
        if (g0 >= gend) continue;
        uint64_t* y = reinterpret_cast<uint64_t*>(f.y);
        // T threads per row, each ceil(k / 8 / T) <= STEPS 16-byte steps; G = CONSUMERS / T rows in flight
        const int chunks = static_cast<int>(f.k / 8), rows = static_cast<int>(f.rows);
        int T = 1;
        while (T * STEPS < chunks) T *= 2;
        int G = CONSUMERS / T;
        if (G > rows) {
            G = rows;
            T = CONSUMERS / G;
        }
        float4 xa[STEPS], xb[STEPS];        // this thread's x: steps m of chunk tid % T + m T, the same every row
        int64_t have_slot = -1, done = 0;
        for (int64_t g = g0; g < gend; g += nblk, ++i, ++done) {
            const int64_t t = g - f.tile0, row0 = t * f.rows;
            const int64_t slot = f.kind == ROUTED && f.xstride ? row0 / f.ne : 0;   // whose x (routed: per expert)
            const uint32_t s = i % NSLOT;
            if (slot != have_slot) {        // this tile's x from the stage, piece by piece (a top-k's: kept there)
                have_slot = slot;
                const int xn = x_len(f), len = piece_len(f);
#pragma unroll
                for (int m = 0; m < STEPS; ++m) xa[m] = xb[m] = make_float4(0.f, 0.f, 0.f, 0.f);
                for (int q0 = 0; q0 < xn; q0 += len, ++u) {
#ifdef TRACE
                    unsigned long long* tr = trace + (blockIdx.x * TRACE_UNITS + u) * 6;
                    if (tid == 0 && u < TRACE_UNITS) tr[2] = now_ns();
#endif
                    if (!wait_slot(xfull, u & 1u, err, 7, p, t)) return;
#ifdef TRACE
                    if (tid == 0 && u < TRACE_UNITS) tr[3] = now_ns();
#endif
                    if (f.kind == TOPK) continue;           // (one piece; handed back after the top-k)
#pragma unroll
                    for (int m = 0; m < STEPS; ++m) {       // elements 8c..8c+7 of chunk c, rounded to bf16
                        const int c = tid % T + m * T, e0 = 8 * c - q0;
                        if (c >= chunks || e0 < 0 || e0 >= len) continue;
                        const uint4* w4 = reinterpret_cast<const uint4*>(stage + e0);
                        float v[8];
#pragma unroll
                        for (int h = 0; h < 4; ++h) {
                            const uint4 q = w4[h];
                            v[2 * h] = __bfloat162float(__float2bfloat16_rn(__uint_as_float(q.x)));
                            v[2 * h + 1] = __bfloat162float(__float2bfloat16_rn(__uint_as_float(q.z)));
                        }
                        xa[m] = make_float4(v[0], v[1], v[2], v[3]);
                        xb[m] = make_float4(v[4], v[5], v[6], v[7]);
                    }
                    __syncwarp();
                    if (lane == 0) mbar_arrive(xempty);     // this warp is done with the piece
                }
            }
            if (!wait_slot(&full[s], (i / NSLOT) & 1u, err, 2, p, t)) return;
#ifdef TRACE
            if (tid == 0 && u >= 1 && u - 1 < TRACE_UNITS && trace[(blockIdx.x * TRACE_UNITS + u - 1) * 6 + 4] == 0)
                trace[(blockIdx.x * TRACE_UNITS + u - 1) * 6 + 4] = now_ns();      // the unit's first tile ready
#endif

            if (f.kind == TOPK) {
                if (warp == 0) {              // k rounds of a warp argmax over the staged values (taken: -inf)
                    float* xf = reinterpret_cast<float*>(stage);    // value j at xf[2 j] (the word's low half)
                    for (int64_t r = 0; r < f.ne; ++r) {
                        float best = -INFINITY;
                        int idx = 0x7fffffff;
                        for (int j = lane; j < f.xlen; j += 32)
                            if (xf[2 * j] > best) { best = xf[2 * j]; idx = j; }
                        for (int off = 16; off; off >>= 1) {
                            const float ob = __shfl_xor_sync(0xffffffffu, best, off);
                            const int oi = __shfl_xor_sync(0xffffffffu, idx, off);
                            if (ob > best || (ob == best && oi < idx)) { best = ob; idx = oi; }
                        }
                        if (lane == 0) {
                            store_word(y + r, static_cast<float>(idx), epoch);
                            if (idx < f.xlen) xf[2 * idx] = -INFINITY;
                        }
                        __syncwarp();
                    }
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(xempty);         // the top-k's x handed back
            } else {
                const uint4* tile = reinterpret_cast<const uint4*>(ring + s * SLOT_BYTES);
                const int rows_here = static_cast<int>(min(static_cast<int64_t>(f.rows), f.n - row0));   // (last: part)
                for (int r0 = 0; r0 < rows_here; r0 += G) {
                    const int r = r0 + tid / T;
                    float acc = 0.f;
#ifndef SKIP_COMPUTE
                    if (r < rows_here) {
                        // every step's 16 bytes loaded first (zeros past the row: x is zero there too), then the
                        // sums in four independent chains
                        const uint4* wrow = tile + r * chunks;
                        uint4 wv[STEPS];
#pragma unroll
                        for (int m = 0; m < STEPS; ++m) {
                            const int c = tid % T + m * T;
                            wv[m] = c < chunks ? wrow[c] : make_uint4(0u, 0u, 0u, 0u);
                        }
                        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                        for (int m = 0; m < STEPS; ++m) part[m % 4] += dot8(wv[m], xa[m], xb[m]);
                        acc = (part[0] + part[1]) + (part[2] + part[3]);
                    }
#endif
                    for (int off = (T < 32 ? T : 32) / 2; off; off >>= 1)
                        acc += __shfl_xor_sync(0xffffffffu, acc, off);
                    if (T <= 32) {
                        if (tid % T == 0 && r < rows_here) store_word(y + row0 + r, acc, epoch);
                    } else {
                        if (lane == 0) red[warp] = acc;
                        consumers_sync();
                        if (tid < G && r0 + tid < rows_here) {
                            float sum = 0.f;
                            for (int w2 = 0; w2 < T / 32; ++w2) sum += red[tid * (T / 32) + w2];
                            store_word(y + row0 + r0 + tid, sum, epoch);
                        }
                        consumers_sync();
                    }
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[s]);     // this warp is done with slot s
        }
        // this block's tiles of p are done: add them to p's counter
        if (mode == SERIAL) consumers_sync();           // (SERIAL's producers wait on it: every row written)
        if (tid == 0) {
            if (mode == SERIAL) add_release(counters + p, static_cast<uint32_t>(done));
            else add_relaxed(counters + p, static_cast<uint32_t>(done));   // (no fence: the timeline only)
            atomicMax(t_done + p, static_cast<unsigned long long>(now_ns()));
        }
    }
}
