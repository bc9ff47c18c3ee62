"""Writes each Hugging Face case's half-precision references beside its
float32 ones: for every case folder (a `config.json`, `model.safetensors`
and `reference.safetensors`, see tests/fixtures/hf/README.md), the model
loaded by `transformers` in bfloat16 and in float16 is run on the reference
batch, and `reference_half.safetensors` gets, for each dtype `d` of
`bf16` and `f16`:

* `logits_<d>`: the whole batch's logits with its mask (eval mode);
* `loss_<d>`: each example's own loss, run alone as a batch of one (the
  reference's loss: cross-entropy, or the causal LM's shifted, masked
  mean), computed by PyTorch in that dtype;

stored as float32 (every half value is exact in it).

    "$HOME/peers/bin/python" scripts/make_hf_half.py tests/fixtures/hf
"""

import json
import os
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file

# the reference's own loss (this script's folder is on the path when run)
from make_hf_cases import loss_of

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}


def case(folder):
    cfg = json.load(open(os.path.join(folder, "config.json")))
    arch = getattr(transformers, cfg["architectures"][0])
    ref = load_file(os.path.join(folder, "reference.safetensors"))
    ids, mask, labels = ref["input_ids"], ref["attention_mask"], ref["labels"]
    lm = labels.dim() == 2
    out = {}
    for name, dt in DTYPES.items():
        model = arch.from_pretrained(folder, dtype=dt).eval()
        with torch.no_grad():
            out[f"logits_{name}"] = model(input_ids=ids, attention_mask=mask).logits.float().contiguous()
            losses = []
            for i in range(ids.shape[0]):
                one = model(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1]).logits
                losses.append(loss_of(one, ids[i : i + 1], mask[i : i + 1], labels[i : i + 1], lm).float())
            out[f"loss_{name}"] = torch.stack(losses)
    meta = {
        "kind": "hf_half_precision",
        "generator": f"scripts/make_hf_half.py over transformers {transformers.__version__} (torch {torch.__version__}): "
        "the model loaded in each dtype, run in it, stored as float32",
    }
    save_file(out, os.path.join(folder, "reference_half.safetensors"), metadata=meta)
    print(os.path.basename(folder), "written")


def main(root):
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        if os.path.isfile(os.path.join(folder, "config.json")):
            case(folder)


if __name__ == "__main__":
    main(sys.argv[1])
