//! `--gpu auto|off|required`.

use crate::detect::{probe, Probe};

pub use orbitkv_config::GpuMode;

/// Why the GPU side cannot start.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// `--gpu required` and no usable device.
    #[error("--gpu required, but no CUDA device can be used: {0}")]
    Unavailable(String),
    /// A CUDA call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
}

/// Applies `mode` to what [`probe`] finds: `Ok(None)` means serve without a GPU.
pub fn resolve(mode: GpuMode) -> Result<Option<Probe>, GpuError> {
    if mode == GpuMode::Off {
        return Ok(None);
    }
    let found = probe();
    match (&found, mode) {
        (Probe::Absent { .. }, GpuMode::Auto) => Ok(Some(found)),
        (Probe::Absent { reason }, _) => Err(GpuError::Unavailable(reason.clone())),
        (Probe::Present { .. }, _) => Ok(Some(found)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_names() {
        for m in [GpuMode::Auto, GpuMode::Off, GpuMode::Required] {
            assert_eq!(GpuMode::parse(m.as_str()), Some(m));
        }
        assert_eq!(GpuMode::parse("maybe"), None);
    }

    #[test]
    fn off_never_probes_and_auto_never_fails() {
        assert!(resolve(GpuMode::Off).unwrap().is_none());
        assert!(resolve(GpuMode::Auto).is_ok());
        // `required` fails exactly when the probe finds nothing usable.
        match probe() {
            Probe::Absent { reason } => {
                let e = resolve(GpuMode::Required).unwrap_err().to_string();
                assert!(e.contains("--gpu required") && e.contains(&reason), "{e}");
            }
            Probe::Present { .. } => assert!(resolve(GpuMode::Required).is_ok()),
        }
    }
}
