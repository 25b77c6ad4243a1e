// Milestone 1 of docs/megakernel.md: a synthetic decode chain as ONE persistent launch.
//
// A chain of phases, each a GEMV y_p = W_p x_p (bf16 weights; x rounded to bf16 as a bf16 model feeds it; fp32
// sums and y) whose input x_p is the output of an earlier phase (plus, elementwise, a second one's), a top-k over a
// router's output, or a GEMV over the rows of the experts that top-k chose. The tiles of all phases (ordered by
// phase) are dealt round robin to one block per SM. In each block:
//   - a producer warp streams the weight rows of the block's tiles, in order, into a ring of shared-memory slots
//     (NSLOT x SLOT_BYTES, 3 x 64 KB) with bulk copies (cp.async.bulk, completion on an mbarrier). It waits for
//     nothing but a free slot, except for routed tiles, which need the chosen expert (mode SERIAL also waits
//     until each tile's input phases are done: the launch-per-phase order without launch costs);
//   - CONSUMER_WARPS (16) consumer warps take x from L2 once per (phase, slot), take the tile from the ring and
//     write its rows of y. Outputs are 8-byte words {value, epoch}, written in one store: a consumer polls the
//     words it reads until they carry this launch's epoch, so the data is its own ready flag (no fence, no
//     counter, one L2 round trip from the writer's store to the reader's use). Per-phase counters (a block adds
//     its tile count after its last tile of the phase) serve only mode SERIAL and the timeline.
// Every wait is bounded; a wait that runs out writes what it waited for to err[] and the kernel stops (the host
// reads err after the launch).
//
// Milestone 2 (real layers): a phase may form its x by a recipe (`Phase.xop`: XSeg entries, one per part of x) instead
// of copying words: SiTU-GLU of two parts of a phase's output, the MoE combine (the top-k's weights times the routed
// experts' rows) followed by an RMSNorm, and for a top-k the router's scores (sigmoid, correction bias for the
// choice only, weights renormalised). Their arithmetic follows the Triton kernels op for op (plugins/moe/kernels.py
// `_sigmoid`, `_tanh`, the pair kernels' SiTU-GLU, `_topk`, `_ticket_combine`; the RMSNorm as `RMSNorm` rounds).

#include <cstdint>
#include <cuda_bf16.h>

#ifndef NSLOT
#define NSLOT 3                        // ring slots per block (-DNSLOT=...)
#endif
#ifndef SLOT_BYTES
#define SLOT_BYTES 65536               // bytes per slot: the largest tile
#endif
#ifndef BLOCKS_PER_SM
#define BLOCKS_PER_SM 1                // blocks a launch puts on each SM (each with its own ring; all must be resident)
#endif
#ifndef TILE_IN_REGS
#define TILE_IN_REGS 0                 // 1: consumers take each tile into registers and free its slot before they load
#endif                                 // a new x, so the ring streams one more tile through the x load's stall
#ifndef WARP_ROWS
#define WARP_ROWS 0                    // 1: each warp sums whole rows of a tile on its own (x read from shared memory
#endif                                 // per chunk): no barrier and no cross-warp sum in a tile
#if defined(NOHANDSHAKE) && (!defined(NOCOPY) || TILE_IN_REGS)
#error "NOHANDSHAKE needs NOCOPY (nothing is copied into slots nobody waits for), and not TILE_IN_REGS"
#endif
#ifndef MMA_TILES                      // 1: full tiles of 16k rows (k a multiple of 32, at least MMA_MIN_K) summed on
#if !(WARP_ROWS || TILE_IN_REGS)       // tensor cores (mma.sync m16n8k16 bf16, fp32 sums) from tiles packed for it
#define MMA_TILES 1                    // on the host (the default since 12-02: k3-small 0.624 against 0.650 ms)
#else
#define MMA_TILES 0                    // (the other consumer layouts: none)
#endif
#endif
#ifndef MMA_MIN_K                      // narrower tiles keep the default layout, whose small tiles need no barrier
#define MMA_MIN_K 32                   // (512: k3-small 0.634 ms, the skeleton 0.269 against 0.288)
#endif
#ifndef MMA_ONLY                       // 1: every tile is a tensor-core tile (the host checks that each is): the
#define MMA_ONLY 0                     // CUDA-core path and its x registers (STEPS x 8 floats) are compiled out, which
#endif                                 // frees the tile loop's registers: the real layers' chains (milestone 2) build
                                       // with RECIPES=1 MMA_ONLY=1 (92 registers, no spills; RECIPES alone spills)
#if MMA_ONLY && !MMA_TILES
#error "MMA_ONLY needs MMA_TILES"
#endif
#if MMA_TILES && (WARP_ROWS || TILE_IN_REGS)
#error "MMA_TILES keeps the default layout for the tiles it does not take: not with WARP_ROWS or TILE_IN_REGS"
#endif
#if WARP_ROWS && TILE_IN_REGS
#error "WARP_ROWS and TILE_IN_REGS are two consumer layouts: pick one"
#endif
#ifndef EPOCH_PTR                      // 1: the launch's epoch is read from device memory (the `megakernel` backend,
#define EPOCH_PTR 0                    // which bumps it before each launch, so that the step is a CUDA graph)
#endif
#ifndef STEP_INPUTS                    // 1 (with EPOCH_PTR): the step's inputs from the engine's buffers: x_in is the
#define STEP_INPUTS 0                  // bf16 embedding table, the row the token at step_ids[0] picks, every ATTN
#endif                                 // phase's key count step_lengths[0] + 1, and the launch's epoch
                                       // epoch_at[0] + step_lengths[0] (a base the host moves when it loads a
                                       // sequence; so nothing is bumped between launches), whose largest so far the
                                       // launch leaves at epoch_at[1] (atomicMax), for the host's next base
#if STEP_INPUTS && !EPOCH_PTR
#error "STEP_INPUTS takes its epoch base from device memory: build it with EPOCH_PTR=1"
#endif
#ifndef COMMIT_LENGTHS                 // 1 (with STEP_INPUTS): when commit_active is not null, the launch also commits
#define COMMIT_LENGTHS 0               // the step: the last block to count itself in (counters[nphase], after every
#endif                                 // block has read step_lengths[0]) adds commit_active[0] to step_lengths[0], the
                                       // engine's `lengths.add_(active)` after the step, one kernel and a gap fewer
#if COMMIT_LENGTHS && !STEP_INPUTS
#error "COMMIT_LENGTHS advances the lengths the launch reads (STEP_INPUTS): build it with STEP_INPUTS=1"
#endif
#if COMMIT_LENGTHS                     // (written by the last block: not read-only to the compiler)
#define STEP_LENGTHS_PTR int64_t*
#else
#define STEP_LENGTHS_PTR const int64_t* __restrict__
#endif
#ifndef ARGMAX                         // 1 (with STEP_INPUTS and MMA_ONLY): the launch also takes the greedy token, the
#define ARGMAX 0                       // first index of the largest logit (the last phase's values; NaN as +inf), when
#endif                                 // am_ids is not null: each consumer keeps its LM-head rows' largest as a 64-bit
                                       // key (`argmax_key`; 1: in the LM head's tile loop, 2: after the phases, read
                                       // back from its stores), the block's largest goes to am_best (a max at L2), and the
                                       // last block to count itself in (counters[nphase]) writes the token to am_ids[0]
                                       // and, when am_ring is not null, to the engine's host ring at row
                                       // (step_lengths[0] + am_active[0]) mod am_ring_rows, then zeroes both words
#if ARGMAX != 0 && ARGMAX != 1 && ARGMAX != 2
#error "ARGMAX is 0 (none), 1 (keys in the LM head's tile loop) or 2 (keys after the phases)"
#endif
#if ARGMAX && !(STEP_INPUTS && MMA_ONLY)
#error "ARGMAX reads the sums of tensor-core tiles (MMA_ONLY) and writes the engine's ids (STEP_INPUTS)"
#endif
#ifndef PDL                            // 1 (with STEP_INPUTS): launched with programmatic dependent launch
#define PDL 0                          // (`ChainKernel` does, on a stream): the launch may begin while the kernel
#endif                                 // before it still runs, so nothing that the step's inputs or an earlier launch
                                       // wrote is read before `griddepcontrol.wait` (which returns once that kernel
                                       // has completed, its writes visible); the producer streams phase 0's weight
                                       // tiles before it when phase 0 is a GEMV (weights only, in stream mode). Every
                                       // block first lets the stream's next PDL launch begin
                                       // (`griddepcontrol.launch_dependents`): its blocks take SMs as this launch's
                                       // exit, and wait there. Launched without the attribute, the wait is a no-op.
#if PDL && !STEP_INPUTS
#error "PDL reads the step's inputs after its wait (STEP_INPUTS): build it with STEP_INPUTS=1"
#endif
#ifndef STEP_LOOP                      // 1 (with ARGMAX and COMMIT_LENGTHS): a launch runs `nsteps` greedy steps, one
#define STEP_LOOP 0                    // after another (docs/megakernel.md, "Several decode steps in one launch"): step
#endif                                 // st's epoch and key count are the first step's plus st; the last block of a
                                       // step writes its token (ids, host ring), advances the lengths and then, with
                                       // a release, the token word counters[nphase + 1] = the next step's epoch. Each
                                       // block's consumers poll that word (acquire) before the next step's first x
                                       // (the token's embedding row), its producer before the next step's first tile
                                       // that reads state (a KDA tile: the state its consumers wrote; an attention
                                       // tile: the MLA rows another block appended), then fence.proxy.async (those
                                       // were generic stores, the tile is a bulk copy). Weight tiles wait for nothing,
                                       // so the producers stream the next step's first weights while the LM head ends
#if STEP_LOOP && !(ARGMAX && COMMIT_LENGTHS && STEP_INPUTS)
#error "STEP_LOOP feeds each step's token to the next and advances the lengths in the launch: build it with ARGMAX, COMMIT_LENGTHS and STEP_INPUTS"
#endif
#ifndef RECIPES
#define RECIPES 0                      // 1: phases may form x by a recipe (real layers, milestone 2); 0: the synthetic
#endif                                 // chains' kernel (with the recipes, the diagnostic builds spill registers)
#define GROUPS 2                       // row groups of a tile at most (megakernel_chain.py checks every chain)
#ifndef TRACE_UNITS
#define TRACE_UNITS 256                // -DTRACE: per block, the first TRACE_UNITS (phase, slot) x loads' times:
#endif                                 // x load begun, x in shared memory, the x's first tile in the ring
#define TRACE_FIELDS 17                // (an ATTN phase's first x load and tile: its x parts, then tile begun,
                                       // scores, softmax, done; -DATTN_TWICE: the same four for the tile again;
                                       // then clock64 at the tile's begun and done: [11], [12] ([15], [16]).
                                       // Any other unit: [0] begun, [3] every warp done with the last x, [4 + q]
                                       // part q's words here (thread 0's, before a norm; part 0's norm: [5] every
                                       // thread's, [6] normed; a top-k: [5] every score, [6] key 0 ranked, [7]
                                       // every key; an AttnRes x: [4] the old sources, [5] y, [6] its sums'
                                       // barrier, [11] the scores, [12] the mix, [7] its norm's barrier),
                                       // [10 + q] part q done, [1] x in shared memory, [2] its first tile here, [8]
                                       // the last warp done with the block's tiles of the phase, [16] the phase + 1:
                                       // `layer.x_load_parts`)
#ifndef TILE_TRACE_MAX
#define TILE_TRACE_MAX 256             // -DTRACE_TILES: per block, the first TILE_TRACE_MAX tiles' times (TILE_FIELDS):
#endif                                 // producer: wants the slot, has it free, has issued the copy; observer warp:
#define TILE_FIELDS 7                  // the copy landed; consumers (thread 0): want the tile, have it, are done
#ifndef INFLIGHT                       // copies the producer keeps on their way at most (0: as many as the ring
#define INFLIGHT 0                     // holds): copy i waits until copy i - INFLIGHT has landed. Bytes queued past
#endif                                 // the bandwidth-delay product only lengthen every other load's wait: a
// store seen by another SM's poll took 2.7-2.9 us there and back with the ring's 3 x 64 KB on their way, 1.0 us with
// one 64 KB copy, 0.58 us with none (scripts/l2_queue_probe.py, 12-04 16:53). The backend builds with INFLIGHT=1
// (layer step 0.699 ms against 0.726). Pieces of a tile on barriers of their own, 16 or 32 KB, 1 to 4 in flight,
// were slower (0.730-0.786 ms; commit 63eab80 has them). Two copies on their way once a block's consumers have a
// phase's x (its tiles past the first three: the long streams) were no faster, and from its second tile 15 us slower
// (INFLIGHT_DEEP, 12-06 05:13 on an H100: 0.7705 / 0.7847 ms against 0.7706; commit 9a4e4ae has it).
#if INFLIGHT >= NSLOT
#error "INFLIGHT must be below NSLOT (0: no limit)"
#endif
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 0               // GEMV tiles past the ring the producer asks L2 to fetch (measured slower)
#endif
#ifndef XPREFETCH
#define XPREFETCH 0                    // next phase's x words per consumer loaded ahead, 0..4 (measured slower)
#endif
#define XPREFETCH_N (XPREFETCH > 0 ? XPREFETCH : 1)
// -DSKIP_COMPUTE: consumers take each tile and write zeros (a diagnostic: the streaming alone)
#define XMAX 8192                      // longest x of a GEMV (bf16 in shared memory, as a bf16 model feeds it)
#define XBYTES (XMAX * 2)              // (a top-k's x is fp32: XMAX / 2 values at most)
#ifndef CONSUMER_WARPS
#define CONSUMER_WARPS 16              // (-DCONSUMER_WARPS=...)
#endif
#ifndef STEPS
#define STEPS 4                        // 16-byte steps per thread and row, at most (even; x kept in registers)
#endif
#define CONSUMERS (32 * CONSUMER_WARPS)
#ifndef POLL_SLEEP                     // ns a consumer sleeps between two polls of words not yet written (0: none;
#define POLL_SLEEP 0                   // every waiting thread of 132 blocks polls L2 back to back otherwise)
#endif
#ifndef LIVE_SPLITS                    // 1: an ATTN phase skips its tiles past this launch's keys (no words), and
#define LIVE_SPLITS 0                  // BMM2's combine (X_MLA_COMBINE) adds only the key blocks that hold keys
#endif
#ifndef ATTN_SUMS_TOGETHER             // 1: an ATTN tile's 16 score sums a warp butterflied a level at a time, not
#define ATTN_SUMS_TOGETHER 1           // one sum after another (the same adds in the same order; 12-03 18:50, layer
#endif                                 // step: 0.7326 / 0.7313 ms against 0.7350 / 0.7341)
#ifndef ATTN_X_TAIL                    // 1: an ATTN x's new row and pe words polled in its queries' last round (one
#define ATTN_X_TAIL 0                  // round trip a thread, not three; the same x bit for bit)
#endif
#ifndef ATTN_ROW_W_SMEM                 // 1 (with ATTN_X_TAIL): the new row's norm weights copied into shared memory
#define ATTN_ROW_W_SMEM 0              // (cp.async, past the x) before its words are polled, so that its norm reads
#endif                                 // them there after its barrier, not from L2 (no register held over the poll)
#ifndef COMBINE_WORDS                  // X_MLA_COMBINE (BMM2's x): key blocks' words a thread polls together a round
#define COMBINE_WORDS 8                // (12: 3 rounds at 1025 keys, not 5, the same adds; 16 spills. H200 12-03
#endif                                 // 21:20: 12 no faster, layer step 0.7326 ms against 0.7310 / 0.7315)
#ifndef ATTN_MMA                       // 1: an ATTN tile's scores and O on tensor cores (`attn_tile`; fp32 sums in
#define ATTN_MMA 0                     // other orders, the weights as three bf16 parts)
#endif
#ifndef PAIR_TILES                     // 1: a routed phase with x per expert (the MoE down projection) hands each
#define PAIR_TILES 0                   // block consecutive row blocks, so that its tiles share an expert and it
#endif                                 // loads that x once (`tile_row0`)
#ifdef TRACE_TILES
#define THREADS (CONSUMERS + 64)       // + the producer warp + an observer warp that records when each copy lands
#else
#define THREADS (CONSUMERS + 32)       // + the producer warp
#endif
#ifndef SPIN_LIMIT
#define SPIN_LIMIT (1u << 24)          // polls before a wait gives up (-DSPIN_LIMIT=...)
#endif

enum Kind : int64_t { GEMV = 0, TOPK = 1, ROUTED = 2, KDA = 3, ATTN = 4 };
enum XOp : int32_t { X_GLU = 1, X_COMBINE_NORM = 2, X_SCORE = 3, X_KDA = 4, X_HEADNORM = 5, X_NORM = 6, X_SUM = 7,
                     X_ATTNRES = 8, X_MLA_Q = 9, X_MLA_COMBINE = 10, X_GATE = 11 };
enum Mode : int { STREAM = 0, SERIAL = 1, NODEPS = 2 };

struct Phase {                          // 17 int64 fields, built by megakernel_chain.py (`Buffers.table`)
    int64_t kind, n, k, rows, ntiles, tile0;   // tile0: index of the phase's first tile in the global order
    int64_t src;                        // phase whose y is x (-1: the external input vector)
    int64_t xlen, xstride;              // x[j] = y_src[slot * xstride + j % xlen] (+ y_dep2[j % xlen2])
    int64_t route, ne;                  // ROUTED: the TOPK phase, rows per expert; TOPK: k in `ne`
    int64_t w, y;                       // addresses: weights (bf16) and output ({fp32 value, u32 epoch} words)
    int64_t n_experts;                  // ROUTED: experts in w (ids are clamped to it)
    int64_t dep2, xlen2;                // a second input phase, added to x elementwise (-1: none)
    int64_t xop, nxseg;                 // x by recipe: XSeg entries xop .. xop + nxseg - 1 (-1: x as above)
    int64_t spare;                      // blocks the phase's tiles are not dealt to (`phase_stride`; 0: none)
};

