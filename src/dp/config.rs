//! The privacy parameters of a private trainer: the expected batch, the
//! noise multiplier and how per-example (or per-user) gradients are bounded.

use super::adaptive::AdaptiveClipping;
use super::trainable::{overlap, under};
use crate::error::{Error, Result};

/// How per-example gradients are bounded.
#[derive(Clone, Debug, PartialEq)]
pub enum Clipping {
    /// The whole gradient to this L2 norm (Opacus's `"flat"`).
    Flat(f64),
    /// Each group of parameters to its own norm (Opacus's `"per_layer"`,
    /// with groups): `(prefix, bound)` where a parameter belongs to the
    /// first group whose prefix is its name or a `.`-separated head of it
    /// (`"fc1"` holds `fc1.weight` and `fc1.bias`). Every parameter must
    /// belong to a group.
    PerLayer(Vec<(String, f64)>),
    /// The whole gradient to a bound that tracks a quantile of the norms
    /// (see [`AdaptiveClipping`]).
    Adaptive(AdaptiveClipping),
    /// Automatic clipping with stability constant `γ` (Bu et al. 2023):
    /// each example's gradient scaled by `1 / (||g|| + γ)`, norm below 1
    /// (the sensitivity), no bound to tune (see
    /// [`ClippedGradSum::automatic`](super::ClippedGradSum::automatic)).
    Automatic(f64),
}

/// The privacy parameters of [`PrivacyEngine::make_private`](crate::dp::PrivacyEngine::make_private).
#[derive(Clone, Debug, PartialEq)]
pub struct DpConfig {
    /// The expected logical batch size: the sample rate is `batch_size / N`.
    pub batch_size: usize,
    /// The noise's standard deviation over the sensitivity, `σ`.
    pub noise_multiplier: f64,
    /// The clipping of per-example gradients.
    pub clipping: Clipping,
}

impl DpConfig {
    /// Flat clipping to `max_grad_norm`.
    pub fn new(batch_size: usize, noise_multiplier: f64, max_grad_norm: f64) -> DpConfig {
        DpConfig {
            batch_size,
            noise_multiplier,
            clipping: Clipping::Flat(max_grad_norm),
        }
    }

    /// Adaptive flat clipping (see [`AdaptiveClipping`]): `noise_multiplier`
    /// is the `σ` the accountant records, shared between the gradient and
    /// the count of unclipped examples.
    ///
    /// ```
    /// use candle_func::dp::{AdaptiveClipping, DpConfig};
    /// // start at C = 1, keep the median example unclipped
    /// let config = DpConfig::adaptive(64, 1.1, AdaptiveClipping::new(1.0, 0.5));
    /// # let _ = config;
    /// ```
    pub fn adaptive(batch_size: usize, noise_multiplier: f64, spec: AdaptiveClipping) -> DpConfig {
        DpConfig {
            batch_size,
            noise_multiplier,
            clipping: Clipping::Adaptive(spec),
        }
    }

    /// Automatic clipping (Bu et al. 2023, AUTO-S): each example's gradient
    /// scaled by `1 / (||g|| + gamma)` rather than clipped to a bound, so
    /// the noise is `σ` per coordinate (the sensitivity is 1) and there is
    /// no `C` to tune; the learning rate takes its place (the paper uses
    /// `gamma = 0.01`). Ghost norms apply as for clipping.
    ///
    /// ```
    /// use candle_func::dp::{Clipping, DpConfig};
    /// let config = DpConfig::automatic(64, 1.1, 0.01);
    /// assert_eq!(config.clipping, Clipping::Automatic(0.01));
    /// ```
    pub fn automatic(batch_size: usize, noise_multiplier: f64, gamma: f64) -> DpConfig {
        DpConfig {
            batch_size,
            noise_multiplier,
            clipping: Clipping::Automatic(gamma),
        }
    }

    /// Per-layer clipping: `(prefix, bound)` groups (see [`Clipping::PerLayer`]).
    pub fn per_layer(batch_size: usize, noise_multiplier: f64, groups: &[(&str, f64)]) -> DpConfig {
        DpConfig {
            batch_size,
            noise_multiplier,
            clipping: Clipping::PerLayer(groups.iter().map(|&(p, c)| (p.to_string(), c)).collect()),
        }
    }
}

/// Each parameter's group (in name order) and each group's bound.
pub(super) fn groups(names: &[String], clipping: &Clipping) -> Result<(Vec<usize>, Vec<f64>)> {
    match clipping {
        Clipping::Flat(c) => {
            super::positive("make_private", "max_grad_norm", *c, false)?;
            Ok((vec![0; names.len()], vec![*c]))
        }
        // the bound is carried by the examples' weights (1 / C): the
        // transform clips the scaled gradients to 1
        Clipping::Adaptive(_) => Ok((vec![0; names.len()], vec![1.0])),
        // every example's scaled gradient has norm below 1
        Clipping::Automatic(gamma) => {
            super::positive("make_private", "automatic clipping's gamma", *gamma, false)?;
            Ok((vec![0; names.len()], vec![1.0]))
        }
        Clipping::PerLayer(groups) => {
            for (p, c) in groups {
                super::positive("make_private", &format!("the bound of group {p:?}"), *c, false)?;
            }
            // A parameter in two groups would be clipped to each bound in
            // turn while the noise is scaled to sqrt(Σ bounds²) as if every
            // parameter were in exactly one: refuse the overlap outright
            // rather than let the first group win silently.
            for (i, (a, _)) in groups.iter().enumerate() {
                if let Some((b, _)) = groups[i + 1..].iter().find(|(b, _)| overlap(a, b)) {
                    let setting = format!("per-layer clipping groups {a:?} and {b:?}");
                    let value = if a == b { "the same prefix twice" } else { "overlapping" };
                    return Err(Error::privacy("make_private", setting, "disjoint", value));
                }
            }
            let of_leaf = names
                .iter()
                .map(|name| {
                    groups.iter().position(|(p, _)| under(name, p)).ok_or_else(|| {
                        let prefixes: Vec<&String> = groups.iter().map(|g| &g.0).collect();
                        let expected = format!("in a per-layer clipping group (prefixes: {prefixes:?})");
                        Error::privacy("make_private", format!("parameter {name:?}"), expected, "in none")
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            // A group that holds no parameter would add its bound to the
            // sensitivity, and so noise, for nothing: a misspelt prefix.
            if let Some(k) = (0..groups.len()).find(|k| !of_leaf.contains(k)) {
                let expected = format!("a prefix of some parameter's name (parameters: {names:?})");
                let setting = format!("per-layer clipping group {:?}", groups[k].0);
                return Err(Error::privacy("make_private", setting, expected, "a prefix of none"));
            }
            Ok((of_leaf, groups.iter().map(|g| g.1).collect()))
        }
    }
}

/// Steps per epoch at the sample rate `q`: `1 / q` rounded, at least 1.
pub(super) fn steps_per_epoch(q: f64) -> usize {
    ((1.0 / q).round() as usize).max(1)
}
