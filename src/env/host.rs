//! The guards before a host allocation sized from user input (a config
//! field, a loop's trip count, a band's size), which would otherwise abort
//! the process where the allocator fails.

use super::memory;
use crate::error::{Error, Result};

/// An error naming `op`, `what` and the size unless `elems` elements of
/// `elem_bytes` bytes fit in usize and in the memory available now.
pub(crate) fn check_host_alloc(op: &str, what: &str, elems: usize, elem_bytes: usize) -> Result<()> {
    let Some(bytes) = elems.checked_mul(elem_bytes) else {
        return Err(Error::Config {
            msg: format!("{op}: {what} of {elems} elements of {elem_bytes} bytes overflows usize"),
        });
    };
    match memory::available() {
        Some(avail) if bytes > avail => Err(Error::Config {
            msg: format!(
                "{op}: {what} of {elems} elements would take {bytes} bytes, more than the {avail} bytes this machine has available"
            ),
        }),
        _ => Ok(()),
    }
}

/// [`checked_elems`] then [`check_host_alloc`]: `shape` of `elem_bytes`
/// each fits in usize and in the machine's memory.
pub(crate) fn check_host_shape(op: &str, what: &str, shape: &[usize], elem_bytes: usize) -> Result<()> {
    let n = checked_elems(op, what, shape)?;
    check_host_alloc(op, what, n, elem_bytes)
}

/// A vector with room for `n` values, or an error naming `op` and `what`
/// where the allocator refuses it (the portable backstop of
/// [`check_host_alloc`], which reads the available memory on Linux only).
pub(crate) fn host_vec<T>(op: &str, what: &str, n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| Error::Config {
        msg: format!("{op}: {what} of {n} elements cannot be allocated: {e}"),
    })?;
    Ok(v)
}

/// The element count of `shape`, or an error naming `op` and `what` where
/// it overflows usize.
pub(crate) fn checked_elems(op: &str, what: &str, shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::Config {
            msg: format!("{op}: {what} of shape {shape:?} has more elements than usize holds"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_requests_are_errors_naming_the_operation() {
        let e = check_host_alloc("fori_loop", "the indices", usize::MAX, 8).unwrap_err();
        assert!(e.to_string().contains("fori_loop") && e.to_string().contains("overflows"));
        let e = checked_elems("attention", "the band", &[usize::MAX, 2]).unwrap_err();
        assert!(e.to_string().contains("attention"));
        assert!(host_vec::<u8>("x", "y", 16).is_ok_and(|v| v.capacity() >= 16));
    }
}