// One part of a phase's x by recipe, x[j0 + j] for j < len (j0: the parts before it). 64 bytes, built by
// megakernel_chain.py (`Chain.xsegs`). Words are read from phase src's y at off + slot * stride + j (slot: a routed
// phase's expert slot).
//   X_GLU: bf16(SiTU-GLU(a, b)), a at that word, b off2 words further; round_in: a and b rounded to bf16 first (a
//     bf16 GEMV's outputs) or not (the routed experts' fp32 products, as the pair kernel keeps them);
//   X_COMBINE_NORM: u = bf16(sum over s < nslot of w_s y_src[off + s stride + j]) in slot order, w_s the top-k phase
//     route's weights, then bf16(aux[j] * bf16(u * rsqrt(mean(u^2) + eps))) (RMSNorm, aux its bf16 weight);
//   X_SCORE (a top-k's x): s = sigmoid(logit), key = s + aux[j] (fp32 correction bias, for the choice only); the
//     chosen s renormalised when renorm, times scaling, are the weights the top-k writes after its ids.
//   X_KDA (a KDA phase's x; tile t is head t / 4's quarter t % 4 of the value columns): the head's vectors for the
//     delta rule (`load_x_kda`). src: the input projection's phase, its words q | k | v at off (3 H 128
//     channels), b at stride, f_a (128) at route (a word offset here, not a phase); nslot: H; lb: the decay's
//     lower bound; aux: `KdaAux`.
//   X_NORM: u = bf16(y_src[off + j] (+ y_route[off2 + j] when route >= 0: a phase's two fp32 parts, added as a
//     plain x adds them)), then RMSNorm as X_COMBINE_NORM's;
//   X_SUM: bf16(y_src[off + j] + y_{src+1}[off + j] + ...) over nslot <= 4 consecutive phases, added in order (a
//     GEMV split over k into phases: k3-small's dense down projection, k = 8192, is four);
//   X_HEADNORM (after a KDA phase src, whose words are the heads' outputs o, rounded): per head of 128,
//     bf16(bf16(aux[j] * bf16(o rsqrt(mean(o^2) + eps))) * sigmoid(g)), g the words of phase route at off2 (the
//     KDA kernel's head RMSNorm and output gate, op for op).
//   X_ATTNRES (Block AttnRes before a sublayer, in every consuming block's x load; aux: `MixAux`): p = bf16(p_prev
//     + bf16(y)), y the sublayer output's parts added in order; the depth softmax over the sources (the sealed bank
//     rows, then p), score rsqrt(mean(v^2) + eps) (v . gw); their mix in fp32, rounded; then the sublayer's RMSNorm
//     as X_COMBINE_NORM's. src: the "mix" phase, whose words [x | p] (2 len) the block with tile 0 of phase
//     aux.writer writes (one consumer a mix: later mixes read p there, and the check reads both). The consumers of
//     a mix share its part (shared memory holds the table and the parts: k3-small's step came 272 bytes short).
//   X_MLA_Q (an ATTN phase's first part; slot: the tile's head group): for its nslot heads h = slot nslot + i, the
//     query [ql_h (stride words at off + h stride of src, BMM1's output) | q_pe_h (the last len / nslot - stride
//     words of head h in phase route, q_b's output, heads len / nslot - stride + off2 words apart, q_pe at off2)];
//     scaling: the softmax scale (read by the ATTN phase).
//   X_MLA_COMBINE (BMM2's per-slot x; slot: the head): the ATTN phase src's nslot partials of the head (split s at
//     off + s stride + slot (len + 2): max m_s, sum l_s, then len outputs), a_s = exp(m_s - max m), x = bf16(sum_s
//     a_s O_s / sum_s a_s l_s), the sums in split order.
//   X_GATE: bf16(sigmoid(g) o), o = bf16(y_src[off + j]), g = bf16 of the words of phase route at off2 + j (the MLA's
//     output gate).
struct XSeg {
    int64_t aux;
    int32_t op, src, off, len;
    int32_t off2, stride, route, nslot;
    int32_t round_in, renorm;
    float beta, lb, eps, scaling;       // GLU: beta, linear beta; COMBINE_NORM: eps; SCORE: scaling
};
static_assert(sizeof(XSeg) == 64, "XSeg is 64 bytes (megakernel_chain.py XSEG_BYTES)");

// An X_KDA part's tensors (addresses). The phase's "weights" are its tiles (KDA_TILE bytes each): tile 4 h + q holds
// f_b's rows for head h (bf16 [128 k][128 r], 32 KB) and then the fp32 state's value columns 32 q .. 32 q + 31
// ([128 k][32], 16 KB). The producer streams it like a weight tile (the state part: the last launch wrote it); the
// consumers write the state part back.
struct KdaAux {
    int64_t conv_state;                 // bf16 [2][3 H 128][3]: the window, oldest first, in two copies: a launch
                                        // reads copy epoch & 1 and writes [u1, u2, new] to the other
    int64_t conv_weight;                // bf16 [3 H 128][4]
    int64_t a_log, dt_bias;             // fp32 [H], [H 128]
};
// An X_ATTNRES part's sources (`megakernel_chain.py` MIX_AUX). A vector is the words at off .. off + len - 1 of
// phase src; src -1: the external input (fp32, rounded to bf16: the embedding row); src -2 (p_prev only): none.
#define MIX_BANK 3                      // sealed bank rows at most (k3-small: blocks of 4 layers)
#define MIX_Y 4                         // the sublayer output's parts at most (the dense MLP's down: 4)
#define MIX_E 4                         // elements a thread: len <= MIX_E CONSUMERS
struct MixAux {
    int64_t gw;                         // fp32 [len]: res_norm * res_query (the scores' weights)
    int64_t out_w;                      // bf16 [len]: the sublayer's RMSNorm weight
    int32_t nbank, ny;
    int32_t bank_src[MIX_BANK], bank_off[MIX_BANK];
    int32_t prev_src, prev_off;
    int32_t y_src[MIX_Y];               // words 0 .. len - 1 of each
    float eps, out_eps;
    int32_t writer, pad;                // the phase whose block with tile 0 writes the mix's words [x | p]
};
static_assert(sizeof(MixAux) == 88, "MixAux is 88 bytes (megakernel_chain.py MIX_AUX)");
#define KDA_FB_BYTES 32768
#define KDA_TILE (KDA_FB_BYTES + 128 * 32 * 4)

struct PhaseC {                         // the table as the kernel keeps it in shared memory (64 bytes a phase; 80
    int64_t w, y;                       // with every field 32-bit left k3-small's step with AttnRes 1.8 KB short)
    int32_t n, k, ntiles, tile0, xlen, xstride, ne, xlen2;
    int8_t kind;
    uint8_t spare;
    int16_t rows, src, route, n_experts, dep2, xop, nxseg;       // (the host checks that they fit)
};
static_assert(sizeof(PhaseC) == 64, "PhaseC is 64 bytes (megakernel_chain.py PHASE_BYTES)");
__device__ __forceinline__ PhaseC compact(const Phase& f) {
    return PhaseC{f.w, f.y, (int32_t)f.n, (int32_t)f.k, (int32_t)f.ntiles, (int32_t)f.tile0, (int32_t)f.xlen,
                  (int32_t)f.xstride, (int32_t)f.ne, (int32_t)f.xlen2, (int8_t)f.kind, (uint8_t)f.spare,
                  (int16_t)f.rows,
                  (int16_t)f.src, (int16_t)f.route, (int16_t)f.n_experts, (int16_t)f.dep2, (int16_t)f.xop,
                  (int16_t)f.nxseg};
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
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok) : "r"(smem_u32(bar)), "r"(parity) : "memory");
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
// ARGMAX: (value, index) as a key whose unsigned order is the argmax's: the larger value, then the smaller index
// (the value's bits mapped to an order-preserving u32; NaN as +inf, -0 as +0: compared as torch.argmax compares, bar
// NaN). Every key is above 0, which stands for no row. (MMA_ONLY: every tile full, no index past the phase's n.)
__device__ __forceinline__ unsigned long long argmax_key(float v, int index) {
    v = v != v ? INFINITY : (v == 0.f ? 0.f : v);
    const uint32_t u = __float_as_uint(v), o = u & 0x80000000u ? ~u : u | 0x80000000u;
    return (static_cast<unsigned long long>(o) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(index));
}
__device__ __forceinline__ unsigned long long max_u64(unsigned long long a, unsigned long long b) {
    return a > b ? a : b;
}
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
#ifdef TRACE                                        // -DTRACE: thread 0 notes the time in field k of a trace unit
#define TMARK(tr, k) do { if ((tr) && threadIdx.x == 0) (tr)[k] = now_ns(); } while (0)
#else
#define TMARK(tr, k) do { } while (0)
#endif
__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory"); }
// STEP_INPUTS: a launch's epoch, the base plus the sequence's length
__device__ __forceinline__ uint32_t step_epoch(const uint32_t* epoch_at, const int64_t* step_lengths) {
    return epoch_at[0] + static_cast<uint32_t>(*step_lengths);
}
#if PDL                                 // (PDL: the kernel before this launch in the stream has completed)
__device__ __forceinline__ void grid_dep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
#endif

// err[0] = what ran out (1 an input word, 2 a filled slot, 3 a free slot, 4 the top-k's words, 5 an input
// phase's counter, 6 the last step's token; 7: not a wait, a NaN router score), err[1..3] = block, phase, tile
// (7: the expert)
__device__ bool give_up(uint32_t* err, uint32_t what, int64_t phase, int64_t tile) {
    if (atomicCAS(err, 0u, what) == 0u) {
        err[1] = blockIdx.x;
        err[2] = static_cast<uint32_t>(phase);
        err[3] = static_cast<uint32_t>(tile);
    }
    return false;
}
__device__ __forceinline__ bool stopped(const uint32_t* err) { return *(volatile const uint32_t*)err != 0u; }
// Called on every poll of a wait: true once the wait must end (it ran out: recorded; or another one did). With
// POLL_SLEEP, a poll of words not yet written (what 1) sleeps that many ns before the next one.
__device__ __forceinline__ bool out_of_time(uint32_t spin, uint32_t* err, uint32_t what, int64_t phase, int64_t tile) {
#if POLL_SLEEP
    if (what == 1) __nanosleep(POLL_SLEEP);
#endif
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

#if STEP_LOOP
// STEP_LOOP: the step's token word once it holds `epoch`, the step's (acquire: the last step's writes, every
// block's, are visible). false: gave up (err what 6).
__device__ bool wait_token(const uint32_t* word, uint32_t epoch, uint32_t* err, int64_t phase) {
    for (uint32_t spin = 0; load_acquire(word) != epoch; ++spin)
        if (out_of_time(spin, err, 6, phase, 0)) return false;
    return true;
}
#endif

// Wait until phase f's input phases (src, dep2) are done in this launch (mode SERIAL's producer).
__device__ bool wait_inputs(const PhaseC* ph, const PhaseC& f, const uint32_t* counters, uint32_t epoch, uint32_t* err,
                            int64_t p, int64_t t) {
    if (f.src >= 0 && !wait_counter(counters + f.src, epoch * (uint32_t)ph[f.src].ntiles, err, p, t)) return false;
    if (f.dep2 >= 0 && !wait_counter(counters + f.dep2, epoch * (uint32_t)ph[f.dep2].ntiles, err, p, t)) return false;
    return true;
}

// j % n without a division where j < n already (most x: no wrap-around)
__device__ __forceinline__ int wrap(int j, int n) { return j < n ? j : j % n; }

// x[j] = y_src[slot * xstride + j % xlen] (+ y_dep2[j % xlen2]) for j < xn, each word polled until it is this
// launch's; into xs as bf16 (a top-k's as fp32). Eight loads in flight per thread before the first poll.
// false: gave up.
// had: pre / pre2 hold the words of j = tid + u CONSUMERS, u < XPREFETCH, loaded earlier (`prefetch_x`).
__device__ __forceinline__ ulonglong2 load_words2(const uint64_t* p) {   // two words in one 16-byte load, from L2
    ulonglong2 v;
    asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
    return v;
}

// x's common case in 16-byte loads: x = y_src[j] (+ y_dep2[j]) without wrap-around, 4 consecutive words a thread a
// round, written to xs 8 bytes at a time. A thread polls its words together: while any is not this launch's, it
// loads them all again at once (one round trip a poll, not one a word).
__device__ __forceinline__ bool load_x_fast(__nv_bfloat16* xs, const uint64_t* src, const uint64_t* src2, int xn,
                                           uint32_t epoch, bool wait, uint32_t* err, int64_t p, int64_t t) {
    for (int j = 4 * threadIdx.x; j < xn; j += 4 * CONSUMERS) {
        ulonglong2 a0, a1, b0, b1;
        for (uint32_t spin = 0;; ++spin) {
            a0 = load_words2(src + j);
            a1 = load_words2(src + j + 2);
            const uint64_t fresh_word = static_cast<uint64_t>(epoch) << 32;
            b0 = src2 ? load_words2(src2 + j) : make_ulonglong2(fresh_word, fresh_word);
            b1 = src2 ? load_words2(src2 + j + 2) : make_ulonglong2(fresh_word, fresh_word);
            const bool fresh = epoch_of(a0.x) == epoch && epoch_of(a0.y) == epoch && epoch_of(a1.x) == epoch
                               && epoch_of(a1.y) == epoch && epoch_of(b0.x) == epoch && epoch_of(b0.y) == epoch
                               && epoch_of(b1.x) == epoch && epoch_of(b1.y) == epoch;
            if (fresh || !wait) break;
            if (out_of_time(spin, err, 1, p, t)) return false;
        }
        float x[4] = {value_of(a0.x), value_of(a0.y), value_of(a1.x), value_of(a1.y)};
        if (src2) {
            x[0] += value_of(b0.x);
            x[1] += value_of(b0.y);
            x[2] += value_of(b1.x);
            x[3] += value_of(b1.y);
        }
        __nv_bfloat162 h[2] = {__floats2bfloat162_rn(x[0], x[1]), __floats2bfloat162_rn(x[2], x[3])};
        *reinterpret_cast<uint2*>(xs + j) = *reinterpret_cast<const uint2*>(h);
    }
    return true;
}

// ------------------------------------------------------------------------- x by recipe (milestone 2: real layers)
// The Triton kernels' arithmetic op for op, each op rounded as there (no contraction into FMA where they have none).
__device__ __forceinline__ float bf16r(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
#ifndef POW2_MEAN                       // 1: a norm's or score's mean over len values, len a power of two, as a multiply
#define POW2_MEAN 0                     // by 2^-log2(len), not an IEEE division (the same real number, so the same
#endif                                  // rounding: bit for bit; k3-small's norms are over 2048, 1024 and 512 values,
                                        // its q norm over 768 still divides)
// x / len, rounded to nearest (a mean's division)
__device__ __forceinline__ float div_len(float x, int len) {
#if POW2_MEAN
    if ((len & (len - 1)) == 0) return __fmul_rn(x, __int_as_float((127 - (31 - __clz(len))) << 23));
#endif
    return __fdiv_rn(x, static_cast<float>(len));
}
__device__ __forceinline__ float sigmoid_k3(float x) {          // plugins/moe/kernels.py `_sigmoid`
    return __fdiv_rn(1.f, __fadd_rn(1.f, expf(-x)));
}
__device__ __forceinline__ float tanh_k3(float x) {             // plugins/moe/kernels.py `_tanh`
    const float ax = fabsf(x);
    const float t = expf(__fmul_rn(-2.f, ax));
    const float big = __fdiv_rn(__fsub_rn(1.f, t), __fadd_rn(1.f, t));
    const float x2 = __fmul_rn(ax, ax);
    float q = __fsub_rn(static_cast<float>(2.0 / 15.0), __fmul_rn(x2, static_cast<float>(17.0 / 315.0)));
    q = __fsub_rn(static_cast<float>(1.0 / 3.0), __fmul_rn(x2, q));
    const float small = __fmul_rn(ax, __fsub_rn(1.f, __fmul_rn(x2, q)));
    const float r = ax < 0.1f ? small : big;
    return x < 0.f ? -r : r;
}
__device__ __forceinline__ float situ_glu_k3(float a, float b, float beta, float lb) {   // the pair kernels' SiTU-GLU
    const float left = __fmul_rn(__fmul_rn(beta, tanh_k3(__fdiv_rn(a, beta))), sigmoid_k3(a));
    return __fmul_rn(left, __fmul_rn(lb, tanh_k3(__fdiv_rn(b, lb))));
}

// What Triton 3.6 emits for the KDA decode kernel (plugins/kda/kernels.py `_decode_head`; docs/megakernel.md,
// "The KDA decode step, op for op"): tl.exp as ex2.approx of x log2e, `/` as div.full, tl.sqrt and tl.rsqrt as the
// approximate ftz forms.
__device__ __forceinline__ float ex2_approx(float x) {
    float y;
    asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float div_full(float a, float b) {
    float y;
    asm("div.full.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
    return y;
}
__device__ __forceinline__ float sqrt_approx(float x) {
    float y;
    asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float rsqrt_approx(float x) {
    float y;
    asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#define LOG2E 1.44269502f              // Triton's log2(e) (0x3FB8AA3B)
__device__ __forceinline__ float exp_tl(float x) { return ex2_approx(__fmul_rn(x, LOG2E)); }
__device__ __forceinline__ float sigmoid_tl(float x) {          // tl.sigmoid: 1 / (1 + exp(0 - x))
    return div_full(1.f, __fadd_rn(1.f, exp_tl(__fsub_rn(0.f, x))));
}
// A 128-vector's sum of squares as the KDA kernel's tl.sum makes it (element 32 w + lane in warp w of four): a
// butterfly in each warp (lane 0's view), then (W0 + W2) + (W1 + W3). Every thread of the four warps calls it and
// reaches the barrier; red[w0 .. w0 + 3] is theirs (w0 = their first warp).
__device__ __forceinline__ void warp_squares(float v, float* red, int warp, int lane) {
    float s = __fmul_rn(v, v);
    for (int o = 16; o; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
    if (lane == 0) red[warp] = s;
}
__device__ __forceinline__ float four_warps(const float* red, int w0) {
    return __fadd_rn(__fadd_rn(red[w0], red[w0 + 2]), __fadd_rn(red[w0 + 1], red[w0 + 3]));
}

// The words at a[i] (null: none) once each carries `epoch`, as values: loaded together, all loaded again while any is
// stale (one round trip a poll). false: gave up.
template <int N>
__device__ __forceinline__ bool poll_all(const uint64_t* const (&a)[N], float (&v)[N], uint32_t epoch, bool wait,
                                         uint32_t* err, int64_t p, int64_t t) {
    for (uint32_t spin = 0;; ++spin) {
        uint64_t w[N];
#pragma unroll
        for (int i = 0; i < N; ++i) w[i] = a[i] ? load_word(a[i]) : static_cast<uint64_t>(epoch) << 32;
        bool fresh = true;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            v[i] = value_of(w[i]);
            fresh = fresh && epoch_of(w[i]) == epoch;
        }
        if (fresh || !wait) return true;
        if (out_of_time(spin, err, 1, p, t)) return false;
    }
}

#define COMBINE_MAX 16                 // X_COMBINE_NORM: top-k slots at most (K3: 16)
#define ATTN_SPLITS 64                 // X_MLA_COMBINE: key blocks at most
#define HEADNORM_ROUNDS 4              // X_HEADNORM: rounds of CONSUMERS elements whose words are polled together
#define XDUMP_SLOTS 16                 // xdump: x slots a phase at most

// The n <= N words p[i * stride] as values, polled as `poll_all` does.
template <int N>
__device__ __forceinline__ bool poll_strided(const uint64_t* p, int64_t stride, int n, float (&v)[N], uint32_t epoch,
                                             bool wait, uint32_t* err, int64_t ph, int64_t t) {
    for (uint32_t spin = 0;; ++spin) {
        uint64_t w[N];
#pragma unroll
        for (int i = 0; i < N; ++i) w[i] = i < n ? load_word(p + i * stride) : static_cast<uint64_t>(epoch) << 32;
        bool fresh = true;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            v[i] = value_of(w[i]);
            fresh = fresh && epoch_of(w[i]) == epoch;
        }
        if (fresh || !wait) return true;
        if (out_of_time(spin, err, 1, ph, t)) return false;
    }
}

// X_KDA: x holds head h's vectors for the delta rule, fp32 (KDA_* offsets, 128 each; A and beta one value each),
// and the state sums' partials (KDA_PART: 16 x 32).
#define KDA_ALPHA 0
#define KDA_KN 128
#define KDA_T 256                       // kn beta
#define KDA_QN 384
#define KDA_V 512
#define KDA_DTB 640                     // dt_bias
#define KDA_FA 768                      // f_a, rounded as the input projection's bf16 output; element r at
                                        // r + r / 32 (a quarter's 32 a bank apart: the fold reads 4 at once)
#define KDA_A 900                       // exp(A_log[h])
#define KDA_BETA 901
#define KDA_PART 1024
// Head h's vectors, with the arithmetic of `_decode_head` (Triton 3.6) op for op. Needs 512 consumer threads.
// Threads 0..383 (channel tid of q | k | v) first load their conv window (copy epoch & 1) and taps, then, once the
// input projection's word is this launch's, make the short conv over the window and the new input (the word rounded
// as the projection's bf16 output), SiLU, rounded; quarter 0's block writes the next window to the other copy.
// Threads 384..511 take f_a, dt_bias, A and beta. Then q and k are L2-normalised. (alpha needs f_b's rows, which
// come with the tile: `kda_tile`.)
__device__ __forceinline__ bool load_x_kda(float* xf, const XSeg& g, const PhaseC* ph, int t, uint32_t epoch,
                                          bool wait, uint32_t* err, int64_t p, float* red) {
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, H = g.nslot, h = t >> 2;
    const KdaAux& a = *reinterpret_cast<const KdaAux*>(g.aux);
    const uint64_t* words = reinterpret_cast<const uint64_t*>(ph[g.src].y);
    const int part = tid >> 7, i = tid & 127, c = (part * H + h) * 128 + i;
    const int64_t copy = static_cast<int64_t>(3 * H) * 128 * 3;        // one copy of the window, in elements
    const __nv_bfloat16* cs = reinterpret_cast<const __nv_bfloat16*>(a.conv_state) + (epoch & 1u) * copy
                              + static_cast<int64_t>(c) * 3;
    const __nv_bfloat16* cw = reinterpret_cast<const __nv_bfloat16*>(a.conv_weight) + static_cast<int64_t>(c) * 4;
    const bool conv = tid < 384;
    const __nv_bfloat16 zero = __float2bfloat16(0.f);
    const __nv_bfloat16 u0 = conv ? cs[0] : zero, u1 = conv ? cs[1] : zero, u2 = conv ? cs[2] : zero;
    const __nv_bfloat16 c0 = conv ? cw[0] : zero, c1 = conv ? cw[1] : zero, c2 = conv ? cw[2] : zero,
                        c3 = conv ? cw[3] : zero;
    bool ok = true;
    float val = 0.f;
    if (conv) {
        const uint64_t* w[1] = {words + g.off + c};
        float x[1];
        ok = poll_all(w, x, epoch, wait, err, p, t);
        const __nv_bfloat16 xn = __float2bfloat16_rn(x[0]);
        const float p0 = __fmul_rn(__bfloat162float(c0), __bfloat162float(u0));
        const float p1 = __fmul_rn(__bfloat162float(c1), __bfloat162float(u1));
        const float p2 = __fmul_rn(__bfloat162float(c2), __bfloat162float(u2));
        const float p3 = __fmul_rn(__bfloat162float(c3), __bfloat162float(xn));
        const float y = __fadd_rn(__fadd_rn(p0, p2), __fadd_rn(p1, p3));
        val = bf16r(__fmul_rn(y, sigmoid_tl(y)));
        if (ok && (t & 3) == 0) {
            __nv_bfloat16* next = reinterpret_cast<__nv_bfloat16*>(a.conv_state) + ((epoch & 1u) ^ 1u) * copy
                                  + static_cast<int64_t>(c) * 3;
            next[0] = u1;
            next[1] = u2;
            next[2] = xn;
        }
    } else {
        const int k = tid - 384;
        const float dtb = reinterpret_cast<const float*>(a.dt_bias)[h * 128 + k];   // (in flight while it polls)
        const float alog = reinterpret_cast<const float*>(a.a_log)[h];
        const uint64_t* w[2] = {words + g.route + k, k == 0 ? words + g.stride + h : nullptr};
        float v[2];
        ok = poll_all(w, v, epoch, wait, err, p, t);
        xf[KDA_FA + k + (k >> 5)] = bf16r(v[0]);
        xf[KDA_DTB + k] = dtb;
        if (k == 0) {
            xf[KDA_BETA] = sigmoid_tl(bf16r(v[1]));
            xf[KDA_A] = exp_tl(alog);
        }
    }
    if (tid < 256) warp_squares(val, red, warp, lane);
    consumers_sync();
    if (tid < 128) {
        const float n = sqrt_approx(__fadd_rn(four_warps(red, 0), 1e-6f));
        xf[KDA_QN + tid] = __fmul_rn(div_full(val, n), __uint_as_float(0x3DB504F3u));   // fp32(128 ** -0.5)
    } else if (tid < 256) {
        const float kn = div_full(val, sqrt_approx(__fadd_rn(four_warps(red, 4), 1e-6f)));
        xf[KDA_KN + tid - 128] = kn;
        xf[KDA_T + tid - 128] = __fmul_rn(kn, xf[KDA_BETA]);
    } else if (tid < 384) {
        xf[KDA_V + tid - 256] = val;
    }
    return ok;
}

// One of a column's 16 partial k sums: k = k0 .. k0 + 7 in order, the first product rounded, then FMAs.
template <typename F>
__device__ __forceinline__ float kda_part(F&& term, const float* y, int k0) {
    float acc = __fmul_rn(term(k0), y[k0]);
#pragma unroll
    for (int k = k0 + 1; k < k0 + 8; ++k) acc = __fmaf_rn(term(k), y[k], acc);
    return acc;
}
__device__ __forceinline__ float kda_parts_sum(const float* part, int j) {     // the 16 partials in order
    float s = part[j];
#pragma unroll
    for (int r = 1; r < 16; ++r) s = __fadd_rn(s, part[r * 32 + j]);
    return s;
}

// Tile t of a KDA phase (head h = t / 4, value columns 32 q .. 32 q + 31, q = t % 4), in the ring: f_b's rows for
// the head, then the state's columns S (fp32 [128 k][32]). With the vectors of `load_x_kda`:
//   f = f_b f_a (thread: row tid / 4, columns 32 (tid % 4) .. in order, then (Q0 + Q1) + (Q2 + Q3) across the four
//   lanes), rounded; alpha = exp(lb sigmoid(A (f + dt_bias)));
//   S' = alpha S, err = v - S'^T kn, S'' = S' + (kn beta) err^T (written to state_g), o = S''^T qn,
// thread (warp r, lane j) summing k = 8 r .. 8 r + 7 of column j, the partials added in order; o rounded to y.
// (The head's RMSNorm and output gate need all its columns: the next phase's x recipe, X_HEADNORM.) Every consumer
// thread calls it (four barriers).
__device__ __forceinline__ void kda_tile(const unsigned char* tile, float* xf, float* state_g, uint64_t* y,
                                         const XSeg& g, int q, uint32_t epoch) {
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    {
        const int fk = tid >> 2, fq = tid & 3;
        const uint4* fb = reinterpret_cast<const uint4*>(tile) + fk * 16 + fq * 4;
        const float* fa = xf + KDA_FA + fq * 33;
        float acc = 0.f;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const uint4 wq = fb[u];
            const __nv_bfloat162* hw = reinterpret_cast<const __nv_bfloat162*>(&wq);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float2 wf = __bfloat1622float2(hw[e]);
                acc = __fmaf_rn(wf.x, fa[8 * u + 2 * e], acc);
                acc = __fmaf_rn(wf.y, fa[8 * u + 2 * e + 1], acc);
            }
        }
        acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 1));   // (Q0 + Q1), (Q2 + Q3) ...
        acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 2));   // ... then their sum (lane fq = 0's order)
        if (fq == 0) {
            const float x = __fadd_rn(bf16r(acc), xf[KDA_DTB + fk]);
            const float s = div_full(1.f, __fadd_rn(1.f, exp_tl(-__fmul_rn(xf[KDA_A], x))));
            xf[KDA_ALPHA + fk] = exp_tl(__fmul_rn(s, g.lb));
        }
    }
    consumers_sync();
    const float* S = reinterpret_cast<const float*>(tile + KDA_FB_BYTES);
    const float* al = xf + KDA_ALPHA;
    const float* tb = xf + KDA_T;
    float* part = xf + KDA_PART;
    const int j = lane, k0 = 8 * warp;
    part[warp * 32 + j] = kda_part([&](int k) { return __fmul_rn(S[k * 32 + j], al[k]); }, xf + KDA_KN, k0);
    consumers_sync();
    const float e = __fsub_rn(xf[KDA_V + 32 * q + j], kda_parts_sum(part, j));
    consumers_sync();                       // (every thread has read the partials: they are reused below)
    part[warp * 32 + j] = kda_part([&](int k) {
        const float nk = __fmaf_rn(tb[k], e, __fmul_rn(S[k * 32 + j], al[k]));
        state_g[k * 32 + j] = nk;
        return nk;
    }, xf + KDA_QN, k0);
    consumers_sync();
    if (warp == 0) store_word(y + j, bf16r(kda_parts_sum(part, j)), epoch);
}

