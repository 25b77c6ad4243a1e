"""`MegakernelBackend`: the persistent decode kernel (`chain.cu`) behind the runtime's `Engine`, at B = 1.

A decode step is one launch of the whole model step (every layer's KDA / MLA attention, MoE or dense MLP, Block
AttnRes and the LM head), its weights and states streamed through each SM's shared-memory ring (docs/megakernel.md).
Around the launch, on the device: the next token's embedding row into the kernel's input, the attention phases'
key count from the engine's lengths, and the launch's epoch (chain.cu built with EPOCH_PTR=1 reads it from device
memory, bumped before each launch); by default (`step_inputs`, chain.cu built with STEP_INPUTS=1) the launch reads
all three itself (its epoch is a base plus the length), and nothing runs before it. The engine then counts the step
and takes the argmax, as for every backend; with `argmax` (chain.cu built with ARGMAX=1; opt-in until its GPU test
has run) the last block to finish writes the logits' argmax into the engine's ids buffer and host ring itself, and
the engine runs no argmax program. Nothing reads the device, so the engine captures the step, launch included, as a
CUDA graph and replays it.

The kernel keeps the KDA state in its own layouts (the state in its weight tiles, each conv window in two copies),
carried from launch to launch, and reads and appends the MLA rows in the engine's own cache (`bind_engine_cache`:
the engine commits nothing). The engine's state tensors are where a sequence starts: after a prefill (the engine
calls `state_changed`), `before_decode` loads them into the kernel's layouts outside the graph
(`layer.load_model_state`; one host read of the length). From then on the engine's MLA cache has every row, but its
KDA tensors keep the prefill's values: the kernel holds the live ones.

Prefill runs on `prefill_backend` (`compile` on a GPU). `emulate=True` runs the kernel's torch emulation instead of
the launch (`chain.Buffers.run_reference`, the same phases op for op; slow, not capturable): the backend's plumbing
on any device.

Limits, each refused with its reason: one sequence (`max_batch` 1); an sm_90 GPU with nvcc and cupy (the GPU
image); the shapes chain.cu is written for (MLA heads a multiple of 8, every GEMV's k a multiple of 32, KDA heads
of 128, at most `chain.ATTN_SPLITS` key blocks of `chain.ATTN_ROWS`); a bf16 model. k3-small qualifies, k3-tiny
does not (4 MLA heads, latent rank 24). The attention's tiles cover `max_len` keys whatever the length: key blocks
past it are empty tiles, cheap but not free, so size `max_len` to the sequences served.
"""

from __future__ import annotations

import torch

from k3export.megakernel import chain as mc
from k3export.megakernel import layer as ml

# chain.cu's build for the backend: the recipes, tensor-core tiles only, the epoch in device memory (so that the
# engine can capture the step, launch included, as a CUDA graph), and the step's inputs read by the launch itself
# (the token's embedding row, the key count, the epoch as a base plus the length: nothing runs before the launch).
# HOST_INPUTS_DEFINES (`step_inputs=False`): those set by small kernels around it (bench `megakernel-host-inputs`;
# 12-03 12:01, 300 steps: 0.777 ms a step against 0.769 ms, the same logits bit for bit).
# PAIR_TILES (`pair_tiles`, the default): each block's tiles of a MoE down projection are one expert's, so that it
# loads that expert's x once, not once a tile (chain.cu `tile_row0`; 12-03 14:43, 300 steps: 0.769 ms a step against
# 0.784 unpaired, the same logits bit for bit).
# LIVE_SPLITS (`live_splits`, the default): the MLA attention skips its tiles past the launch's keys (the engine
# sizes them for max_len) and BMM2's combine adds only the key blocks that hold keys (12-03 17:03, 300 steps:
# pipelined generation 0.760 ms against 0.763, decode 0.756; the same logits bit for bit).
# ATTN_MMA and ATTN_X_TAIL (`attn_mma`, `x_tail`, the defaults): the attention tile's scores and O on tensor cores,
# and its x's new row polled in the queries' last round (12-03 19:10, layer step: 0.7317 ms against 0.7421; 19:31,
# 300 steps on a slower H200: pipelined generation 0.753 against 0.759, decode 0.772 against 0.773). The tile's
# sums change order (not bit for bit: the first step within 2.4e-7 of the emulation's logits).
# INFLIGHT=1 (`inflight`, the default 1): the producer keeps one weight copy on its way, not the ring's three, so
# that the boundaries' stores and polls queue behind fewer bytes (12-04 16:53-16:57: a store seen by another SM's
# poll 1.0 us there and back against 2.7-2.9 under the full ring; layer step 0.699 ms against 0.726; the same
# words: the copies land in the same slots, only later).

NSLOT = mc.cu_default("NSLOT")          # chain.cu's ring slots (read once: `kernel_defines` runs per backend)


