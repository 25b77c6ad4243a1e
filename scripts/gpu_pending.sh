#!/usr/bin/env bash
# What is owed to the GPU, one part per argument, each under its own time limit (device tool, carry [".whl"]; logs
# under $OUT). Each part below has run at least once (results in docs/perf.md) except where it says not yet.
#   toy      scripts/aoti_toy.py: does any CUDA AOTI package load there, per import context (bare, CUDA
#            initialised, triton, k3export.plugins)? ~2 min. Decides whether the crash is torch's or ours.
#   demo     `k3export demo --device cuda`: the main job end to end on the GPU (aoti refused by the load check
#            there, then the compile fallback)
#   aoti     tests/test_aoti_cuda.py: the k3 Triton kernels compiled into AOTI packages (compiles since 01:35),
#            loaded without k3export, vs eager (xfail while packages do not load)
#   mla      the MLA contract's cupy test with its corrected bound (2^-7)
#   mlabench bench mla --no-sweep: MLA decode (96 / 12 heads, B 1..128, L 1k..64k; plain calls and CUDA-graph
#            replays) with the runtime's tiles, and prefill
#   mlasplit scripts/mla_split_probe.py: MLA decode split counts (waves, min_chunk) at B = 1 / 8, 8k / 64k rows
#   moe      bench moe: every prefill / decode tiling
#   model    bench model: compile vs compile-frozen (Inductor freezing) at B = 1 and 64, prefill 2048
#   kda      bench kda: prefill (B=1, T=8192, 96 heads) and decode B=1..256 vs fla-core and eager, one run
#   fp8c     bench fp8 --compiled: k3-small FP8 vs bf16 decode as the compile backend serves it (packed, B = 1)
#   mlatest  the MLA decode and packing cuda tests
#   fused    k3::attn_res_norm: its cuda tests, then bench model $FUSED_BACKENDS (default eager, compile,
#            compile-unfused; B = $FUSED_BATCHES, prefill 2048)
#   probe    scripts/gemv_pack_probe.py: separate vs packed projections sharing an input (k3-small, B = 1)
#   serve    the serving path's cuda tests: kda_decode_inplace, attn_res_add_norm / attn_res_norm at K3 shape, the
#            compile backend (packed, fused, in place) vs eager under CUDA graphs, packing on the GPU
#   moefused the MoE pairs path with top-k in the router launch and the combine in gemm2's (pairs-n8-fused): cuda tests
#   fp8split the FP8 GEMV's split-K sum inside its launch: cuda tests (bit-identical to the two-launch sum, CUDA
#            graphs), then scripts/fp8_split_sum.py (per-GEMM times, k3-small and K3 shapes)
#   gemvprobe scripts/gemv_triton_probe.py: a plain Triton GEMV vs cuBLAS at k3-small's decode shapes (planning)
#   moepair  MoE prefill with gate/up rows paired in one tensor: its cuda tests, then `bench moe --layout
#            $MOEPAIR_LAYOUT` (default both) over the prefill tilings $MOEPAIR_TILES at $MOEPAIR_TOKENS
#   mlawide  the MLA decode wide-tile cuda tests, then scripts/mla_decode_sweep.py (old vs wide tiles, 96 heads;
#            $MLAWIDE_VARIANTS picks the tiles, e.g. wide64-tma-fill,trans128-tma)
#   pdl      scripts/pdl_probe.py: PDL under CUDA-graph capture (time per launch, programmatic edges, same bits);
#            time it in the model with MODEL_BACKENDS=compile,compile-pdl
#   gemvpdl  scripts/gemv_pdl_probe.py: the step's 52 GEMVs chained, cuBLAS vs plugins.gemv with and without PDL and
#            weights loaded before the wait (M = $GEMVPDL_M, default "1 4"), then the FP8 chain (--fp8: split-K
#            weight-only GEMV vs plugins.gemv with E4M3 weights)
#   pdltest  tests/test_pdl.py's cuda tests (PDL chain in a CUDA graph; k3-small compile with / without PDL bit-identical)
#   gemv4    k3::gemv at 2-4 rows (x rows loaded in one batch): its cuda tests (vs fp64, == rows in turn; k3-tiny
#            `CompileBackend(gemv_rows=4)` tokens at B = 2 / 4), then scripts/ab_decode.py --backends
#            compile,compile-gemv4 at B = $GEMV4_BATCHES (default "2 4"), k3-small
#   fp8moe   the W8A8 expert tilings (`FP8_PREFILL_TILINGS`, TMA, E4M3 tensor cores): their cuda tests vs
#            moe_fp8_sorted at k3-small shapes, then `bench moe --precision fp8 --phases prefill` at K3 shapes
#            ($FP8MOE_TOKENS, default 4096,8192,16384; $FP8MOE_TILES to pick tilings)
#   fp8prefill the W8A8 tiling defaults through the op (cuda tests), then `bench fp8 --compiled` on k3-small (decode
#            B = 1, prefill 2048) once per W8A8 tiling in $FP8PREFILL_TILES (default "ptr m128t64-n64-f2")
#   gemvtest the k3::gemv cuda tests (K3 shapes vs fp64, PDL chain in a CUDA graph, k3-small compile-gemv-pdl tokens)
#   ab       scripts/ab_decode.py --env $AB_ENV (NAME=A,B, a switch read at launch time): one switch A/B on the k3-small
#            decode step, settings interleaved over rounds in one process (the script also takes several --env,
#            --config FIELD=A,B and --backends A,B experiments per run)
#   gentest  the runtime's cuda tests (CUDA-graph decode == plain, the pipelined Generator's greedy graph, prefill and
#            decode buckets, prefill graphs in one pool with eviction)
#   normtest k3::gemv_norm's cuda tests (the latent RMSNorm in the MoE output GEMV) and compile-fast's k3-tiny tokens
#   barrier  scripts/barrier_probe.py: R rounds of neighbour-dependent work on one program per SM (and two), as R
#            PDL launches in a CUDA graph vs one persistent launch with a grid barrier per round (16:58: 0.86 vs 1.14 us)
#   fp8fused (= fp8ftest, then fp8fab) the fused FP8 "pairs" expert scheme (`ExpertWo.fuse`) and
#            `k3::fp8_linear_cols`: their cuda tests (== unfused bit for bit, CUDA graph; the two-weight GEMV vs
#            fp64), then scripts/ab_decode.py --fp8 with K3_FP8_EXPERT_WO=unfused,fused (and --backends
#            $FP8FAB_BACKENDS if set, e.g. compile,compile-nofp8cols), and --precisions: bf16 vs FP8 through
#            `compile` (k3-small, B = 1)
#   bucket   the runtime's prefill length buckets: cuda tests (bucket graph replays == plain prefills), then bench
#            model (eager, compile; prefill $BUCKET_LENGTHS with the new-length rows, with and without buckets)
#   dbuckets `Engine(decode_buckets=True)` (decode only the slots up to the highest active one, a CUDA graph per
#            bucket): the runtime's cuda tests (k3-tiny eager / compile tokens == eager with requests joining and
#            leaving; prefill graphs through `prefill_last`),
#            then scripts/decode_buckets_probe.py (k3-small, 64 slots, 1 / 3 / 17 / 64 active, with and without)
#   trtmoe   the MoE prefill AOT chain (chunked align, pointer-load prefill tilings): the chain's PTX through cupy at
#            K3 size (decode and prefill cases) and the chunked align / ptr-* tilings' cuda tests, then `bench moe
#            --phases prefill` of the ptr-* tilings against the TMA defaults ($TRTMOE_TOKENS, default 4096,8192,16384)
#            (ran 12-01 01:45; the cupy tests again at 03:12 with ptr-m64t32-n128 at 4096 tokens: 9 passed)
#   trtfp8   the FP8 MoE AOT chain (plugins/moe/trt_fp8.py): its PTX through cupy at K3 size (weight-only and W8A8,
#            one-program and chunked align) and the bf16 chains' cupy tests again (their routing / align / combine
#            steps were refactored into shared helpers), then `bench moe --precision fp8` of the chain's W8A8 tiling
#            ("ptr") against the op's TMA default at $TRTFP8_TOKENS (default 4096)
#   fp8eng   FP8 engines: tests/test_build.py's FP8 cuda test (a `compile` engine built with --scales on the GPU gives
#            the eager engine's greedy tokens, fp32 activations)
#   grouped  `bench moe --phases prefill` at 16..64 rows per expert ($GROUPED_TOKENS, default 1024,2048,3072 at K3
#            size), where the "grouped" regime ran the 2026-11-29 tiling ("old") until 12-01, against the newer ones
#   grpsmall scripts/moe_grouped_probe.py: the grouped-regime tilings at k3-small's expert shapes (128..512 tokens,
#            separate and paired gate/up), then the MoE kernel cuda tests (the grouped default changed 12-01)
#   fp8comp  scripts/fp8_compile_probe.py: FP8 k3-tiny through Engine, compile variants vs eager logits (teacher
#            forced), bf16 as the yardstick ($FP8COMP_VARIANTS)
#   overlap  scripts/ab_decode.py --background: the skeleton's and k3-small's B = 1 step beside a concurrent HBM reader
#            of $OVERLAP_PROGRAMS ($OVERLAP_SMALL for k3-small) programs (scripts/hbm_background.py), with the
#            reader's rate beside the step and alone
#   chain    milestone 1 of docs/megakernel.md: tests/test_megakernel_chain.py's cuda tests, then
#            scripts/megakernel_chain.py (k3-small's step as a synthetic chain in one persistent launch; stream,
#            serial and nodeps modes; rings $CHAIN_RINGS, default 3x65536), JSON and plot in $OUT (and with a
#            TRACE_TILES ring, chain-tiles.png: the landed bytes over time)
#   layer    milestone 2 of docs/megakernel.md: tests/test_megakernel_layer.py's cuda tests, then
#            scripts/megakernel_layer.py (k3-small's 8 KDA and 11 MoE sublayers with the model's weights in one
#            persistent launch, checked against its emulation, the KDA plugin's Triton kernel and the compile
#            backend's sublayers, timed against a CUDA graph of those; $LAYER_ARGS, e.g. --no-kda or --step), JSON
#            and plot in $OUT
#   step     the whole k3-small step in one launch (`megakernel_layer.py --step`: real but for the MLA attention,
#            stand-ins, and AttnRes, absent), checked and timed against compile's real sublayers, with its plot;
#            then without the stand-ins (ran 12-02 15:48 as two direct calls: 0.628 / 0.557 ms)
#   attnres  the layer's cuda tests (with the whole step and AttnRes in the kernel: emulation checks), then the whole
#            step with AttnRes (`--step --attnres`: MLA stand-ins) against the compile engine's real step, with its plot;
#            with an untracked k3export/megakernel/chain_prev.cu, the step without AttnRes, that version vs chain.cu
#   abmix    the AttnRes cuda tests, then the step with AttnRes, an untracked chain_prev.cu against chain.cu, twice
#   gmla     the persistent kernel's cuda tests (the MLA attention in the kernel too), then the whole step with
#            AttnRes and the real MLA attention (`--mla 1024`) against the compile engine's step, then its PHASE_TIMES
#   greedy   the persistent kernel's greedy cuda tests (random states; from the model's prefill), then 8 steps
#            with the model restarted from the kernel's states every step (`--greedy 8 --follow`)
#   mkback   the megakernel backend (k3export/megakernel/backend.py): its cuda tests (k3-small through the engine
#            vs its emulation and eager; an engine directory built, opened, decoding, refused when corrupt), then
#            `--greedy 8 --follow` with the routing diagnostics
#   greedy64 (not yet run) `--greedy 8 --follow --ref64`: each step's kernel and model logits against the model in
#            fp64 on the CPU from the kernel's states (which of the two is nearer fp64 at the step that differs)
#   mkinputs chain.cu -DSTEP_INPUTS=1 (the launch reads the embedding row and key count itself): its cuda test (==
#            the build with them set around the launch, bit for bit), then mkbench with both (12-03: the names were
#            megakernel-inputs and megakernel; now megakernel and megakernel-host-inputs)
#   mkstep   the STEP_INPUTS cuda test alone, then scripts/profile_decode.py --timeline for both builds: the
#            CUDA-graph step's kernels in order, with the gaps between them
#   mkcache  the backend's cuda tests (the kernel reading and appending the engine's own MLA cache; STEP_INPUTS
#            epochs over two requests), bench model of both builds (300 decode steps), and the graph step's
#            timeline of the STEP_INPUTS one
#   mkfinal  bench model eager, compile, megakernel (the default build now: STEP_INPUTS, the engine's cache), then
#            profile_decode.py --backend megakernel --timeline --generate 6 (the pipelined generation's GPU timeline)
#   mkrouter router_first: its cuda test (== the default layout bit for bit), then bench model megakernel and
#            megakernel-router-first, 300 decode steps (12-03 14:04: passed; 0.779 ms pipelined both)
#   mkpair   PAIR_TILES: the unpaired variant's cuda test (== the default kernel bit for bit), bench model
#            megakernel and megakernel-unpaired, 300 decode steps (12-03 14:43 as paired vs default: passed; 0.769
#            ms against 0.784)
#   mkargmax (not yet run) the greedy step's argmax as one Triton program over the launch's strided logits
#            (then `MegakernelBackend.argmax_into`, now the engine's): its cuda tests and the backend's, bench model
#            megakernel (300 steps),
#            and the pipelined generation's timeline (was: torch's argmax 11.8 us a token)
#   mksleep  (not yet run) POLL_SLEEP: the variant's cuda test (== the default kernel bit for bit), bench model
#            megakernel, megakernel-poll-sleep64, -poll-sleep256 (300 steps)
#   mkrun    mkargmax's and mksleep's tests in one pytest, one bench of megakernel and both POLL_SLEEP builds, the
#            pipelined generation's timeline, and the layer step's PHASE_TIMES with PAIR_TILES
#   mkblocks the layer step's PHASE_TIMES per block (BLOCK_TIMES): each phase kind's first / median / last block
#   mkattn   mkblocks, then the layer step with ATTN_HEADS=4 against the default, two interleaved rounds of each (run
#            16:29 also with ATTN_ROW_FIRST=1 and COMBINE_PAIRS=1, both slower and removed since: commit 1013a3e)
#   mkheads  attention tiles of 4 heads: the variant's cuda test (bit for bit), bench megakernel vs -attn-heads4
#   mklive   LIVE_SPLITS (the default since 17:03; with and without 4 heads a tile): cuda tests (bit for bit), bench
#            against the build without it (megakernel-dead-splits)
#   mktrace  mkblocks with -DTRACE: when each block had each part of the MLA attention's x
#   mktiles  mktrace's run with the tile's parts too (begun, scores, softmax, done, the SM clock), for each of
#            $MKTILES_VARIANTS (default: the default build) with $MKTILES_DEFINES (e.g. ATTN_TWICE+: the tile again)
#   mksums   the attention's score sums butterflied a level at a time (ATTN_SUMS_TOGETHER, chain.cu's default
#            since 18:50) against one after another, layer step, two processes each; then mktiles with
#            ATTN_TWICE (the SM clock too)
#   mkmma    the attention tile on tensor cores (ATTN_MMA) and its x's row in the queries' last round
#            (ATTN_X_TAIL): cuda tests (sums_apart's and x_tail's bit for bit), the layer step with each and both
#            against the default, then mktiles with ATTN_MMA
#   mkmmafinal the default build since 19:10 (ATTN_MMA, ATTN_X_TAIL): the engine directory's cuda test
#            and x_tail's (bit for bit), then bench megakernel against megakernel-attn-cuda-cores (300 steps)
#   mkcombine BMM2's combine polling 12 key blocks' words a round (COMBINE_WORDS=12) and the tensor-core tile's
#            softmax in its chunk sums (ATTN_SOFTMAX_IN_SUMS): their cuda tests (bit for bit), the layer step with
#            each and both against the default build, then bench megakernel against megakernel-combine12 with
#            --rounds 3 (ran 12-03 21:20: neither faster; both removed since, so it needs commit 91653d6)
#   mksample (not yet run) sampling on the device (`k3export.sampling.draw`, `Engine.decode_sampled`): its cuda tests
#            (the Triton program == the torch form at 32768 logits, in a CUDA graph; the graphed engine's pipelined
#            sampled tokens == eager generate's; decode buckets with sampled requests; the megakernel engine's
#            pipelined sampled tokens == its plain loop's), scripts/sampling_probe.py (the draw's host and GPU time),
#            then bench model compile, megakernel with the sampled generation rows ($MKBENCH_BACKENDS, default
#            compile,megakernel; $MKSAMPLE_K picks the tests, MKSAMPLE_NO_PROBE=1 skips the probe)
#   mkpost   (run 12-04 09:10 and 10:10, docs/perf.md "Tokens posted to host memory") the draw's thresholds in its program and the host ring of tokens (`Engine.post_mark` /
#            `posted`): cuda tests of sampling, argmax and the engines' graphed / pipelined decoding ($MKPOST_K picks
#            them), scripts/sampling_probe.py at 32768 and 163840 logits, the megakernel's pipelined timeline
#            (profile_decode --generate 7); its bench is `mkbench` in a call of its own
#   mkgapart (run 12-04 14:50, docs/perf.md "The gate rows apart") the gate rows of each KDA / MLA layer a GEMV
#            phase of their own, dealt over the blocks beside the step / attention (`g_apart`, `mla_g_apart`, the
#            defaults since): the variant's cuda test (bit for bit against the gate rows in the projections), then
#            the layer step with neither, KDA's, MLA's and both ($MKGAPART_ROUNDS processes each, default 1,
#            interleaved); its bench is `mkbench` with MKBENCH_BACKENDS=megakernel,megakernel-g-in-proj
#   mkshared (ran 12-04 15:30, docs/perf.md "The gate rows apart") each MoE's shared_down after its routed gate_up,
#            alone and with router_first: layer step +43 us, bench +40 us; the option is removed (commit c06737c has
#            it and this part)
#   mkqueue  (ran 12-04 16:48 and 16:57, docs/perf.md "Fewer bytes in flight") scripts/l2_queue_probe.py (a small
#            load's and a store-to-poll round trip's time under the weight stream, per bytes in flight; its one-hop
#            mode, with only the writers' or the readers' SMs streaming, ran 12-04 18:57: docs/perf.md "Each x load
#            part by part"), then the layer step for each build in $MKQUEUE_BUILDS ($MKQUEUE_ROUNDS rounds,
#            interleaved)
#   mkinflight the backend's INFLIGHT=1 default: its cuda tests (inflight variants bit for bit, the kernel against
#            its emulation, an engine directory), the layer step with INFLIGHT=1 alone and with the L2 prefetch
#            ($MKINFLIGHT_BUILDS), its phase times; its bench is `mkbench` with
#            MKBENCH_BACKENDS=megakernel,megakernel-uncapped
#   mkxparts (ran 12-04 18:57-19:15) the layer step's x loads part by part (-DTRACE with the backend's defines,
#            `layer.x_load_parts`): per phase kind, when each block began its x, had every warp done with the last
#            one, had the words polled, the x made, in shared memory, its first tile; and when the phase before's
#            last warp was done ($MKXPARTS_DEFINES: more, "+NAME=V...")
#   mkab     (ran 12-04 19:10-19:50) the layer step of each chain.cu in $MKAB_CUS (paths), interleaved,
#            $MKAB_ROUNDS rounds (default 2), with the backend's defines ($MKAB_DEFINES: more); the checkout's
#            chain.cu is put back after
#   mkdefs   (ran 12-05 07:45, ATTN_ROW_W_SMEM and POW2_MEAN: no faster) the layer step of the checkout's chain.cu with each of $MKDEFS_VARIANTS (extra defines,
#            "+"-joined, "-" for none; e.g. "- +ATTN_ROW_W_SMEM=1 +POW2_MEAN=1"), interleaved, $MKAB_ROUNDS rounds
#            (default 2)
#   mkgreedy (ran 12-05 07:35 with ARGMAX=1 only: passed; ARGMAX=2 not yet) ARGMAX, the greedy token taken in the
#            launch (MegakernelBackend(argmax=1 / 2)): the cuda tests (its tokens, ids and ring posts against
#            torch.argmax and the engine's argmax build, both ARGMAX builds; an engine directory; STEP_INPUTS), the
#            pipelined generation's timeline, then mkbench with
#            MKBENCH_BACKENDS=megakernel,megakernel-argmax,megakernel-argmax-after in a call of its own
#   mkcommit (ran 12-05 09:09, H100: all 4 tests passed, none faster) ARGMAX=2 and COMMIT_LENGTHS (the greedy token's keys after the phases; the step's lengths
#            moved by the launch): the cuda tests (tokens, ring posts and lengths against the engine's own, each
#            build), then mkbench with megakernel and the three new variants, 300 steps, 3 rounds (~8 min in all)
#   mkpdl    (ran 12-05 13:00, H100: 3 passed, no faster) the launch as a programmatic dependent launch on a stream (PDL; no CUDA graphs): the
#            greedy-token cuda tests (each build's logits, tokens, ring and lengths against the default's), then
#            mkbench with megakernel, megakernel-stream, -pdl, -pdl-commit and -pdl-argmax-commit, 300 steps, 3
#            rounds, then the pipelined greedy timeline of megakernel-pdl (~8 min in all)
#   mkcheck  the backend's test against its emulation (the first launch's phases on their own inputs,
#            `first_step_errors`), scripts/megakernel_first_steps.py --steps 1, then mkbench compile, megakernel
#   mkhead   the megakernel layer file's cuda tests at HEAD (test_greedy_steps_in_the_kernel_from_the_models_prefill
#            among them, never run on a GPU before 12-06), then mkbench compile, megakernel (300 steps, 3 rounds)
#   mkh200   on an H200 only (anything else: says so, runs nothing): #6's number of the day and the launch variants
#            never timed there, mkbench with compile, megakernel, megakernel-argmax-after-commit and
#            megakernel-pdl-argmax-commit ($MKH200_BACKENDS), 300 steps, 3 rounds (~5 min)
#   mkloop   several greedy steps in one launch (STEP_LOOP, 12-06): the cuda test (two launches of 4 steps == 8 single
#            steps, the Generator's bursts == the default's tokens), then mkbench with megakernel and
#            $MKLOOP_BACKENDS (default megakernel-steps4,megakernel-steps8), $MKLOOP_ROUNDS rounds (default 2)
#   mkprobe  scripts/mkloop_probe.py $MKPROBE_ARGS: the STEP_LOOP build's stages checked one by one, then pipelined
#            greedy generation with K steps a launch against the default build in one process
#   mkstress scripts/mkloop_stress.py $MKSTRESS_ARGS: the STEP_LOOP build's intermittent hang hunted (the failing
#            pattern, prefill + a plain step + 12 launches of 8 steps, over many cycles; one long sequence; Generator
#            runs), failures counted with the step each was in
#   mkbench  bench model eager, compile, megakernel at B = 1, context 1024 ($MKBENCH_BACKENDS; $MKBENCH_ROUNDS
#            decode rounds, the backends' order rotated each round)
#   profile  scripts/profile_decode.py --backend $PROFILE_BACKEND (default compile): kernels per decode step, and the
#            graph replay's critical path (what each kernel adds to the span under PDL; 15:25: an upper bound only)
set -uo pipefail
parts=${*:-model profile}
parts=${parts//fp8fused/fp8ftest fp8fab}
source "$(dirname "$0")/gpu_setup.sh"
# The whole k3-small step in chain.cu with the real MLA attention over 1024 cache rows, stream mode, no baseline:
# layer_step TIMEOUT_S [megakernel_layer.py options]
layer_step() { timeout "$1" python3 scripts/megakernel_layer.py --step --attnres --mla 1024 --no-baseline \
  --modes stream "${@:2}"; }
# layer_builds LOG DEFINES...: the layer step once per build (two rounds each; "base": chain.cu's defaults), in
# order, into $OUT/LOG.log
layer_builds() { local log=$1; shift
  for v in "$@"; do
    layer_step 90 --rounds 2 --defines PAIR_TILES=1+LIVE_SPLITS=1+${v/base/} --out "$OUT/$log.json" \
      >> "$OUT/$log.log" 2>&1
  done
  rm -f "$OUT/$log.json"; }
for part in $parts; do
  t=$SECONDS
  case "$part" in
    demo)  timeout ${DEMO_TIMEOUT:-360} python3 -m k3export.cli demo --device cuda --backend ${DEMO_BACKEND:-best} \
             --out /tmp/demo > "$OUT/demo.log" 2>&1 ;;
    aoti)  timeout ${AOTI_TIMEOUT:-280} python3 -m pytest -q -m cuda tests/test_aoti_cuda.py -s -rxX -p no:cacheprovider \
             > "$OUT/aoti.log" 2>&1 ;;
    mla)   timeout 60 python3 -m pytest -q -m cuda tests/test_mla_trt.py -rs -p no:cacheprovider > "$OUT/mla.log" 2>&1 ;;
    mlabench) timeout ${MLABENCH_TIMEOUT:-400} python3 -m k3export.cli bench mla --no-sweep --out "$OUT/mla" \
             > "$OUT/mlabench.log" 2>&1 ;;
    mlasplit) timeout 150 python3 scripts/mla_split_probe.py --out "$OUT/mla-split.json" > "$OUT/mlasplit.log" 2>&1 ;;
    moe)   timeout 200 python3 -m k3export.cli bench moe --out "$OUT/moe" --budget-s ${MOE_BUDGET:-180} --phases ${MOE_PHASES:-prefill,decode} \
             > "$OUT/moe.log" 2>&1 ;;
    moetest) timeout 150 python3 -m pytest -q -m cuda tests/test_moe_kernels.py tests/test_moe_trt.py -s -rs \
             -k "${MOETEST_K:-pairs or cupy}" -p no:cacheprovider > "$OUT/moetest.log" 2>&1 ;;
    model) timeout ${MODEL_TIMEOUT:-300} python3 -m k3export.cli bench model --preset k3-small --dtype bf16 \
             --backends ${MODEL_BACKENDS:-eager,compile,compile-frozen} --prefill-lengths 2048 \
             --batches ${MODEL_BATCHES:-1,8,64} --contexts 1024 \
             --warmup 2 --iters 5 --decode-iters ${MODEL_DECODE_ITERS:-40} \
             --generate-tokens ${MODEL_GEN:-64} --out "$OUT/model" > "$OUT/model.log" 2>&1
           tar -C "$OUT" -czf "$OUT/model.tar.gz" model && rm -rf "$OUT/model" ;;   # the device returns <= 8 files
    toy)   timeout 150 python3 scripts/aoti_toy.py /tmp/toy > "$OUT/toy.log" 2>&1 ;;
    fp8c)  timeout ${FP8C_TIMEOUT:-200} python3 -m k3export.cli bench fp8 --preset k3-small --batches ${FP8C_BATCHES:-1} \
             --compiled --no-layer-pair --no-sweep --prefill ${FP8C_PREFILL:-0} --report-tokens 0 --noise-dtype none \
             --out "$OUT/fp8c" > "$OUT/fp8c.log" 2>&1 ;;
    mlatest) timeout 120 python3 -m pytest -q -m cuda tests/test_mla_kernels.py tests/test_packing.py -rs \
             -k "${MLATEST_K:-decode or packed}" -p no:cacheprovider > "$OUT/mlatest.log" 2>&1 ;;
    fused) timeout 120 python3 -m pytest -q -m cuda tests/test_attn_res_kernels.py tests/test_runtime.py -s -rs \
             -p no:cacheprovider > "$OUT/fused-test.log" 2>&1
           timeout 240 python3 -m k3export.cli bench model --preset k3-small --dtype bf16 \
             --backends ${FUSED_BACKENDS:-eager,compile,compile-unfused} --prefill-lengths 2048 --batches ${FUSED_BATCHES:-1,16} --contexts 1024 \
             --warmup 2 --iters 5 --out "$OUT/fused" > "$OUT/fused.log" 2>&1 ;;
    serve) timeout ${SERVE_TIMEOUT:-200} python3 -m pytest -q -m cuda tests/test_kda_kernels.py tests/test_attn_res_kernels.py \
             tests/test_runtime.py tests/test_packing.py -s -rs -k "${SERVE_K:-inplace or decode_k3 or norm or runtime or packed or cuda_graph or generates}" \
             -p no:cacheprovider > "$OUT/serve.log" 2>&1 ;;
    moefused) timeout 150 python3 -m pytest -q -m cuda tests/test_moe_pairs_fused.py tests/test_moe_kernels.py -k pairs -s -rs \
             -p no:cacheprovider > "$OUT/moefused.log" 2>&1 ;;
    fp8split) timeout 200 python3 -m pytest -q -m cuda tests/test_fp8_kernels_split.py tests/test_fp8.py -rs -p no:cacheprovider \
             > "$OUT/fp8split-test.log" 2>&1
           timeout 150 python3 scripts/fp8_split_sum.py --out "$OUT/split_sum" > "$OUT/fp8split.log" 2>&1 ;;
    gemvprobe) timeout 120 python3 scripts/gemv_triton_probe.py --out "$OUT/gemv_triton.json" > "$OUT/gemvprobe.log" 2>&1 ;;
    kda)   timeout 200 python3 -m k3export.cli bench kda --out "$OUT/kda" > "$OUT/kda.log" 2>&1 ;;
    moepair) timeout 150 python3 -m pytest -q -m cuda tests/test_moe_kernels.py -k "paired or tilings_k3_shapes and (prefill-m128t64 or y16r)" \
             -s -rs -p no:cacheprovider > "$OUT/moepair-test.log" 2>&1
           timeout ${MOEPAIR_TIMEOUT:-280} python3 -m k3export.cli bench moe --phases prefill --layout ${MOEPAIR_LAYOUT:-both} \
             --tiles ${MOEPAIR_TILES:-m128t64-aw,m128t64-aw-y16r-f2,m128-tma-aw,m64t32-n128-aw8,m64t32-n128-aw8-y16r-f2} \
             --tokens ${MOEPAIR_TOKENS:-8192,16384,4096} --budget-s ${MOEPAIR_BUDGET:-240} --out "$OUT/moepair" \
             > "$OUT/moepair.log" 2>&1 ;;
    mlawide) timeout ${MLAWIDE_TEST_TIMEOUT:-150} python3 -m pytest -q -m cuda tests/test_mla_kernels.py -s -rs \
             -k "wide or fp32" -p no:cacheprovider > "$OUT/mlawide-test.log" 2>&1
           timeout ${MLAWIDE_TIMEOUT:-200} python3 scripts/mla_decode_sweep.py "$OUT/mla-decode-wide.json" \
             --budget-s ${MLAWIDE_BUDGET:-140} ${MLAWIDE_VARIANTS:+--variants $MLAWIDE_VARIANTS} \
             > "$OUT/mlawide.log" 2>&1 ;;
    pdl)   timeout 120 python3 scripts/pdl_probe.py --out "$OUT/pdl" > "$OUT/pdl.log" 2>&1 ;;
    pdltest) timeout 300 python3 -m pytest -q -m cuda tests/test_pdl.py -s -rs -k "${PDLTEST_K:-cuda or k3_small}" \
             -p no:cacheprovider > "$OUT/pdltest.log" 2>&1 ;;
    gentest) timeout 240 python3 -m pytest -q -m cuda tests/test_runtime.py -s -rs \
             -p no:cacheprovider > "$OUT/gentest.log" 2>&1 ;;
    ab)    timeout ${AB_TIMEOUT:-240} python3 scripts/ab_decode.py --env "$AB_ENV" --backend ${AB_BACKEND:-compile} \
             --out "$OUT/ab.json" > "$OUT/ab.log" 2>&1 ;;
    normtest) timeout 150 python3 -m pytest -q -m cuda tests/test_gemv.py -s -rs -k "norm or swaps" -p no:cacheprovider \
             > "$OUT/normtest.log" 2>&1 ;;
    gemv4) timeout 150 python3 -m pytest -q -m cuda tests/test_gemv.py -s -rs -k "batched or gemv4" -p no:cacheprovider \
             > "$OUT/test-gemv4.log" 2>&1
           for b in ${GEMV4_BATCHES:-2 4}; do timeout 200 python3 scripts/ab_decode.py --backends compile,compile-gemv4 \
             --batch $b --rounds 3 --out "$OUT/ab-gemv4-b$b.json" > "$OUT/ab-gemv4-b$b.log" 2>&1; done ;;
    fp8moe) timeout 200 python3 -m pytest -q -m cuda tests/test_fp8.py -s -rs -k "w8a8_tilings or grouped_kernel" \
             -p no:cacheprovider > "$OUT/test-fp8moe.log" 2>&1
           timeout ${FP8MOE_TIMEOUT:-330} python3 -m k3export.cli bench moe --precision fp8 --phases prefill \
             --tokens ${FP8MOE_TOKENS:-4096,8192,16384} ${FP8MOE_TILES:+--tiles $FP8MOE_TILES} --budget-s 300 \
             --out "$OUT/moe-fp8" > "$OUT/moe-fp8.log" 2>&1 ;;
    fp8prefill) timeout 150 python3 -m pytest -q -m cuda tests/test_fp8.py tests/test_gemv.py -s -rs \
             -k "grouped_kernel or w8a8_tiling_rule or compile_gemv4" -p no:cacheprovider > "$OUT/test-fp8prefill.log" 2>&1
           for t in ${FP8PREFILL_TILES:-ptr m128t64-n64-f2}; do K3_FP8_MOE_PREFILL=$t timeout 240 python3 -m k3export.cli \
             bench fp8 --preset k3-small --batches 1 --compiled --no-layer-pair --no-sweep --prefill 2048 \
             --report-tokens 0 --noise-dtype none --out "$OUT/fp8p-$t" > "$OUT/fp8p-$t.log" 2>&1; done ;;
    gemvtest) timeout 240 python3 -m pytest -q -m cuda tests/test_gemv.py -s -rs -p no:cacheprovider > "$OUT/gemvtest.log" 2>&1 ;;
    gemvpdl) for m in ${GEMVPDL_M:-1 4}; do timeout 90 python3 scripts/gemv_pdl_probe.py --m $m --out "$OUT/gemvpdl-m$m.json"; done \
             > "$OUT/gemvpdl.log" 2>&1
             timeout 90 python3 scripts/gemv_pdl_probe.py --fp8 --out "$OUT/gemvpdl-fp8.json" >> "$OUT/gemvpdl.log" 2>&1 ;;
    probe) timeout 60 python3 scripts/gemv_pack_probe.py --out "$OUT/probe.json" > "$OUT/probe.log" 2>&1 ;;
    barrier) for g in 0 264; do timeout 60 python3 scripts/barrier_probe.py --programs $g --out "$OUT/barrier-g$g.json"; done \
             > "$OUT/barrier.log" 2>&1 ;;
    fp8ftest) timeout 150 python3 -m pytest -q -m cuda tests/test_fp8.py -k "fused or expert_wo or cols or runs" \
             -s -rs -p no:cacheprovider > "$OUT/fp8fused-test.log" 2>&1 ;;
    fp8fab) timeout ${FP8FAB_TIMEOUT:-400} python3 scripts/ab_decode.py --fp8 --rounds ${FP8FAB_ROUNDS:-4} \
             --env K3_FP8_EXPERT_WO=pairs-n16k512-shift,pairs-n16k512-shift-fused \
             ${FP8FAB_BACKENDS:+--backends $FP8FAB_BACKENDS} --precisions --out "$OUT/ab-fp8fused.json" \
             > "$OUT/fp8fused.log" 2>&1 ;;
    bucket) timeout 150 python3 -m pytest -q -m cuda tests/test_runtime.py -s -rs -k "bucket or cuda_graph or generates" \
             -p no:cacheprovider > "$OUT/bucket-test.log" 2>&1
           timeout ${BUCKET_TIMEOUT:-200} python3 -m k3export.cli bench model --preset k3-small --dtype bf16 \
             --backends compile --prefill-lengths ${BUCKET_LENGTHS:-2048} --batches 1 --contexts 1024 --warmup 2 \
             --iters 5 --decode-iters 10 --generate-tokens 0 --out "$OUT/bucket" > "$OUT/bucket.log" 2>&1 ;;
    dbuckets) timeout 200 python3 -m pytest -q -m cuda tests/test_runtime.py -s -rs \
             -p no:cacheprovider > "$OUT/dbuckets-test.log" 2>&1
           timeout ${DBUCKETS_TIMEOUT:-300} python3 scripts/decode_buckets_probe.py --out "$OUT/dbuckets.json" \
             > "$OUT/dbuckets.log" 2>&1 ;;
    trtmoe) timeout 300 python3 -m pytest -q -m cuda tests/test_moe_trt.py tests/test_moe_kernels.py -s -rs \
             -k "chain_through_cupy or chunked or ptr" -p no:cacheprovider > "$OUT/test-trtmoe.log" 2>&1
           timeout ${TRTMOE_TIMEOUT:-280} python3 -m k3export.cli bench moe --phases prefill \
             --tiles ptr-m64,ptr-m128t64,ptr-m64t32-n128,m64t32-n128-aw8-y16r-f2,m128t64-aw-y16r-f2,m128-tma-aw-y16r-f2 \
             --tokens ${TRTMOE_TOKENS:-4096,8192,16384} --budget-s 240 --out "$OUT/moe-trt" > "$OUT/trtmoe.log" 2>&1 ;;
    trtfp8) timeout 400 python3 -m pytest -q -m cuda tests/test_moe_trt_fp8.py tests/test_moe_trt.py -s -rs \
             -k "cupy" -p no:cacheprovider > "$OUT/test-trtfp8.log" 2>&1
           timeout ${TRTFP8_TIMEOUT:-150} python3 -m k3export.cli bench moe --precision fp8 --phases prefill \
             --tiles ptr,m128-n128-s4-f2 --tokens ${TRTFP8_TOKENS:-4096} --budget-s 120 --out "$OUT/moe-fp8-trt" \
             > "$OUT/trtfp8.log" 2>&1 ;;
    fp8eng) timeout 200 python3 -m pytest -q -m cuda tests/test_build.py -s -rs -k fp8 -p no:cacheprovider \
             > "$OUT/fp8eng.log" 2>&1 ;;
    grouped) timeout ${GROUPED_TIMEOUT:-300} python3 -m k3export.cli bench moe --phases prefill \
             --tiles ${GROUPED_TILES:-old,ptr-m64,m64t32-aw8,m64t32-n128-aw8-y16r-f2,ptr-m64t32-n128,m128t64-aw-y16r-f2} \
             --tokens ${GROUPED_TOKENS:-1024,2048,3072} --budget-s 260 --out "$OUT/grouped" > "$OUT/grouped.log" 2>&1 ;;
    grpsmall) timeout 150 python3 scripts/moe_grouped_probe.py --out "$OUT/grpsmall.json" > "$OUT/grpsmall.log" 2>&1
           timeout 100 python3 scripts/moe_grouped_probe.py --paired >> "$OUT/grpsmall.log" 2>&1
           timeout 300 python3 -m pytest -q -m cuda tests/test_moe_kernels.py -rs -p no:cacheprovider \
             > "$OUT/test-moe-kernels.log" 2>&1 ;;
    overlap) timeout ${OVERLAP_TIMEOUT:-300} python3 scripts/ab_decode.py --on-skeleton --rounds 3 \
             --background ${OVERLAP_PROGRAMS:-0,16,33,66} --out "$OUT/overlap-skeleton.json" \
             > "$OUT/overlap-skeleton.log" 2>&1
           timeout ${OVERLAP_TIMEOUT:-300} python3 scripts/ab_decode.py --rounds 3 --background ${OVERLAP_SMALL:-0,33} \
             --out "$OUT/overlap-small.json" > "$OUT/overlap-small.log" 2>&1 ;;
    fp8comp) timeout ${FP8COMP_TIMEOUT:-400} python3 scripts/fp8_compile_probe.py \
             ${FP8COMP_VARIANTS:+--variants $FP8COMP_VARIANTS} > "$OUT/fp8comp.log" 2>&1 ;;
    chain) timeout 200 python3 -m pytest -q -m cuda tests/test_megakernel_chain.py -s -rs -p no:cacheprovider \
             > "$OUT/chain.log" 2>&1
           timeout ${CHAIN_TIMEOUT:-300} python3 scripts/megakernel_chain.py --rings ${CHAIN_RINGS:-3x65536} \
             ${CHAIN_ARGS:-} --out "$OUT/chain.json" --plot "$OUT/chain.png" \
             $([[ ${CHAIN_RINGS:-} == *TRACE_TILES* ]] && echo --tile-plot "$OUT/chain-tiles.png") \
             >> "$OUT/chain.log" 2>&1 ;;
    layer) timeout 240 python3 -m pytest -q -m cuda tests/test_megakernel_layer.py -s -rs -p no:cacheprovider \
             > "$OUT/layer.log" 2>&1
           timeout ${LAYER_TIMEOUT:-300} python3 scripts/megakernel_layer.py ${LAYER_ARGS:-} --out "$OUT/layer.json" \
             --plot "$OUT/layer.png" \
             >> "$OUT/layer.log" 2>&1 ;;
    step)  timeout 200 python3 scripts/megakernel_layer.py --step --out "$OUT/step.json" --plot "$OUT/step.png" \
             > "$OUT/step.log" 2>&1
           timeout 120 python3 scripts/megakernel_layer.py --step --no-standins --no-baseline --modes stream,nodeps \
             --out "$OUT/step-nostandins.json" >> "$OUT/step.log" 2>&1 ;;
    attnres) timeout 330 python3 -m pytest -q -m cuda tests/test_megakernel_layer.py -s -rs -p no:cacheprovider \
             > "$OUT/attnres.log" 2>&1
           timeout 200 python3 scripts/megakernel_layer.py --step --attnres --out "$OUT/step-attnres.json" \
             --plot "$OUT/step-attnres.png" >> "$OUT/attnres.log" 2>&1
           if [[ -f k3export/megakernel/chain_prev.cu ]]; then        # (an untracked copy: the A/B without AttnRes)
             for cu in k3export/megakernel/chain_prev.cu k3export/megakernel/chain.cu; do
               timeout 100 python3 scripts/megakernel_layer.py --step --no-baseline --modes stream --rounds 3 \
                 --cu $cu --out "$OUT/step-$(basename $cu .cu).json" >> "$OUT/attnres.log" 2>&1
             done
           fi ;;
    abmix) timeout 200 python3 -m pytest -q -m cuda tests/test_megakernel_layer.py -s -rs -k attnres \
             -p no:cacheprovider > "$OUT/abmix.log" 2>&1
           for r in 1 2; do                       # (an untracked chain_prev.cu: the version before, with AttnRes)
             for cu in k3export/megakernel/chain_prev.cu k3export/megakernel/chain.cu; do
               timeout 100 python3 scripts/megakernel_layer.py --step --attnres --no-baseline --modes stream \
                 --rounds 3 --cu $cu --out "$OUT/ab$r-$(basename $cu .cu).json" >> "$OUT/abmix.log" 2>&1
             done
           done ;;
    gmla)  timeout 420 python3 -m pytest -q -m cuda tests/test_megakernel_layer.py tests/test_megakernel_chain.py -s -rs \
             -p no:cacheprovider > "$OUT/gmla.log" 2>&1
           timeout 200 python3 scripts/megakernel_layer.py --step --attnres --mla 1024 --out "$OUT/step-mla.json" \
             --plot "$OUT/step-mla.png" >> "$OUT/gmla.log" 2>&1
           timeout 100 python3 scripts/megakernel_layer.py --step --attnres --mla 1024 --no-baseline --modes stream \
             --rounds 1 --defines PHASE_TIMES --out "$OUT/step-mla-phase-times.json" >> "$OUT/gmla.log" 2>&1 ;;
    greedy) timeout 300 python3 -m pytest -q -m cuda tests/test_megakernel_layer.py -k "greedy" -s -rs \
             -p no:cacheprovider > "$OUT/greedy.log" 2>&1
           timeout 200 python3 scripts/megakernel_layer.py --greedy 8 --follow --out "$OUT/greedy-follow.json" \
             >> "$OUT/greedy.log" 2>&1 ;;
    mkback) timeout 330 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -s -rs -p no:cacheprovider \
             > "$OUT/mkback.log" 2>&1
           timeout 110 python3 scripts/megakernel_layer.py --greedy 8 --follow --out "$OUT/greedy-follow.json" \
             >> "$OUT/mkback.log" 2>&1 ;;
    greedy64) timeout 300 python3 scripts/megakernel_layer.py --greedy 8 --follow --ref64 \
             --out "$OUT/greedy-ref64.json" > "$OUT/greedy64.log" 2>&1 ;;
    mkinputs) timeout 200 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -k step_inputs -s -rs \
             -p no:cacheprovider > "$OUT/mkinputs.log" 2>&1
           MKBENCH_BACKENDS=eager,megakernel-host-inputs,megakernel bash "$0" mkbench ;;
    mkstep) timeout 200 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -k step_inputs -s -rs \
             -p no:cacheprovider > "$OUT/mkstep.log" 2>&1
           for be in megakernel-host-inputs megakernel; do
             timeout 150 python3 scripts/profile_decode.py --backend $be --timeline --top 15 >> "$OUT/mkstep.log" 2>&1
           done ;;
    mkcache) timeout 300 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -s -rs -p no:cacheprovider \
             > "$OUT/mkcache.log" 2>&1
           MKBENCH_BACKENDS=megakernel-host-inputs,megakernel MKBENCH_ITERS=300 bash "$0" mkbench
           timeout 150 python3 scripts/profile_decode.py --backend megakernel --timeline --top 15 \
             >> "$OUT/mkcache.log" 2>&1 ;;
    mkfinal) timeout 200 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -k "directory or follows" \
             -s -rs -p no:cacheprovider > "$OUT/mkfinal-tests.log" 2>&1
           bash "$0" mkbench
           timeout 200 python3 scripts/profile_decode.py --backend megakernel --timeline --generate 6 --top 10 \
             > "$OUT/mkfinal.log" 2>&1 ;;
    mkrouter) timeout 200 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -k router_first -s -rs \
             -p no:cacheprovider > "$OUT/mkrouter.log" 2>&1
           MKBENCH_BACKENDS=megakernel,megakernel-router-first MKBENCH_ITERS=300 bash "$0" mkbench ;;
    mkpair) timeout 200 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -k "pair_tiles" -s -rs \
             -p no:cacheprovider > "$OUT/mkpair.log" 2>&1
           MKBENCH_BACKENDS=megakernel-unpaired,megakernel MKBENCH_ITERS=300 bash "$0" mkbench ;;
    mkargmax) timeout 300 python3 -m pytest -q -m cuda tests/test_argmax.py tests/test_megakernel_backend.py \
             -s -rs -p no:cacheprovider > "$OUT/mkargmax.log" 2>&1
           MKBENCH_BACKENDS=megakernel MKBENCH_ITERS=300 bash "$0" mkbench
           timeout 150 python3 scripts/profile_decode.py --backend megakernel --timeline --generate 6 --top 10 \
             >> "$OUT/mkargmax.log" 2>&1 ;;
    mksleep) timeout 200 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -k "poll_sleep" -s -rs \
             -p no:cacheprovider > "$OUT/mksleep.log" 2>&1
           MKBENCH_BACKENDS=megakernel,megakernel-poll-sleep64,megakernel-poll-sleep256 MKBENCH_ITERS=300 \
             bash "$0" mkbench ;;
    mkrun)  timeout 260 python3 -m pytest -q -m cuda tests/test_argmax.py tests/test_megakernel_backend.py \
             -k "argmax or poll_sleep or directory" -s -rs -p no:cacheprovider > "$OUT/mkrun.log" 2>&1
           MKBENCH_BACKENDS=megakernel,megakernel-poll-sleep64,megakernel-poll-sleep256 MKBENCH_ITERS=300 \
             bash "$0" mkbench
           timeout 120 python3 scripts/profile_decode.py --backend megakernel --timeline --generate 6 --top 10 \
             >> "$OUT/mkrun.log" 2>&1
           layer_step 110 --rounds 1 --defines PHASE_TIMES+PAIR_TILES=1 --out "$OUT/step-phase-times-paired.json" \
             >> "$OUT/mkrun.log" 2>&1 ;;
    mkblocks) layer_step 150 --rounds 1 --defines PHASE_TIMES+BLOCK_TIMES+PAIR_TILES=1 \
             --out "$OUT/step-block-times.json" > "$OUT/mkblocks.log" 2>&1 ;;
    mkattn) bash "$0" mkblocks
           for r in 1 2; do
             for v in base ATTN_HEADS=4; do
               layer_step 100 --rounds 2 --defines PAIR_TILES=1+${v/base/} --out "$OUT/attn$r-${v%%=*}.json" \
                 >> "$OUT/mkattn.log" 2>&1
             done
           done
           grep -h "stream: GEMV\|^round\|k3-small KDA" "$OUT/mkattn.log" | tail -30 ;;
    mkheads) timeout 200 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -k "attn_heads" -s -rs \
             -p no:cacheprovider > "$OUT/mkheads.log" 2>&1
           MKBENCH_BACKENDS=megakernel,megakernel-attn-heads4 MKBENCH_ITERS=300 bash "$0" mkbench
           rm -f "$OUT/mkbench/model.png" "$OUT/mkbench/model.partial.json" ;;
    mklive) timeout 200 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -k "live_splits" -s -rs \
             -p no:cacheprovider > "$OUT/mklive.log" 2>&1
           MKBENCH_BACKENDS=megakernel-dead-splits,megakernel,megakernel-attn-heads4 MKBENCH_ITERS=300 \
             bash "$0" mkbench
           rm -f "$OUT/mkbench/model.png" "$OUT/mkbench/model.partial.json" "$OUT/gpu.txt" ;;
    mktrace) layer_step 150 --rounds 1 --defines PHASE_TIMES+BLOCK_TIMES+TRACE+PAIR_TILES=1 \
             --out "$OUT/step-trace.json" > "$OUT/mktrace.log" 2>&1
           rm -f "$OUT/step-trace.json" ;;
    mktiles) for v in ${MKTILES_VARIANTS:-base}; do
             layer_step 100 --rounds 1 --defines PHASE_TIMES+BLOCK_TIMES+TRACE+${MKTILES_DEFINES:-}PAIR_TILES=1+LIVE_SPLITS=1+${v/base/} \
               --out "$OUT/tiles.json" >> "$OUT/mktiles.log" 2>&1
           done
           rm -f "$OUT/tiles.json"
           grep -h "x and tile parts\|k3-small KDA" "$OUT/mktiles.log" ;;
    mksums) layer_builds mksums ATTN_SUMS_TOGETHER=0 base ATTN_SUMS_TOGETHER=0 base   # (1: the default since 18:50)
           MKTILES_DEFINES=ATTN_TWICE+ bash "$0" mktiles
           grep -h "^round\|k3-small KDA\|x and tile" "$OUT/mksums.log" "$OUT/mktiles.log" ;;
    mkmma) timeout 280 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py \
             -k "attn_mma or sums_apart or x_tail" -s -rs -p no:cacheprovider > "$OUT/mkmma.log" 2>&1
           layer_builds mkmma base ATTN_MMA=1 ATTN_MMA=1+ATTN_X_TAIL=1 ATTN_X_TAIL=1 base
           MKTILES_DEFINES=ATTN_TWICE+ATTN_MMA=1+ bash "$0" mktiles
           grep -h "passed\|failed\|max rel\|^round\|k3-small KDA\|x and tile" "$OUT/mkmma.log" "$OUT/mktiles.log" ;;
    mkmmafinal) timeout 150 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -k "directory or x_tail" \
             -s -rs -p no:cacheprovider > "$OUT/mkmmafinal.log" 2>&1
           MKBENCH_BACKENDS=megakernel,megakernel-attn-cuda-cores MKBENCH_ITERS=300 MKBENCH_TIMEOUT=260 \
             bash "$0" mkbench
           rm -f "$OUT/mkbench/model.png" "$OUT/mkbench/model.partial.json" "$OUT/gpu.txt" ;;
    mkcombine) timeout 200 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py \
             -k "combine_words or softmax_in_sums" -s -rs -p no:cacheprovider > "$OUT/mkcombine.log" 2>&1
           m=ATTN_MMA=1+ATTN_X_TAIL=1
           layer_builds mkcombine $m $m+COMBINE_WORDS=12 $m+ATTN_SOFTMAX_IN_SUMS=1 \
             $m+COMBINE_WORDS=12+ATTN_SOFTMAX_IN_SUMS=1 $m
           grep -h "passed\|failed\|max rel\|^round\|k3-small KDA" "$OUT/mkcombine.log"
           MKBENCH_BACKENDS=megakernel,megakernel-combine12 MKBENCH_ITERS=300 MKBENCH_ROUNDS=3 bash "$0" mkbench
           rm -f "$OUT/mkbench/model.png" "$OUT/mkbench/model.partial.json" "$OUT/gpu.txt" ;;
    mksample) timeout 300 python3 -m pytest -q -m cuda tests/test_sampling.py tests/test_runtime.py \
             tests/test_megakernel_backend.py -k "${MKSAMPLE_K:-draw_program or cuda_graph_decode_equals_plain or \
             decode_bucket_graphs or directory_builds}" -s -rs -p no:cacheprovider > "$OUT/mksample.log" 2>&1
           grep -h "passed\|failed\|greedy" "$OUT/mksample.log"
           [ -z "${MKSAMPLE_NO_PROBE:-}" ] && timeout 120 python3 scripts/sampling_probe.py >> "$OUT/mksample.log" 2>&1
           MKBENCH_BACKENDS=${MKBENCH_BACKENDS:-compile,megakernel} MKBENCH_ITERS=100 MKBENCH_TIMEOUT=280 \
             bash "$0" mkbench
           rm -f "$OUT/mkbench/model.partial.json" "$OUT/gpu.txt" ;;
    mkpost) timeout 330 python3 -m pytest -q -m cuda tests/test_sampling.py tests/test_argmax.py tests/test_runtime.py \
             tests/test_megakernel_backend.py -k "${MKPOST_K:-draw_program or thresholds or argmax or \
             cuda_graph_decode_equals_plain or decode_bucket_graphs or directory_builds}" -s -rs -p no:cacheprovider \
             > "$OUT/mkpost.log" 2>&1
           grep -h "passed\|failed\|thresholds:" "$OUT/mkpost.log"
           timeout 100 python3 scripts/sampling_probe.py > "$OUT/mkpost-probe.log" 2>&1
           timeout 100 python3 scripts/sampling_probe.py --vocab 163840 --iters 100 >> "$OUT/mkpost-probe.log" 2>&1
           grep -h "graph replay" "$OUT/mkpost-probe.log"
           PROFILE_BACKEND=megakernel PROFILE_ARGS="--timeline --generate 7" bash "$0" profile
           grep -h "step to step" "$OUT/profile.log" ;;
    mkgapart) timeout 240 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -k "g_apart" -s -rs \
             -p no:cacheprovider > "$OUT/mkgapart.log" 2>&1
           grep -h "passed\|failed" "$OUT/mkgapart.log"
           for r in $(seq ${MKGAPART_ROUNDS:-1}); do
             for v in "--no-g-apart --no-mla-g-apart" "--g-apart --no-mla-g-apart" "--no-g-apart --mla-g-apart" \
                      "--g-apart --mla-g-apart"; do
               echo "== $v" >> "$OUT/mkgapart-step.log"
               layer_step 100 --rounds 2 --defines PAIR_TILES=1+LIVE_SPLITS=1+ATTN_MMA=1+ATTN_X_TAIL=1 $v \
                 --out "$OUT/gapart.json" >> "$OUT/mkgapart-step.log" 2>&1
             done
           done
           rm -f "$OUT/gapart.json"
           grep -h "^== \|k3-small KDA" "$OUT/mkgapart-step.log" ;;
    mkqueue) timeout 120 python3 scripts/l2_queue_probe.py --out "$OUT/l2-queue-probe.json" > "$OUT/mkqueue.log" 2>&1
           for r in $(seq ${MKQUEUE_ROUNDS:-1}); do
             for v in ${MKQUEUE_BUILDS:-base INFLIGHT=2 INFLIGHT=1}; do
               echo "== $v" >> "$OUT/mkqueue-step.log"
               d=PAIR_TILES=1+LIVE_SPLITS=1+ATTN_MMA=1+ATTN_X_TAIL=1; [ "$v" = base ] || d+="+$v"
               layer_step 100 --rounds 2 --defines $d \
                 --out "$OUT/queue.json" >> "$OUT/mkqueue-step.log" 2>&1
             done
           done
           rm -f "$OUT/queue.json"
           cat "$OUT/mkqueue.log"; grep -h "^== \|k3-small KDA\|max rel" "$OUT/mkqueue-step.log" ;;
    mkinflight) timeout 220 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py \
             -k "${MKINFLIGHT_K:-inflight or follows_its_emulation or directory_builds}" -s -rs -p no:cacheprovider \
             > "$OUT/mkinflight.log" 2>&1
           grep -h "passed\|failed" "$OUT/mkinflight.log"
           for v in ${MKINFLIGHT_BUILDS:-INFLIGHT=1 INFLIGHT=1+PREFETCH_TILES=1 INFLIGHT=1+PREFETCH_TILES=2 base}; do
             echo "== $v" >> "$OUT/mkinflight-step.log"
             d=PAIR_TILES=1+LIVE_SPLITS=1+ATTN_MMA=1+ATTN_X_TAIL=1; [ "$v" = base ] || d+="+$v"
             layer_step 60 --rounds 2 --defines $d --out "$OUT/inflight.json" >> "$OUT/mkinflight-step.log" 2>&1
           done
           layer_step 60 --rounds 1 --defines PHASE_TIMES+PAIR_TILES=1+LIVE_SPLITS=1+ATTN_MMA=1+ATTN_X_TAIL=1+INFLIGHT=1 \
             --out "$OUT/inflight-phase-times.json" > "$OUT/mkinflight-phase-times.log" 2>&1
           rm -f "$OUT/inflight.json"
           grep -h "^== \|k3-small KDA\|max rel" "$OUT/mkinflight-step.log"
           grep -h "after the phase before" "$OUT/mkinflight-phase-times.log" ;;
    mkxparts) layer_step 100 --rounds 1 \
             --defines PHASE_TIMES+BLOCK_TIMES+TRACE+PAIR_TILES=1+LIVE_SPLITS=1+ATTN_MMA=1+ATTN_X_TAIL=1+INFLIGHT=1+NORM_W_FIRST=1${MKXPARTS_DEFINES:-} \
             --out "$OUT/xparts.json" > "$OUT/mkxparts.log" 2>&1
           rm -f "$OUT/xparts.json"
           grep -v "vs emulation\|GEMV / routed" "$OUT/mkxparts.log" | tail -60 ;;
    mkab)  cp k3export/megakernel/chain.cu "$OUT/chain.cu.checkout"
           for r in $(seq ${MKAB_ROUNDS:-2}); do
             for v in ${MKAB_CUS:?}; do          # (each a chain.cu; the checkout's put back after)
               echo "== $v" >> "$OUT/mkab-step.log"
               cp "$v" k3export/megakernel/chain.cu
               layer_step 100 --rounds 2 \
                 --defines PAIR_TILES=1+LIVE_SPLITS=1+ATTN_MMA=1+ATTN_X_TAIL=1+INFLIGHT=1+NORM_W_FIRST=1${MKAB_DEFINES:-} \
                 --out "$OUT/ab.json" >> "$OUT/mkab-step.log" 2>&1
             done
           done
           cp "$OUT/chain.cu.checkout" k3export/megakernel/chain.cu
           rm -f "$OUT/ab.json" "$OUT/chain.cu.checkout"
           grep -h "^== \|k3-small KDA\|max rel\|AttnRes (25" "$OUT/mkab-step.log" ;;
    mkdefs) for r in $(seq ${MKAB_ROUNDS:-2}); do
             for v in ${MKDEFS_VARIANTS:?}; do
               echo "== $v" >> "$OUT/mkdefs-step.log"
               layer_step 100 --rounds 2 \
                 --defines PAIR_TILES=1+LIVE_SPLITS=1+ATTN_MMA=1+ATTN_X_TAIL=1+INFLIGHT=1+NORM_W_FIRST=1${v#-} \
                 --out "$OUT/ab.json" >> "$OUT/mkdefs-step.log" 2>&1
             done
           done
           rm -f "$OUT/ab.json"
           grep -h "^== \|k3-small KDA\|max rel\|AttnRes (25" "$OUT/mkdefs-step.log" ;;
    mkgreedy) timeout 330 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -k \
             "greedy_token or directory_builds or step_inputs" -s -rs -p no:cacheprovider > "$OUT/mkgreedy.log" 2>&1
           timeout 150 python3 scripts/profile_decode.py --backend megakernel --timeline --generate 6 --top 10 \
             >> "$OUT/mkgreedy.log" 2>&1 ;;
    mkcommit) timeout 300 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -k "greedy_token" -s -rs \
             -p no:cacheprovider > "$OUT/mkcommit.log" 2>&1
           MKBENCH_BACKENDS=${MKCOMMIT_BACKENDS:-megakernel,megakernel-argmax-after,megakernel-commit-lengths,megakernel-argmax-after-commit} \
             MKBENCH_ITERS=300 MKBENCH_ROUNDS=3 MKBENCH_TIMEOUT=320 bash "$0" mkbench
           rm -f "$OUT/mkbench/model.partial.json" ;;
    mkpdl) timeout 330 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -k "${MKPDL_TESTS:-greedy_token}" -s -rs \
             -p no:cacheprovider > "$OUT/mkpdl.log" 2>&1
           MKBENCH_BACKENDS=${MKPDL_BACKENDS:-megakernel,megakernel-stream,megakernel-pdl,megakernel-pdl-commit,megakernel-pdl-argmax-commit} \
             MKBENCH_ITERS=300 MKBENCH_ROUNDS=3 MKBENCH_TIMEOUT=360 bash "$0" mkbench
           rm -f "$OUT/mkbench/model.partial.json"
           timeout 150 python3 scripts/profile_decode.py --backend megakernel-pdl --timeline --generate 6 --top 10 \
             > "$OUT/mkpdl-profile.log" 2>&1 ;;
    mkcheck) timeout 240 python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -k follows_its_emulation -s -rs \
             -p no:cacheprovider > "$OUT/mkcheck-tests.log" 2>&1
           timeout 150 python3 scripts/megakernel_first_steps.py --prompts 64 --steps 1 --out "$OUT/mkcheck-diag.json" \
             > "$OUT/mkcheck-diag.log" 2>&1
           MKBENCH_BACKENDS=compile,megakernel MKBENCH_ITERS=300 MKBENCH_ROUNDS=3 MKBENCH_TIMEOUT=300 bash "$0" mkbench ;;
    mkhead) timeout ${MKHEAD_TIMEOUT:-330} python3 -m pytest -q -m cuda tests/test_megakernel_layer.py -s -rs --durations=0 \
             -p no:cacheprovider > "$OUT/mkhead-tests.log" 2>&1
           MKBENCH_BACKENDS=compile,megakernel MKBENCH_ITERS=300 MKBENCH_ROUNDS=3 MKBENCH_TIMEOUT=220 bash "$0" mkbench ;;
    mkh200) if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
             echo "mkh200: not an H200 ($(nvidia-smi --query-gpu=name --format=csv,noheader)); nothing run" \
               | tee "$OUT/mkh200.log"
             continue
           fi
           MKBENCH_BACKENDS=${MKH200_BACKENDS:-compile,megakernel,megakernel-argmax-after-commit,megakernel-pdl-argmax-commit} \
             MKBENCH_ITERS=300 MKBENCH_ROUNDS=3 MKBENCH_TIMEOUT=420 bash "$0" mkbench ;;
    mkloop) timeout ${MKLOOP_TEST_TIMEOUT:-300} python3 -m pytest -q -m cuda tests/test_megakernel_backend.py -s -rs \
             -k several_steps -p no:cacheprovider > "$OUT/mkloop.log" 2>&1
           echo "mkloop test: exit $?" | tee -a "$OUT/pending.log"
           MKBENCH_BACKENDS=megakernel,${MKLOOP_BACKENDS:-megakernel-steps4,megakernel-steps8} MKBENCH_ITERS=300 \
             MKBENCH_ROUNDS=${MKLOOP_ROUNDS:-2} MKBENCH_TIMEOUT=${MKLOOP_BENCH_TIMEOUT:-400} bash "$0" mkbench ;;
    mkprobe) timeout ${MKPROBE_TIMEOUT:-400} python3 scripts/mkloop_probe.py ${MKPROBE_ARGS:-} > "$OUT/mkprobe.log" 2>&1 ;;
    mkstress) timeout ${MKSTRESS_TIMEOUT:-300} python3 scripts/mkloop_stress.py ${MKSTRESS_ARGS:-} > "$OUT/mkstress.log" 2>&1 ;;
    mkbench) timeout ${MKBENCH_TIMEOUT:-400} python3 -m k3export.cli bench model --preset k3-small --dtype bf16 \
             --backends ${MKBENCH_BACKENDS:-eager,compile,megakernel} --prefill-lengths 2048 --batches 1 \
             --contexts 1024 --warmup 3 --iters 5 --decode-iters ${MKBENCH_ITERS:-100} --rounds ${MKBENCH_ROUNDS:-1} \
             --generate-tokens 64 \
             --no-new-lengths --out "$OUT/mkbench" > "$OUT/mkbench.log" 2>&1 ;;
    profile) timeout 150 python3 scripts/profile_decode.py --backend ${PROFILE_BACKEND:-compile} ${PROFILE_ARGS:-} \
             > "$OUT/profile.log" 2>&1 ;;
    *)     echo "unknown part $part (toy demo aoti mla mlabench mlasplit mlatest mlawide moe moetest moefused moepair pdl model fused serve fp8split gemvprobe gemvpdl gemvtest normtest gentest ab pdltest kda fp8c probe barrier fp8ftest fp8fab bucket dbuckets trtmoe trtfp8 fp8eng grouped grpsmall fp8comp overlap chain layer step attnres abmix gmla greedy greedy64 mkback mkinputs mkstep mkcache mkfinal mkrouter mkpair mkargmax mksleep mkrun mkblocks mkattn mkheads mklive mktrace mktiles mksums mkmma mkmmafinal mkcombine mksample mkpost mkgapart mkxparts mkab mkdefs mkgreedy mkcommit mkpdl mkcheck mkhead mkh200 mkloop mkprobe mkstress mkbench profile)"; continue ;;
  esac
  echo "$part: exit $? in $((SECONDS - t)) s" | tee -a "$OUT/pending.log"
  tail -4 "$OUT/$part.log" 2>/dev/null
done