// A KDA phase: this block's tiles (g0, g0 + stride, ...; ring slots from tile count i on), each its head's vectors
// into x, then the tile from the ring. Returns the tiles done, or -1: a wait gave up.
__device__ __forceinline__ int kda_phase(const PhaseC& f, const PhaseC* ph, const XSeg* xsegs,
                                         const unsigned char* ring, float* xf, uint64_t* full, uint64_t* empty,
                                         uint32_t i, int g0, int stride, uint32_t epoch, bool wait, uint32_t* err,
                                         int64_t p, float* red, int* gave_up, unsigned long long* t_x,
                                         unsigned long long* t_tile) {
    const XSeg& g = xsegs[f.xop];
    uint64_t* y = reinterpret_cast<uint64_t*>(f.y);
    int n = 0;
    for (int gt = g0; gt < f.tile0 + f.ntiles; gt += stride, ++i, ++n) {
        const int t = gt - f.tile0;
        const uint32_t s = i % NSLOT;
        consumers_sync();                   // every warp is done with the last x
        if (!load_x_kda(xf, g, ph, t, epoch, wait, err, p, red)) *gave_up = 1;
        consumers_sync();
        if (*gave_up) return -1;
#ifdef PHASE_TIMES
        if (threadIdx.x == 0 && n == 0) atomicMin(t_x, static_cast<unsigned long long>(now_ns()));
#endif
        if (!wait_slot(&full[s], (i / NSLOT) & 1u, err, 2, p, t)) return -1;
        kda_tile(ring + s * SLOT_BYTES, xf,
                 reinterpret_cast<float*>(f.w + static_cast<int64_t>(t) * KDA_TILE + KDA_FB_BYTES), y + t * 32, g,
                 t & 3, epoch);
#ifdef PHASE_TIMES                          // (a KDA phase's third time: the first block done with a tile)
        if (threadIdx.x == 0 && n == 0) atomicMin(t_tile, static_cast<unsigned long long>(now_ns()));
#endif
        __syncwarp();
        if (threadIdx.x % 32 == 0) mbar_arrive(&empty[s]);     // this warp is done with slot s
    }
    return n;
}

#ifndef NORM_W_FIRST                    // 1: the norms' weights loaded before their words are polled (`norm_w_pre`,
#define NORM_W_FIRST 0                  // X_HEADNORM); the backend builds with it (layer step 0.6822 ms against
#endif                                  // 0.6999 with the top-k and AttnRes changes of 12-04). 0 for the layer
                                        // script's base build (RECIPES MMA_ONLY), which it makes spill 8 bytes
#define NORM_W_PRE 2                    // a norm's weights a thread loaded before its words are polled (`norm_w_pre`)
// This thread's first NORM_W_PRE weights of an RMSNorm over len values (elements tid + u CONSUMERS), two bf16 a word:
// loaded before the polls, so that the norm, after its barrier, does not wait on an L2 round trip (under the weight
// stream the slowest of 512 such loads held the barrier after it: the MoE up's x spent 1.6 us in its norm; 12-04).
__device__ __forceinline__ void norm_w_pre(uint32_t (&w)[NORM_W_PRE / 2], const __nv_bfloat16* nw, int len) {
    const unsigned short* h = reinterpret_cast<const unsigned short*>(nw);
#pragma unroll
    for (int u = 0; u < NORM_W_PRE / 2; ++u) {
        const int j0 = threadIdx.x + 2 * u * CONSUMERS, j1 = j0 + CONSUMERS;
        w[u] = (j0 < len ? h[j0] : 0u) | (j1 < len ? static_cast<uint32_t>(h[j1]) << 16 : 0u);
    }
}

// The RMSNorm of X_COMBINE_NORM, X_NORM and X_ATTNRES over x (len values, bf16 in x already; ss: this thread's sum
// of their squares, fmaf in order): the threads' sums by warp butterflies, then over the warps in order;
// x = bf16(w bf16(u r)) with r = rsqrt(mean + eps), w = nw (bf16), as `RMSNorm` rounds; wpre (null: none): this
// thread's first NORM_W_PRE weights (`norm_w_pre`). Every consumer thread calls it (two barriers).
__device__ __forceinline__ bool rms_norm_x(__nv_bfloat16* x, int len, float eps, const __nv_bfloat16* nw, float ss,
                                           float* red, unsigned long long* tr = nullptr,
                                           const uint32_t* wpre = nullptr) {
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) red[warp] = ss;
    consumers_sync();
    TMARK(tr, 0);                                   // (-DTRACE: every thread's words here)
    float total = 0.f;
    for (int w = 0; w < CONSUMER_WARPS; ++w) total += red[w];
    const float r = rsqrtf(__fadd_rn(div_len(total, len), eps));
    int j = tid;
    if (wpre) {
#pragma unroll
        for (int u = 0; u < NORM_W_PRE; ++u, j += CONSUMERS) {
            if (j >= len) continue;
            const float nu = bf16r(__fmul_rn(__bfloat162float(x[j]), r));
            const float w = __uint_as_float((u % 2 ? wpre[u / 2] >> 16 : wpre[u / 2] & 0xffffu) << 16);
            x[j] = __float2bfloat16_rn(__fmul_rn(w, nu));
        }
    }
    for (; j < len; j += CONSUMERS) {               // RMSNorm: bf16(u r), times the weight, bf16
        const float nu = bf16r(__fmul_rn(__bfloat162float(x[j]), r));
        x[j] = __float2bfloat16_rn(__fmul_rn(__bfloat162float(nw[j]), nu));
    }
    consumers_sync();                               // (red is free again)
    TMARK(tr, 1);
    return true;
}

__device__ __forceinline__ const __nv_bfloat16* aux_bf16(const XSeg& g) {
    return reinterpret_cast<const __nv_bfloat16*>(g.aux);
}

// The words b[s][i CONSUMERS] for s < S (b[s] null: none) and i < n <= N as values, polled as `poll_all` does, from
// S base pointers (not S N: the poll loop keeps its addresses live).
template <int S, int N>
__device__ __forceinline__ bool poll_grid(const uint64_t* const (&b)[S], int n, float (&v)[S][N], uint32_t epoch,
                                          bool wait, uint32_t* err, int64_t ph, int64_t t) {
    for (uint32_t spin = 0;; ++spin) {
        uint64_t w[S][N];
#pragma unroll
        for (int s = 0; s < S; ++s)
#pragma unroll
            for (int i = 0; i < N; ++i)
                w[s][i] = b[s] && i < n ? load_word(b[s] + i * CONSUMERS) : static_cast<uint64_t>(epoch) << 32;
        bool fresh = true;
#pragma unroll
        for (int s = 0; s < S; ++s)
#pragma unroll
            for (int i = 0; i < N; ++i) {
                v[s][i] = value_of(w[s][i]);
                fresh = fresh && epoch_of(w[s][i]) == epoch;
            }
        if (fresh || !wait) return true;
        if (out_of_time(spin, err, 1, ph, t)) return false;
    }
}

// The pairs of words b[s][2 (i CONSUMERS) + {0, 1}] for s < S (b[s] null: none) and i < n <= N as values (v[s][2 i],
// v[s][2 i + 1]), in 16-byte loads, polled as `poll_all` does.
template <int S, int N>
__device__ __forceinline__ bool poll_pairs(const uint64_t* const (&b)[S], int n, float (&v)[S][2 * N], uint32_t epoch,
                                           bool wait, uint32_t* err, int64_t ph, int64_t t) {
    for (uint32_t spin = 0;; ++spin) {
        bool fresh = true;
#pragma unroll
        for (int s = 0; s < S; ++s)
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const uint64_t now = static_cast<uint64_t>(epoch) << 32;
                const ulonglong2 w = b[s] && i < n ? load_words2(b[s] + 2 * i * CONSUMERS) : make_ulonglong2(now, now);
                v[s][2 * i] = value_of(w.x);
                v[s][2 * i + 1] = value_of(w.y);
                fresh = fresh && epoch_of(w.x) == epoch && epoch_of(w.y) == epoch;
            }
        if (fresh || !wait) return true;
        if (out_of_time(spin, err, 1, ph, t)) return false;
    }
}

__device__ __forceinline__ float2 bf2(uint32_t bits) {         // a packed pair of bf16, as floats
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
}
// The chain's external input x_in: fp32 values, or (STEP_INPUTS) the bf16 embedding row of the step's token.
#if STEP_INPUTS
typedef __nv_bfloat16 XIn;
__device__ __forceinline__ float x_in_at(const XIn* x, int64_t j) { return __bfloat162float(x[j]); }
#else
typedef float XIn;
__device__ __forceinline__ float x_in_at(const XIn* x, int64_t j) { return x[j]; }
#endif

__device__ __forceinline__ uint32_t bits2(float a, float b) {   // two floats as a packed pair of bf16
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
}
// This warp's sums of 2 S values into sums[warp * 8 + i] (lane 0's butterfly view), i < 2 S.
template <int S>
__device__ __forceinline__ void warp_sums(float (&v)[2 * S], float* sums, int i0) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < 2 * S; ++i) {
        float x = v[i];
        for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
        if (lane == 0) sums[warp * 8 + i0 + i] = x;
    }
}

