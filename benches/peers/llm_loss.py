"""The loss of `bench_llm.rs`'s batch under transformers with the checkpoint
loaded in f32, bf16 and f16 (eval mode, no_grad): the reference for
`cargo run --release --example bench_llm -- --model DIR --variant loss
--precision f32|bf16-mixed|f16-mixed`.

    "$HOME/peers/bin/python" benches/peers/llm_loss.py DIR

PEER_THREADS sets torch's threads (default 2).
"""
import os
import sys

import torch
import transformers
from bench_llm import batch, per_example_loss


def main():
    folder = sys.argv[1]
    torch.set_num_threads(int(os.environ.get("PEER_THREADS", "2")))
    for name, dtype in [("f32", torch.float32), ("bf16", torch.bfloat16), ("f16", torch.float16)]:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype)
        model.eval()
        ids, mask = batch(4, 128, model.config.vocab_size)
        pos = torch.arange(128).expand(4, 128).contiguous()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        loss = per_example_loss(logits, ids, mask).mean()
        print(f"RESULT torch_loss {name} {loss.item():.6f}", flush=True)
        del model


if __name__ == "__main__":
    main()
