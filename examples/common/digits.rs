//! The UCI handwritten digits shipped in `data/digits.csv.gz` (1,797 8x8
//! images, pixels 0..16, labels 0..9; see data/README.md), embedded in the
//! binary so nothing is downloaded.

use candle_core::{Device, Tensor};
use std::io::Read;

static DIGITS_GZ: &[u8] = include_bytes!("../../data/digits.csv.gz");

/// Images `[N, 1, 8, 8]` (f32, pixels scaled to [-1, 1]) and labels `[N]` (u32).
pub struct Digits {
    pub images: Tensor,
    pub labels: Tensor,
}

impl Digits {
    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.dims()[0]
    }

    /// The examples at `idx`, in that order.
    pub fn select(&self, idx: &[usize]) -> candle_core::Result<Digits> {
        let i = Tensor::from_vec(
            idx.iter().map(|&i| i as u32).collect::<Vec<u32>>(),
            idx.len(),
            self.labels.device(),
        )?;
        Ok(Digits {
            images: self.images.index_select(&i, 0)?,
            labels: self.labels.index_select(&i, 0)?,
        })
    }
}

/// All 1,797 digits, in file order.
pub fn load(device: &Device) -> Result<Digits, Box<dyn std::error::Error>> {
    let mut text = String::new();
    flate2::read::GzDecoder::new(DIGITS_GZ).read_to_string(&mut text)?;
    let (mut pixels, mut labels) = (Vec::new(), Vec::new());
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let vals: Vec<f32> = line
            .split(',')
            .map(|v| v.trim().parse::<f32>())
            .collect::<Result<_, _>>()?;
        if vals.len() != 65 {
            return Err(format!("a digits row has {} values, expected 65", vals.len()).into());
        }
        pixels.extend(vals[..64].iter().map(|p| p / 8.0 - 1.0));
        labels.push(vals[64] as u32);
    }
    let n = labels.len();
    Ok(Digits {
        images: Tensor::from_vec(pixels, (n, 1, 8, 8), device)?,
        labels: Tensor::from_vec(labels, n, device)?,
    })
}

/// The fixed train/test split: a seeded shuffle, then the first 80 % for
/// training (1,437 examples) and the rest for testing (360).
pub fn split(all: &Digits) -> candle_core::Result<(Digits, Digits)> {
    let order = candle_func::rng::Rng::seeded(2024).permutation(all.len());
    let n_train = all.len() * 4 / 5;
    Ok((all.select(&order[..n_train])?, all.select(&order[n_train..])?))
}