// X_ATTNRES (`XSeg`): x[0 .. len) for len <= MIX_E CONSUMERS (x's only part). Thread tid takes the pairs of elements
// q = tid + i CONSUMERS (elements 2 q, 2 q + 1), i < MIX_E / 2. A mix's p is kept as packed words {bf16 p[2 q],
// bf16 p[2 q + 1], epoch}, so the old sources (the bank rows and p_prev, written by earlier mixes) come in one poll
// of MIX_BANK + 1 words a pair, with gw and the norm's weight in flight beside them; their sums (squares, dots with
// gw) are made before y is polled. Once y's parts are here (two a poll): p, its sums, one barrier, the scores, the
// softmax, the mix, its sum of squares, a barrier, the RMSNorm. The sums: fmaf over the thread's elements in order,
// a warp butterfly, the warps in order (`block_dot_k3(..., pairs=True)`). The bank rows wait in shared memory past x.
// Every consumer thread calls it (two barriers). false: gave up.
__device__ __forceinline__ bool attnres_x(__nv_bfloat16* xs, const XSeg& g, const PhaseC* ph, const XIn* x_in,
                                          int64_t t, uint32_t epoch, bool wait, uint32_t* err, int64_t p,
                                          float* red, float* sums, unsigned long long* tr = nullptr) {
    constexpr int NP = MIX_E / 2;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, len = g.len;
    const MixAux& a = *reinterpret_cast<const MixAux*>(g.aux);
    const int nb = a.nbank;
    const int n = min(NP, (len / 2 - tid + CONSUMERS - 1) / CONSUMERS);     // this thread's pairs
    float2 gw[NP];
    uint32_t ow[NP];
#pragma unroll
    for (int i = 0; i < NP; ++i) {
        const int q = tid + i * CONSUMERS;
        gw[i] = i < n && nb ? reinterpret_cast<const float2*>(a.gw)[q] : make_float2(0.f, 0.f);
        ow[i] = i < n ? reinterpret_cast<const uint32_t*>(a.out_w)[q] : 0u;
    }
    // y's first two parts, loaded in flight with the old sources (one round trip where y is already written)
    const uint64_t* yb[2];
#pragma unroll
    for (int q = 0; q < 2; ++q)
        yb[q] = q < a.ny ? reinterpret_cast<const uint64_t*>(ph[a.y_src[q]].y) + 2 * tid : nullptr;
    ulonglong2 ypre[2][NP];
#pragma unroll
    for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int i = 0; i < NP; ++i) {
            const uint64_t now = static_cast<uint64_t>(epoch) << 32;
            ypre[q][i] = yb[q] && i < n ? load_words2(yb[q] + 2 * i * CONSUMERS) : make_ulonglong2(now, now);
        }
    bool ok;
    uint32_t pp[NP];                                // p_prev, then p (packed pairs)
    {
        const uint64_t* b[MIX_BANK + 1];            // source s < MIX_BANK: bank row s (s < nb); MIX_BANK: p_prev
#pragma unroll
        for (int s = 0; s <= MIX_BANK; ++s) {
            const int src = s < MIX_BANK ? (s < nb ? a.bank_src[s] : -2) : a.prev_src;
            b[s] = src >= 0 ? reinterpret_cast<const uint64_t*>(ph[src].y) + (s < MIX_BANK ? a.bank_off[s] : a.prev_off)
                                  + tid : nullptr;
        }
        float v[MIX_BANK + 1][NP];
        ok = poll_grid(b, n, v, epoch, wait, err, p, t);
        TMARK(tr, 4);                               // (-DTRACE: the old sources here)
        float part[2 * MIX_BANK];                   // the bank rows' sums of squares and dots
#pragma unroll
        for (int s = 0; s <= MIX_BANK; ++s) {
            const int src = s < MIX_BANK ? (s < nb ? a.bank_src[s] : -2) : a.prev_src;
            float ss = 0.f, dt = 0.f;
#pragma unroll
            for (int i = 0; i < NP; ++i) {
                const int q = tid + i * CONSUMERS;
                uint32_t w = 0u;
                if (i < n) {
                    if (src == -1) {
#if STEP_INPUTS
                        w = reinterpret_cast<const uint32_t*>(x_in)[q];     // (the bf16 pair as it is)
#else
                        const float2 xi = reinterpret_cast<const float2*>(x_in)[q];
                        w = bits2(xi.x, xi.y);
#endif
                    } else if (src >= 0) {
                        w = __float_as_uint(v[s][i]);
                    }
                }
                if (s == MIX_BANK) {
                    pp[i] = w;
                } else if (s < nb && i < n) {
                    reinterpret_cast<uint32_t*>(xs + (1 + s) * len)[q] = w;
                    const float2 f = bf2(w);
                    ss = fmaf(f.y, f.y, fmaf(f.x, f.x, ss));
                    dt = fmaf(f.y, gw[i].y, fmaf(f.x, gw[i].x, dt));
                }
            }
            if (s < MIX_BANK) {
                part[2 * s] = ss;
                part[2 * s + 1] = dt;
            }
        }
        if (nb) warp_sums<MIX_BANK>(part, sums, 0);
    }
    // y's parts, added in order, two parts a poll; p = bf16(p_prev + bf16(y))
    float y[2 * NP];
    for (int q0 = 0; q0 < a.ny; q0 += 2) {
        const uint64_t* b[2];
#pragma unroll
        for (int q = 0; q < 2; ++q)
            b[q] = q0 + q < a.ny ? reinterpret_cast<const uint64_t*>(ph[a.y_src[q0 + q]].y) + 2 * tid : nullptr;
        float v[2][2 * NP];
        bool fresh = q0 == 0;                       // (the first two parts: loaded above; polled again if stale)
#pragma unroll
        for (int q = 0; q < 2; ++q)
#pragma unroll
            for (int i = 0; i < NP; ++i) {
                v[q][2 * i] = value_of(ypre[q][i].x);
                v[q][2 * i + 1] = value_of(ypre[q][i].y);
                fresh = fresh && epoch_of(ypre[q][i].x) == epoch && epoch_of(ypre[q][i].y) == epoch;
            }
        if (!fresh) ok = poll_pairs<2, NP>(b, n, v, epoch, wait, err, p, t) && ok;
#pragma unroll
        for (int e = 0; e < 2 * NP; ++e) {
            y[e] = q0 ? __fadd_rn(y[e], v[0][e]) : v[0][e];
            if (q0 + 1 < a.ny) y[e] = __fadd_rn(y[e], v[1][e]);
        }
    }
    TMARK(tr, 5);                                   // (y here)
    uint64_t* words = reinterpret_cast<uint64_t*>(ph[g.src].y);
    const bool writer = a.writer == p && t == 0 && ok;
    float ps[2] = {0.f, 0.f};                       // p's sum of squares and dot
#pragma unroll
    for (int i = 0; i < NP; ++i) {
        if (a.ny) {
            const float2 f = bf2(pp[i]);
            pp[i] = bits2(__fadd_rn(f.x, bf16r(y[2 * i])), __fadd_rn(f.y, bf16r(y[2 * i + 1])));
        }
        if (i < n) {
            const float2 f = bf2(pp[i]);
            ps[0] = fmaf(f.y, f.y, fmaf(f.x, f.x, ps[0]));
            ps[1] = fmaf(f.y, gw[i].y, fmaf(f.x, gw[i].x, ps[1]));
            if (writer) {
                const uint64_t packed = (static_cast<uint64_t>(epoch) << 32) | pp[i];
                asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(words + len + tid + i * CONSUMERS),
                             "l"(packed) : "memory");
            }
        }
    }
    float mix[2 * NP];
#pragma unroll
    for (int i = 0; i < NP; ++i) {
        const float2 f = bf2(pp[i]);
        mix[2 * i] = f.x;
        mix[2 * i + 1] = f.y;
    }
    if (nb) {
        warp_sums<1>(ps, sums, 2 * MIX_BANK);
        consumers_sync();
        TMARK(tr, 6);                               // (the sums' barrier passed)
        // the warps' sums added in warp order, lane j & 7 making total j (its 16 loads issue before the first add; as
        // a loop per source in every thread, each add waited for its load), then shuffled to the warp
        static_assert(2 * MIX_BANK + 2 == 8, "a warp's sums are 8 floats");
        float tsum = 0.f;
#pragma unroll
        for (int w2 = 0; w2 < CONSUMER_WARPS; ++w2) tsum += sums[w2 * 8 + (lane & 7)];
        // the softmax over the sources, source lane % 4 in each lane (the same values as one source after another
        // in every lane, with a quarter of the instructions: 16 warps ran them all, ~1 us; 12-04). Its sums: bank
        // row s's at 2 s, p's at 2 MIX_BANK.
        const int sl = lane % (MIX_BANK + 1), at = sl < nb ? 2 * sl : 2 * MIX_BANK;
        const float ss = __shfl_sync(0xffffffffu, tsum, at), dt = __shfl_sync(0xffffffffu, tsum, at + 1);
        float el = __fmul_rn(rsqrtf(__fadd_rn(div_len(ss, len), a.eps)), dt);   // the score
        const float ml = sl <= nb ? el : -INFINITY;
        float e[MIX_BANK + 1], mx = -INFINITY, tot = 0.f;
#pragma unroll
        for (int s = 0; s <= MIX_BANK; ++s) mx = fmaxf(mx, __shfl_sync(0xffffffffu, ml, s));
        TMARK(tr, 11);                              // (-DTRACE: the scores)
        el = sl <= nb ? expf(__fsub_rn(el, mx)) : 0.f;
#pragma unroll
        for (int s = 0; s <= MIX_BANK; ++s) tot = __fadd_rn(tot, __shfl_sync(0xffffffffu, el, s));   // (in order)
        el = __fdiv_rn(el, tot);
#pragma unroll
        for (int s = 0; s <= MIX_BANK; ++s) e[s] = __shfl_sync(0xffffffffu, el, s);     // the softmax's weights
#pragma unroll
        for (int i = 0; i < NP; ++i) {              // the mix: sum_s w_s v_s in source order, rounded
            const int q = tid + i * CONSUMERS;
            float2 acc = make_float2(0.f, 0.f);
#pragma unroll
            for (int s = 0; s <= MIX_BANK; ++s) {
                if (s > nb || i >= n) continue;
                const float2 f = s < nb ? bf2(reinterpret_cast<const uint32_t*>(xs + (1 + s) * len)[q]) : bf2(pp[i]);
                acc.x = __fadd_rn(acc.x, __fmul_rn(e[s], f.x));
                acc.y = __fadd_rn(acc.y, __fmul_rn(e[s], f.y));
            }
            mix[2 * i] = bf16r(acc.x);
            mix[2 * i + 1] = bf16r(acc.y);
        }
        TMARK(tr, 12);                              // (the softmax and the mix)
    }
    // the RMSNorm of the mix: bf16(w bf16(u rsqrt(mean(u^2) + eps)))
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < NP; ++i)
        if (i < n) ss = fmaf(mix[2 * i + 1], mix[2 * i + 1], fmaf(mix[2 * i], mix[2 * i], ss));
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) red[warp] = ss;
    consumers_sync();
    TMARK(tr, 7);                                   // (the norm's barrier passed)
    float total = 0.f;
    for (int w2 = 0; w2 < CONSUMER_WARPS; ++w2) total += red[w2];
    const float r = rsqrtf(__fadd_rn(div_len(total, len), a.out_eps));
#pragma unroll
    for (int i = 0; i < NP; ++i) {
        if (i >= n) continue;
        const int q = tid + i * CONSUMERS;
        const float2 w = bf2(ow[i]);
        const float x0 = bf16r(__fmul_rn(w.x, bf16r(__fmul_rn(mix[2 * i], r))));
        const float x1 = bf16r(__fmul_rn(w.y, bf16r(__fmul_rn(mix[2 * i + 1], r))));
        reinterpret_cast<uint32_t*>(xs)[q] = bits2(x0, x1);
        if (writer) {
            store_word(words + 2 * q, x0, epoch);
            store_word(words + 2 * q + 1, x1, epoch);
        }
    }
    return ok;
}

// Phase f's x by its recipe (f.nxseg parts) into xs: bf16 for a GEMV, fp32 keys then scores for a top-k. Every
// consumer thread calls it and reaches its barriers (an RMSNorm's sum), also after a wait gave up. false: gave up.
// X_MLA_Q's word for element j of head group `slot`'s queries (null past them): a head's x is hw words, the
// first g.stride (its latent query, BMM1's words from base) then its pe words (q_b's, qw words a head from qb).
__device__ __forceinline__ const uint64_t* query_word(const XSeg& g, const uint64_t* base, const uint64_t* qb,
                                                      int slot, int hw, int qw, int j) {
    const int h = slot * g.nslot + j / hw, c = j % hw;
    return j >= g.len ? nullptr : c < g.stride ? base + h * g.stride + c : qb + h * qw + g.off2 + (c - g.stride);
}

__device__ __forceinline__ bool load_x_recipe(__nv_bfloat16* xs, const PhaseC& f, const PhaseC* ph, const XSeg* xsegs,
                                              int slot, uint32_t epoch, bool wait, uint32_t* err, int64_t p,
                                              int64_t t, float* red, float* comb_w,
                                              unsigned long long* part_t = nullptr,
                                              unsigned long long* poll_t = nullptr) {
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    bool ok = true;
    int j0 = 0;                                     // where this part starts in x
    for (int q = 0; q < f.nxseg; ++q) {
        const XSeg& g = xsegs[f.xop + q];
        const uint64_t* base = reinterpret_cast<const uint64_t*>(ph[g.src].y) + g.off;
        if (g.op == X_GLU) {
            base += static_cast<int64_t>(slot) * g.stride;
            for (int jb = tid; ok && jb < g.len; jb += 4 * CONSUMERS) {
                const uint64_t* a[8];
                float v[8];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int j = jb + u * CONSUMERS;
                    a[u] = j < g.len ? base + j : nullptr;
                    a[4 + u] = j < g.len ? base + g.off2 + j : nullptr;
                }
                ok = poll_all(a, v, epoch, wait, err, p, t);
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int j = jb + u * CONSUMERS;
                    if (!ok || j >= g.len) continue;
                    const float av = g.round_in ? bf16r(v[u]) : v[u], bv = g.round_in ? bf16r(v[4 + u]) : v[4 + u];
                    xs[j0 + j] = __float2bfloat16_rn(situ_glu_k3(av, bv, g.beta, g.lb));
                }
            }
        } else if (g.op == X_COMBINE_NORM) {
            uint32_t wpre[NORM_W_PRE / 2];
            norm_w_pre(wpre, aux_bf16(g), g.len);
            // (Each warp copying the weights itself beside its first words, with no barrier before them, was
            // right and 6-8 us slower a step: COMBINE_W_EARLY, 12-06 05:25 on an H100, commit c4b320b.)
            if (tid < g.nslot) {                    // the top-k's weights, into shared memory (in registers with
                float w[1];                         // the rows, they spill)
                ok = poll_strided(reinterpret_cast<const uint64_t*>(ph[g.route].y) + ph[g.route].ne + tid, 1, 1, w,
                                  epoch, wait, err, p, t);
                comb_w[tid] = w[0];
            }
            consumers_sync();
            float ss = 0.f;
            for (int j = tid; ok && j < g.len; j += CONSUMERS) {
                float acc = 0.f;                    // `_ticket_combine`: out += w_s * y_s in slot order
                for (int s0 = 0; ok && s0 < g.nslot; s0 += 8) {     // 8 slots' rows at a time
                    float v[8];
                    const int ns = min(8, g.nslot - s0);
                    ok = poll_strided(base + static_cast<int64_t>(s0) * g.stride + j, g.stride, ns, v, epoch, wait,
                                      err, p, t);
#pragma unroll
                    for (int s = 0; s < 8; ++s)
                        if (s < ns) acc = fmaf(comb_w[s0 + s], v[s], acc);
                }
                const float u = bf16r(acc);         // the op's output u, in z's dtype
                xs[j0 + j] = __float2bfloat16_rn(u);
                ss = fmaf(u, u, ss);
            }
            if (q < 4) TMARK(poll_t, q);            // (-DTRACE: thread 0's words here, before the norm)
            ok = rms_norm_x(xs + j0, g.len, g.eps, aux_bf16(g), ss, red, poll_t && !q ? poll_t + 1 : nullptr,
                            NORM_W_FIRST ? wpre : nullptr) && ok;
        } else if (g.op == X_NORM) {
            const uint64_t* b2 = g.route >= 0 ? reinterpret_cast<const uint64_t*>(ph[g.route].y) + g.off2 : nullptr;
            uint32_t wpre[NORM_W_PRE / 2];
            norm_w_pre(wpre, aux_bf16(g), g.len);
            float ss = 0.f;
            for (int jb = tid; ok && jb < g.len; jb += 4 * CONSUMERS) {     // 4 words a thread (and their second
                const uint64_t* a[8];                                        // parts) polled together
                float v[8];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int j = jb + u * CONSUMERS;
                    a[u] = j < g.len ? base + j : nullptr;
                    a[4 + u] = j < g.len && b2 ? b2 + j : nullptr;
                }
                ok = poll_all(a, v, epoch, wait, err, p, t);
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int j = jb + u * CONSUMERS;
                    if (j >= g.len) continue;
                    const float x = bf16r(__fadd_rn(v[u], v[4 + u]));
                    xs[j0 + j] = __float2bfloat16_rn(x);
                    ss = fmaf(x, x, ss);
                }
            }
            if (q < 4) TMARK(poll_t, q);
            ok = rms_norm_x(xs + j0, g.len, g.eps, aux_bf16(g), ss, red, poll_t && !q ? poll_t + 1 : nullptr,
                            NORM_W_FIRST ? wpre : nullptr) && ok;
        } else if (g.op == X_SUM) {
            for (int jb = tid; ok && jb < g.len; jb += 2 * CONSUMERS) {     // 2 elements of 4 parts polled together
                const uint64_t* a[8];
                float v[8];
#pragma unroll
                for (int u = 0; u < 2; ++u)
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const int j = jb + u * CONSUMERS;
                        a[4 * u + q] = j < g.len && q < g.nslot
                                           ? reinterpret_cast<const uint64_t*>(ph[g.src + q].y) + g.off + j : nullptr;
                    }
                ok = poll_all(a, v, epoch, wait, err, p, t);
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    const int j = jb + u * CONSUMERS;
                    float x = v[4 * u];
#pragma unroll
                    for (int q = 1; q < 4; ++q)
                        if (q < g.nslot) x = __fadd_rn(x, v[4 * u + q]);
                    if (j < g.len) xs[j0 + j] = __float2bfloat16_rn(x);
                }
            }
        } else if (g.op == X_HEADNORM) {            // per head of 128: 4 heads a round, warps 4 m .. 4 m + 3 each
            const __nv_bfloat16* nw = reinterpret_cast<const __nv_bfloat16*>(g.aux);
            const uint64_t* gw = reinterpret_cast<const uint64_t*>(ph[g.route].y) + g.off2;
            // every round's words polled together (one round trip), the rounds' sums of squares side by side past
            // x in shared memory (HEADNORM_ROUNDS x CONSUMER_WARPS floats at byte XBYTES / 2), one barrier
            float* sq = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(xs) + XBYTES / 2);
            // this thread's norm weight, the same every round (element e's is nw[e & 127], e & 127 = tid & 127),
            // loaded before the polls: after the barrier, the slowest of 512 L2 loads held the next one (12-04)
            static_assert(CONSUMERS % 128 == 0, "X_HEADNORM: a thread's weight is the same every round");
            const float nwt = NORM_W_FIRST ? __bfloat162float(nw[tid & 127]) : 0.f;
            // (every thread takes every round, also after a wait gave up: each round has its barriers)
            for (int e0 = 0; e0 < g.len; e0 += HEADNORM_ROUNDS * CONSUMERS) {    // (len: a multiple of 128)
                const uint64_t* a[2 * HEADNORM_ROUNDS];
                float v[2 * HEADNORM_ROUNDS];
#pragma unroll
                for (int u = 0; u < HEADNORM_ROUNDS; ++u) {
                    const int e = e0 + u * CONSUMERS + tid;
                    a[u] = e < g.len ? base + e : nullptr;
                    a[HEADNORM_ROUNDS + u] = e < g.len ? gw + e : nullptr;
                }
                ok = poll_all(a, v, epoch, wait, err, p, t) && ok;
#pragma unroll
                for (int u = 0; u < HEADNORM_ROUNDS; ++u) warp_squares(v[u], sq + u * CONSUMER_WARPS, warp, lane);
                consumers_sync();
#pragma unroll
                for (int u = 0; u < HEADNORM_ROUNDS; ++u) {
                    const int e = e0 + u * CONSUMERS + tid;
                    const float r = rsqrt_approx(__fadd_rn(div_full(four_warps(sq + u * CONSUMER_WARPS, warp & ~3),
                                                                    128.f), g.eps));
                    const float on = bf16r(__fmul_rn(r, v[u]));
                    const float wn = bf16r(__fmul_rn(NORM_W_FIRST ? nwt : __bfloat162float(nw[e & 127]), on));
                    if (e < g.len)
                        xs[j0 + e] = __float2bfloat16_rn(__fmul_rn(wn, sigmoid_tl(bf16r(v[HEADNORM_ROUNDS + u]))));
                }
                consumers_sync();                   // (sq is reused by the next rounds)
            }
        } else if (g.op == X_MLA_Q) {               // the head group's queries: [ql | q_pe] a head
            const int hw = g.len / g.nslot, pe = hw - g.stride, qw = g.off2 + pe;   // q_b's head: [nope | pe]
            const uint64_t* qb = reinterpret_cast<const uint64_t*>(ph[g.route].y);
            const int nr = (g.len + 8 * CONSUMERS - 1) / (8 * CONSUMERS);             // rounds of 8 words a thread
#if ATTN_X_TAIL     // the attention's x (`Chain.attn`: then "norm", "sum"): the new row's and its pe words (one a
            // thread each) polled in the queries' last round, where it has room: two round trips, not four
            const int uq = (g.len - (nr - 1) * 8 * CONSUMERS + CONSUMERS - 1) / CONSUMERS;   // ... in the last
            const XSeg* gn = q + 2 < f.nxseg ? &xsegs[f.xop + q + 1] : nullptr;
            const bool tail = gn && gn->op == X_NORM && gn->route < 0 && gn->len <= CONSUMERS && gn[1].op == X_SUM &&
                              gn[1].nslot == 1 && gn[1].len <= CONSUMERS && uq <= 6;
#else
            const bool tail = false;
#endif
            for (int i = 0; ok && i < nr - tail; ++i) {    // (every thread takes every round; with the row, the
                const int jb = tid + i * 8 * CONSUMERS;          // last one below)
                const uint64_t* a[8];
                float v[8];
#pragma unroll
                for (int u = 0; u < 8; ++u) a[u] = query_word(g, base, qb, slot, hw, qw, jb + u * CONSUMERS);
                ok = poll_all(a, v, epoch, wait, err, p, t);
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    const int j = jb + u * CONSUMERS;
                    if (j < g.len) xs[j0 + j] = __float2bfloat16_rn(v[u]);
                }
            }
