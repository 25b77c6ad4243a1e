"""The persistent decode kernel (docs/megakernel.md): k3-small's whole B = 1 decode step in one launch.

- `chain.py`: the chain of phases the kernel runs (its table, weights, x recipes), its torch emulation, and
  `ChainKernel` (chain.cu compiled with nvcc for sm_90a, launched through cupy);
- `layer.py`: a model's layers as phases (KDA, MoE, dense MLP, MLA attention, Block AttnRes, the LM head), the
  states carried from launch to launch in the kernel's layouts, and the checks against the emulation;
- `backend.py`: `MegakernelBackend`, the kernel behind the runtime's `Engine` (B = 1, greedy decode on the device;
  the greedy step's argmax over the launch's strided logits is the engine's, `k3export.sampling.argmax_rows`).

`python3 scripts/megakernel_chain.py` and `python3 scripts/megakernel_layer.py` run the benchmarks of both.
"""
