#!/usr/bin/env python3
"""Randomly initialised checkpoints at real configurations, for
`examples/bench_llm.rs` and `benches/peers/bench_llm.py` (issue 36): each
is transformers' `from_config` with a fixed seed, written by
`save_pretrained` (f32 safetensors, sharded as transformers shards) into a
cache outside the repository. Nothing is downloaded: the configurations are
written out below from the published `config.json` files.

    PY="$HOME/peers/bin/python"   # transformers and torch
    "$PY" scripts/make_scale_checkpoint.py qwen2-0.5b [gpt2-medium smollm2-360m ...]

prints each folder (`$CANDLE_FUNC_CACHE`, default ~/.cache/candle-func,
then `scale/<name>`); a folder that is already complete is kept.
`llama-1b` is written in bf16 (the others in f32). `tiny-qwen2` and
`tiny-gpt2` are two-layer versions of the same families
for a quick check of the benchmark's plumbing.
"""
import json
import os
import sys

CONFIGS = {
    # Qwen/Qwen2-0.5B's config.json (494M parameters, tied embeddings)
    "qwen2-0.5b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
        tie_word_embeddings=True, use_sliding_window=False, sliding_window=131072, max_window_layers=24,
        bos_token_id=151643, eos_token_id=151643, attention_dropout=0.0, initializer_range=0.02,
    ),
    # HuggingFaceTB/SmolLM2-360M's (the Llama at 362M parameters)
    "smollm2-360m": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=960, intermediate_size=2560,
        num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, hidden_act="silu",
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, bos_token_id=0, eos_token_id=0,
        initializer_range=0.041666666666666664,
    ),
    # openai-community/gpt2-medium's (355M parameters)
    "gpt2-medium": dict(
        model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=1024, n_layer=24, n_head=16,
        n_positions=1024, n_ctx=1024, vocab_size=50257, activation_function="gelu_new", layer_norm_epsilon=1e-5,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=50256, eos_token_id=50256,
    ),
    # A Llama at 1.24B parameters: meta-llama/Llama-3.2-1B's shape (hidden
    # 2048, 16 layers, vocabulary 128,256, tied embeddings) with plain RoPE
    # (no llama3 scaling), written in bf16: the mixed-precision target's
    # base, whose f32 file would take 5 GB
    "llama-1b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu",
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, bos_token_id=128000,
        eos_token_id=128001, initializer_range=0.02, dtype="bfloat16",
    ),
    "tiny-qwen2": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
        max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu",
        tie_word_embeddings=True, use_sliding_window=False,
    ),
    "tiny-gpt2": dict(
        model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=2, n_head=4, n_positions=256,
        vocab_size=1000, activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ),
}


def cache_dir():
    base = os.environ.get("CANDLE_FUNC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "candle-func")
    return os.path.join(base, "scale")


def make(name):
    import torch
    import transformers

    if name not in CONFIGS:
        raise SystemExit(f"{name}: one of {', '.join(CONFIGS)}")
    out = os.path.join(cache_dir(), name)
    done = os.path.join(out, "complete")
    if os.path.exists(done):
        return out
    fields = dict(CONFIGS[name])
    model_type = fields.pop("model_type")
    dtype = getattr(torch, fields.pop("dtype", "float32"))
    config = transformers.AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    with open(done, "w") as f:
        json.dump({"parameters": params, "transformers": transformers.__version__, "seed": 0}, f)
    print(f"{name}: {params / 1e6:.1f}M parameters", file=sys.stderr)
    return out


def main():
    for name in sys.argv[1:] or ["qwen2-0.5b"]:
        print(make(name))


if __name__ == "__main__":
    main()
