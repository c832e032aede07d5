//! Finding CUDA devices without assuming CUDA exists. The order matters: any cudarc call made
//! before `is_culib_present()` can panic when libcuda is missing.

use cudarc::driver::result;

/// One CUDA device.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceInfo {
    /// CUDA ordinal (changes with `CUDA_VISIBLE_DEVICES`).
    pub ordinal: i32,
    /// Device name.
    pub name: String,
    /// Stable identity: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
    /// Its PCI address (`0000:3b:00.0`), where the driver says.
    pub pci_address: Option<String>,
    /// The host NUMA node its PCI link hangs off (sysfs `numa_node`), where the kernel says:
    /// the DMA threads of the device are placed on its cores.
    pub numa_node: Option<u32>,
}

/// What the machine offers.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum Probe {
    /// No usable CUDA: why.
    Absent {
        /// A sentence for logs and `--gpu required` errors.
        reason: String,
    },
    /// The devices found.
    Present {
        /// At least one.
        devices: Vec<DeviceInfo>,
    },
}

fn format_uuid(bytes: &[u8; 16]) -> String {
    let h: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

/// Looks for CUDA devices: libcuda present, driver initialises, at least one device.
pub fn probe() -> Probe {
    if !crate::dma::driver_library_present() {
        return Probe::Absent {
            reason: "libcuda (the NVIDIA driver library) is not installed".into(),
        };
    }
    if let Err(e) = result::init() {
        return Probe::Absent { reason: format!("the CUDA driver failed to initialise: {e}") };
    }
    let count = match result::device::get_count() {
        Ok(n) => n,
        Err(e) => return Probe::Absent { reason: format!("counting CUDA devices failed: {e}") },
    };
    if count == 0 {
        return Probe::Absent { reason: "the CUDA driver reports no device".into() };
    }
    let mut devices = Vec::new();
    for ordinal in 0..count {
        let info = result::device::get(ordinal).and_then(|dev| {
            let name = result::device::get_name(dev)?;
            let uuid = result::device::get_uuid(dev)?;
            let bytes: [u8; 16] = uuid.bytes.map(|b| b as u8);
            let pci_address = crate::dma::pci_address(dev).ok();
            let numa_node = pci_address.as_deref().and_then(pci_numa_node);
            Ok(DeviceInfo { ordinal, name, uuid: format_uuid(&bytes), pci_address, numa_node })
        });
        match info {
            Ok(d) => devices.push(d),
            Err(e) => tracing::warn!(ordinal, error = %e, "CUDA device skipped"),
        }
    }
    if devices.is_empty() {
        return Probe::Absent { reason: "no CUDA device could be queried".into() };
    }
    Probe::Present { devices }
}

/// The NUMA node of the PCI device at `address`, as sysfs says (`-1`: none, e.g. one node).
fn pci_numa_node(address: &str) -> Option<u32> {
    let path = format!("/sys/bus/pci/devices/{address}/numa_node");
    std::fs::read_to_string(path)
        .ok()?
        .trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_format_matches_nvidia_smi() {
        let b: [u8; 16] = [
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ];
        assert_eq!(format_uuid(&b), "GPU-12345678-9abc-def0-0123-456789abcdef");
    }

    #[test]
    fn probing_never_panics() {
        match probe() {
            Probe::Absent { reason } => {
                println!("no CUDA here: {reason}");
                assert!(!reason.is_empty());
            }
            Probe::Present { devices } => assert!(!devices.is_empty()),
        }
    }
}