#if ATTN_X_TAIL
            if (tail) {                             // the last round, the row's element and pe word in its slots 6
                const int jb = tid + (nr - 1) * 8 * CONSUMERS;          // and 7 (uq <= 6; fixed slots keep a and v
                const uint64_t* a[8];                                   // in registers)
                float v[8];
#if ATTN_ROW_W_SMEM                         // the row's norm weights past the x (when they fit), 4 bytes a thread
                const int wat = (j0 + g.len + gn->len + gn[1].len + 7) / 8 * 8;   // (elements: 16-byte aligned)
                const bool w_smem = (wat + gn->len) * 2 <= XBYTES && gn->len % 2 == 0 &&
                                    (reinterpret_cast<uintptr_t>(aux_bf16(*gn)) & 3u) == 0;   // (4-byte copies)
                if (w_smem && 2 * tid < gn->len)
                    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_u32(xs + wat + 2 * tid)),
                                 "l"(aux_bf16(*gn) + 2 * tid) : "memory");
#endif
#pragma unroll
                for (int u = 0; u < 6; ++u) a[u] = query_word(g, base, qb, slot, hw, qw, jb + u * CONSUMERS);
                a[6] = tid < gn->len ? reinterpret_cast<const uint64_t*>(ph[gn->src].y) + gn->off + tid : nullptr;
                a[7] = tid < gn[1].len ? reinterpret_cast<const uint64_t*>(ph[gn[1].src].y) + gn[1].off + tid : nullptr;
                ok = poll_all(a, v, epoch, wait, err, p, t) && ok;
#pragma unroll
                for (int u = 0; u < 6; ++u) {
                    const int j = jb + u * CONSUMERS;
                    if (j < g.len) xs[j0 + j] = __float2bfloat16_rn(v[u]);
                }
                const float rv = v[6], pv = v[7];
                float ss = 0.f;                     // as "norm" and "sum" make them
                if (tid < gn->len) {
                    const float x = bf16r(__fadd_rn(rv, 0.f));
                    xs[j0 + g.len + tid] = __float2bfloat16_rn(x);
                    ss = fmaf(x, x, ss);
                }
                if (tid < gn[1].len) xs[j0 + g.len + gn->len + tid] = __float2bfloat16_rn(pv);
#if ATTN_ROW_W_SMEM
                asm volatile("cp.async.wait_all;" ::: "memory");    // (the norm's barrier: every thread's copy)
                ok = rms_norm_x(xs + j0 + g.len, gn->len, gn->eps, w_smem ? xs + wat : aux_bf16(*gn), ss, red) && ok;
#else
                ok = rms_norm_x(xs + j0 + g.len, gn->len, gn->eps, aux_bf16(*gn), ss, red) && ok;
#endif
#ifdef TRACE
                if (part_t && tid == 0) part_t[0] = part_t[1] = now_ns();
#endif
                j0 += gn->len + gn[1].len;
                q += 2;
            }
#endif
        } else if (g.op == X_MLA_COMBINE) {         // BMM2's x: the head's split partials combined
            // (past x in shared memory: m_s at sc[s], l_s at sc[S + s], a_s at sc[2 S + s]; S = ATTN_SPLITS >= nslot)
            float* sc = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(xs) + XBYTES / 2);
            const uint64_t* hb = base + static_cast<int64_t>(slot) * (g.len + 2);
#if LIVE_SPLITS                                 // the key blocks that hold keys this launch (the rest: not written)
            const int live = min(static_cast<int>(g.nslot),
                                 static_cast<int>((ph[g.src].n + ph[g.src].rows - 1) / ph[g.src].rows));
#else
            const int live = g.nslot;
#endif
            if (tid < live) {
                float ml[2];
                ok = poll_strided(hb + static_cast<int64_t>(tid) * g.stride, 1, 2, ml, epoch, wait, err, p, t);
                sc[tid] = ml[0];
                sc[ATTN_SPLITS + tid] = ml[1];
            }
            consumers_sync();
            float mx = -INFINITY;
            for (int q2 = 0; q2 < live; ++q2) mx = fmaxf(mx, sc[q2]);
            if (tid < live) sc[2 * ATTN_SPLITS + tid] = expf(__fsub_rn(sc[tid], mx));
            consumers_sync();
            float den = 0.f;
            for (int q2 = 0; q2 < live; ++q2)
                den = __fadd_rn(den, __fmul_rn(sc[2 * ATTN_SPLITS + q2], sc[ATTN_SPLITS + q2]));
            for (int j = tid; ok && j < g.len; j += CONSUMERS) {
                float acc = 0.f;
                for (int s0 = 0; ok && s0 < live; s0 += COMBINE_WORDS) {     // COMBINE_WORDS splits' words a round
                    float v[COMBINE_WORDS];
                    const int ns = min(COMBINE_WORDS, live - s0);
                    ok = poll_strided(hb + static_cast<int64_t>(s0) * g.stride + 2 + j, g.stride, ns, v, epoch,
                                      wait, err, p, t);
#pragma unroll
                    for (int q2 = 0; q2 < COMBINE_WORDS; ++q2)
                        if (q2 < ns) acc = __fadd_rn(acc, __fmul_rn(sc[2 * ATTN_SPLITS + s0 + q2], v[q2]));
                }
                xs[j0 + j] = __float2bfloat16_rn(__fdiv_rn(acc, den));
            }
            consumers_sync();                       // (sc is free again)
        } else if (g.op == X_GATE) {                // bf16(sigmoid(g) o)
            const uint64_t* gb = reinterpret_cast<const uint64_t*>(ph[g.route].y) + g.off2;
            for (int jb = tid; ok && jb < g.len; jb += 4 * CONSUMERS) {
                const uint64_t* a[8];
                float v[8];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int j = jb + u * CONSUMERS;
                    a[u] = j < g.len ? base + j : nullptr;
                    a[4 + u] = j < g.len ? gb + j : nullptr;
                }
                ok = poll_all(a, v, epoch, wait, err, p, t);
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const int j = jb + u * CONSUMERS;
                    if (j < g.len)             // (both a bf16 GEMV's outputs: rounded first)
                        xs[j0 + j] = __float2bfloat16_rn(__fmul_rn(sigmoid_k3(bf16r(v[4 + u])), bf16r(v[u])));
                }
            }
        } else if (g.op == X_SCORE) {               // a top-k's x: keys, then the scores
            float* xf = reinterpret_cast<float*>(xs);
            const float* bias = reinterpret_cast<const float*>(g.aux);
            for (int jb = tid; ok && jb < g.len; jb += 8 * CONSUMERS) {
                const uint64_t* a[8];
                float v[8];
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    const int j = jb + u * CONSUMERS;
                    a[u] = j < g.len ? base + j : nullptr;
                }
                ok = poll_all(a, v, epoch, wait, err, p, t);
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    const int j = jb + u * CONSUMERS;
                    if (!ok || j >= g.len) continue;
                    const float sc = sigmoid_k3(v[u]);
                    xf[j] = __fadd_rn(sc, bias[j]);
                    xf[g.len + j] = sc;
                    // a NaN key ranks nowhere (it compares false both ways): ranks would go unwritten and the
                    // producers waiting for those ids would run out of time far from the cause. Say so here.
                    if (isnan(xf[j])) ok = give_up(err, 7, p, j);
                }
            }
            // The top-k itself, here where the tile loop's registers are free: each key's rank among them (larger
            // first, ties: the lower id first), P lanes a key (each counts every P-th key, then a butterfly); the k
            // best write their ids and, in slot order, their scores. (12-02 14:10: k rounds of a warp argmax, in the
            // tile loop, took ~6 us a sublayer; 12-04: one key a thread, 64 dependent shared loads, 1.4 us.)
            if (q < 4) TMARK(poll_t, q);            // (-DTRACE: thread 0's scores made, before the ranks)
            consumers_sync();
            if (!q) TMARK(poll_t, 1);               // (every thread's)
            uint64_t* y = reinterpret_cast<uint64_t*>(f.y);
            float* chosen = xf + 2 * g.len;
            int P = 1;                              // lanes a key (a power of two: a warp holds whole keys)
            while (P < 32 && 2 * P * g.len <= CONSUMERS) P *= 2;
            for (int jb = 0; jb < g.len; jb += CONSUMERS / P) {     // (the same trips in every lane: the shuffles)
                const int j = jb + tid / P;
                const float kj = j < g.len ? xf[j] : 0.f;
                int rank = 0;
                for (int i = tid % P; j < g.len && i < g.len; i += P) {
                    const float ki = xf[i];
                    rank += ki > kj || (ki == kj && i < j);
                }
                for (int o = P / 2; o; o >>= 1) rank += __shfl_xor_sync(0xffffffffu, rank, o);
                if (ok && j < g.len && tid % P == 0 && rank < f.ne) {
                    store_word(y + rank, static_cast<float>(j), epoch);
                    chosen[rank] = xf[g.len + j];
                }
            }
            if (!q) TMARK(poll_t, 2);               // (thread 0's key ranked)
            consumers_sync();
            if (!q) TMARK(poll_t, 3);               // (every key's)
            if (ok && tid < f.ne) {     // `_topk`: w = s / (sum s + 1e-20) when renormalising, then * scaling
                float sum = 0.f;
                for (int r = 0; r < f.ne; ++r) sum = __fadd_rn(sum, chosen[r]);
                const float w = g.renorm ? __fdiv_rn(chosen[tid], __fadd_rn(sum, 1e-20f)) : chosen[tid];
                store_word(y + f.ne + tid, __fmul_rn(w, g.scaling), epoch);
            }
        }
#ifdef TRACE                                        // (-DTRACE: each part's end, thread 0's view)
        if (part_t && tid == 0 && q < 6) part_t[q] = now_ns();
#endif
        j0 += g.len;
    }
    return ok;
}

__device__ __forceinline__ bool load_x(__nv_bfloat16* xs, const PhaseC& f, const PhaseC* ph, const XIn* x_in,
                                      int64_t slot, uint32_t epoch, bool wait, uint32_t* err, int64_t p, int64_t t,
                                      bool had, const uint64_t (&pre)[XPREFETCH_N],
                                      const uint64_t (&pre2)[XPREFETCH_N]) {
    const int tid = threadIdx.x;
    const bool top = f.kind == TOPK;
    const int xn = top ? f.xlen : f.k;
    const uint64_t* src = f.src >= 0 ? reinterpret_cast<const uint64_t*>(ph[f.src].y) + slot * f.xstride : nullptr;
    const uint64_t* src2 = f.dep2 >= 0 ? reinterpret_cast<const uint64_t*>(ph[f.dep2].y) : nullptr;
    if (!top && !had && src && f.xlen >= xn && (!src2 || f.xlen2 >= xn) && xn % 4 == 0
        && (reinterpret_cast<uintptr_t>(src) & 15) == 0 && (reinterpret_cast<uintptr_t>(src2) & 15) == 0)
        return load_x_fast(xs, src, src2, xn, epoch, wait, err, p, t);
    for (int j0 = tid; j0 < xn; j0 += 8 * CONSUMERS) {
        uint64_t v[8], v2[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int j = j0 + u * CONSUMERS;
            // a word loaded ahead is kept if it is already this launch's; the rest are loaded again here, all
            // together, before any is polled (polling a stale word first would cost a round trip per word)
            const bool ahead = had && j0 == tid && u < XPREFETCH;
            const uint64_t a = ahead ? pre[u % XPREFETCH_N] : 0, a2 = ahead ? pre2[u % XPREFETCH_N] : 0;
            v[u] = j < xn && src ? (epoch_of(a) == epoch ? a : load_word(src + wrap(j, f.xlen))) : 0;
            v2[u] = j < xn && src2 ? (epoch_of(a2) == epoch ? a2 : load_word(src2 + wrap(j, f.xlen2))) : 0;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int j = j0 + u * CONSUMERS;
            if (j >= xn) continue;
            float x;
            if (src) {
                if (!poll_word(src + wrap(j, f.xlen), v[u], epoch, wait, err, 1, p, t)) return false;
                x = value_of(v[u]);
            } else {
                x = x_in_at(x_in, wrap(j, f.xlen));
            }
            if (src2) {
                if (!poll_word(src2 + wrap(j, f.xlen2), v2[u], epoch, wait, err, 1, p, t)) return false;
                x += value_of(v2[u]);
            }
            if (top) reinterpret_cast<float*>(xs)[j] = x;
            else xs[j] = __float2bfloat16_rn(x);
        }
    }
    return true;
}

// Issue the loads of phase f's first XPREFETCH words per thread (slot `slot`) without waiting for them: the words
// arrive while this block computes its current phase, and load_x polls only those not yet of this launch.
__device__ __forceinline__ void prefetch_x(uint64_t (&pre)[XPREFETCH_N], uint64_t (&pre2)[XPREFETCH_N],
                                           const PhaseC& f, const PhaseC* ph, int64_t slot) {
    const int tid = threadIdx.x;
    const int xn = f.kind == TOPK ? f.xlen : f.k;
    const uint64_t* src = reinterpret_cast<const uint64_t*>(ph[f.src].y) + slot * f.xstride;
    const uint64_t* src2 = f.dep2 >= 0 ? reinterpret_cast<const uint64_t*>(ph[f.dep2].y) : nullptr;
#pragma unroll
    for (int u = 0; u < XPREFETCH_N; ++u) {
        const int j = tid + u * CONSUMERS;
        pre[u] = u < XPREFETCH && j < xn ? load_word(src + wrap(j, f.xlen)) : 0;
        pre2[u] = u < XPREFETCH && j < xn && src2 ? load_word(src2 + wrap(j, f.xlen2)) : 0;
    }
}

__device__ __forceinline__ float dot8(uint4 w, float4 a, float4 b) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&w);
    float2 f0 = __bfloat1622float2(h[0]), f1 = __bfloat1622float2(h[1]);
    float2 f2 = __bfloat1622float2(h[2]), f3 = __bfloat1622float2(h[3]);
    return f0.x * a.x + f0.y * a.y + f1.x * a.z + f1.y * a.w + f2.x * b.x + f2.y * b.y + f3.x * b.z + f3.y * b.w;
}

__device__ __forceinline__ float dot8_bf16(uint4 w, uint4 x) {   // 8 bf16 products, fp32 sum in order
    const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&w);
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&x);
    float s = 0.f;
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        const float2 fa = __bfloat1622float2(a[h]), fb = __bfloat1622float2(b[h]);
        s = fmaf(fa.x, fb.x, s);
        s = fmaf(fa.y, fb.y, s);
    }
    return s;
}

// WARP_ROWS: rows rows_here of a tile (chunks 16-byte chunks a row), each summed by L lanes of one warp, L the
// power of two >= chunks up to 32 (32 / L rows a warp at a time); warps take rows round robin, with no barrier.
__device__ __forceinline__ void warp_rows(const uint4* tile, const uint4* x8, int chunks, int rows_here, int warp,
                                          int lane, uint64_t* y, uint32_t epoch) {
    int L = 32;
    while (L > 1 && L / 2 >= chunks) L /= 2;
    const int per = 32 / L;                     // rows a warp sums at a time
    for (int base = warp * per; base < rows_here; base += CONSUMER_WARPS * per) {
        const int r = base + lane / L;
        const bool valid = r < rows_here;
        float acc = 0.f;
#ifndef SKIP_COMPUTE
        float part[4] = {0.f, 0.f, 0.f, 0.f};
        const uint4* w = tile + (valid ? r : 0) * chunks;
        for (int c0 = lane % L; c0 < chunks; c0 += 4 * L) {
            uint4 wv[4], xv[4];                 // four chunks' loads first, then their sums in four chains
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int c = c0 + u * L;
                const bool in = valid && c < chunks;
                wv[u] = in ? w[c] : make_uint4(0u, 0u, 0u, 0u);
                xv[u] = in ? x8[c] : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) part[u] += dot8_bf16(wv[u], xv[u]);
        }
        acc = (part[0] + part[1]) + (part[2] + part[3]);
#endif
        for (int off = L / 2; off; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (valid && lane % L == 0) store_word(y + r, acc, epoch);
    }
}

// MMA_TILES: whether a tile is summed on tensor cores, and so packed for it (megakernel_chain.py `mma_tile`).
__device__ __forceinline__ bool mma_tile(int rows, int rows_here, int k) {
    return MMA_ONLY || (MMA_TILES && rows % 16 == 0 && rows_here == rows && k % 32 == 0 && k >= MMA_MIN_K);
}

// D += A B for one m16n8k16 step: A 16 x 16 bf16 (row), B 16 x 8 bf16 (col), D 16 x 8 fp32.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

struct MmaSplit {                        // a phase's split of its tiles over the warps (computed once a phase)
    int KB, wpr, rb, ks;                    // k blocks; warps per row block; this warp's row block and first k block
};
__device__ __forceinline__ MmaSplit mma_split(int rows, int k, int warp) {
    const int RB = rows / 16, wpr = RB <= CONSUMER_WARPS ? CONSUMER_WARPS / RB : 1;
    return MmaSplit{k / 32, wpr, warp / wpr, warp % wpr};
}

// A packed tile (rows x k, rows = 16 RB): 16-byte chunks in the order [rb][kb][half][g][q], chunk = the 8 weights
// of row 16 rb + 8 half + g at columns 32 kb + 8 q ... + 7. Lane (g, q) = (lane / 4, lane % 4) takes chunks U
// (half 0) and V (half 1) of its k block, 512 contiguous bytes a warp, and x's chunk X at 32 kb + 8 q, and makes
// them two m16n8k16 steps. The k order is permuted the same way in A and B: step 1 sees columns 8q + {0, 1, 2, 3}
// as its 2q, 2q + 1, 2q + 8, 2q + 9, step 2 columns 8q + {4..7}. B has x in all eight columns, so D's columns are
// equal. Warps split (row block, k blocks); their partial sums meet in red (double-buffered by MMA tile).
// Returns once this warp's partials are in red; the caller syncs, then sums.
__device__ __forceinline__ void mma_partials(const uint4* tile, const uint4* x8, int rows, const MmaSplit& m, int warp,
                                             int lane, float* red) {
    const int RB = rows / 16, KB = m.KB, wpr = m.wpr, rb = m.rb, ks = m.ks;
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    if (rb < RB) {
        const uint4* t = tile + static_cast<int64_t>(rb) * KB * 64 + lane;
        for (int kb = ks; kb < KB; kb += wpr) {
            const uint4 U = t[kb * 64], V = t[kb * 64 + 32], X = x8[kb * 4 + lane % 4];
            mma_bf16(d, U.x, V.x, U.y, V.y, X.x, X.y);
            mma_bf16(d, U.z, V.z, U.w, V.w, X.z, X.w);
        }
    }
    if (lane % 4 == 0) {                    // column 0: rows g and g + 8 of the row block
        red[warp * 16 + lane / 4] = d[0];
        red[warp * 16 + lane / 4 + 8] = d[2];
    }
}

// An MMA tile's rows into y[0 .. rows) (every consumer thread calls it: one barrier). The partials go to mma_red by
// the parity of MMA tiles: a warp writes the half of MMA tile j + 2 only once past MMA tile j + 1's sync, which the
// threads summing tile j reach after they have read it.
__device__ __forceinline__ float mma_tile_sum(const unsigned char* tile, const __nv_bfloat16* xs, int rows,
                                              const MmaSplit& ms, float* mma_red, uint32_t& mma_count, uint64_t* y,
                                              uint32_t epoch) {
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    float* r16 = mma_red + (mma_count++ & 1u) * CONSUMER_WARPS * 16;
#ifndef SKIP_COMPUTE
    mma_partials(reinterpret_cast<const uint4*>(tile), reinterpret_cast<const uint4*>(xs), rows, ms, warp, lane, r16);
#endif
    consumers_sync();                       // every warp's partials are in (the next tile's use the other half)
    float value = 0.f;                      // (returned: row tid's value, for ARGMAX; threads past the rows: 0)
    if (tid < rows) {                       // row tid: its row block's warps' partials, in order
        float sum = 0.f;
        const float* part = r16 + (tid / 16) * ms.wpr * 16 + tid % 16;
        for (int w2 = 0; w2 < ms.wpr; ++w2) sum += part[w2 * 16];
        store_word(y + tid, sum, epoch);
        value = sum;
    }
    return value;
}

