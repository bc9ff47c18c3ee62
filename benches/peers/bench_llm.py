"""A causal language model at real size in PyTorch, the peer of
`examples/bench_llm.rs`: a folder `scripts/make_scale_checkpoint.py` wrote,
loaded by transformers' `AutoModelForCausalLM` (f32, eager attention off:
transformers' default SDPA), the batch `bench_llm.rs` draws (B=4, T=128,
example i keeps 128 - 16 i tokens), one variant per process so that the
process's peak resident memory is that variant's:

* forward: the logits (eval mode, no_grad);
* lora_step: peft's LoRA (rank 8, alpha 16, q_proj and v_proj, GPT-2's
  c_attn), loss.backward(), SGD over the adapters;
* dp_lora, dp_lora_ghost: one Opacus DP step training the same adapters,
  with its per-sample gradient hooks and with ghost clipping;
* dp, dp_ghost: one Opacus DP step training every weight (hooks; ghost,
  which refuses tied embeddings: then `unsupported`).

The loss is each example's mean next-token cross-entropy over its real
tokens, averaged over the batch (ghost mode's criterion averages over
every position, padding counted as zero: the same work).

    "$HOME/peers/bin/python" benches/peers/bench_llm.py DIR VARIANT [REPS] [B] [T]

PEER_THREADS sets torch's threads (default 2).
"""
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from timing import process_result

warnings.filterwarnings("ignore")
torch.set_num_threads(int(os.environ.get("PEER_THREADS", "2")))


def batch(b, t, vocab):
    """The ids and mask `bench_llm.rs` draws (the same recurrence)."""
    ids = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.long)
    state = 2024
    for i in range(b):
        for j in range(max(t - 16 * i, min(2, t))):
            state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
            ids[i, j] = (state >> 33) % vocab
            mask[i, j] = 1
    return ids, mask


def per_example_loss(logits, ids, mask):
    """Each example's mean next-token loss over its real targets, `[B]`."""
    b, t, v = logits.shape
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1), reduction="none").view(b, t - 1)
    w = mask[:, 1:].to(losses.dtype)
    return (losses * w).sum(1) / w.sum(1)


def main():
    import transformers

    folder, variant = sys.argv[1], sys.argv[2]
    reps = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    b = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    t = int(sys.argv[5]) if len(sys.argv) > 5 else 128
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    ids, mask = batch(b, t, model.config.vocab_size)
    # [B, T] positions: Opacus reads the batch off every layer's input
    pos = torch.arange(t).expand(b, t).contiguous()
    targets = ["c_attn"] if model.config.model_type == "gpt2" else ["q_proj", "v_proj"]
    if variant.startswith("dp_lora") or variant == "lora_step":
        import peft

        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    logits = lambda m: m(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    if variant == "forward":
        model.eval()

        def run():
            with torch.no_grad():
                logits(model)

    elif variant == "lora_step":
        model.train()

        def run():
            opt.zero_grad()
            per_example_loss(logits(model), ids, mask).mean().backward()
            opt.step()

    elif variant in ("dp", "dp_ghost", "dp_lora", "dp_lora_ghost"):
        from opacus import PrivacyEngine

        model.train()
        labels = ids.masked_fill(mask == 0, -100)
        data = torch.utils.data.TensorDataset(ids, mask, pos, labels)
        loader = torch.utils.data.DataLoader(data, batch_size=b)
        ghost = variant.endswith("ghost")
        try:
            made = PrivacyEngine().make_private(
                module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                grad_sample_mode="ghost" if ghost else "hooks", poisson_sampling=False,
                criterion=torch.nn.CrossEntropyLoss(ignore_index=-100),
            )
        except Exception as e:  # Opacus's ghost mode and tied embeddings
            print(f"unsupported: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            return
        if ghost:
            pmodel, popt, crit, _ = made

            def run():
                popt.zero_grad()
                out = logits(pmodel)
                v = out.shape[-1]
                crit(out[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1), shape=(b, t - 1)).backward()
                popt.step()

        else:
            pmodel, popt, _ = made

            def run():
                popt.zero_grad()
                per_example_loss(logits(pmodel), ids, mask).mean().backward()
                popt.step()  # clip, noise, SGD

    else:
        sys.exit(f"unknown variant {variant}")
    try:
        process_result(variant, run, reps, torch.get_num_threads())
    except Exception as e:
        print(f"unsupported: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


if __name__ == "__main__":
    main()
