// How long a small load takes while the weight stream runs (docs/megakernel.md, "Next (12-04, afternoon)" item 1).
//
// One block per SM, as chain.cu runs. Lane 0 of warp 0 streams a large buffer into a shared-memory ring with bulk
// copies (cp.async.bulk, evict-first, as chain.cu's producer), keeping at most `inflight` copies of `slot_bytes` on
// their way: copy i is issued once copy i - inflight has landed. Warp 1 measures, once the stream has run for
// `warm_ns`, while it still runs:
//   mode 0: one 8-byte load of a word already in L2 (ld.relaxed.gpu, as chain.cu polls), `nsamples` times, each
//           timed alone (the load's value feeds the next one's address, so they cannot overlap);
//   mode 1: a ping-pong between block b and block b + blocks / 2: one side stores {value, epoch} as chain.cu's
//           store_word does, the other polls until it sees it and answers; each sample is one round trip (two
//           store-to-poll hops), what a phase boundary pays once per hop;
//   mode 2: one hop at a time: block b < blocks / 2 stores, notes %globaltimer before the store; block b + blocks
//           / 2 notes it when its poll sees the word (the host subtracts: one store-to-poll hop), then answers so
//           that the next sample starts after it.
// inflight 0: no stream (the idle figures). who: the blocks that stream (0 all, 1 the first half: the writers in
// mode 2, 2 the second half: the readers), so that a hop's cost can be put on the writer's SM or the reader's.
#include <cstdint>

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ uint64_t load_word(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void store_word(uint64_t* p, uint64_t v) {
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ bool mbar_test(uint64_t* bar, uint32_t parity) {
    uint32_t ok;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    return ok != 0;
}

extern "C" __global__ void __launch_bounds__(64, 1)
probe(const unsigned char* __restrict__ buf, uint64_t buf_bytes, int slot_bytes, int inflight, uint64_t* words,
      unsigned long long* lat, int nsamples, int mode, unsigned long long warm_ns, unsigned long long* streamed,
      unsigned long long* span, int who) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ uint64_t full[16];
    __shared__ volatile int done;
    const int tid = threadIdx.x, nblk = gridDim.x, b = blockIdx.x;
    if (who && (b < nblk / 2) != (who == 1)) inflight = 0;   // (this block does not stream)
    if (tid == 0) {
        for (int s = 0; s < inflight; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[s])));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        done = 0;
    }
    __syncthreads();
    if (tid == 0) {                                     // ------------------------------------------ the stream
        uint64_t policy;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        const uint64_t t0 = now_ns();
        uint64_t i = 0, off = static_cast<uint64_t>(b) * slot_bytes;
        for (; inflight && !done; ++i) {
            const uint32_t s = i % inflight;
            if (i >= static_cast<uint64_t>(inflight))    // copy i - inflight landed: its slot is free
                while (!mbar_test(&full[s], ((i / inflight) - 1) & 1u)) {}
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(&full[s])),
                         "r"(slot_bytes) : "memory");
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, "
                "[%3], %4;" ::"r"(smem_u32(ring + s * slot_bytes)), "l"(buf + off), "r"(slot_bytes),
                "r"(smem_u32(&full[s])), "l"(policy) : "memory");
            off += static_cast<uint64_t>(nblk) * slot_bytes;
            if (off + slot_bytes > buf_bytes) off = static_cast<uint64_t>(b) * slot_bytes;
        }
        const uint64_t first = i > static_cast<uint64_t>(inflight) ? i - inflight : 0;
        for (uint64_t j = first; j < i; ++j)            // every copy landed before the block ends
            while (!mbar_test(&full[j % inflight], (j / inflight) & 1u)) {}
        streamed[b] = i * static_cast<uint64_t>(slot_bytes);
        span[2 * b] = t0;
        span[2 * b + 1] = now_ns();
        return;
    }
    if (tid < 32) return;
    const int lane = tid - 32;
    const uint64_t start = now_ns();
    while (now_ns() - start < warm_ns) {}
    unsigned long long* out = lat + static_cast<int64_t>(b) * nsamples;
    if (mode == 0) {
        if (lane == 0) {
            const uint64_t* p = words + static_cast<int64_t>(((b * 7) % nblk)) * 32;   // another block's line
            __shared__ volatile uint64_t sink;
            uint64_t v = load_word(p);
            for (int n = 0; n < nsamples; ++n) {
                const uint64_t t = now_ns();
                v = load_word(p + (v & 1u));            // (v is even: the same word, but the load waits for v)
                sink = v;                               // (issued in order: the clock is read once v is here)
                out[n] = now_ns() - t;
            }
        }
    } else {                                            // (mode 1: round trips; mode 2: one hop's two ends)
        const int half = nblk / 2;
        if (lane == 0 && b < 2 * half) {
            const bool first = b < half;
            uint64_t* mine = words + static_cast<int64_t>(b) * 32;
            const uint64_t* theirs = words + static_cast<int64_t>(first ? b + half : b - half) * 32;
            for (int n = 0; n < nsamples; ++n) {
                const uint64_t want = (static_cast<uint64_t>(n + 1) << 33);   // even
                const uint64_t t = now_ns();
                uint64_t seen = 0;
                if (first) {
                    store_word(mine, want);
                    while (load_word(theirs) != want) {}
                } else {
                    while (load_word(theirs) != want) {}
                    if (mode == 2) seen = now_ns();
                    store_word(mine, want);
                }
                out[n] = mode == 1 ? now_ns() - t : (first ? t : seen);
            }
        }
    }
    __syncwarp();
    if (lane == 0) done = 1;
}
