//! The SSD file format: a superblock, then equal regions of self-validating records.
//!
//! ```text
//! block 0            superblock (4 KiB)
//! region r           at SUPERBLOCK_BYTES + r * region_bytes, a log of records:
//!   record           header block (4 KiB) + payload, padded to 4 KiB
//!   tombstone        header block alone: a deletion of a key, a namespace or everything
//! ```
//!
//! Every integer is little endian. Every block carries an xxh3-64 of its own bytes, so a torn
//! or stale block is recognised, never trusted. A record's payload checksum is verified on
//! every read; recovery reads headers only.

use orbitkv_proto::{ChunkKey, Digest};
// Record headers are checked with the same XXH3-64 as chunk payloads.
use orbitkv_proto::chunk_checksum as xxh3_64;

use orbitkv_proto::PAGE_SIZE;

/// Bytes of the superblock at the start of the file.
pub const SUPERBLOCK_BYTES: u64 = PAGE_SIZE;
/// Bytes of a record header block.
pub const RECORD_HEADER_BYTES: u64 = PAGE_SIZE;
/// Largest payload a record header may state (1 TiB, far above any region).
pub const MAX_RECORD_LEN: u64 = 1 << 40;
/// Version of this format; a file of another version is refused (or rebuilt), never misread.
/// Version 2 added tombstones and the reclaimed-generation mark of every header.
pub const FORMAT_VERSION: u32 = 2;

const SUPER_MAGIC: [u8; 8] = *b"OKVSSD\0\x01";
const RECORD_MAGIC: [u8; 8] = *b"OKVREC\0\x01";

/// What identifies a file as belonging to one shard of one configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// Format version ([`FORMAT_VERSION`]).
    pub format_version: u32,
    /// The shard this file belongs to.
    pub shard_id: u32,
    /// Shard count of the server that wrote it: placement depends on it.
    pub shard_count: u32,
    /// Bytes per region (a multiple of 4 KiB).
    pub region_bytes: u64,
    /// Regions in the file.
    pub region_count: u64,
}

/// Why a block was not accepted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// Not one of our blocks (zeroes, garbage, another file).
    #[error("bad magic")]
    BadMagic,
    /// Our block, but its bytes do not match its checksum (torn or corrupted).
    #[error("block checksum mismatch")]
    BadChecksum,
    /// Written by another format version.
    #[error("format version {found}, this build reads {FORMAT_VERSION}")]
    Version {
        /// The version in the block.
        found: u32,
    },
    /// Fields out of range.
    #[error("invalid field {0}")]
    Field(&'static str),
}

fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4-byte slice"))
}
fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8-byte slice"))
}

/// Seals a block: its last 8 bytes are the xxh3 of everything before them.
fn seal(block: &mut [u8]) {
    let n = block.len() - 8;
    let sum = xxh3_64(&block[..n]);
    put_u64(block, n, sum);
}

fn check(block: &[u8], magic: &[u8; 8]) -> Result<(), FormatError> {
    if &block[..8] != magic {
        return Err(FormatError::BadMagic);
    }
    let n = block.len() - 8;
    if xxh3_64(&block[..n]) != get_u64(block, n) {
        return Err(FormatError::BadChecksum);
    }
    Ok(())
}

impl Superblock {
    /// Encodes into a 4 KiB block.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; SUPERBLOCK_BYTES as usize];
        b[..8].copy_from_slice(&SUPER_MAGIC);
        put_u32(&mut b, 8, self.format_version);
        put_u32(&mut b, 12, self.shard_id);
        put_u32(&mut b, 16, self.shard_count);
        put_u64(&mut b, 24, self.region_bytes);
        put_u64(&mut b, 32, self.region_count);
        seal(&mut b);
        b
    }

    /// Decodes and validates a superblock block.
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        if b.len() != SUPERBLOCK_BYTES as usize {
            return Err(FormatError::Field("superblock length"));
        }
        check(b, &SUPER_MAGIC)?;
        let sb = Superblock {
            format_version: get_u32(b, 8),
            shard_id: get_u32(b, 12),
            shard_count: get_u32(b, 16),
            region_bytes: get_u64(b, 24),
            region_count: get_u64(b, 32),
        };
        if sb.format_version != FORMAT_VERSION {
            return Err(FormatError::Version { found: sb.format_version });
        }
        if sb.region_bytes == 0 || !sb.region_bytes.is_multiple_of(PAGE_SIZE) {
            return Err(FormatError::Field("region_bytes"));
        }
        if sb.shard_count == 0 || sb.shard_id >= sb.shard_count {
            return Err(FormatError::Field("shard_id"));
        }
        Ok(sb)
    }

    /// Byte offset of region `r` in the file.
    pub fn region_offset(&self, r: u64) -> u64 {
        SUPERBLOCK_BYTES + r * self.region_bytes
    }

    /// Total file size.
    pub fn file_bytes(&self) -> u64 {
        self.region_offset(self.region_count)
    }
}

