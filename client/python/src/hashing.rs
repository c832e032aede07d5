//! Chunk identities computed as the Rust client computes them (same bytes in every process).

use orbitkv_client as okv;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::invalid;

/// Digests of every full chunk of `tokens`, chained from `parent` (default: the fixed seed).
#[pyfunction]
#[pyo3(signature = (tokens, tokens_per_chunk, extra = b"".as_slice(), parent = None))]
pub(crate) fn prefix_digests<'py>(
    py: Python<'py>,
    tokens: Vec<u32>,
    tokens_per_chunk: usize,
    extra: &[u8],
    parent: Option<&[u8]>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    if tokens_per_chunk == 0 {
        return Err(invalid("tokens_per_chunk must be at least 1"));
    }
    let mut hasher = match parent {
        None => okv::PrefixHasher::new(),
        Some(p) => okv::PrefixHasher::resume(
            p.try_into().map_err(|_| invalid(format!("parent is 32 bytes, not {}", p.len())))?,
        ),
    };
    Ok(tokens
        .chunks_exact(tokens_per_chunk)
        .map(|c| PyBytes::new(py, &hasher.next_chunk(c, extra)))
        .collect())
}

/// The digest of a chunk an engine names by its own block hash (vLLM's `block_hashes`).
#[pyfunction]
pub(crate) fn chunk_digest<'py>(py: Python<'py>, engine_hash: &[u8]) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &okv::engine_digest(engine_hash))
}

/// XXH3-64 of a chunk's bytes, as the server computes it at commit.
#[pyfunction]
pub(crate) fn chunk_checksum(data: &[u8]) -> u64 {
    okv::chunk_checksum(data)
}