def check_argmax(argmax) -> None:
    """Refuses an `argmax` option that is not one of chain.cu's ARGMAX builds."""
    if isinstance(argmax, float) or argmax not in (False, True, 0, 1, 2):
        raise ValueError(f"megakernel backend: argmax is False / 0 (the engine's argmax program), True / 1 (the "
                         f"token taken in the launch, its keys in the LM head's tile loop) or 2 (its keys after the "
                         f"phases), got {argmax!r}")


def kernel_defines(step_inputs: bool = True, pair_tiles: bool = True, poll_sleep: int = 0,
                   attn_heads: int = mc.ATTN_HEADS, live_splits: bool = True, sums_apart: bool = False,
                   attn_mma: bool = True, x_tail: bool = True, inflight: int = 1,
                   argmax: bool | int = False, commit_lengths: bool = False, pdl: bool = False,
                   step_loop: bool = False) -> tuple[str, ...]:
    """chain.cu's defines for the backend's build with these options (`DEFINES`: the defaults; ARGMAX, the greedy
    token taken in the launch, only with STEP_INPUTS: argmax True or 1, the keys in the LM head's tile loop; 2, after
    the phases, read back from the block's stores; COMMIT_LENGTHS, the step's lengths advanced in the launch, and
    PDL, the launch a programmatic dependent one, only with STEP_INPUTS too; STEP_LOOP, several greedy steps a
    launch, with ARGMAX and COMMIT_LENGTHS and without PDL)."""
    check_argmax(argmax)
    if step_loop and not (step_inputs and argmax and commit_lengths and not pdl):
        raise ValueError("megakernel backend: several steps a launch (STEP_LOOP) feed each step's token to the next "
                         "and advance the lengths in the launch: they need step_inputs, argmax and commit_lengths, "
                         "and not pdl")
    if pdl and not step_inputs:
        raise ValueError("megakernel backend: pdl reads the step's inputs after the launch's wait (STEP_INPUTS); "
                         "it needs step_inputs=True")
    if not isinstance(inflight, int) or not 0 <= inflight < NSLOT:
        raise ValueError(f"megakernel backend: inflight is the weight copies on their way at most, 1..{NSLOT - 1} "
                         f"(0: as many as the ring's {NSLOT} slots), got {inflight!r}")
    if attn_mma and attn_heads != mc.ATTN_HEADS:
        raise ValueError(f"megakernel backend: the attention on tensor cores (attn_mma) takes tiles of "
                         f"{mc.ATTN_HEADS} heads (the mma's n); for attn_heads={attn_heads} pass attn_mma=False")
    return (*ml.DEFINES, "EPOCH_PTR=1", *(("STEP_INPUTS=1",) if step_inputs else ()),
            *(("PAIR_TILES=1",) if pair_tiles else ()), *((f"POLL_SLEEP={poll_sleep}",) if poll_sleep else ()),
            *((f"ATTN_HEADS={attn_heads}",) if attn_heads != mc.ATTN_HEADS else ()),
            *(("LIVE_SPLITS=1",) if live_splits else ()), *(("ATTN_SUMS_TOGETHER=0",) if sums_apart else ()),
            *(("ATTN_MMA=1",) if attn_mma else ()), *(("ATTN_X_TAIL=1",) if x_tail else ()),
            *((f"INFLIGHT={inflight}",) if inflight else ()), "NORM_W_FIRST=1",
            *((f"ARGMAX={int(argmax)}",) if argmax and step_inputs else ()),
            *(("COMMIT_LENGTHS=1",) if commit_lengths and step_inputs else ()), *(("PDL=1",) if pdl else ()),
            *(("STEP_LOOP=1",) if step_loop else ()))


DEFINES = kernel_defines()
HOST_INPUTS_DEFINES = kernel_defines(step_inputs=False)
# An engine directory's greedy steps a launch (`k3export build --backend megakernel --steps-per-launch`): 8, the
# STEP_LOOP build. 12-06 20:30, H200, k3-small B = 1, two calls: pipelined greedy 0.683 ms a token against the
# single-step build's 0.693-0.694 (the bytes floor 0.3436: 1.99x against 2.02x); one step a launch no slower (0.701-
# 0.703 against 0.705-0.714), sampled generation the same (0.781); 9,900 launches of 8 steps and 30 Generator runs
# of a stress run (scripts/mkloop_stress.py) all clean and equal to the single-step build's tokens.
ENGINE_STEPS = 8


def engine_defines(steps_per_launch: int) -> tuple[str, ...]:
    """chain.cu's defines for an engine directory that runs `steps_per_launch` greedy steps a launch (the backend's
    build with `steps_per_launch` and every other option at its default)."""
    return kernel_defines(argmax=2, commit_lengths=True, step_loop=True) if steps_per_launch > 1 else DEFINES