/// What a record is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RecordKind {
    /// A chunk: its payload follows the header.
    Chunk,
    /// The deletion of `key`: every earlier record of it is gone.
    Tombstone,
    /// The deletion of `key.namespace`: every earlier record of the namespace is gone.
    NamespaceTombstone,
    /// The deletion of everything: every earlier record is gone.
    EverythingTombstone,
}

impl RecordKind {
    fn code(self) -> u32 {
        match self {
            Self::Chunk => 0,
            Self::Tombstone => 1,
            Self::NamespaceTombstone => 2,
            Self::EverythingTombstone => 3,
        }
    }

    fn from_code(code: u32) -> Option<Self> {
        Some(match code {
            0 => Self::Chunk,
            1 => Self::Tombstone,
            2 => Self::NamespaceTombstone,
            3 => Self::EverythingTombstone,
            _ => return None,
        })
    }
}

/// The header block of one record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    /// A chunk or a tombstone.
    pub kind: RecordKind,
    /// The chunk.
    pub key: ChunkKey,
    /// Payload bytes (the record occupies the header plus `len` rounded up to 4 KiB); zero
    /// for a tombstone.
    pub len: u64,
    /// xxh3-64 of the payload, computed at commit and carried unchanged.
    pub checksum: u64,
    /// Global write order in this file: the newest record of a key wins at recovery.
    pub sequence: u64,
    /// Generation of the region when the record was written; a record from an earlier use
    /// of the region is stale.
    pub region_generation: u64,
    /// Every region generation below this one had been reclaimed when the record was
    /// written: recovery ignores a region still showing such a generation (one whose first
    /// write after its reclaim never landed), so that nothing reclaimed comes back.
    pub reclaimed_below: u64,
}

impl RecordHeader {
    /// Bytes the record occupies on disk.
    pub fn disk_bytes(&self) -> u64 {
        RECORD_HEADER_BYTES + self.len.div_ceil(PAGE_SIZE) * PAGE_SIZE
    }

    /// Encodes into a 4 KiB block.
    pub fn encode_into(&self, b: &mut [u8]) {
        assert_eq!(b.len(), RECORD_HEADER_BYTES as usize, "a header block is 4 KiB");
        b.fill(0);
        b[..8].copy_from_slice(&RECORD_MAGIC);
        put_u32(b, 8, FORMAT_VERSION);
        put_u32(b, 12, self.kind.code());
        put_u64(b, 16, self.key.namespace);
        b[24..56].copy_from_slice(&self.key.digest);
        put_u64(b, 56, self.len);
        put_u64(b, 64, self.checksum);
        put_u64(b, 72, self.sequence);
        put_u64(b, 80, self.region_generation);
        put_u64(b, 88, self.reclaimed_below);
        seal(b);
    }

