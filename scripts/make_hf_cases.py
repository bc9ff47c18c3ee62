"""Writes Hugging Face reference cases in the format of tests/fixtures/hf
(see its README): a small random model of a family, saved by
`save_pretrained`, and `reference.safetensors` with the inputs, the batch's
logits and each example's per-sample gradient of its own loss (plain
autograd, one example at a time, float64 from float32-exact weights,
stored as float32).

    "$HOME/peers/bin/python" scripts/make_hf_cases.py tests/fixtures/hf

Cases: roberta_cls (RoBERTa classifier, padding), gpt2_padded_lm (GPT-2 with
padding), mistral_lm (Mistral, grouped-query attention) and qwen2_lm (Qwen2:
q/k/v biases, multi-query attention, tied head).

    "$HOME/peers/bin/python" scripts/make_hf_cases.py tests/fixtures/hf windows

writes only the sliding-window cases: mistral_window_lm (every layer's
attention a window of 4 tokens over sequences of 12) and qwen2_window_lm
(`use_sliding_window` with `max_window_layers=1`: the first layer full, the
second windowed)."""

import os
import sys

import torch
import transformers
from safetensors.torch import save_file

B, T = 4, 12


def perturb_norms(model, gen):
    # norm weights and biases away from 1 and 0, so a skipped one is caught
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name.lower() or "ln_" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))


def inputs(vocab, pad, gen, lm, classes=3):
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    ids[ids == pad] = (pad + 1) % vocab
    mask = torch.zeros(B, T, dtype=torch.long)
    for i in range(B):
        keep = max(3, T - 2 * i)
        mask[i, :keep] = 1
        ids[i, keep:] = pad
    labels = ids.clone() if lm else torch.randint(0, classes, (B,), generator=gen)
    return ids, mask, labels


def loss_of(logits, ids, mask, labels, lm):
    if not lm:
        return torch.nn.functional.cross_entropy(logits, labels)
    pred, target, w = logits[:, :-1], ids[:, 1:], mask[:, 1:].to(logits.dtype)
    per = torch.nn.functional.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1), reduction="none")
    return (per * w.reshape(-1)).sum() / w.sum()


def write(out, name, family, task, model, ids, mask, labels):
    lm = task == "lm"
    folder = os.path.join(out, name)
    model.save_pretrained(folder)
    model = model.double().eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    grads, losses = {}, []
    for i in range(B):
        model.zero_grad()
        out_i = model(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1]).logits
        loss = loss_of(out_i, ids[i : i + 1], mask[i : i + 1], labels[i : i + 1], lm)
        loss.backward()
        losses.append(loss.detach())
        for n, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads.setdefault(n, []).append(g.detach().clone())
    tensors = {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "logits": logits.float().contiguous(),
        "loss": torch.stack(losses).float(),
    }
    for n, gs in grads.items():
        tensors["grad." + n] = torch.stack(gs).float().contiguous()
    meta = {
        "kind": "hf_per_sample_grad",
        "family": family,
        "task": task,
        "loss": "cross_entropy" if not lm else "lm_cross_entropy_shifted_masked",
        "generator": f"scripts/make_hf_cases.py over transformers {transformers.__version__} (torch {torch.__version__}), float64 from float32-exact values, stored as float32",
    }
    save_file(tensors, os.path.join(folder, "reference.safetensors"), metadata=meta)
    print(name, "written")


def main(out):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    c = transformers.RobertaConfig(vocab_size=91, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=37, max_position_embeddings=T + 4, type_vocab_size=1,
                                   num_labels=3, pad_token_id=1, hidden_act="gelu")
    m = transformers.RobertaForSequenceClassification(c)
    perturb_norms(m, gen)
    write(out, "roberta_cls", "roberta", "cls", m, *inputs(91, 1, gen, lm=False))

    c = transformers.GPT2Config(vocab_size=89, n_embd=32, n_layer=2, n_head=4, n_positions=T + 4, pad_token_id=0)
    m = transformers.GPT2LMHeadModel(c)
    perturb_norms(m, gen)
    write(out, "gpt2_padded_lm", "gpt2", "lm", m, *inputs(89, 0, gen, lm=True))

    c = transformers.MistralConfig(vocab_size=83, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, sliding_window=None, pad_token_id=0,
                                   rope_theta=5000.0, tie_word_embeddings=False)
    m = transformers.MistralForCausalLM(c)
    perturb_norms(m, gen)
    write(out, "mistral_lm", "llama", "lm", m, *inputs(83, 0, gen, lm=True))

    c = transformers.Qwen2Config(vocab_size=79, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                 pad_token_id=0, tie_word_embeddings=True, use_sliding_window=False)
    m = transformers.Qwen2ForCausalLM(c)
    perturb_norms(m, gen)
    write(out, "qwen2_lm", "llama", "lm", m, *inputs(79, 0, gen, lm=True))


def windows(out):
    torch.manual_seed(1)
    gen = torch.Generator().manual_seed(1)
    c = transformers.MistralConfig(vocab_size=83, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, sliding_window=4, pad_token_id=0,
                                   rope_theta=5000.0, tie_word_embeddings=False)
    m = transformers.MistralForCausalLM(c)
    perturb_norms(m, gen)
    write(out, "mistral_window_lm", "llama", "lm", m, *inputs(83, 0, gen, lm=True))

    c = transformers.Qwen2Config(vocab_size=79, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                 pad_token_id=0, tie_word_embeddings=True, use_sliding_window=True,
                                 sliding_window=4, max_window_layers=1)
    m = transformers.Qwen2ForCausalLM(c)
    perturb_norms(m, gen)
    write(out, "qwen2_window_lm", "llama", "lm", m, *inputs(79, 0, gen, lm=True))


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/hf"
    windows(out) if sys.argv[2:] == ["windows"] else main(out)
