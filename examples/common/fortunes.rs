//! The fortune-cookie texts shipped in `data/fortunes.tsv.gz` (3,009
//! records in four topics; see data/README.md), embedded in the binary, as
//! character ids for a language model.

use candle_core::{Device, Tensor};
use std::io::Read;

static FORTUNES_GZ: &[u8] = include_bytes!("../../data/fortunes.tsv.gz");

/// Id 0 pads a short text (its targets are ignored), 1 starts every text,
/// then newline and the printable ASCII characters.
pub const PAD: u32 = 0;
pub const BOS: u32 = 1;
pub const VOCAB: usize = 2 + 1 + 95;

/// A character's id (anything else was removed when the data was made).
pub fn id(c: char) -> u32 {
    match c {
        '\n' => 2,
        ' '..='~' => 3 + (c as u32 - ' ' as u32),
        _ => 3,
    }
}

/// Every record's text, in file order, with its topic.
pub fn load() -> Result<Vec<(String, String)>, Box<dyn std::error::Error>> {
    let mut tsv = String::new();
    flate2::read::GzDecoder::new(FORTUNES_GZ).read_to_string(&mut tsv)?;
    let mut out = Vec::new();
    for line in tsv.lines().skip(1) {
        let (topic, text) = line.split_once('\t').ok_or("a record without a tab")?;
        // `\n` is a newline and `\\` a backslash inside a text
        let (mut t, mut chars) = (String::new(), text.chars());
        while let Some(c) = chars.next() {
            match (c, c == '\\') {
                (_, true) => match chars.next() {
                    Some('n') => t.push('\n'),
                    Some(o) => t.push(o),
                    None => t.push('\\'),
                },
                (c, false) => t.push(c),
            }
        }
        out.push((topic.to_string(), t));
    }
    Ok(out)
}

/// Inputs `[N, t]` (`BOS` then the first `t - 1` characters) and targets
/// `[N, t]` (the first `t` characters, `PAD` after a text's end), u32.
pub fn windows(texts: &[&str], t: usize, dev: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let (mut xs, mut ys) = (Vec::with_capacity(texts.len() * t), Vec::with_capacity(texts.len() * t));
    for text in texts {
        let ids: Vec<u32> = text.chars().map(id).take(t).collect();
        let y: Vec<u32> = ids.iter().copied().chain(std::iter::repeat(PAD)).take(t).collect();
        xs.push(BOS);
        xs.extend(&y[..t - 1]);
        ys.extend(y);
    }
    Ok((
        Tensor::from_vec(xs, (texts.len(), t), dev)?,
        Tensor::from_vec(ys, (texts.len(), t), dev)?,
    ))
}