    /// Decodes and validates a header block.
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        if b.len() != RECORD_HEADER_BYTES as usize {
            return Err(FormatError::Field("header length"));
        }
        check(b, &RECORD_MAGIC)?;
        let version = get_u32(b, 8);
        if version != FORMAT_VERSION {
            return Err(FormatError::Version { found: version });
        }
        let mut digest: Digest = [0; 32];
        digest.copy_from_slice(&b[24..56]);
        let kind = RecordKind::from_code(get_u32(b, 12)).ok_or(FormatError::Field("kind"))?;
        let h = RecordHeader {
            kind,
            key: ChunkKey::new(get_u64(b, 16), digest),
            len: get_u64(b, 56),
            checksum: get_u64(b, 64),
            sequence: get_u64(b, 72),
            region_generation: get_u64(b, 80),
            reclaimed_below: get_u64(b, 88),
        };
        // A chunk of zero bytes is no record; past MAX_RECORD_LEN no region could hold it (and
        // its size on disk would overflow). A tombstone has no payload.
        let len_ok = match kind {
            RecordKind::Chunk => h.len > 0 && h.len <= MAX_RECORD_LEN,
            _ => h.len == 0 && h.checksum == 0,
        };
        if !len_ok {
            return Err(FormatError::Field("len"));
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> RecordHeader {
        RecordHeader {
            kind: RecordKind::Chunk,
            key: ChunkKey::new(7, [3; 32]),
            len: 5000,
            checksum: 0xfeed,
            sequence: 42,
            region_generation: 2,
            reclaimed_below: 1,
        }
    }

    #[test]
    fn superblock_round_trip_and_validation() {
        let sb = Superblock {
            format_version: FORMAT_VERSION,
            shard_id: 1,
            shard_count: 2,
            region_bytes: 1 << 20,
            region_count: 8,
        };
        let b = sb.encode();
        assert_eq!(Superblock::decode(&b), Ok(sb));
        assert_eq!(sb.file_bytes(), 4096 + 8 * (1 << 20));
        let mut flipped = b.clone();
        flipped[20] ^= 1;
        assert_eq!(Superblock::decode(&flipped), Err(FormatError::BadChecksum));
        assert_eq!(Superblock::decode(&vec![0u8; 4096]), Err(FormatError::BadMagic));
        let bad = Superblock { shard_id: 2, ..sb }.encode();
        assert_eq!(Superblock::decode(&bad), Err(FormatError::Field("shard_id")));
        let other = Superblock { format_version: 9, ..sb }.encode();
        assert_eq!(Superblock::decode(&other), Err(FormatError::Version { found: 9 }));
    }

    #[test]
    fn record_header_round_trip_and_every_flipped_byte_is_caught() {
        let h = header();
        let mut b = vec![0u8; 4096];
        h.encode_into(&mut b);
        assert_eq!(RecordHeader::decode(&b), Ok(h));
        assert_eq!(h.disk_bytes(), 4096 + 8192);
        for i in 0..96 {
            let mut f = b.clone();
            f[i] ^= 0x10;
            assert!(RecordHeader::decode(&f).is_err(), "flip at {i} accepted");
        }
        // A torn block (only its first half written over zeroes) is rejected.
        let mut torn = vec![0u8; 4096];
        torn[..2048].copy_from_slice(&b[..2048]);
        assert!(RecordHeader::decode(&torn).is_err());
    }

    #[test]
    fn a_sealed_header_stating_an_impossible_length_is_refused() {
        let mut b = vec![0u8; RECORD_HEADER_BYTES as usize];
        for len in [MAX_RECORD_LEN + 1, u64::MAX] {
            RecordHeader { len, ..header() }.encode_into(&mut b);
            assert_eq!(RecordHeader::decode(&b), Err(FormatError::Field("len")), "{len}");
        }
        RecordHeader { len: MAX_RECORD_LEN, ..header() }.encode_into(&mut b);
        assert!(RecordHeader::decode(&b).is_ok());
    }

    #[test]
    fn tombstones_round_trip_and_carry_nothing() {
        let mut b = vec![0u8; RECORD_HEADER_BYTES as usize];
        for kind in
            [RecordKind::Tombstone, RecordKind::NamespaceTombstone, RecordKind::EverythingTombstone]
        {
            let t = RecordHeader { kind, len: 0, checksum: 0, ..header() };
            t.encode_into(&mut b);
            assert_eq!(RecordHeader::decode(&b), Ok(t));
            assert_eq!(t.disk_bytes(), RECORD_HEADER_BYTES);
            // A tombstone stating a payload, or a chunk none, is refused.
            RecordHeader { len: 4096, ..t }.encode_into(&mut b);
            assert_eq!(RecordHeader::decode(&b), Err(FormatError::Field("len")), "{kind:?}");
        }
        RecordHeader { len: 0, ..header() }.encode_into(&mut b);
        assert_eq!(RecordHeader::decode(&b), Err(FormatError::Field("len")));
        // An unknown kind (sealed, so not a torn block) is refused, naming the field.
        header().encode_into(&mut b);
        b[12] = 9;
        let n = b.len() - 8;
        let sum = xxh3_64(&b[..n]);
        b[n..].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(RecordHeader::decode(&b), Err(FormatError::Field("kind")));
    }
}
