//! Fuzz targets for the decoders of outside input. Each is a function of the raw input that
//! must never panic, whatever the bytes; where a decoder accepts the input, what it decoded
//! must survive a round trip. `fuzz_targets/` wraps each for `cargo fuzz` (libFuzzer, nightly);
//! `tests/smoke.rs` runs each over seeds and mutations on stable, in the test suite.
//!
//! | target | input | decoder |
//! | --- | --- | --- |
//! | [`request`] | an iceoryx2 request or response message | `orbitkv_proto::decode::<Request>` / `<Response>` (rkyv, validated) |
//! | [`bootstrap`] | the bootstrap socket's byte stream | `read_frame`, then `decode::<Bootstrap>` / `<Welcome>` |
//! | [`ssd_blocks`] | one 4 KiB block of an SSD file | `Superblock::decode`, `RecordHeader::decode` |
//! | [`ssd_recovery`] | a whole SSD file, as records of arbitrary fields (sealed, so recovery reads them) and raw bytes | `RegionLog::recover` |
//! | [`peer_messages`] | a peer control RPC message | prost decode of each message type, `Key::to_chunk_key` |
//! | [`admin_request`] | a line on the admin socket | `orbitkv_proto::admin::AdminRequestLine::parse`, `request` |
//! | [`config_file`] | a `--config` file's text | `orbitkv_config::from_file_text` (TOML, then `validate`) |

#![deny(unsafe_code)]

use orbitkv_proto::{decode, encode, Bootstrap, ChunkKey, Request, Response, Welcome};
use orbitkv_ssd::format::{
    RecordHeader, RecordKind, Superblock, RECORD_HEADER_BYTES, SUPERBLOCK_BYTES,
};
use orbitkv_ssd::log::RegionLog;
use prost::Message;

/// Decodes the bytes as the type; when they decode, encoding and decoding again gives the
/// same value.
macro_rules! round_trip {
    ($t:ty, $data:expr) => {
        if let Ok(value) = decode::<$t>($data) {
            let again = decode::<$t>(&encode(&value)).expect("what decoded encodes and decodes");
            assert_eq!(again, value, "a decoded message survives a round trip");
        }
    };
}

/// A request message as a shard receives it from a session (and a response as a client does).
pub fn request(data: &[u8]) {
    round_trip!(Request, data);
    round_trip!(Response, data);
    if let Ok(r) = decode::<Request>(data) {
        // What the router asks of every request before it executes it.
        let _ = (r.key_count(), r.op_name(), r.find_key(|k| k.namespace == 0));
    }
}

/// The bootstrap socket's bytes: a length-prefixed frame holding a hello (or, for a client,
/// a welcome).
pub fn bootstrap(data: &[u8]) {
    if let Ok(frame) = orbitkv_proto::read_frame(&mut &data[..], Vec::new()) {
        round_trip!(Bootstrap, &frame);
        round_trip!(Welcome, &frame);
    }
    round_trip!(Bootstrap, data);
}

/// One block of an SSD file, as a superblock and as a record header.
pub fn ssd_blocks(data: &[u8]) {
    let mut block = vec![0u8; SUPERBLOCK_BYTES as usize];
    let n = data.len().min(block.len());
    block[..n].copy_from_slice(&data[..n]);
    if let Ok(sb) = Superblock::decode(&block) {
        assert_eq!(Superblock::decode(&sb.encode()), Ok(sb));
        // The geometry a decoded superblock gives is arithmetic the store relies on.
        let _ = sb.region_count.checked_mul(sb.region_bytes);
    }
    if let Ok(h) = RecordHeader::decode(&block) {
        let mut again = vec![0u8; RECORD_HEADER_BYTES as usize];
        h.encode_into(&mut again);
        assert_eq!(RecordHeader::decode(&again), Ok(h));
    }
}

/// The geometry of the fuzzed SSD file: 4 regions of 64 KiB.
const REGION_BYTES: u64 = 64 << 10;
const REGIONS: u64 = 4;