// The blocks phase f's tiles are dealt over: all nblk, or (f.spare > 0, and at least a quarter of the grid left) the
// nblk - f.spare blocks from block tile0 mod nblk on, so that the f.spare blocks before them (the phase before's,
// which run its tiles meanwhile) take none: tile t goes to block (tile0 + t mod stride) mod nblk.
__device__ __forceinline__ int phase_stride(const PhaseC& f, int64_t nblk) {
    const int n = static_cast<int>(nblk), m = n - f.spare;
    return f.spare && 4 * m >= n ? m : n;
}

// This block's first tile of phase f (tiles are dealt round robin: tile g goes to block g % gridDim.x, over the
// phase's `phase_stride` blocks; a block past them: tile0 + ntiles, none), its next ones g + phase_stride.
// In 32 bits: a 64-bit remainder of a negative number is a call to a slow routine, and every thread makes this
// one for every phase.
__device__ __forceinline__ int first_tile(const PhaseC& f, int64_t nblk) {
    int d = (static_cast<int>(blockIdx.x) - f.tile0) % static_cast<int>(nblk);   // (negative: tile0 > block)
    d = d < 0 ? d + static_cast<int>(nblk) : d;
    return f.tile0 + (d < phase_stride(f, nblk) ? d : f.ntiles);
}

// The first row of phase f's tile t. Block b takes the tiles t = c, c + nblk, c + 2 nblk, ... (c = (b - tile0) mod
// nblk); with PAIR_TILES, in a ROUTED phase with x per expert (xstride) over more tiles than blocks, the tiles of
// column c are row blocks in a run (c R, c R + 1, ... for the F columns of R = ceil(ntiles / nblk) tiles, then runs
// of R - 1), so that a block's tiles are one expert's (ne a multiple of R row blocks) and it loads that x once;
// else tile t is row block t. Every row is computed as before, by another block: the same outputs bit for bit.
// (`chain.py` `tile_row0`.)
__device__ __forceinline__ int tile_row0(const PhaseC& f, int t, int nblk) {
#if PAIR_TILES
    if (f.kind == ROUTED && f.xstride && f.ntiles > nblk) {
        const int R = (f.ntiles + nblk - 1) / nblk, F = f.ntiles - (R - 1) * nblk, r = t / nblk, c = t % nblk;
        return (c < F ? c * R + r : F * R + (c - F) * (R - 1) + r) * f.rows;
    }
#endif
    return t * f.rows;
}

// This block's tiles in order (phase p, global tile g; p == nphase past the last), for the L2 prefetches.
struct Cursor {
    int64_t p, g;
    __device__ void settle(const PhaseC* ph, int64_t nphase, int64_t nblk) {
        while (p < nphase && g >= ph[p].tile0 + ph[p].ntiles)
            if (++p < nphase) g = first_tile(ph[p], nblk);
    }
    __device__ void next(const PhaseC* ph, int64_t nphase, int64_t nblk) {
        g += phase_stride(ph[p], nblk);
        settle(ph, nphase, nblk);
    }
};

#if RECIPES && MMA_ONLY
#ifndef ATTN_HEADS
#define ATTN_HEADS 8                    // ATTN: heads a tile (a head group; the tile's x holds their queries)
#endif
#define ATTN_ROWS_WARP 2                // ... keys a warp: a tile is ATTN_ROWS_WARP CONSUMER_WARPS keys (3: spills)
// An ATTN phase (MLA decode attention over the latent cache, B = 1): f.n keys, the f.n - 1 cache rows (f.w, bf16
// [rows][k], k = rank + pe) and the new row; tile t covers key block t / f.ne (f.rows keys) for head group t % f.ne
// (its x slot). Its x (X_MLA_Q, then the new row: X_NORM of the latent and the pe words as they are) is
// [ATTN_HEADS queries | the new row], k each. Per tile and head, the words [m, l, O (rank)]: the block's max score m,
// l = sum exp(s - m) and O = sum exp(s - m) row[:rank] over its keys (fp32; scores s = scale (q . row), the dot in
// each lane's order, then a warp butterfly). The block with tile 0 appends the new row to the cache (row f.n - 1,
// which no tile reads from there). Every consumer thread calls it (512; three barriers). part_t (-DTRACE, the
// phase's first tile): thread 0's times [3] begun, [4] scores, [5] softmax, [6] done.
#if ATTN_MMA
#if ATTN_HEADS != 8 || ATTN_ROWS_WARP * CONSUMER_WARPS != 32
#error "ATTN_MMA: tiles of 8 heads (the mma's n) and 32 keys (two blocks of 16)"
#endif
#define ATTN_KCHUNKS 4                  // ATTN_MMA: the scores' k split over warps (2 key blocks x 4: warps 0-7)
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {      // ldmatrix: lanes 8 i .. 8 i + 7
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"   // give matrix i's rows
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], uint32_t addr) {      // (lanes 0-15's addresses)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
// x = hi + mid + lo, three bf16 (x - hi and its rest exact in fp32): a pair's three parts as packed bf16 pairs
__device__ __forceinline__ void bf16_parts(float a, float b, uint32_t (&p)[3]) {
    const float ah = bf16r(a), bh = bf16r(b), ar = __fsub_rn(a, ah), br = __fsub_rn(b, bh);
    const float am = bf16r(ar), bm = bf16r(br);
    p[0] = bits2(ah, bh);
    p[1] = bits2(am, bm);
    p[2] = bits2(__fsub_rn(ar, am), __fsub_rn(br, bm));
}
#endif
__device__ __noinline__ void attn_tile(const PhaseC& f, const XSeg& q0, const __nv_bfloat16* tile,
                                          const __nv_bfloat16* xs, int t, uint32_t epoch,
                                          unsigned long long* part_t) {
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int k = f.k, rows = f.rows, keys = f.n, cache_len = keys - 1;
    const int rank = q0.stride, row0 = (t / f.ne) * rows;
    const float scale = q0.scaling;
    // the scores, then the weights, [ATTN_HEADS][rows] fp32 past x in shared memory (the host checks that they fit)
    float* sc = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(const_cast<__nv_bfloat16*>(xs)) +
                                         ((ATTN_HEADS + 1) * k * 2 + 15) / 16 * 16);
    uint64_t* y = reinterpret_cast<uint64_t*>(f.y);
    const __nv_bfloat16* nrow = xs + ATTN_HEADS * k;                  // the new row
    consumers_sync();                       // every warp is done with the last tile's weights in sc
#ifdef TRACE
    if (part_t && tid == 0) {
        part_t[3] = now_ns();
        part_t[11] = clock64();
    }
#endif
    if (t == 0)                             // the cache's new row (no tile of this launch reads it from there)
        for (int j = tid; j < k; j += CONSUMERS)
            const_cast<__nv_bfloat16*>(reinterpret_cast<const __nv_bfloat16*>(f.w))[
                static_cast<int64_t>(cache_len) * k + j] = nrow[j];
    const int nkeys = min(rows, keys - row0), ncache = min(nkeys, cache_len - row0);   // keys from the tile: ncache
#if ATTN_MMA
    // the scores, keys x heads = K Q^T on tensor cores (m16n8k16): warp w < 8 takes key block w & 1 (16 keys; a key
    // past the cache's rows reads the new row, masked below if past the keys) and the k steps of chunk w >> 1, its
    // sums into part[chunk][key][head]; then thread (key, head) adds the chunks in order
    const uint32_t tile_s = smem_u32(tile), nrow_s = smem_u32(nrow);
    float* part = sc + ATTN_HEADS * rows;
    if (warp < 2 * ATTN_KCHUNKS) {
        const int mt = warp & 1, kc = warp >> 1, S = k / 16, g = lane >> 2, tq = lane & 3;
        const int r = mt * 16 + (lane & 15);
        const uint32_t ra = (r < ncache ? tile_s + r * k * 2 : nrow_s) + (lane >> 4) * 16;
        const uint32_t qa = smem_u32(xs) + (lane & 7) * k * 2 + ((lane >> 3) & 1) * 16;
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        for (int st = kc * S / ATTN_KCHUNKS; st < (kc + 1) * S / ATTN_KCHUNKS; ++st) {
            uint32_t a[4], b[2];
            ldsm_x4(a, ra + st * 32);
            ldsm_x2(b, qa + st * 32);
            mma_bf16(d, a[0], a[1], a[2], a[3], b[0], b[1]);
        }
        float* pp = part + (kc * rows + mt * 16 + g) * ATTN_HEADS + 2 * tq;
        *reinterpret_cast<float2*>(pp) = make_float2(d[0], d[1]);
        *reinterpret_cast<float2*>(pp + 8 * ATTN_HEADS) = make_float2(d[2], d[3]);
    }
    consumers_sync();
    if (tid < rows * ATTN_HEADS) {
        const int r = tid / ATTN_HEADS;
        float s = part[tid];
#pragma unroll
        for (int c = 1; c < ATTN_KCHUNKS; ++c) s = __fadd_rn(s, part[c * rows * ATTN_HEADS + tid]);
        sc[(tid % ATTN_HEADS) * rows + r] = r < nkeys ? __fmul_rn(s, scale) : -INFINITY;
    }
#else
    const int k2 = k / 2;
    const __nv_bfloat162* qh = reinterpret_cast<const __nv_bfloat162*>(xs);
    // the scores: warp w takes keys w + 16 m (m < ATTN_ROWS_WARP: rows = ATTN_ROWS_WARP CONSUMER_WARPS, the host
    // checks), lane l the pairs l, l + 32, ... of each: the queries' pair loaded once for the warp's keys
    const __nv_bfloat162* krow[ATTN_ROWS_WARP];
#pragma unroll
    for (int m = 0; m < ATTN_ROWS_WARP; ++m) {
        const int r = warp + m * CONSUMER_WARPS;
        krow[m] = r >= nkeys ? nullptr : reinterpret_cast<const __nv_bfloat162*>(r < ncache ? tile + r * k : nrow);
    }
    float acc[ATTN_ROWS_WARP][ATTN_HEADS];
#pragma unroll
    for (int m = 0; m < ATTN_ROWS_WARP; ++m)
#pragma unroll
        for (int h = 0; h < ATTN_HEADS; ++h) acc[m][h] = 0.f;
    for (int q = lane; q < k2; q += 32) {
        float2 qv[ATTN_HEADS];
#pragma unroll
        for (int h = 0; h < ATTN_HEADS; ++h) qv[h] = __bfloat1622float2(qh[h * k2 + q]);
#pragma unroll
        for (int m = 0; m < ATTN_ROWS_WARP; ++m) {
            if (!krow[m]) continue;
            const float2 c = __bfloat1622float2(krow[m][q]);
#pragma unroll
            for (int h = 0; h < ATTN_HEADS; ++h) acc[m][h] = fmaf(c.y, qv[h].y, fmaf(c.x, qv[h].x, acc[m][h]));
        }
    }
#if ATTN_SUMS_TOGETHER                      // every sum's butterfly a level at a time (independent shuffles in
#pragma unroll                                  // flight), then lane h stores head h's: the same adds in the same order
    for (int o = 16; o; o >>= 1)
#pragma unroll
        for (int m = 0; m < ATTN_ROWS_WARP; ++m)
#pragma unroll
            for (int h = 0; h < ATTN_HEADS; ++h) acc[m][h] += __shfl_xor_sync(0xffffffffu, acc[m][h], o);
#pragma unroll
    for (int m = 0; m < ATTN_ROWS_WARP; ++m) {
        const int r = warp + m * CONSUMER_WARPS;
        float mine = acc[m][0];
#pragma unroll
        for (int h = 1; h < ATTN_HEADS; ++h) mine = lane == h ? acc[m][h] : mine;
        if (lane < ATTN_HEADS) sc[lane * rows + r] = r < nkeys ? __fmul_rn(mine, scale) : -INFINITY;
    }
#else
#pragma unroll
    for (int m = 0; m < ATTN_ROWS_WARP; ++m) {
        const int r = warp + m * CONSUMER_WARPS;
#pragma unroll
        for (int h = 0; h < ATTN_HEADS; ++h) {
            for (int o = 16; o; o >>= 1) acc[m][h] += __shfl_xor_sync(0xffffffffu, acc[m][h], o);
            if (lane == h) sc[h * rows + r] = r < nkeys ? __fmul_rn(acc[m][h], scale) : -INFINITY;
        }
    }
#endif
#endif
    consumers_sync();
#ifdef TRACE
    if (part_t && tid == 0) part_t[4] = now_ns();
#endif
    if (warp < ATTN_HEADS) {                // warp h: head h's max, weights and sum over the block's keys
        float m = -INFINITY;
        for (int r = lane; r < rows; r += 32) m = fmaxf(m, sc[warp * rows + r]);
        for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float l = 0.f;
        for (int r = lane; r < rows; r += 32) {
            const float e = r < nkeys ? expf(__fsub_rn(sc[warp * rows + r], m)) : 0.f;
            sc[warp * rows + r] = e;
            l += e;
        }
        for (int o = 16; o; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
        if (lane == 0) {
            uint64_t* yh = y + static_cast<int64_t>(t * ATTN_HEADS + warp) * (rank + 2);
            store_word(yh, m, epoch);
            store_word(yh + 1, l, epoch);
        }
    }
    consumers_sync();
#ifdef TRACE
    if (part_t && tid == 0) part_t[5] = now_ns();
#endif
    uint64_t* yo = y + static_cast<int64_t>(t * ATTN_HEADS) * (rank + 2) + 2;
#if ATTN_MMA
    {   // O^T, columns x heads = V^T P^T on tensor cores: warp w the column blocks w, w + 16, ... (16 columns), two k
        // steps of 16 keys; the weights (B) as three bf16 parts, each part's mma adding into the same fp32 sums
        const int g = lane >> 2, tq = lane & 3;
        uint32_t pb[2][3][2];                       // [k step][part][b0, b1]
#pragma unroll
        for (int ks = 0; ks < 2; ++ks)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float2 w = *reinterpret_cast<const float2*>(sc + g * rows + ks * 16 + half * 8 + 2 * tq);
                uint32_t p3[3];
                bf16_parts(w.x, w.y, p3);
#pragma unroll
                for (int q = 0; q < 3; ++q) pb[ks][q][half] = p3[q];
            }
        for (int mt = warp; mt * 16 < rank; mt += CONSUMER_WARPS) {
            float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int ks = 0; ks < 2; ++ks) {
                const int key = ks * 16 + (lane & 7) + ((lane >> 4) << 3);      // (past the keys: weight 0)
                const uint32_t va = (key < ncache ? tile_s + key * k * 2 : nrow_s) +
                                    (mt * 16 + ((lane >> 3) & 1) * 8) * 2;
                uint32_t a[4];
                ldsm_x4_trans(a, va);
#pragma unroll
                for (int q = 0; q < 3; ++q) mma_bf16(d, a[0], a[1], a[2], a[3], pb[ks][q][0], pb[ks][q][1]);
            }
            const int c = mt * 16 + g;
            store_word(yo + (2 * tq) * (rank + 2) + c, d[0], epoch);
            store_word(yo + (2 * tq + 1) * (rank + 2) + c, d[1], epoch);
            store_word(yo + (2 * tq) * (rank + 2) + c + 8, d[2], epoch);
            store_word(yo + (2 * tq + 1) * (rank + 2) + c + 8, d[3], epoch);
        }
    }
#else
    for (int c = tid; c < rank; c += CONSUMERS) {     // O: thread c, every head, keys in order
        float o[ATTN_HEADS];
#pragma unroll
        for (int h = 0; h < ATTN_HEADS; ++h) o[h] = 0.f;
        for (int r = 0; r < nkeys; r += 2) {        // 2 keys a step: their weights one 8-byte load a head
            const float v0 = __bfloat162float(r < ncache ? tile[r * k + c] : nrow[c]);
            const float v1 = r + 1 >= nkeys ? 0.f              // (past the keys: 0, and so is its weight)
                                            : __bfloat162float(r + 1 < ncache ? tile[(r + 1) * k + c] : nrow[c]);
#pragma unroll
            for (int h = 0; h < ATTN_HEADS; ++h) {
                const float2 w = *reinterpret_cast<const float2*>(sc + h * rows + r);
                o[h] = fmaf(w.y, v1, fmaf(w.x, v0, o[h]));
            }
        }
#pragma unroll
        for (int h = 0; h < ATTN_HEADS; ++h) store_word(yo + h * (rank + 2) + c, o[h], epoch);
    }
#endif
#ifdef TRACE
    if (part_t) {
        consumers_sync();
        if (tid == 0) {
            part_t[6] = now_ns();
            part_t[12] = clock64();
        }
    }
#endif
}
#endif

#if RECIPES && MMA_ONLY && defined(TRACE)
__device__ __forceinline__ int attn_before(const PhaseC* ph, int64_t p) {     // ATTN phases before p
    int a = 0;
    for (int64_t q = 0; q < p; ++q) a += ph[q].kind == ATTN;
    return a;
}
#endif

#if RECIPES && MMA_ONLY
// An ATTN phase: this block's tiles (g0, g0 + stride, ...; ring slots from tile count i on), x loaded where the head
// group changes. Returns the tiles done, or -1: a wait gave up.
__device__ __forceinline__ int attn_phase(const PhaseC& f, const PhaseC* ph, const XSeg* xsegs,
                                          const unsigned char* ring, __nv_bfloat16* xs, uint64_t* full,
                                          uint64_t* empty, uint32_t i, int g0, int stride, uint32_t epoch, bool wait,
                                          uint32_t* err, int64_t p, float* red, float* comb_w, int* gave_up,
                                          __nv_bfloat16* xdump,
                                          unsigned long long* t_x, unsigned long long* t_tile,
                                          unsigned long long* part_t) {
    const int tid = threadIdx.x;
    int n = 0, have = -1;
    for (int gt = g0; gt < f.tile0 + f.ntiles; gt += stride, ++i, ++n) {
        const int t = gt - f.tile0, hg = t % f.ne;
        const uint32_t s = i % NSLOT;
        const bool no_keys = LIVE_SPLITS && (t / f.ne) * f.rows >= f.n;   // (no x, no words; BMM2 skips it)
        if (!no_keys && hg != have) {
            consumers_sync();               // every warp is done with the last x
            if (!load_x_recipe(xs, f, ph, xsegs, hg, epoch, wait, err, p, t, red, comb_w, n ? nullptr : part_t))
                *gave_up = 1;
            consumers_sync();
            if (*gave_up) return -1;
            if (xdump && t < f.ne && hg < XDUMP_SLOTS)
                for (int j = tid; j < (ATTN_HEADS + 1) * f.k; j += CONSUMERS)
                    xdump[(p * XDUMP_SLOTS + hg) * XMAX + j] = xs[j];
            have = hg;
        }
#ifdef PHASE_TIMES
        if (tid == 0 && n == 0) atomicMin(t_x, static_cast<unsigned long long>(now_ns()));
#endif
        if (!wait_slot(&full[s], (i / NSLOT) & 1u, err, 2, p, t)) return -1;
#ifdef PHASE_TIMES
        if (tid == 0 && n == 0) atomicMin(t_tile, static_cast<unsigned long long>(now_ns()));
#endif
        if (!no_keys) {
            attn_tile(f, xsegs[f.xop], reinterpret_cast<const __nv_bfloat16*>(ring + s * SLOT_BYTES), xs, t, epoch,
                      n ? nullptr : part_t);
#if defined(TRACE) && defined(ATTN_TWICE)       // (a diagnostic: the tile run again, its code and data now warm;
            attn_tile(f, xsegs[f.xop], reinterpret_cast<const __nv_bfloat16*>(ring + s * SLOT_BYTES), xs, t, epoch,
                      n ? nullptr : part_t + 4);  // the same words stored again, timed in part_t[7..10])
#endif
        }
        __syncwarp();
        if (tid % 32 == 0) mbar_arrive(&empty[s]);     // this warp is done with slot s
    }
    return n;
}
#endif

