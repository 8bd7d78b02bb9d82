"""Non-view ATen ops per layer in one decode step (SmolLM2-135M shapes, 4 layers, random weights, batch 2, 512-token prompts, budget 0.1)."""
import sys, warnings, torch
warnings.filterwarnings("ignore")
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM
import keepkv
torch.manual_seed(0); torch.set_num_threads(1)
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
model = LlamaForCausalLM(cfg).eval(); keepkv.enable(model)
class Count(TorchDispatchMode):
    def __init__(self): super().__init__(); self.n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not torch.Tag.view_copy in func.tags and not func.is_view:
            self.n += 1
        return func(*args, **(kwargs or {}))
ids = torch.randint(0, 49152, (2, 512)); mask = torch.ones_like(ids)
for spec in sys.argv[1:]:
    cache = keepkv.CompressedCache(cfg, spec, 0.1)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        tok = out.logits[:, -1:].argmax(-1); m = torch.cat([mask, torch.ones_like(tok)], 1)
        for _ in range(3):
            out = model(input_ids=tok, attention_mask=m, past_key_values=cache); tok = out.logits[:, -1:].argmax(-1); m = torch.cat([m, torch.ones_like(tok)], 1)
        c = Count()
        with c:
            model(input_ids=tok, attention_mask=m, past_key_values=cache)
    print(f"{spec:45s} {c.n / 4:.1f} ops per layer-step (whole model incl. the method)")