/// A whole SSD file: the input is read as a program of 40-byte steps, each writing at a block
/// of the file either a sealed record header with the step's fields (any length, sequence,
/// generation, key: recovery must judge them, since their checksums are right) or the step's
/// raw bytes. Recovery must not panic, and every record it keeps must lie inside its region.
pub fn ssd_recovery(data: &[u8]) {
    let sb = Superblock {
        format_version: orbitkv_ssd::format::FORMAT_VERSION,
        shard_id: 0,
        shard_count: 1,
        region_bytes: REGION_BYTES,
        region_count: REGIONS,
    };
    let mut file = vec![0u8; sb.file_bytes() as usize];
    file[..SUPERBLOCK_BYTES as usize].copy_from_slice(&sb.encode());
    let blocks = (file.len() as u64 - SUPERBLOCK_BYTES) / RECORD_HEADER_BYTES;
    for step in data.chunks(40) {
        let mut s = [0u8; 40];
        s[..step.len()].copy_from_slice(step);
        let u = |i: usize| u64::from_le_bytes(s[i..i + 8].try_into().expect("8 bytes"));
        let at = (SUPERBLOCK_BYTES + (u(0) >> 8) % blocks * RECORD_HEADER_BYTES) as usize;
        let block = &mut file[at..at + RECORD_HEADER_BYTES as usize];
        if s[0] & 1 == 0 {
            let mut digest = [0u8; 32];
            digest[..8].copy_from_slice(&s[32..40]);
            // Mostly chunks; a tombstone of a key, a namespace or everything now and then.
            let kind = match s[3] & 0x3f {
                1 => RecordKind::Tombstone,
                2 => RecordKind::NamespaceTombstone,
                3 => RecordKind::EverythingTombstone,
                _ => RecordKind::Chunk,
            };
            let h = RecordHeader {
                kind,
                key: ChunkKey::new(u(8) & 0xff, digest),
                // Mostly small (within a region), sometimes anything; none for a tombstone.
                len: match kind {
                    RecordKind::Chunk if s[1] & 0x80 == 0 => u(16) % (REGION_BYTES * 2),
                    RecordKind::Chunk => u(16),
                    _ => 0,
                },
                checksum: 0,
                sequence: u(24) % 64,
                region_generation: u64::from(s[2] % 4),
                reclaimed_below: u64::from(s[4] % 4),
            };
            h.encode_into(block);
        } else {
            block[..40].copy_from_slice(&s);
        }
    }
    let read = |offset: u64, buf: &mut [u8]| -> std::io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        match file.get(start..start + buf.len()) {
            Some(bytes) => {
                buf.copy_from_slice(bytes);
                Ok(())
            }
            None => Err(std::io::ErrorKind::UnexpectedEof.into()),
        }
    };
    if let Ok((log, report)) = RegionLog::recover(sb, read) {
        assert_eq!(log.len() as u64, report.kept);
        for (_, e) in log.iter() {
            assert!(e.len > 0, "a tombstone indexed as a chunk: {e:?}");
            let region_start = sb.region_offset(u64::from(e.region));
            assert!(e.region < REGIONS as u32, "{e:?}");
            assert!(e.offset >= region_start, "{e:?}");
            let end = e.payload_offset() + e.len.div_ceil(4096) * 4096;
            assert!(end <= region_start + REGION_BYTES, "a kept record overruns its region: {e:?}");
        }
    }
}

/// A peer control RPC message, as the owner (requests) and the requester (answers and the
/// inventory stream) receive them.
pub fn peer_messages(data: &[u8]) {
    use orbitkv_peer::rpc::{
        GrantReply, GrantRequest, InventoryRequest, InventoryUpdate, Key, ReleaseReply,
        ReleaseRequest,
    };
    if let Ok(m) = InventoryUpdate::decode(data) {
        for c in &m.added {
            let _ = c.key.as_ref().and_then(Key::to_chunk_key);
        }
        for k in &m.removed {
            let _ = k.to_chunk_key();
        }
        assert_eq!(InventoryUpdate::decode(m.encode_to_vec().as_slice()).ok(), Some(m));
    }
    if let Ok(m) = GrantRequest::decode(data) {
        let _: Option<Vec<ChunkKey>> = m.keys.iter().map(Key::to_chunk_key).collect();
    }
    let _ = GrantReply::decode(data);
    let _ = ReleaseRequest::decode(data);
    let _ = ReleaseReply::decode(data);
    let _ = InventoryRequest::decode(data);
}

/// A line on the admin socket: parsed as the server parses it (its command, then the request,
/// an `evict`'s target included), and a request that parses says the same once serialized and
/// parsed again. Only what the server acts on is compared (the request it reads): other
/// members may be floats, which serde_json does not parse back bit for bit.
pub fn admin_request(data: &[u8]) {
    use orbitkv_proto::admin::{AdminRequest, AdminRequestLine};
    let Ok(line) = std::str::from_utf8(data) else { return };
    let Ok(parsed) = AdminRequestLine::parse(line) else { return };
    let Ok(request) = parsed.request() else { return };
    assert_eq!(request.cmd(), parsed.cmd(), "a request is the command its line names");
    let again = serde_json::to_string(&request).expect("admin requests serialize");
    assert_eq!(AdminRequest::parse(&again).expect("a parsed request re-parses"), request);
}

/// A config file's text, as `--config` reads it: TOML into the options, then validated (a
/// config that validates prints, with `--print-config`, as TOML that reads back the same).
pub fn config_file(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(settings) = orbitkv_config::from_file_text(text) {
        let printed = toml::to_string(&settings.config).expect("a configuration prints");
        let back = orbitkv_config::from_file_text(&printed).expect("what printed reads back");
        assert_eq!(back.config, settings.config, "{printed}");
    }
}
