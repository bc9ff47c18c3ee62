//! User-level DP ([`PrivacyEngine::users`](super::PrivacyEngine::users)):
//! every example belongs to a user, and the unit the guarantee protects is
//! the user, with all their examples.
//!
//! One step samples users (by the engine's [`Sampling`](super::Sampling)
//! scheme, at the rate `batch_size / users`), takes at most `k` examples
//! of each sampled user (all of a user's examples when they have at most
//! `k`, else `k` drawn uniformly without replacement), and clips each
//! user's combined gradient (the mean of its examples' gradients, or the
//! sum: [`UserGradient`]) to the bound. One user then moves the clipped
//! sum by at most the bound, so the noise and the accounting are those of
//! example-level DP with users in place of examples: `σ C` noise, the
//! accountant's ε at the users' sample rate, an ε per user.
//!
//! A pass holds `physical` users as `[physical, k, ..]` examples, the
//! slots of a user with fewer than `k` (and of a padding user) weighted 0.
//! The loss of one user is the weighted sum of an inner `vmap` over its
//! `k` examples, so the outer `vmap` over users sees each user's products
//! whole: a linear layer's ghost norm then takes the user's `k T` rows as
//! one sequence, and so has the cross terms between examples,
//! `||Σ_j G_j||² = Σ_{j,l} <G_j, G_l>`, without materialising a gradient.
//! With `k = 1` (every user with one example, or a cap of one) a user is an
//! example and the step is example-level DP's, bit for bit.

use super::accountant::Sampling;
use crate::error::{Error, Result};
use crate::rng::Rng;
use candle_core::{DType, Tensor};
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// How a user's examples' gradients combine into the one gradient that is
/// clipped (user-level DP, [`PrivacyEngine::users`](super::PrivacyEngine::users)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UserGradient {
    /// The mean of the user's selected examples' gradients (the default):
    /// a user with many examples weighs as much as one with few, and the
    /// learning rate of an example-level run carries over.
    #[default]
    Mean,
    /// Their sum: a user's examples each count fully until the sum reaches
    /// the bound.
    Sum,
}

/// The users of a data set: each user's examples and how many a step takes.
#[derive(Clone, Debug)]
pub(super) struct Users {
    /// Each user's examples (ascending), users in ascending order of id.
    members: Vec<Vec<usize>>,
    /// Examples a step takes of a user: the cap, or fewer when no user has
    /// that many (the pass's shape need hold no more).
    pub(super) k: usize,
    pub(super) gradient: UserGradient,
    /// The cap asked for, for the checkpoint's record.
    cap: usize,
}

impl Users {
    /// The users of `users` (an integer id per example, `[n]`), taking at
    /// most `max_examples` of a user's examples a step.
    pub(super) fn new(users: &Tensor, max_examples: usize, n: usize, gradient: UserGradient) -> Result<Users> {
        const OP: &str = "PrivacyEngine::users";
        if max_examples == 0 {
            return Err(Error::privacy(OP, "max_examples", ">= 1", 0));
        }
        if users.dims() != [n] || users.dtype().is_float() {
            return Err(Error::data(
                OP,
                format!(
                    "the user ids are {:?} {:?}, expected one integer id per example, [{n}]",
                    users.dtype(),
                    users.dims()
                ),
            ));
        }
        let ids = users.to_dtype(DType::I64)?.to_vec1::<i64>()?;
        let mut by_id: BTreeMap<i64, Vec<usize>> = BTreeMap::new();
        for (i, id) in ids.into_iter().enumerate() {
            by_id.entry(id).or_default().push(i);
        }
        let members: Vec<Vec<usize>> = by_id.into_values().collect();
        let most = members.iter().map(Vec::len).max().unwrap_or(0);
        Ok(Users {
            members,
            k: max_examples.min(most),
            gradient,
            cap: max_examples,
        })
    }

    /// How many users there are.
    pub(super) fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether a user is more than one example (`k > 1`): the pass then
    /// holds `[physical, k, ..]` examples and the loss is a user's.
    pub(super) fn grouped(&self) -> bool {
        self.k > 1
    }

    /// The examples a step takes of each `sampled` user: all of them when
    /// the user has at most `k` (drawing nothing), else `k` uniformly.
    fn select(&self, rng: &mut Rng, sampled: &[usize]) -> Vec<Vec<usize>> {
        sampled
            .iter()
            .map(|&u| {
                let all = &self.members[u];
                match all.len() > self.k {
                    true => rng.subset(all.len(), self.k).into_iter().map(|j| all[j]).collect(),
                    false => all.clone(),
                }
            })
            .collect()
    }

    /// What a checkpoint records of the users, so that a resumed run is
    /// the same one.
    pub(super) fn describe(&self) -> Value {
        json!({
            "users": self.members.len(),
            "max_examples": self.cap,
            "gradient": format!("{:?}", self.gradient),
        })
    }
}

