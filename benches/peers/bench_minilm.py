"""Hugging Face's BertForSequenceClassification on all-MiniLM-L6-v2 with a
new 4-class head, B=32, T=64 (the batch `examples/bench_minilm.rs` draws),
in PyTorch, one variant per process so that the process's peak resident
memory is that variant's:

* forward: the batch's logits (eval mode, no_grad);
* step: the ordinary training step (loss.backward(), SGD);
* psg_hooks: every parameter's per-sample gradient by Opacus 1.6's hooks
  (forward and backward; `p.grad_sample`);
* dp_ghost: one Opacus 1.6 ghost-clipping DP step (norms, a second
  backward, noise, SGD);
* dp_lora, dp_lora_ghost: one Opacus 1.6 DP step training peft's LoRA
  adapters (rank 8, alpha 16, on `query` and `value`, the classifier in
  `modules_to_save`), the encoder frozen: with Opacus's per-sample
  gradient hooks (its LoRA tutorial's mode) and with ghost clipping.

    CANDLE_FUNC_MINILM=DIR "$HOME/peers/bin/python" benches/peers/bench_minilm.py VARIANT [REPS]

Dropout is off (probabilities 0), as in ours. Opacus fails on Hugging
Face's BERT out of the box, in ghost and hooks mode alike, until
contiguous [B, T] position_ids and token_type_ids are passed explicitly:
they are here. PEER_THREADS sets torch's threads (default 2).
"""
import os
import sys
import warnings

import torch
from timing import process_result

warnings.filterwarnings("ignore")
torch.set_num_threads(int(os.environ.get("PEER_THREADS", "2")))
B, T, LABELS = 32, 64, 4


def batch(vocab):
    """The ids, mask and labels `bench_minilm.rs` makes (the same recurrence)."""
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    state = 12345
    for i in range(B):
        keep = T - 2 * (i % 16)
        for t in range(keep):
            state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
            word = 1000 + (state >> 33) % (vocab - 1000)
            ids[i, t] = 101 if t == 0 else (102 if t == keep - 1 else word)
            mask[i, t] = 1
    labels = torch.arange(B) % LABELS
    return ids, mask, labels


def main():
    import transformers
    from opacus import PrivacyEngine

    variant = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    model = transformers.BertForSequenceClassification.from_pretrained(
        os.environ["CANDLE_FUNC_MINILM"], num_labels=LABELS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
    )
    ids, mask, labels = batch(model.config.vocab_size)
    pos = torch.arange(T).expand(B, T).contiguous()
    types = torch.zeros(B, T, dtype=torch.long)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    if variant == "forward":
        model.eval()

        def run():
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask).logits

    elif variant == "step":
        model.train()

        def run():
            opt.zero_grad()
            loss_fn(model(input_ids=ids, attention_mask=mask).logits, labels).backward()
            opt.step()

    elif variant in ("psg_hooks", "dp_ghost", "dp_lora", "dp_lora_ghost"):
        if variant.startswith("dp_lora"):
            import peft

            config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"], lora_dropout=0.0,
                                     modules_to_save=["classifier"])
            model = peft.get_peft_model(model, config)
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        model.train()
        data = torch.utils.data.TensorDataset(ids, mask, pos, types, labels)
        loader = torch.utils.data.DataLoader(data, batch_size=B)
        mode = "ghost" if variant in ("dp_ghost", "dp_lora_ghost") else "hooks"
        engine = PrivacyEngine()
        made = engine.make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            grad_sample_mode=mode, poisson_sampling=False, criterion=loss_fn,
        )
        if mode == "ghost":  # dp_ghost, dp_lora_ghost
            pmodel, popt, crit, _ = made

            def run():
                popt.zero_grad()
                out = pmodel(input_ids=ids, attention_mask=mask, position_ids=pos, token_type_ids=types).logits
                crit(out, labels).backward()
                popt.step()
        elif variant == "dp_lora":
            pmodel, popt, _ = made

            def run():
                popt.zero_grad()
                out = pmodel(input_ids=ids, attention_mask=mask, position_ids=pos, token_type_ids=types).logits
                loss_fn(out, labels).backward()
                popt.step()  # clip, noise, SGD
        else:
            pmodel, popt, _ = made

            def run():
                popt.zero_grad()
                out = pmodel(input_ids=ids, attention_mask=mask, position_ids=pos, token_type_ids=types).logits
                loss_fn(out, labels).backward()  # fills every p.grad_sample
    else:
        sys.exit(f"unknown variant {variant}")
    process_result(variant, run, reps, torch.get_num_threads())


if __name__ == "__main__":
    main()
