"""A transformers causal LM built from a config with random weights (nothing downloaded)
generating tokens on the GPU, for the acceptance run's `cost` section: accept.py runs it
bare and under the shim and compares. Prints `TOKENS per_s=<tokens per second>`: the
quicker of two timed generations after a warm-up, 8 sequences of 128 new tokens each.
"""

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=512,
)
model = LlamaForCausalLM(config).to("cuda", dtype=torch.bfloat16).eval()
prompt = torch.randint(0, config.vocab_size, (8, 32), device="cuda")
new = 128


def generate():
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return out


generate()
best = float("inf")
for _ in range(2):
    start = time.monotonic()
    out = generate()
    best = min(best, time.monotonic() - start)
assert out.shape == (8, 32 + new), out.shape
print(f"TOKENS per_s={8 * new / best:.1f}", flush=True)
