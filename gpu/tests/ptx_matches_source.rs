//! The embedded PTX files were built from the kernel sources as they are now. The CPU tests
//! run the checksum kernels' source (compiled as C), the GPU runs their PTX: a source changed
//! without its PTX rebuilt would pass here and run the old kernels there. Each PTX header
//! names its source's CRC-32, written by `gpu/kernels/build-ptx-nvrtc.py` (or `build-ptx.sh`).

/// CRC-32 (IEEE 802.3, reflected, as zlib's `crc32`).
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0xedb8_8320 } else { crc >> 1 };
        }
    }
    !crc
}

/// The CRC-32 a PTX header names, if any.
fn named_crc(ptx: &str) -> Option<u32> {
    ptx.lines()
        .take_while(|l| l.starts_with("//"))
        .find_map(|l| l.strip_prefix("// Source crc32 "))
        .and_then(|h| u32::from_str_radix(h.trim(), 16).ok())
}

#[test]
fn crc32_is_zlibs() {
    // zlib.crc32(b"123456789") and zlib.crc32(b"").
    assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
    assert_eq!(crc32(b""), 0);
}

#[test]
fn header_parsing() {
    let ptx = "// Built from x.cu\n// Source crc32 0000abcd\n.version 8.8\n";
    assert_eq!(named_crc(ptx), Some(0xabcd));
    assert_eq!(named_crc("// Built from x.cu\n.version 8.8\n// Source crc32 1\n"), None);
}

#[test]
fn every_embedded_ptx_was_built_from_its_source() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("cu") {
            continue;
        }
        let name = path.file_stem().unwrap().to_str().unwrap().to_owned();
        let source = std::fs::read(&path).unwrap();
        let ptx_path = dir.join(format!("{name}.ptx"));
        let ptx = std::fs::read_to_string(&ptx_path).unwrap_or_else(|e| {
            panic!("{}: {e} (every kernel source ships its PTX)", ptx_path.display())
        });
        let rebuild =
            format!("rebuild it: python3 gpu/kernels/build-ptx-nvrtc.py gpu/kernels/{name}.cu");
        let named = named_crc(&ptx)
            .unwrap_or_else(|| panic!("gpu/kernels/{name}.ptx names no source CRC-32; {rebuild}"));
        assert_eq!(
            named,
            crc32(&source),
            "gpu/kernels/{name}.ptx was built from another {name}.cu; {rebuild}"
        );
        checked += 1;
    }
    assert_eq!(checked, 4, "copy_segments, copy_blocks, scatter_uniform and chunk_checksum");
}
