//! Which parameters a private trainer trains: all of them, those under
//! given prefixes, or those a predicate picks. The rest are frozen: they
//! enter the traced loss as constants, so they get no per-sample gradient,
//! no noise, no update and no optimiser state, and the noise's dimension
//! counts only what trains.

use crate::error::{Error, Result};
pub(crate) use crate::transforms::tree::{overlap, under};
use std::fmt;
use std::sync::Arc;

/// A choice of trainable parameters by name (see [`PrivacyEngine::trainable`](super::PrivacyEngine::trainable)).
///
/// A prefix holds a name when it is the name or a `.`-separated head of it
/// (`"classifier"` holds `classifier.weight`, not `classifier2.weight`).
///
/// ```
/// use candle_func::dp::Trainable;
/// let names = ["bert.embeddings.word_embeddings.weight", "bert.pooler.dense.weight", "classifier.weight"];
/// let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
/// let (train, frozen) = Trainable::prefixes(&["classifier", "bert.pooler"]).split(&names)?;
/// assert_eq!(train, ["bert.pooler.dense.weight", "classifier.weight"]);
/// assert_eq!(frozen, ["bert.embeddings.word_embeddings.weight"]);
/// // a prefix that matches nothing is an error naming it, never an empty choice
/// assert!(Trainable::prefixes(&["clasifier"]).split(&names).is_err());
/// # Ok::<(), candle_func::Error>(())
/// ```
#[derive(Clone)]
pub struct Trainable(Select);

#[derive(Clone)]
enum Select {
    All,
    Prefixes(Vec<String>),
    Except(Vec<String>),
    Matching(Arc<dyn Fn(&str) -> bool + Send + Sync>),
}

impl fmt::Debug for Trainable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Select::All => write!(f, "Trainable::all()"),
            Select::Prefixes(p) => write!(f, "Trainable::prefixes({p:?})"),
            Select::Except(p) => write!(f, "Trainable::except({p:?})"),
            Select::Matching(_) => write!(f, "Trainable::matching(<predicate>)"),
        }
    }
}

impl Default for Trainable {
    fn default() -> Trainable {
        Trainable::all()
    }
}

impl Trainable {
    /// Every parameter trains (the default).
    pub fn all() -> Trainable {
        Trainable(Select::All)
    }

    /// The parameters under these prefixes train; each prefix must hold at
    /// least one parameter.
    pub fn prefixes<S: AsRef<str>>(prefixes: &[S]) -> Trainable {
        Trainable(Select::Prefixes(
            prefixes.iter().map(|p| p.as_ref().to_string()).collect(),
        ))
    }

    /// Every parameter except those under these prefixes trains (freezing
    /// the embeddings, say); each prefix must hold at least one parameter.
    pub fn except<S: AsRef<str>>(prefixes: &[S]) -> Trainable {
        Trainable(Select::Except(
            prefixes.iter().map(|p| p.as_ref().to_string()).collect(),
        ))
    }

    /// The parameters whose name `keep` accepts train; it must accept at
    /// least one.
    pub fn matching(keep: impl Fn(&str) -> bool + Send + Sync + 'static) -> Trainable {
        Trainable(Select::Matching(Arc::new(keep)))
    }

    /// `names` split into those that train and those frozen, in the order
    /// given; an error naming the prefix that holds no parameter, or saying
    /// that nothing would train.
    pub fn split(&self, names: &[String]) -> Result<(Vec<String>, Vec<String>)> {
        let unmatched = |prefixes: &[String]| -> Result<()> {
            match prefixes.iter().find(|p| !names.iter().any(|n| under(n, p))) {
                Some(p) => Err(Error::privacy(
                    "Trainable",
                    format!("prefix {p:?}"),
                    format!("a prefix of some parameter's name (parameters: {})", list(names)),
                    "a prefix of none",
                )),
                None => Ok(()),
            }
        };
        let trains: Box<dyn Fn(&str) -> bool + '_> = match &self.0 {
            Select::All => Box::new(|_| true),
            Select::Prefixes(p) => {
                unmatched(p)?;
                Box::new(move |n| p.iter().any(|p| under(n, p)))
            }
            Select::Except(p) => {
                unmatched(p)?;
                Box::new(move |n| !p.iter().any(|p| under(n, p)))
            }
            Select::Matching(keep) => Box::new(|n| keep(n)),
        };
        let (train, frozen): (Vec<String>, Vec<String>) = names.iter().cloned().partition(|n| trains(n));
        if train.is_empty() {
            return Err(Error::privacy(
                "Trainable",
                format!("{self:?}"),
                format!("at least one parameter to train (parameters: {})", list(names)),
                "none",
            ));
        }
        Ok((train, frozen))
    }
}

/// Names for a message: all of them when few, else the first and a count.
fn list(names: &[String]) -> String {
    const SHOWN: usize = 8;
    if names.len() <= SHOWN {
        return format!("{names:?}");
    }
    format!("{:?} and {} more", &names[..SHOWN], names.len() - SHOWN)
}