class MegakernelBackend:
    """The runtime backend over one persistent-kernel chain of `model` (an unpacked or packed K3Model; the chain
    copies its weights). max_len: the longest sequence (cache rows) it serves; the attention's tiles are sized for
    it, so a longer capacity costs empty key blocks on every step."""

    name = "megakernel"
    state_views = False
    max_batch = 1

    def __init__(self, model, max_len: int, prefill_backend=None, emulate: bool = False, defines=None,
                 cubin: tuple[str, str] | None = None, step_inputs: bool = True, router_first: bool = False,
                 pair_tiles: bool = True, poll_sleep: int = 0, attn_heads: int = mc.ATTN_HEADS,
                 live_splits: bool = True, sums_apart: bool = False, attn_mma: bool = True,
                 x_tail: bool = True, g_apart: bool = True, mla_g_apart: bool = True, inflight: int = 1,
                 argmax: bool | int = False, commit_lengths: bool = False, pdl: bool = False,
                 cuda_graphs: bool | None = None, steps_per_launch: int = 1):
        """step_inputs (the default): chain.cu built with STEP_INPUTS=1 reads the token's embedding row, the key
        count and its epoch from the engine's buffers itself, four small kernels fewer a step than setting them
        around it (False: `HOST_INPUTS_DEFINES`). defines: another build (the engine directory's). router_first:
        each MoE's router rows early in its packed projection (`layer.layers_chain`), meant to take the top-k off
        the critical path; the same logits bit for bit, and the same step (12-03 14:04: 0.779 ms pipelined both).
        pair_tiles (the default): chain.cu built with PAIR_TILES=1, a block's tiles of each MoE down projection one
        expert's (one x load, not two); the same logits bit for bit as without (False). poll_sleep (written 12-03,
        not yet run on a GPU): chain.cu built with POLL_SLEEP=N, a consumer thread sleeping N ns between two polls
        of words not yet written (fewer back-to-back L2 requests from the waiting blocks); the same logits (12-03
        16:12: no faster). attn_heads: the MLA attention's heads a tile (chain.cu built with ATTN_HEADS=N when not
        its default); each (key block, head)'s words are computed as before, so the same logits. live_splits (the
        default): chain.cu built with LIVE_SPLITS=1, the attention skipping its tiles past the launch's keys (the
        cache's room up to max_len) and BMM2's combine adding only the key blocks that hold keys; the same logits
        as without (False) bit for bit (12-03 17:03, cuda test). sums_apart: chain.cu built with ATTN_SUMS_TOGETHER=0,
        the attention tile's score sums butterflied one after another as before 12-03 evening (the same adds: the
        same logits). attn_mma (the default): chain.cu built with ATTN_MMA=1, the attention tile's scores and O on
        tensor cores (fp32 sums in other orders, the weights as three bf16 parts: not bit for bit; its first step
        within 2.4e-7 of the emulation's logits, 12-03 19:10); False: on CUDA cores, as before. x_tail (the
        default): chain.cu built with ATTN_X_TAIL=1, the attention x's new row and pe words polled in the queries'
        last round (two round trips, not four; the same x bit for bit). Layer step, 12-03 19:10: 0.7317 ms with
        both against 0.7421 without, 0.7362 with attn_mma alone, 0.7415 with x_tail alone (which spills 12
        bytes without the tensor-core tile). (Options measured no faster and removed: `combine_words=12`, BMM2's
        combine polling 12 key blocks' words a round, and `softmax_in_sums`, the tile's softmax warps adding its
        score chunks; both gave the default's logits bit for bit, 12-03 21:20: commit 91653d6 has them.) g_apart
        (the default): each KDA layer's gate rows a GEMV phase of their own on the blocks beside the step's
        (`layer.kda_sublayer`), so that the step waits for three rounds of the input projection's tiles, not four;
        mla_g_apart (the default): each MLA layer's beside the attention (`layer.mla_sublayer`: its projection one
        round of tiles, not two); the same logits either way (12-04 14:50, cuda test). Layer step 0.7238 ms with
        both against 0.7315 with neither (KDA's alone 0.7260, MLA's 0.7282); decode at B = 1 0.740 against 0.748,
        pipelined 0.731 against 0.738. inflight (default 1): chain.cu built with INFLIGHT=N, the producer keeping
        at most N weight copies on their way (0: as many as the ring holds, as before 12-04 evening); the copies
        land in the same slots, only later, so the same logits bit for bit. Layer step 12-04 16:57: 0.699 ms
        against 0.726 uncapped. argmax (with step_inputs; off by default): chain.cu built with ARGMAX=1 (True),
        the greedy step's token taken in the launch (`takes_argmax`: the engine passes its ids buffer and host ring
        to `decode_`, and runs no argmax program of its own), the token `torch.argmax` of the logits gives (12-05
        cuda test, 16 steps) but no faster: pipelined greedy 0.698 ms against 0.694 on the H200, the plain decode
        launch 12-13 us slower for the code in the LM head's tile loop (12-05 07:51). argmax=2: chain.cu's ARGMAX=2,
        the keys taken after the phases from the block's own stores, the tile loop untouched (12-05 09:09, H100:
        the right tokens, no faster, pipelined greedy 0.792 ms against 0.788). commit_lengths (with step_inputs;
        off by default; 12-05 09:09, H100: right, no faster, 0.791 alone and 0.789 with argmax=2): chain.cu built
        with COMMIT_LENGTHS=1, the launch's last block adding
        the engine's active flag to its lengths (`commits_lengths`: the engine passes `active` to `decode_` and
        runs no `lengths.add_` of its own: one kernel and a gap fewer a step). pdl (with step_inputs; off by
        default: right and no faster than the step's graph, 12-05 13:00 on an H100): chain.cu built with PDL=1
        and each launch a programmatic dependent launch (`chain.launch_pdl`), so that its blocks take the SMs, and its producers
        stream the first phase's weights, while the kernel before it still runs (the engine's argmax program
        signals it first thing: `launches_pdl`). The overlap acts between kernels of one stream, and a CUDA graph
        a step puts a graph boundary before each launch, so pdl turns the engine's graphs off. cuda_graphs (None:
        on, except with pdl): False keeps the engine from capturing the step (the launches go to the stream one by
        one; bench `megakernel-stream`). steps_per_launch (default 1): K > 1 builds chain.cu with STEP_LOOP=1 (and
        ARGMAX, argmax=2 unless given, and COMMIT_LENGTHS), so that the engine's `decode_greedy_steps(K)` runs K
        greedy steps in one launch, each fed the last one's token on the device (docs/megakernel.md, "Several
        decode steps in one launch"); single steps are launches of one step. Right (12-06 cuda test: the default
        build's tokens and logits bit for bit) and faster on an H100: 0.755 ms a token in launches of 8 steps, 0.758-
        0.761 in launches of 4, against 0.765-0.782 for the default build (device time); pipelined generation 0.754
        against 0.771. Not yet timed on an H200, and a build of the same semantics hung once in 24 launches of 8 steps
        (docs/megakernel.md, "Several decode steps in one launch, built"), so not the default."""
        cfg = model.config
        self.model, self.config, self.dtype, self.device = model, cfg, model.dtype, model.device
        self.max_len, self.emulate = max_len, emulate
        if not isinstance(poll_sleep, int) or poll_sleep < 0:
            raise ValueError(f"megakernel backend: poll_sleep is whole ns (>= 0), got {poll_sleep!r}")
        if not isinstance(attn_heads, int) or attn_heads < 1:
            raise ValueError(f"megakernel backend: attn_heads is the MLA heads an attention tile takes (>= 1), got "
                             f"{attn_heads!r}")
        if isinstance(steps_per_launch, bool) or not isinstance(steps_per_launch, int) or steps_per_launch < 1:
            raise ValueError(f"megakernel backend: steps_per_launch is the greedy steps one launch may run (>= 1), "
                             f"got {steps_per_launch!r}")
        if steps_per_launch > 1:
            if emulate:
                raise ValueError("megakernel backend: steps_per_launch > 1 runs several steps in one launch; the "
                                 "emulation runs one step a call")
            if pdl:
                raise ValueError("megakernel backend: steps_per_launch > 1 (STEP_LOOP) is built without pdl")
            argmax = argmax or 2
            commit_lengths = True
        why = unsupported(model, max_len, emulate, attn_heads)
        if why:
            raise ValueError(f"megakernel backend: {why}")
        chain = decode_chain(model, max_len, router_first, attn_heads, g_apart, mla_g_apart)
        self.bufs = mc.Buffers(chain, device=str(self.device))
        self.kernel = None
        check_argmax(argmax)                # (an emulation too: it takes no argmax, but a wrong value is refused)
        if not emulate:
            defines = defines or kernel_defines(step_inputs, pair_tiles, poll_sleep, attn_heads, live_splits,
                                                sums_apart, attn_mma, x_tail, inflight, argmax, commit_lengths, pdl,
                                                steps_per_launch > 1)
            self.kernel = mc.ChainKernel(defines=defines, cubin=cubin, quiet=cubin is not None)
            self.kernel.bind(self.bufs)
        # the engine's greedy step passes its ids buffer and host ring to `decode_` (`argmax`), and takes no argmax
        self.takes_argmax = self.kernel is not None and self.kernel.argmax
        # ... and its `active` flags, whose add to the lengths the launch makes itself (the engine then makes none)
        self.commits_lengths = self.kernel is not None and self.kernel.commit_lengths
        # ... and the most greedy steps one `decode_` may run (`Engine.decode_greedy_steps`; STEP_LOOP builds)
        self.steps_per_launch = steps_per_launch if self.kernel is not None and self.kernel.step_loop else 1
        if steps_per_launch > 1 and self.steps_per_launch == 1:
            raise ValueError("megakernel backend: steps_per_launch > 1 needs a STEP_LOOP build; these defines "
                             "have none")
        if prefill_backend is None:
            from k3export.runtime import CompileBackend, EagerBackend
            prefill_backend = CompileBackend(model) if self.device.type == "cuda" else EagerBackend(model)
        self.prefill_backend = prefill_backend        # (the engine calls `state_changed` after each prefill)
        self.max_prefill_tokens = prefill_backend.max_prefill_tokens
        self.prefill = prefill_backend.prefill
        if hasattr(prefill_backend, "prefill_last"):
            self.prefill_last = prefill_backend.prefill_last
        self.embed = model.model.embed_tokens.weight
        self.logits = self.bufs.out(len(chain.phases) - 1)
        self.attn = sorted(chain.caches)
        n_col = mc.FIELDS.index("n")
        self._n_index = torch.tensor([p * len(mc.FIELDS) + n_col for p in self.attn], device=self.device)
        self.loaded = False                  # the kernel holds the engine's sequence (else: load it first)
        self.steps = 0                       # decode steps run
        self.steps_since_load = 0            # ... since the engine's sequence was last loaded (`first_step_errors`)
        # (the emulation reads the device on the host; a PDL launch overlaps the kernel before it in a stream, not
        # across graph launches)
        self.cuda_graphs = not emulate and (not pdl if cuda_graphs is None else bool(cuda_graphs))
        # the engine's greedy step lets this launch begin early: its argmax program signals first thing
        self.launches_pdl = self.kernel is not None and self.kernel.pdl

    def check_engine(self, max_batch: int, max_len: int) -> None:
        """Refuse an engine this backend cannot serve (called by `Engine`)."""
        if max_batch != 1:
            raise ValueError(f"megakernel backend: decodes one sequence; make the engine with max_batch=1, not "
                             f"{max_batch}")
        if max_len > self.max_len:
            raise ValueError(f"megakernel backend: built for sequences of {self.max_len} rows; the engine asks for "
                             f"{max_len} (make the backend with max_len >= {max_len})")

    # ---------------------------------------------------------------------------------------- state
    def state_changed(self) -> None:
        """The engine's state tensors were written outside decode (a prefill, `fill_slots`): the next step starts
        from them (`before_decode`)."""
        self.loaded = False

    def before_decode(self, state, steps: int = 1) -> None:
        """Called by the engine before each decode launch (outside its CUDA graph) of `steps` steps: after a change
        of the engine's state, load sequence 0's into the kernel's layouts (after checking that no launch so far
        gave up; one host read of the length)."""
        if not self.loaded:             # (the engine keeps a sequence under its max_len, at most the backend's)
            self.check()
            length = ml.load_model_state(self.bufs, self.model, state)
            if self.kernel is not None:
                self.bind_engine_cache(state)
                if self.kernel.step_inputs:
                    self.kernel.start_sequence(length)
            self.loaded = True
            self.steps_since_load = 0
        self.steps += steps
        self.steps_since_load += steps

    def bind_engine_cache(self, state) -> None:
        """Point the kernel's attention phases at the engine's MLA cache (sequence 0's rows of each layer's slot):
        the launch reads its keys there and appends the new row there itself, so the engine has nothing to commit
        (`decode_` returns rows None). The kernel's own caches stay allocated, unused."""
        cache = state.mla_cache
        R = self.config.latent_dim
        if cache.dtype != torch.bfloat16 or cache.shape[-1] != R or cache.stride(-2) != R or cache.stride(-1) != 1:
            raise ValueError(f"megakernel backend: the engine's MLA cache must be bf16 rows of {R} contiguous "
                             f"elements, got {cache.dtype} shape {tuple(cache.shape)} strides {cache.stride()}")
        w = mc.FIELDS.index("w")
        for p in self.attn:
            rows = cache[self.model.state_slot[ml.layer_of(self.bufs.chain.phases[p].name)], 0]
            self.bufs.table[p, w] = rows.data_ptr()
        self._engine_cache = cache                 # (keeps the memory the table points at alive)

    # ---------------------------------------------------------------------------------------- decode
    def decode(self, ids, kda_conv, kda_state, mla_cache, cache_len):
        """As `K3Model.forward_decode`, for the engines that commit the KDA tensors themselves: they get the
        tensors as given (the kernel holds the live state; see the module docstring)."""
        logits, rows = self.decode_(ids, kda_conv, kda_state, mla_cache, cache_len)
        if rows is None:                           # (the launch appended them to mla_cache itself)
            rows = mla_cache.index_select(2, cache_len[:1].to(torch.int64))
        return logits, kda_conv, kda_state, rows

    @torch.no_grad()
    def decode_(self, ids, kda_conv, kda_state, mla_cache, cache_len, argmax: tuple | None = None,
                active: torch.Tensor | None = None, steps: int = 1):
        """One step of the one sequence, on the device only (capturable): ids `[1]`, cache_len `[1]` (the engine's
        lengths); the other state tensors are not read (`before_decode` loaded them) -> (logits `[1, V]`, a view
        valid until the next step; None for the new MLA rows: the launch appended them to the engine's cache itself,
        which `before_decode` bound, and the emulation copies them there). argmax (`takes_argmax` only): (ids out
        `[1]` int64, the engine's host ring `[rows, slots]` or None, active `[1]` bool): the launch also writes the
        logits' argmax to ids out and to the ring at row (cache_len + active) mod rows, as the engine's argmax program
        would after the step. active (`commits_lengths` only): the engine's `[1]` bool flags; the launch then adds
        them to cache_len itself, as the engine's `lengths.add_(active)` would after the step (None: it does not).
        steps (at most `steps_per_launch`; with argmax and active): the launch runs that many greedy steps, each fed
        the last one's token, each token posted to the ring's next row; the logits are the last step's."""
        if ids.shape[0] != 1:
            raise ValueError(f"megakernel backend: decodes one sequence (an engine with max_batch=1), got "
                             f"{ids.shape[0]}")
        if argmax is not None and not self.takes_argmax:
            raise ValueError("megakernel backend: this build does not take the argmax in its launch (ARGMAX; an "
                             "emulation, or step_inputs=False / argmax=False): take it from the logits")
        if active is not None and not self.commits_lengths:
            raise ValueError("megakernel backend: this build does not advance the lengths in its launch "
                             "(COMMIT_LENGTHS; an emulation, or step_inputs=False / commit_lengths=False): add "
                             "active to them after the step")
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= self.steps_per_launch:
            raise ValueError(f"megakernel backend: steps is 1..{self.steps_per_launch} (steps_per_launch), got "
                             f"{steps!r}")
        if steps > 1 and (argmax is None or active is None):
            raise ValueError("megakernel backend: a launch of several steps feeds each step's greedy token to the "
                             "next: pass argmax and active (the engine's `decode_greedy_steps` does)")
        if self.kernel is not None and self.kernel.step_loop:
            self.kernel.nsteps = steps
        if self.takes_argmax:
            self.kernel.argmax_args = argmax
        if self.commits_lengths:
            self.kernel.commit_active = active
        b = self.bufs
        pos = cache_len[:1].to(torch.int64)                      # the new row's; the keys: pos + 1
        if self.kernel is not None and self.kernel.step_inputs:   # (the launch reads them, and its epoch, itself)
            self.kernel.step_args = (self.embed, ids, cache_len)
        else:
            b.table.view(-1).index_put_((self._n_index,), (pos + 1).expand(len(self._n_index)))
            b.x.copy_(torch.index_select(self.embed, 0, ids[:1])[0])
        if self.emulate:
            for p in self.attn:                                  # (the emulation reads the key count on the host)
                b.chain.phases[p].n = int(pos) + 1
            b.clear()
            b.run_reference()
            b.advance(move=False)
            for p in self.attn:                   # (as the launch does: the new rows into the engine's cache)
                mla_cache[self.model.state_slot[ml.layer_of(b.chain.phases[p].name)], 0, pos] = b.cache[p][pos]
        else:
            self.kernel.launch("stream")
        return self.logits[None], None            # (the rows: in the engine's cache, `bind_engine_cache`)

    def first_step_errors(self, token: int) -> dict:
        """After the first decode step since the engine's sequence was loaded, fed `token`: that launch's phases
        against their emulation on the launch's own inputs (`Buffers.errors`: each output from the x the kernel
        read, fp32 sums in another order within CHECK_REL; top-k sets, the appended rows and the mix weights
        equal; KDA steps and mix outputs within their bounds; no row unwritten); `Buffers.failed` says whether they
        fail the kernel. Only then: later launches start from the states the kernel carries in its own layouts,
        which the emulation's copies do not follow. This check is robust where comparing logits is not: one rounding
        that an fp32 sum in another order tips early in the chain moves a random model's logits by ~1e-2 (12-05
        19:15, H100: the first step's logits 0.0095 of the largest from the emulation's, every phase within these
        bounds: GEMVs 3.8e-7, routed 3.1e-7, attention 3.6e-7, top-k sets equal, one KDA output 1 bf16 ulp off)."""
        if self.kernel is None:
            raise ValueError("megakernel backend: an emulation has no launch to check")
        if self.steps_since_load != 1:
            raise ValueError(f"megakernel backend: first_step_errors checks the first step after the sequence's "
                             f"load; {self.steps_since_load} steps have run since")
        self.kernel.check()
        torch.cuda.synchronize(self.device)
        b, k = self.bufs, self.kernel
        if not 0 <= token < self.embed.shape[0]:
            raise ValueError(f"megakernel backend: token {token} is outside the vocabulary ({self.embed.shape[0]})")
        if k.step_inputs:     # (the launch read its token's row itself; the checks read b.x, which it left alone)
            b.x.copy_(self.embed[token])
            # the copy of each conv window it wrote: its epoch's, the base plus the length
            length = b.chain.phases[self.attn[0]].n - 1          # (`load_model_state`'s `set_cache_len`)
            b.kda_conv_out = ((int(k.epoch_dev[0]) + length) & 1) ^ 1
        for p in self.attn:                   # (the launch appended its new row to the engine's cache, not b's)
            n = b.chain.phases[p].n
            slot = self.model.state_slot[ml.layer_of(b.chain.phases[p].name)]
            b.cache[p][n - 1] = self._engine_cache[slot, 0, n - 1]
        return b.errors()

    def check(self) -> None:
        """Raise if a launch so far gave up waiting (a kernel error, not an input error; reads the device)."""
        if self.kernel is not None and self.steps:
            self.kernel.check()

    @property
    def post_fail(self) -> torch.Tensor | None:
        """The kernel's give-up word (int32, set by a launch that gave up waiting, until `check` reads and clears
        it): the engine's argmax and draw programs after a launch post UNPOSTED instead of tokens while it is set, so
        that stale logits never reach a request as tokens (`Engine.unposted`)."""
        return None if self.kernel is None or self.kernel.err is None else self.kernel.err[:1]