#if RECIPES && MMA_ONLY
// A GEMV phase whose x is X_ATTNRES: the x once, then this block's tiles (g0, g0 + stride, ...; ring slots from tile
// count i on), tensor-core tiles all (MMA_ONLY). Apart from the tile loop: the x load's registers, inside it, made the
// tile loop spill. Returns the tiles done, or -1: a wait gave up.
__device__ __forceinline__ int attnres_phase(const PhaseC& f, const PhaseC* ph, const XSeg* xsegs, const XIn* x_in,
                                             const unsigned char* ring, __nv_bfloat16* xs, uint64_t* full,
                                             uint64_t* empty, uint32_t i, int g0, int stride, uint32_t epoch, bool wait,
                                             uint32_t* err, int64_t p, float* red, float* mma_red,
                                             uint32_t& mma_count, int* gave_up, __nv_bfloat16* xdump,
                                             unsigned long long* t_x, unsigned long long* t_tile,
                                             unsigned long long* tr, unsigned long long* am_block) {
    const int tid = threadIdx.x;
    TMARK(tr, 0);                           // (-DTRACE: a generic trace unit, `x_load_parts`)
    if (tr && tid == 0) tr[16] = p + 1;
    consumers_sync();                       // every warp is done with the last x
    TMARK(tr, 3);
    if (!attnres_x(xs, xsegs[f.xop], ph, x_in, g0 - f.tile0, epoch, wait, err, p, red, mma_red, tr)) *gave_up = 1;
    TMARK(tr, 10);
    consumers_sync();
    TMARK(tr, 1);
    if (*gave_up) return -1;
    if (xdump && g0 == f.tile0)
        for (int j = tid; j < f.k; j += CONSUMERS) xdump[p * XDUMP_SLOTS * XMAX + j] = xs[j];
#ifdef PHASE_TIMES
    if (tid == 0) atomicMin(t_x, static_cast<unsigned long long>(now_ns()));
#endif
    const MmaSplit ms = mma_split(f.rows, f.k, tid / 32);
    uint64_t* y = reinterpret_cast<uint64_t*>(f.y);
    int n = 0;
    for (int g = g0; g < f.tile0 + f.ntiles; g += stride, ++i, ++n) {
        const uint32_t s = i % NSLOT;
        if (!wait_slot(&full[s], (i / NSLOT) & 1u, err, 2, p, g - f.tile0)) return -1;
#ifdef PHASE_TIMES
        if (tid == 0 && n == 0) atomicMin(t_tile, static_cast<unsigned long long>(now_ns()));
#endif
        if (n == 0) TMARK(tr, 2);
        const float v = mma_tile_sum(ring + s * SLOT_BYTES, xs, f.rows, ms, mma_red, mma_count,
                                     y + (g - f.tile0) * f.rows, epoch);
        (void)v;
#if ARGMAX == 1
        if (am_block && (tid & ~31) < f.rows) {     // (the tile's rows' warps) the warp's largest key, then the
            unsigned long long key = tid < f.rows ? argmax_key(v, (g - f.tile0) * f.rows + tid) : 0ull;  // block's
#pragma unroll
            for (int off = 16; off; off >>= 1) key = max_u64(key, __shfl_xor_sync(0xffffffffu, key, off));
            if (tid % 32 == 0) atomicMax(am_block, key);
        }
#endif
        __syncwarp();
        if (tid % 32 == 0) mbar_arrive(&empty[s]);     // this warp is done with slot s
    }
    return n;
}
#endif

// Shared memory: the ring (NSLOT x SLOT_BYTES), x (XBYTES), the phase table (nphase x 80 bytes), the x recipes
// (nxseg x 64 bytes), the barriers (2 x NSLOT). xdump (null: none): each x made by a recipe for a GEMV or routed
// phase p, slot s, as bf16 at xdump + (p XDUMP_SLOTS + s) XMAX, written by the block with the slot's first tile (a
// check of the recipes against the host's). Producer and consumers walk the same tiles in the same order: phase by
// phase, this block's tiles of each phase.
#if STEP_LOOP && (PDL || PREFETCH_TILES || defined(TRACE) || defined(TRACE_TILES))
#error "STEP_LOOP is built without PDL, PREFETCH_TILES, TRACE and TRACE_TILES (their bookkeeping is per launch)"
#endif
extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM)
chain_kernel(const Phase* __restrict__ ph_global, int64_t nphase, const XIn* __restrict__ x_in,
#if EPOCH_PTR && STEP_LOOP                  // (STEP_LOOP: stream mode, a constant: the host refuses others)
             uint32_t* counters, uint32_t* __restrict__ epoch_at, int mode_arg, uint32_t* err,
             unsigned long long* t_done,
#elif EPOCH_PTR
             uint32_t* counters, uint32_t* __restrict__ epoch_at, int mode, uint32_t* err,
             unsigned long long* t_done,
#else
             uint32_t* counters, uint32_t epoch, int mode, uint32_t* err, unsigned long long* t_done,
#endif
             unsigned long long* t_start, unsigned long long* trace, unsigned long long* tile_trace,
             const XSeg* __restrict__ xseg_global, int64_t nxseg, __nv_bfloat16* xdump
#if STEP_INPUTS
             , const int64_t* __restrict__ step_ids, STEP_LENGTHS_PTR step_lengths, int64_t x_len
#endif
#if ARGMAX
             , int64_t* am_ids, int64_t* am_ring, const unsigned char* __restrict__ am_active,
             int64_t am_ring_stride, int64_t am_ring_rows, unsigned long long* am_best
#endif
#if COMMIT_LENGTHS
             , const unsigned char* __restrict__ commit_active
#endif
#if STEP_LOOP
             , int64_t nsteps
#endif
             ) {
    extern __shared__ __align__(128) unsigned char smem[];
#ifdef BLOCK_TIMES     // -DBLOCK_TIMES (with PHASE_TIMES): the four times per phase of each block, not of the first
    t_done += static_cast<int64_t>(blockIdx.x) * 4 * nphase;   // / last block ([blocks][4][nphase] on the host)
#endif
    unsigned char* ring = smem;
    __nv_bfloat16* xs = reinterpret_cast<__nv_bfloat16*>(smem + NSLOT * SLOT_BYTES);   // (top-k: fp32)
    PhaseC* ph = reinterpret_cast<PhaseC*>(smem + NSLOT * SLOT_BYTES + XBYTES);
    XSeg* xsegs = reinterpret_cast<XSeg*>(ph + nphase);
    uint64_t* full = reinterpret_cast<uint64_t*>(xsegs + nxseg);
    uint64_t* empty = full + NSLOT;
    __shared__ int gave_up;
#if RECIPES
    __shared__ __nv_bfloat16* xdump_s;          // (read there where it is used: in a register, it was spilled)
#endif
#if STEP_INPUTS
    __shared__ const XIn* x_row_s;              // the token's embedding row (in shared memory: as a register, spilled)
#define X_IN x_row_s
#else
#define X_IN x_in
#endif
    __shared__ __align__(16) float red[CONSUMERS / 32];
#if ARGMAX
    __shared__ unsigned long long am_block;     // the block's largest LM-head key (`argmax_key`; 0: none)
#endif
#if STEP_LOOP
    __shared__ uint32_t last_epoch_s, epoch_s;  // the launch's last step's epoch, the consumers' step's
    __shared__ int32_t nsteps_s;                // the steps this launch runs
    // the arguments the step's tail and the next step's start read, from shared memory there (a load after a
    // barrier, which the compiler cannot hoist out of the loop into a register; alone it left the spills as they
    // were, 92 bytes, and it is kept as built and measured)
    __shared__ struct {
        uint32_t* counters; uint32_t* err; int64_t* am_ids; int64_t* am_ring; const unsigned char* am_active;
        unsigned long long* am_best; int64_t* step_lengths; const unsigned char* commit_active; const XIn* x_in;
        int64_t am_ring_stride, am_ring_rows, x_len, nphase;
    } tail_s;
#endif
#if RECIPES
    __shared__ float comb_w[COMBINE_MAX];       // an X_COMBINE_NORM's weights
#endif
    // per tile parity, warp, row of 16 (and X_ATTNRES's sums in an x load: 8 a warp)
    __shared__ __align__(16) float mma_red[MMA_TILES ? 2 * CONSUMER_WARPS * 16 : (RECIPES ? 8 * CONSUMER_WARPS : 1)];
#if STEP_LOOP           // (a register or a spill slot less: the tile loops test the mode)
    constexpr int mode = STREAM;
    (void)mode_arg;
#endif
    const int tid = threadIdx.x;
    const int64_t nblk = gridDim.x;
    const bool wait = mode != NODEPS;

#if PDL                                     // (read after the wait, by the producer and the consumers)
    uint32_t epoch = 0;
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#elif STEP_LOOP                             // the first step's epoch (each role adds one a step)
    uint32_t epoch = step_epoch(epoch_at, step_lengths);
#elif STEP_INPUTS                           // this launch's epoch: the base plus the sequence's length
    const uint32_t epoch = step_epoch(epoch_at, step_lengths);
#elif EPOCH_PTR
    const uint32_t epoch = *epoch_at;       // this launch's epoch, from device memory: a CUDA graph can replay it
#endif

#if STEP_INPUTS && !PDL                     // (PDL: the consumers set the key count after their wait)
    const int32_t keys = static_cast<int32_t>(*step_lengths) + 1;   // the cache rows and the new one
    for (int64_t p = tid; p < nphase; p += THREADS) {
        PhaseC c = compact(ph_global[p]);
        if (c.kind == ATTN) c.n = keys;
        ph[p] = c;
    }
#else
    for (int64_t p = tid; p < nphase; p += THREADS) ph[p] = compact(ph_global[p]);
#endif
#if RECIPES
    for (int64_t q = tid; q < nxseg; q += THREADS) xsegs[q] = xseg_global[q];
#endif
    if (tid == 0) {
        for (int s = 0; s < NSLOT; ++s) {
            mbar_init(&full[s], 1);                 // the producer's arrive (with the tile's bytes)
            mbar_init(&empty[s], CONSUMERS / 32);   // one arrive per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        gave_up = 0;
#if ARGMAX
        am_block = 0;
#endif
#if RECIPES
        xdump_s = xdump;
#endif
#if STEP_LOOP
        // Only an active sequence runs more than one step: an inactive one's lengths do not move, so its epochs
        // repeat from launch to launch (the engine's capture warm-ups), and the token word a step waits for may
        // already hold the awaited epoch from an earlier launch (that step would begin before every block ended the
        // last). An active sequence's epochs only grow (a step's length; a new sequence's base above them all).
        nsteps_s = commit_active && commit_active[0] ? static_cast<int32_t>(nsteps) : 1;
        tail_s.counters = counters;
        tail_s.err = err;
        tail_s.am_ids = am_ids;
        tail_s.am_ring = am_ring;
        tail_s.am_active = am_active;
        tail_s.am_best = am_best;
        tail_s.step_lengths = step_lengths;
        tail_s.commit_active = commit_active;
        tail_s.x_in = x_in;
        tail_s.am_ring_stride = am_ring_stride;
        tail_s.am_ring_rows = am_ring_rows;
        tail_s.x_len = x_len;
        tail_s.nphase = nphase;
        last_epoch_s = epoch + static_cast<uint32_t>(nsteps_s) - 1u;
        epoch_s = epoch;
#endif
#if !PDL
        if (blockIdx.x == 0) *t_start = now_ns();
#if STEP_INPUTS
        x_row_s = x_in + *step_ids * x_len;
#if STEP_LOOP                               // (the last step's epoch: the host's next base goes past it)
        if (blockIdx.x == 0) atomicMax(epoch_at + 1, last_epoch_s);
#else
        if (blockIdx.x == 0) atomicMax(epoch_at + 1, epoch);
#endif
#endif
#endif
    }
    __syncthreads();

#ifdef TRACE_TILES
    // this block's tile i's times: tt(i)[0..6] (see TILE_FIELDS); null past the first TILE_TRACE_MAX tiles
#define TT(i) ((i) < TILE_TRACE_MAX ? tile_trace + (blockIdx.x * TILE_TRACE_MAX + (i)) * TILE_FIELDS : nullptr)
#define TT_SET(i, field) do { unsigned long long* tt_ = TT(i); if (tt_) tt_[field] = now_ns(); } while (0)
    if (tid == CONSUMERS + 32) {            // ------------------ observer warp: when each of the block's copies lands
        uint32_t i = 0;
        for (int64_t p = 0; p < nphase && i < TILE_TRACE_MAX; ++p)
            for (int64_t g = first_tile(ph[p], nblk); g < ph[p].tile0 + ph[p].ntiles && i < TILE_TRACE_MAX;
                 g += phase_stride(ph[p], nblk), ++i) {
                // (the slot's next copy cannot land before the consumers have taken this one, long after it lands)
                uint32_t spin = 0;
                for (; !mbar_test(&full[i % NSLOT], (i / NSLOT) & 1u) && spin < SPIN_LIMIT; ++spin)
                    if ((spin & 1023u) == 1023u && stopped(err)) return;
                if (spin >= SPIN_LIMIT) return;     // (a diagnostic: stop observing, never stop the kernel)
                TT_SET(i, 3);
            }
        return;
    }
#else
#define TT_SET(i, field) do { } while (0)
#endif
    if (tid >= CONSUMERS) {                 // ---------------------------------------------- producer warp
        if (tid != CONSUMERS) return;
#ifdef NOHANDSHAKE                          // -DNOHANDSHAKE (with NOCOPY): a diagnostic, no producer; the consumers
        return;                             // take slots without waiting and free none (their own loop alone)
#endif
        uint64_t policy, keep;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
        asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(keep));
        uint32_t i = 0;
        Cursor ahead{0, first_tile(ph[0], nblk)};               // the next tile to prefetch: NSLOT tiles on
        ahead.settle(ph, nphase, nblk);
        for (int q = 0; q < NSLOT; ++q) ahead.next(ph, nphase, nblk);
        uint32_t fetched = NSLOT;                               // tiles prefetched or loaded by the ring so far
#if PDL         // phase 0's tiles before the wait when they are a GEMV's weights; an ATTN phase's key count from
        int keys = 0;   // the producer's own read (the consumers set the table's after their wait)
        bool ready = false;
#define PH_N(f) ((f).kind == ATTN ? keys : (f).n)
#elif STEP_LOOP
#define PH_N(f) ((f).kind == ATTN ? keys + static_cast<int>(st) : (f).n)
#else
#define PH_N(f) ((f).n)
#endif
#if STEP_LOOP
        for (int st = 0; st < nsteps_s; ++st, ++epoch) {
        bool stepped = st == 0;             // the state this step reads is there (step 0: the launch's inputs)
#endif
        for (int64_t p = 0; p < nphase; ++p) {
            const PhaseC& f = ph[p];
#if STEP_LOOP
            // a KDA tile holds the state its block's consumers wrote in the last step, an attention tile the MLA
            // rows another block appended: wait for the step's token, then order those generic stores before the
            // bulk copies (async proxy). Weight tiles before them need neither.
            if (!stepped && (f.kind == KDA || f.kind == ATTN)) {
                if (!wait_token(counters + nphase + 1, epoch, err, p)) return;
                asm volatile("fence.proxy.async.global;" ::: "memory");
                stepped = true;
            }
#endif
#if PDL
            if (!ready && (p > 0 || f.kind != GEMV || mode == SERIAL)) {
                grid_dep_wait();
                epoch = step_epoch(epoch_at, step_lengths);
                keys = static_cast<int>(*step_lengths) + 1;
                ready = true;
            }
#endif
            const __nv_bfloat16* w = reinterpret_cast<const __nv_bfloat16*>(f.w);
            int64_t have_slot = -1, e = 0;
            bool inputs_done = mode != SERIAL;
            for (int64_t g = first_tile(f, nblk); g < f.tile0 + f.ntiles; g += phase_stride(f, nblk), ++i) {
                const int64_t t = g - f.tile0;
                const int64_t row0 = PAIR_TILES ? tile_row0(f, static_cast<int>(t), static_cast<int>(nblk))
                                                : t * f.rows;
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
                TT_SET(i, 0);
                if (!wait_slot(&empty[s], ((i / NSLOT) & 1u) ^ 1u, err, 3, p, t)) return;
                TT_SET(i, 1);
                if (!inputs_done && !(inputs_done = wait_inputs(ph, f, counters, epoch, err, p, t))) return;
                if (f.kind == TOPK) {
                    TT_SET(i, 2);
                    mbar_arrive(&full[s]);      // nothing to load
                    continue;
                }
                int64_t wrow = row0;
#if RECIPES && MMA_ONLY                     // (the MLA attention's kinds: built with them only)
                int64_t nrows = min(static_cast<int64_t>(f.rows), PH_N(f) - row0);
                if (f.kind == ATTN) {           // key block t / ne of the cache (the new row is the consumers')
                    wrow = (t / f.ne) * f.rows;
                    nrows = min(static_cast<int64_t>(f.rows), PH_N(f) - 1 - wrow);
                    if (nrows <= 0) {           // (a block of the new row alone: nothing to load)
                        TT_SET(i, 2);
                        mbar_arrive(&full[s]);
                        continue;
                    }
                }
                if (f.kind == ROUTED && f.route < 0) {    // a fixed route: slot s is expert s (MLA's BMM1, BMM2)
                    wrow = row0;
                } else
#endif
                if (f.kind == ROUTED) {         // the expert top-k chose for this tile's slot
                    if (row0 / f.ne != have_slot) {
                        have_slot = row0 / f.ne;
                        const uint64_t* id = reinterpret_cast<const uint64_t*>(ph[f.route].y) + have_slot;
                        uint64_t v = load_word(id);
                        if (!poll_word(id, v, epoch, wait, err, 4, p, t)) return;
                        e = static_cast<int64_t>(value_of(v));
                        e = e < 0 ? 0 : (e >= f.n_experts ? f.n_experts - 1 : e);
                    }
                    wrow = e * f.ne + row0 % f.ne;
                }
#ifdef NOCOPY                               // -DNOCOPY: a diagnostic, no weights copied (the consumers alone)
                TT_SET(i, 2);
                mbar_arrive(&full[s]);
                continue;
#endif
#if RECIPES && MMA_ONLY
                const uint32_t bytes = static_cast<uint32_t>(nrows * f.k * 2);    // (the last tile may be part of one)
#else
                const uint32_t bytes =                  // (the last tile may be part of one)
                    static_cast<uint32_t>(min(static_cast<int64_t>(f.rows), PH_N(f) - row0) * f.k * 2);
#endif
                if (INFLIGHT && i >= INFLIGHT &&
                    !wait_slot(&full[(i - INFLIGHT) % NSLOT], ((i - INFLIGHT) / NSLOT) & 1u, err, 2, p, t)) return;
                mbar_expect_tx(&full[s], bytes);
                bulk_load(ring + s * SLOT_BYTES, w + wrow * f.k, bytes, &full[s], policy);
                TT_SET(i, 2);
            }
        }
#if STEP_LOOP
        }
#endif
#undef PH_N
        return;
    }

    // ------------------------------------------------------------------------------------------ consumer warps
#if PDL                                     // the step's inputs, once the kernel before this launch has completed
    grid_dep_wait();
    epoch = step_epoch(epoch_at, step_lengths);
    {
        const int32_t keys = static_cast<int32_t>(*step_lengths) + 1;   // the cache rows and the new one
        for (int64_t p = tid; p < nphase; p += CONSUMERS)
            if (ph[p].kind == ATTN) ph[p].n = keys;
    }
    if (tid == 0) {
        if (blockIdx.x == 0) *t_start = now_ns();
        x_row_s = x_in + *step_ids * x_len;
        if (blockIdx.x == 0) atomicMax(epoch_at + 1, epoch);
    }
    consumers_sync();
#endif
    const int warp = tid / 32, lane = tid % 32;
    uint32_t i = 0, unit = 0, mma_count = 0;   // tiles, x loads and MMA_TILES tiles so far
#ifdef TRACE
    unsigned long long* tr = nullptr;      // this x load's times; null once its first tile is recorded
#endif
    uint64_t pre[XPREFETCH_N], pre2[XPREFETCH_N];   // the next phase's first x words, loaded ahead
    int pre_p = -1;                                   // ... of this phase (-1: none)
    // The step's tail, after its phases (ARGMAX / COMMIT_LENGTHS). STEP_LOOP: called at the top of the one loop
    // over (step, phase), whose phase index wraps to 0 there: a step loop around the phase loop spilled the ring
    // index in the tile loops (92 bytes; a step 0.83 ms against 0.69, H200 12-06); this form spills 20, and 8 with
    // the mode a constant (none in the tile loops; H100: a step 0.761-0.775 ms, the default 0.765-0.782).
    auto step_tail = [&]() {
#if STEP_LOOP
    consumers_sync();
    uint32_t* const counters = tail_s.counters;
    uint32_t* const err = tail_s.err;
    int64_t* const am_ids = tail_s.am_ids;
    int64_t* const am_ring = tail_s.am_ring;
    const unsigned char* const am_active = tail_s.am_active;
    unsigned long long* const am_best = tail_s.am_best;
    int64_t* const step_lengths = tail_s.step_lengths;
    const unsigned char* const commit_active = tail_s.commit_active;
    const XIn* const x_in = tail_s.x_in;
    const int64_t am_ring_stride = tail_s.am_ring_stride, am_ring_rows = tail_s.am_ring_rows;
    const int64_t x_len = tail_s.x_len, nphase = tail_s.nphase;
#endif
#if ARGMAX || COMMIT_LENGTHS
    // The greedy token: the block's key into am_best, the block counted in (release: after its max and its reads of
    // the step's inputs); the last block (acquire: after every block's max and reads) takes am_best, zeroes it and
    // the count, and writes the token; COMMIT_LENGTHS: then the step's lengths. Every block counts, those without
    // LM-head rows too, so the token and the length are written after every block has read step_ids[0] and
    // step_lengths[0].
#if ARGMAX
    const bool am_on = am_ids != nullptr;
#else
    const bool am_on = false;
#endif
#if COMMIT_LENGTHS
    const bool commit = commit_active != nullptr;
#else
    const bool commit = false;
#endif
    if (am_on || commit) {
#if ARGMAX == 2
        // ARGMAX=2: the block's largest key taken here, after the phases, from the LM head's words it stored
        // (`mma_tile_sum`: thread r stores row r of each of the block's tiles, so each reads back its own stores: no
        // fence), not in the tile loop. That loop's code (ARGMAX=1) made the plain decode launch 12-13 us slower
        // (H200, 12-05 07:51), more than the argmax program it replaces.
        if (am_on) {
            const PhaseC& f = ph[nphase - 1];
            unsigned long long key = 0;
            if (tid < f.rows) {
                const uint64_t* y = reinterpret_cast<const uint64_t*>(f.y);
                const int stride = phase_stride(f, nblk);
                for (int g = first_tile(f, nblk); g < f.tile0 + f.ntiles; g += stride) {
                    const int row = (g - f.tile0) * static_cast<int>(f.rows) + tid;
                    key = max_u64(key, argmax_key(value_of(load_word(y + row)), row));
                }
            }
#pragma unroll
            for (int off = 16; off; off >>= 1) key = max_u64(key, __shfl_xor_sync(0xffffffffu, key, off));
            if (lane == 0 && key) atomicMax(&am_block, key);
        }
#endif
        consumers_sync();                   // every warp's max is in am_block
        if (tid == 0) {
#if ARGMAX
            if (am_on && am_block)
                asm volatile("red.relaxed.gpu.global.max.u64 [%0], %1;" ::"l"(am_best), "l"(am_block) : "memory");
#endif
            uint32_t before;
            asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(before) : "l"(counters + nphase)
                         : "memory");
            if (before == static_cast<uint32_t>(nblk) - 1) {
#if ARGMAX
                unsigned long long best = 0;
                if (am_on)
                    asm volatile("atom.relaxed.gpu.global.exch.b64 %0, [%1], 0;" : "=l"(best) : "l"(am_best)
                                 : "memory");
#endif
                counters[nphase] = 0;
#if ARGMAX
                if (am_on) {                // (step_lengths[0]: this step's, which no block has moved yet)
                    const int64_t token = 0xFFFFFFFFu - static_cast<uint32_t>(best);
                    am_ids[0] = token;
                    if (am_ring)
                        am_ring[((*step_lengths + am_active[0]) % am_ring_rows) * am_ring_stride] = token;
                }
#endif
#if COMMIT_LENGTHS
                if (commit) step_lengths[0] = *step_lengths + commit_active[0];
#endif
#if STEP_LOOP           // the next step may begin: after the token, the lengths and the zeroed count and key
                asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(counters + nphase + 1), "r"(epoch_s + 1u)
                             : "memory");
#endif
            }
        }
    }
