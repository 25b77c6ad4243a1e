"""(untracked diagnostic) the KDA states the kernel carries against the model's, step by step."""
import sys, torch
sys.path.insert(0, "scripts")
import megakernel_chain as mc, megakernel_layer as ml
from k3export.bench.fp8 import gpu_random_model
from k3export.config import PRESETS
cfg = PRESETS["k3-small"]; model = gpu_random_model(cfg, 0)
chain = ml.layers_chain(model, list(range(12)), kda=True, seed=0, head=True, attnres=True, mla=1024, mla_room=40,
                        min_tiles=132)
bufs = mc.Buffers(chain); kern = mc.ChainKernel(defines=ml.DEFINES); kern.bind(bufs)
kp = [p for p, _ in bufs.kda_phases()]
conv = torch.stack([bufs.kda_init[p]["conv_state"] for p in kp])[:, None]
state = torch.stack([bufs.kda_init[p]["state"] for p in kp])[:, None]
cps = sorted(bufs.chain.caches)
cache = torch.stack([bufs.cache_init[p][:1024] for p in cps])[:, None]
tok = 11
for i in range(3):
    bufs.x.copy_(model.model.embed_tokens.weight[tok].float())
    bufs.clear(); kern.launch("stream", dump=True); kern.check()
    logits = bufs.out(len(chain.phases) - 1).clone()
    with torch.no_grad():
        ref, conv, state, rows = model.forward_decode(torch.tensor([tok], device="cuda"), conv, state, cache,
                                                      torch.tensor([1024 + i], device="cuda"))
    cache = torch.cat([cache, rows.to(cache.dtype)], dim=2)
    print("step", i, "epoch", kern.epoch, "conv_out", bufs.kda_conv_out, "logits rel",
          float((logits - ref[0].float()).abs().max() / ref.abs().max()), flush=True)
    for j, p in enumerate(kp):
        c_k, s_k = bufs.kda_conv(p), bufs.kda_state(p)
        other = bufs.kda["conv2"][bufs.kda_conv_out ^ 1] if False else bufs.kda[p]["conv2"][bufs.kda_conv_out ^ 1]
        print("  ", chain.phases[p].name, "conv differ", int((c_k != conv[j, 0]).sum()), "other copy differ",
              int((other != conv[j, 0]).sum()), "state rel",
              float((s_k - state[j, 0]).abs().max() / state[j, 0].abs().max()))
    tok = int(logits.argmax())
    bufs.advance()