/// A step's batch, or a rank's share of it, in the units it clips.
#[derive(Clone, Debug)]
pub(super) enum Share {
    /// Examples (example-level DP, or users of one example each).
    Examples(Vec<usize>),
    /// Users, each with the examples the step took.
    Users(Vec<Vec<usize>>),
}

impl Share {
    /// How many units (examples or users).
    pub(super) fn len(&self) -> usize {
        match self {
            Share::Examples(e) => e.len(),
            Share::Users(u) => u.len(),
        }
    }

    /// How many examples.
    pub(super) fn examples(&self) -> usize {
        match self {
            Share::Examples(e) => e.len(),
            Share::Users(u) => u.iter().map(Vec::len).sum(),
        }
    }

    /// The passes of at most `physical` units each.
    pub(super) fn passes(&self, physical: usize) -> Vec<Share> {
        match self {
            Share::Examples(e) => e.chunks(physical).map(|c| Share::Examples(c.to_vec())).collect(),
            Share::Users(u) => u.chunks(physical).map(|c| Share::Users(c.to_vec())).collect(),
        }
    }
}

/// A step's draw as a flat list rank 0 can broadcast: the sampled
/// examples, or for each sampled user its index, its count of examples and
/// those examples.
pub(super) fn draw(
    users: Option<&Users>,
    sampling: Sampling,
    rng: &mut Rng,
    (n, q, batch): (usize, f64, usize),
) -> Vec<usize> {
    let sampled = sampling.draw(rng, n, q, batch);
    let Some(users) = users else {
        return sampled;
    };
    let chosen = users.select(rng, &sampled);
    let mut flat = Vec::with_capacity(2 * sampled.len() + chosen.iter().map(Vec::len).sum::<usize>());
    for (u, examples) in sampled.iter().zip(chosen) {
        flat.extend([*u, examples.len()]);
        flat.extend(examples);
    }
    flat
}

/// A drawn batch (see [`draw`]) and this rank's share of it: the units
/// whose index is `rank` modulo `ranks` (`(0, 1)` alone).
pub(super) fn share(users: Option<&Users>, flat: Vec<usize>, (rank, ranks): (usize, usize)) -> Result<(Share, Share)> {
    let Some(users) = users else {
        let mine = super::collective::shard(&flat, rank, ranks);
        return Ok((Share::Examples(flat), Share::Examples(mine)));
    };
    let (mut all, mut mine) = (Vec::new(), Vec::new());
    let mut rest = flat.as_slice();
    while let [u, count, tail @ ..] = rest {
        if *count > tail.len() || *u >= users.len() {
            return Err(Error::internal("PrivateTrainer::step", "a malformed batch of users"));
        }
        let (examples, tail) = tail.split_at(*count);
        if u % ranks == rank {
            mine.push(examples.to_vec());
        }
        all.push(examples.to_vec());
        rest = tail;
    }
    if !rest.is_empty() {
        return Err(Error::internal("PrivateTrainer::step", "a malformed batch of users"));
    }
    Ok(match users.grouped() {
        true => (Share::Users(all), Share::Users(mine)),
        // one example a user: a user is an example
        false => (Share::Examples(all.concat()), Share::Examples(mine.concat())),
    })
}

/// The first `p` units, each user with its first `k` examples: a pass of
/// the shape every pass has, for the memory plan.
pub(super) fn first(users: Option<&Users>, p: usize) -> Share {
    match users {
        Some(u) if u.grouped() => Share::Users(
            u.members[..p.min(u.len())]
                .iter()
                .map(|m| m[..m.len().min(u.k)].to_vec())
                .collect(),
        ),
        Some(u) => Share::Examples(u.members[..p.min(u.len())].iter().map(|m| m[0]).collect()),
        None => Share::Examples((0..p).collect()),
    }
}

/// The example ids of a pass of `users` (`physical` users, `k` slots
/// each, `B K -> (B K)`) and their weights `[physical, k]`: a real
/// example's `unit` (times `1 / count` for the mean), 0 for a slot past a
/// user's examples and for a padding user (copies of the first user).
pub(super) fn user_slots(users: &Users, chunk: &[Vec<usize>], physical: usize, unit: f64) -> (Vec<usize>, Vec<f32>) {
    let k = users.k;
    let mut ids = Vec::with_capacity(physical * k);
    let mut w = vec![0f32; physical * k];
    for slot in 0..physical {
        let real = chunk.get(slot);
        let examples = real.unwrap_or(&chunk[0]);
        let share = match users.gradient {
            UserGradient::Mean => unit / examples.len() as f64,
            UserGradient::Sum => unit,
        };
        for j in 0..k {
            ids.push(examples.get(j).copied().unwrap_or(examples[0]));
            if real.is_some() && j < examples.len() {
                w[slot * k + j] = share as f32;
            }
        }
    }
    (ids, w)
}
