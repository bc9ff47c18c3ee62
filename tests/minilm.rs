//! A real pretrained model: all-MiniLM-L6-v2 (a 6-layer BERT, 22.7M
//! parameters), fetched once by `scripts/fetch_minilm.sh` into a cache
//! outside the repository, tokenised from its `tokenizer.json` with the
//! `tokenizers` crate, embeds a few fortunes as sentence-transformers does
//! (mean pooling, L2 normalisation): the values in
//! `tests/fixtures/minilm_fortunes.json`, computed once with
//! sentence-transformers. Ignored by a plain `cargo test` (which then
//! says it skipped it); CI fetches the model and runs it with
//! `CANDLE_FUNC_MINILM="$(scripts/fetch_minilm.sh)" cargo test --test
//! minilm -- --include-ignored`, where an unset variable fails it.

mod common;

use common::max_diff;

use candle_core::{DType, Device, Tensor};
use candle_func::models::bert::BertModel;
use candle_func::models::{l2_normalize, mean_pool, Checkpoint};
use candle_func::{jit, vmap, Tracer};
use std::path::{Path, PathBuf};

struct Reference {
    sentences: Vec<String>,
    token_counts: Vec<usize>,
    max_seq_length: usize,
    embeddings: Vec<Vec<f32>>,
}

fn reference() -> Reference {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minilm_fortunes.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let strings = |k: &str| {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect()
    };
    Reference {
        sentences: strings("sentences"),
        token_counts: v["token_counts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap() as usize)
            .collect(),
        max_seq_length: v["max_seq_length"].as_u64().unwrap() as usize,
        embeddings: v["embeddings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                r.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect()
            })
            .collect(),
    }
}

/// The padded batch of ids and its attention mask, `[B, T]` each.
fn tokenise(dir: &Path, r: &Reference) -> (Tensor, Tensor) {
    let mut tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    tok.with_truncation(Some(tokenizers::TruncationParams {
        max_length: r.max_seq_length,
        ..Default::default()
    }))
    .unwrap();
    tok.with_padding(Some(tokenizers::PaddingParams::default()));
    let enc = tok.encode_batch(r.sentences.clone(), true).unwrap();
    let counts: Vec<usize> = enc
        .iter()
        .map(|e| e.get_attention_mask().iter().filter(|&&m| m == 1).count())
        .collect();
    assert_eq!(counts, r.token_counts, "the tokeniser splits the sentences differently");
    let t = enc[0].get_ids().len();
    let flat =
        |f: &dyn Fn(&tokenizers::Encoding) -> &[u32]| enc.iter().flat_map(|e| f(e).to_vec()).collect::<Vec<u32>>();
    let ids = Tensor::from_vec(flat(&|e| e.get_ids()), (enc.len(), t), &Device::Cpu).unwrap();
    let mask = Tensor::from_vec(flat(&|e| e.get_attention_mask()), (enc.len(), t), &Device::Cpu).unwrap();
    (ids, mask)
}

#[test]
#[ignore = "needs the pretrained model: CANDLE_FUNC_MINILM=\"$(scripts/fetch_minilm.sh)\" and --include-ignored"]
fn minilm_embeds_fortunes_as_sentence_transformers_does() {
    let dir = std::env::var_os("CANDLE_FUNC_MINILM")
        .map(PathBuf::from)
        .expect("CANDLE_FUNC_MINILM must name the model's folder: run scripts/fetch_minilm.sh and set it");
    let r = reference();
    let model = BertModel::load(&Checkpoint::load(&dir, DType::F32, &Device::Cpu).unwrap()).unwrap();
    let params: usize = candle_func::nn::Module::params(&model)
        .values()
        .map(|t| t.elem_count())
        .sum();
    assert_eq!(params, 22_713_216, "all-MiniLM-L6-v2 has 22.7M parameters");
    let (ids, mask) = tokenise(&dir, &r);
    let embed = |i: Tracer, m: Tracer| l2_normalize(&mean_pool(&model.forward_masked(&i, Some(&m))?, &m)?);
    let want = Tensor::new(r.embeddings.clone(), &Device::Cpu).unwrap();
    // one sentence per call under vmap, and the padded batch at once
    for (how, got) in [
        ("vmap", vmap(embed).call((&ids, &mask)).unwrap()),
        ("batch", jit(embed).call((&ids, &mask)).unwrap()),
    ] {
        let d = max_diff(&got, &want) as f32;
        println!("{how}: largest difference from sentence-transformers {d:.2e}");
        assert!(d < 1e-4, "{how}: embeddings differ by {d}");
    }
}