#endif
    };
#if STEP_LOOP
    for (int p = 0; ; ++p) {
    if (p == nphase) {      // this step's tail, then the next step's start
    step_tail();
    if (epoch_s == last_epoch_s) break;
    {
    uint32_t* const counters = tail_s.counters;
    uint32_t* const err = tail_s.err;
    int64_t* const am_ids = tail_s.am_ids;
    int64_t* const step_lengths = tail_s.step_lengths;
    const XIn* const x_in = tail_s.x_in;
    const int64_t x_len = tail_s.x_len, nphase = tail_s.nphase;
    consumers_sync();   // (every thread has read epoch_s)
    // the next step's token (every block done with the last step), its embedding row, the key count
    if (tid == 0) {
        const uint32_t epoch = epoch_s + 1u;
        epoch_s = epoch;
        if (wait_token(counters + nphase + 1, epoch, err, 0))
            x_row_s = x_in + *reinterpret_cast<volatile const int64_t*>(am_ids) * x_len;
        else
            gave_up = 1;
        am_block = 0;
    }
    consumers_sync();
    if (gave_up) return;
    {                   // (the lengths the last step's last block advanced: read after the token's acquire)
        const int32_t n_keys = static_cast<int32_t>(*reinterpret_cast<volatile const int64_t*>(step_lengths)) + 1;
        for (int64_t p = tid; p < nphase; p += CONSUMERS)
            if (ph[p].kind == ATTN) ph[p].n = n_keys;
    }
    consumers_sync();
    }
    p = 0;
    pre_p = -1;
    }
#else
    for (int p = 0; p < nphase; ++p) {
#endif
        const PhaseC& f = ph[p];
#if STEP_LOOP           // (from shared memory each phase: a register live across the step loop spilled others)
        const uint32_t epoch = epoch_s;
#endif
        // the fields every tile uses, in 32-bit registers: each asm "memory" clobber below would otherwise make the
        // compiler read them again from shared memory on every tile
        const int kind = f.kind, n = f.n, ne = f.ne, tile0 = f.tile0;
        const bool x_per_expert = kind == ROUTED && f.xstride;
        const int g0 = static_cast<int>(first_tile(f, nblk)), gend = tile0 + f.ntiles;
        if (g0 >= gend) continue;
#ifdef PHASE_TIMES     // -DPHASE_TIMES: per phase, the first block to begin it, to have its x, to have its first tile
        if (tid == 0) atomicMin(t_done + nphase + p, static_cast<unsigned long long>(now_ns()));
        bool x_timed = false;               // (t_done[nphase..4 nphase), reset by the host before the launch)
#endif
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
        // this thread's row in a row group and its first chunk, once a phase (per tile, these divisions cost 8% of
        // the step: 0.766 -> 0.701 ms)
        const int trow = tid / T, tcol = tid % T;
        const MmaSplit ms = mma_split(rows, static_cast<int>(f.k), warp);
        float4 xa[STEPS], xb[STEPS];        // this thread's x: steps m of chunk tcol + m T, the same every row
        int have_slot = -1, done = 0;
#if RECIPES
#if MMA_ONLY
        if (kind == GEMV && f.xop >= 0 && xsegs[f.xop].op == X_ATTNRES) {
            const int nt = attnres_phase(f, ph, xsegs, X_IN, ring, xs, full, empty, i, g0, phase_stride(f, nblk),
                                         epoch, wait, err, p, red, mma_red, mma_count, &gave_up,
                                         *reinterpret_cast<__nv_bfloat16* volatile*>(&xdump_s),
                                         t_done + 2 * nphase + p, t_done + 3 * nphase + p,
#ifdef TRACE
                                         unit < TRACE_UNITS - 4 ? trace + (blockIdx.x * TRACE_UNITS + unit++) *
                                                                          TRACE_FIELDS : nullptr,
#else
                                         nullptr,
#endif
#if ARGMAX == 1
                                         am_ids && p == nphase - 1 ? &am_block : nullptr
#else
                                         nullptr
#endif
                                         );
            if (nt < 0) return;
            i += nt;
            done = nt;
        } else if (kind == ATTN) {
            const int nt = attn_phase(f, ph, xsegs, ring, xs, full, empty, i, g0, phase_stride(f, nblk), epoch, wait,
                                      err, p, red, comb_w, &gave_up,
                                      *reinterpret_cast<__nv_bfloat16* volatile*>(&xdump_s),
                                      t_done + 2 * nphase + p, t_done + 3 * nphase + p,
#ifdef TRACE                                // (the block's a-th ATTN phase: trace unit TRACE_UNITS - 1 - a)
                                      trace + (blockIdx.x * TRACE_UNITS + TRACE_UNITS - 1 - attn_before(ph, p)) *
                                                  TRACE_FIELDS
#else
                                      nullptr
#endif
                                      );
            if (nt < 0) return;
            i += nt;
            done = nt;
        } else
#endif
        if (kind == KDA) {
            const int nt = kda_phase(f, ph, xsegs, ring, reinterpret_cast<float*>(xs), full, empty, i, g0,
                                     phase_stride(f, nblk), epoch, wait, err, p, red, &gave_up,
                                     t_done + 2 * nphase + p, t_done + 3 * nphase + p);
            if (nt < 0) return;
            i += nt;
            done = nt;
        } else
#endif
        // (the stride from f each tile, not a register: one more live value spilled in the CUDA-core build)
        for (int g = g0; g < gend; g += phase_stride(f, nblk), ++i, ++done) {
            const int t = g - tile0, row0 = PAIR_TILES ? tile_row0(f, t, static_cast<int>(nblk)) : t * rows;
            const int slot = x_per_expert ? row0 / ne : 0;     // whose x (routed: per expert)
            const uint32_t s = i % NSLOT;
            const int rows_here = min(rows, n - row0);          // (the last tile may be part of one)
            uint4 wreg[GROUPS][STEPS];      // (TILE_IN_REGS) this thread's share of the tile: row r0 + trow
            if (tid == 0 && TILE_IN_REGS) TT_SET(i, 4);
            if (TILE_IN_REGS) {
                if (!wait_slot(&full[s], (i / NSLOT) & 1u, err, 2, p, t)) return;
                if (tid == 0) TT_SET(i, 5);
                const uint4* tile = reinterpret_cast<const uint4*>(ring + s * SLOT_BYTES);
#pragma unroll
                for (int q = 0; q < GROUPS; ++q) {
                    const int r = q * G + trow;
#pragma unroll
                    for (int m = 0; m < STEPS; ++m) {
                        const int c = tcol + m * T;
                        wreg[q][m] = kind != TOPK && r < rows_here && c < chunks ? tile[r * chunks + c]
                                                                                   : make_uint4(0u, 0u, 0u, 0u);
                    }
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(&empty[s]);     // the slot is free: the producer loads the next tile
            }                               // (a top-k's slot too: it holds nothing)
            if (slot != have_slot) {        // this tile's x (the first sync: every warp is done with the last x)
#ifdef TRACE
                tr = tid == 0 && unit < TRACE_UNITS - 4 ? trace + (blockIdx.x * TRACE_UNITS + unit) * TRACE_FIELDS
                                                    : nullptr;
                if (tr) {
                    tr[0] = now_ns();
                    tr[16] = p + 1;
                }
#endif
#ifndef NOLOADX                             // -DNOLOADX: a diagnostic, x never loaded (the boundary's loads alone)
                consumers_sync();
#ifdef TRACE
                TMARK(tr, 3);
#endif
                const bool had = XPREFETCH && pre_p == p && have_slot < 0;   // (loaded for the phase's first slot)
#if RECIPES
                if (!(f.xop >= 0 ? load_x_recipe(xs, f, ph, xsegs, slot, epoch, wait, err, p, t, red, comb_w
#ifdef TRACE
                                                 , tr ? tr + 10 : nullptr, tr ? tr + 4 : nullptr
#endif
                                                 )
                                 : load_x(xs, f, ph, X_IN, slot, epoch, wait, err, p, t, had, pre, pre2)))
                    gave_up = 1;
                consumers_sync();
                __nv_bfloat16* xd = *reinterpret_cast<__nv_bfloat16* volatile*>(&xdump_s);
                if (xd && f.xop >= 0 && kind != TOPK && row0 == (x_per_expert ? slot * ne : 0) && slot < XDUMP_SLOTS)
                    for (int j = tid; j < f.k; j += CONSUMERS)
                        xd[static_cast<int64_t>(p * XDUMP_SLOTS + slot) * XMAX + j] = xs[j];
#else
                if (!load_x(xs, f, ph, X_IN, slot, epoch, wait, err, p, t, had, pre, pre2)) gave_up = 1;
                consumers_sync();
#endif
#endif
#ifdef TRACE
                if (tr) tr[1] = now_ns();
#endif
                ++unit;
#ifdef PHASE_TIMES
                if (tid == 0 && !x_timed) {
                    atomicMin(t_done + 2 * nphase + p, static_cast<unsigned long long>(now_ns()));
                    x_timed = true;
                }
#endif
                if (gave_up) return;
                if (XPREFETCH && have_slot < 0) {          // the next phase this block has tiles in: its x, ahead
                    pre_p = -1;
                    for (int64_t q = p + 1; q < nphase; ++q) {
                        const PhaseC& h = ph[q];
                        const int64_t hg = first_tile(h, nblk);
                        if (hg >= h.tile0 + h.ntiles) continue;
                        if (h.src >= 0) {
                            const int64_t hr = (hg - h.tile0) * h.rows;
                            prefetch_x(pre, pre2, h, ph, h.kind == ROUTED && h.xstride ? hr / h.ne : 0);
                            pre_p = q;
                        }
                        break;
                    }
                }
                have_slot = slot;
                const uint4* x8 = reinterpret_cast<const uint4*>(xs);
#pragma unroll
                for (int m = 0; m < (WARP_ROWS || MMA_ONLY ? 0 : STEPS); ++m) {   // (WARP_ROWS: x in shared memory)
                    const int c = tcol + m * T;
                    const uint4 u = c < chunks ? x8[c] : make_uint4(0u, 0u, 0u, 0u);
                    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
                    const float2 a0 = __bfloat1622float2(h[0]), a1 = __bfloat1622float2(h[1]);
                    const float2 b0 = __bfloat1622float2(h[2]), b1 = __bfloat1622float2(h[3]);
                    xa[m] = make_float4(a0.x, a0.y, a1.x, a1.y);
                    xb[m] = make_float4(b0.x, b0.y, b1.x, b1.y);
                }
            }
            if (tid == 0 && !TILE_IN_REGS) TT_SET(i, 4);
#ifndef NOHANDSHAKE
            if (!TILE_IN_REGS && !wait_slot(&full[s], (i / NSLOT) & 1u, err, 2, p, t)) return;
#endif
            if (tid == 0 && !TILE_IN_REGS) TT_SET(i, 5);
#ifdef PHASE_TIMES
            if (tid == 0 && g == g0) atomicMin(t_done + 3 * nphase + p, static_cast<unsigned long long>(now_ns()));
#endif
#ifdef TRACE
            if (tr) {
                tr[2] = now_ns();           // the x's first tile is here
                tr = nullptr;
            }
#endif

            if (kind == TOPK) {
                // k rounds of a warp argmax over xs (taken entries set to -inf); a scored top-k (RECIPES) was done
                // in its x load (`load_x_recipe`)
                if (warp == 0 && !(RECIPES && f.xop >= 0)) {
                    float* xf = reinterpret_cast<float*>(xs);
                    for (int64_t r = 0; r < f.ne; ++r) {
                        float best = -INFINITY;
                        int idx = 0x7fffffff;
                        for (int j = lane; j < f.xlen; j += 32)
                            if (xf[j] > best) { best = xf[j]; idx = j; }
                        for (int off = 16; off; off >>= 1) {
                            const float ob = __shfl_xor_sync(0xffffffffu, best, off);
                            const int oi = __shfl_xor_sync(0xffffffffu, idx, off);
                            if (ob > best || (ob == best && oi < idx)) { best = ob; idx = oi; }
                        }
                        if (lane == 0) {
                            store_word(y + r, static_cast<float>(idx), epoch);
                            if (idx < f.xlen) xf[idx] = -INFINITY;   // (NaN x: none)
                        }
                        __syncwarp();
                    }
                }
            } else if (mma_tile(rows, rows_here, static_cast<int>(f.k))) {
                // (by the parity of MMA tiles: a warp writes the half of MMA tile j + 2 only once past MMA tile
                // j + 1's sync, which the threads summing tile j reach after they have read it)
                mma_tile_sum(ring + s * SLOT_BYTES, xs, rows, ms, mma_red, mma_count, y + row0, epoch);
            } else if (WARP_ROWS) {
                warp_rows(reinterpret_cast<const uint4*>(ring + s * SLOT_BYTES), reinterpret_cast<const uint4*>(xs),
                          chunks, rows_here, warp, lane, y + row0, epoch);
            } else {
                const uint4* tile = reinterpret_cast<const uint4*>(ring + s * SLOT_BYTES);
#pragma unroll
                for (int q = 0; q < GROUPS; ++q) {          // row groups: rows r0 .. r0 + G - 1 at once
                    const int r0 = q * G, r = r0 + trow;
                    if (r0 >= rows_here) break;
                    float acc = 0.f;
#ifndef SKIP_COMPUTE
                    if (r < rows_here) {
                        // every step's 16 bytes loaded first (zeros past the row: x is zero there too), then the
                        // sums in four independent chains
                        uint4 wv[STEPS];
#pragma unroll
                        for (int m = 0; m < STEPS; ++m) {
                            const int c = tcol + m * T;
                            wv[m] = TILE_IN_REGS ? wreg[q][m]
                                                 : (c < chunks ? tile[r * chunks + c] : make_uint4(0u, 0u, 0u, 0u));
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
                        if (tcol == 0 && r < rows_here) store_word(y + row0 + r, acc, epoch);
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
            if (tid == 0) TT_SET(i, 6);     // (warp 0's sums done: with T > 32 every warp's are; WARP_ROWS: warp 0's)
#ifndef NOHANDSHAKE
            if (!TILE_IN_REGS) {
                __syncwarp();
                if (lane == 0) mbar_arrive(&empty[s]);     // this warp is done with slot s
            }
#endif
        }
#ifdef TRACE    // each warp done with its last tile of p: field 8 of the block's unit for p (`x_load_parts`)
        if (lane == 0 && unit > 0 && unit <= TRACE_UNITS - 4) {
            unsigned long long* lt = trace + (blockIdx.x * TRACE_UNITS + unit - 1) * TRACE_FIELDS;
            if (lt[16] == static_cast<unsigned long long>(p + 1))
                atomicMax(lt + 8, static_cast<unsigned long long>(now_ns()));
        }
#endif
        // this block's tiles of p are done: add them to p's counter
        if (mode == SERIAL) consumers_sync();           // (SERIAL's producers wait on it: every row written)
        if (tid == 0) {
            if (mode == SERIAL) add_release(counters + p, static_cast<uint32_t>(done));
            else add_relaxed(counters + p, static_cast<uint32_t>(done));   // (no fence: the timeline only)
            atomicMax(t_done + p, static_cast<unsigned long long>(now_ns()));
        }
    }
#if !STEP_LOOP
    step_tail();
#endif
}