def decode_chain(model, max_len: int, router_first: bool = False, attn_heads: int = mc.ATTN_HEADS,
                 g_apart: bool = True, mla_g_apart: bool = True):
    """The whole decode step of `model` as the backend's chain: every layer, AttnRes, the LM head, the MLA caches
    sized for `max_len` keys (projections unpacked first: the chain reads them as loaded); router_first, g_apart,
    mla_g_apart: see `layer.layers_chain`; attn_heads: the attention's heads a tile."""
    from k3export.model import packing
    packing.unpack_projections(model)
    sms = torch.cuda.get_device_properties(model.device).multi_processor_count if model.device.type == "cuda" else 0
    return ml.layers_chain(model, list(range(model.config.num_hidden_layers)), kda=True, head=True, attnres=True,
                           mla=1, mla_room=max_len - 1, min_tiles=sms, router_first=router_first,
                           attn_heads=attn_heads, g_apart=g_apart, mla_g_apart=mla_g_apart)


def unsupported(model, max_len: int, emulate: bool = False, attn_heads: int = mc.ATTN_HEADS) -> str | None:
    """Why `MegakernelBackend` cannot serve `model` with `max_len` rows (None: it can). The chain's own checks
    (`Chain`, `ChainKernel.bind`) catch the rest with their own messages."""
    cfg = model.config
    mla_heads = cfg.num_attention_heads
    if not emulate:
        if model.device.type != "cuda":
            return "runs on an NVIDIA GPU (sm_90); emulate=True runs its torch emulation anywhere"
        if torch.cuda.get_device_capability(model.device) != (9, 0):
            return f"chain.cu is built for sm_90a (H100 / H200); this GPU is sm_" \
                   f"{''.join(map(str, torch.cuda.get_device_capability(model.device)))}"
        import importlib.util
        import shutil
        if shutil.which("nvcc") is None or importlib.util.find_spec("cupy") is None:
            return "needs nvcc (to build chain.cu) and cupy (to launch it); the GPU image has both"
    if model.dtype != torch.bfloat16:
        return f"serves a bf16 model (the kernel streams bf16 weights), not {model.dtype}"
    if cfg.mla_layers and mla_heads % attn_heads:
        return f"the config has {mla_heads} MLA heads; chain.cu's attention takes them " \
               f"{attn_heads} a tile"
    if cfg.linear_attn_config.head_dim != mc.KDA_HEAD:
        return f"KDA heads of {cfg.linear_attn_config.head_dim}; chain.cu's KDA step is written for {mc.KDA_HEAD}"
    if max_len < 2:
        return f"max_len {max_len}: at least 2"
    if -(-max_len // mc.ATTN_ROWS) > mc.ATTN_SPLITS:
        return f"max_len {max_len}: the attention's combine adds at most {mc.ATTN_SPLITS} key blocks of " \
               f"{mc.ATTN_ROWS} ({mc.ATTN_SPLITS * mc.ATTN_ROWS} rows; chain.cu's ATTN_SPLITS)"
    return None


# ---------------------------------------------------------------------------------------------- engine directories
CUBIN = "chain.cubin"


def build_megakernel(model, out, manifest: dict, log, steps_per_launch: int = ENGINE_STEPS) -> dict:
    """`k3export build --backend megakernel`: chain.cu compiled for sm_90a (nvcc) into the engine directory, and
    checked against the model: its chain built and bound to the new cubin (every shape check the kernel makes),
    then dropped. steps_per_launch: the greedy steps one launch may run (> 1: the STEP_LOOP build; 1: one step a
    launch). Records the build (defines, steps a launch, ring, chain.cu's sha256, ptxas's report, the caches' rows)
    in the manifest's "megakernel" entry; returns {file name: path relative to `out`}."""
    import os
    import tempfile
    from k3export.build import EngineError
    from k3export.manifest import file_sha256
    if isinstance(steps_per_launch, bool) or not isinstance(steps_per_launch, int) or steps_per_launch < 1:
        raise EngineError(f"megakernel: steps_per_launch is the greedy steps one launch may run (>= 1), got "
                          f"{steps_per_launch!r}")
    defines = engine_defines(steps_per_launch)
    dec = manifest["profiles"]["decode"]
    max_len = dec["cache"][2]
    if dec["batch"][2] != 1:
        raise EngineError(f"megakernel: decodes one sequence; its decode profile's batch is {dec['batch']} "
                          "(build with --max-batch 1)")
    why = unsupported(model, max_len)
    if why:
        raise EngineError(f"megakernel: {why}")
    nslot, slot_bytes = NSLOT, mc.cu_default("SLOT_BYTES")
    with tempfile.TemporaryDirectory(prefix="k3chain-") as tmp:
        path, ptxas = log.step("nvcc chain.cu (sm_90a)", mc.compile_cubin, nslot, slot_bytes, tmp, None, defines)
        tmp_cubin = out / (CUBIN + ".tmp")
        tmp_cubin.write_bytes(open(path, "rb").read())
        os.replace(tmp_cubin, out / CUBIN)

    def check():
        chain = decode_chain(model, max_len)
        kern = mc.ChainKernel(nslot, slot_bytes, defines=defines, cubin=(str(out / CUBIN), ptxas), quiet=True)
        kern.bind(mc.Buffers(chain, device=str(model.device)))
        return len(chain.phases)
    phases = log.step("chain built and bound (the kernel's shape checks)", check)
    torch.cuda.empty_cache()
    report = mc.kernel_report(ptxas)
    log.note(f"chain.cu: {phases} phases; {steps_per_launch} greedy step(s) a launch; " + " | ".join(report))
    manifest["megakernel"] = {"defines": list(defines), "steps_per_launch": steps_per_launch,
                              "ring": [nslot, slot_bytes], "max_len": max_len,
                              "chain_cu_sha256": file_sha256(mc.CU), "ptxas": ptxas, "phases": phases}
    return {CUBIN: CUBIN}


def stale_build(manifest: dict) -> str | None:
    """Why an engine directory's kernel cannot be used with this k3export (None: it can): it was compiled from
    another chain.cu (the table and recipes this Python lays out are for this one)."""
    from k3export.manifest import file_sha256
    rec = manifest.get("megakernel") or {}
    if rec.get("chain_cu_sha256") != file_sha256(mc.CU):
        return (f"its {CUBIN} was compiled from another chain.cu (sha256 {str(rec.get('chain_cu_sha256'))[:12]}..., "
                f"this k3export's is {file_sha256(mc.CU)[:12]}...)")
    return None


def open_megakernel(path, manifest: dict, model) -> MegakernelBackend:
    """The backend of a megakernel engine directory (checked by `build.check_engine_dir`)."""
    rec = manifest["megakernel"]
    steps = rec.get("steps_per_launch", 1)          # (directories from before 12-06 20:30: one step a launch)
    want = engine_defines(steps) if isinstance(steps, int) and steps >= 1 else None
    if want is None or tuple(rec["defines"]) != want:
        from k3export.build import EngineError
        raise EngineError(f"{path}: built with defines {rec['defines']} for {steps!r} greedy step(s) a launch; this "
                          f"k3export builds {list(want) if want else 'nothing'} for that; rebuild with `k3export build "
                          f"--backend megakernel`")
    return MegakernelBackend(model, max_len=rec["max_len"], cubin=(str(path / CUBIN), rec["ptxas"]),
                             steps_per_launch=steps)
