//! Encoding and validated decoding of wire messages.

use rkyv::api::high::{HighDeserializer, HighSerializer, HighValidator};
use rkyv::bytecheck::CheckBytes;
use rkyv::rancor;
use rkyv::ser::allocator::ArenaHandle;
use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};

/// A message that failed validation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed message ({len} bytes): {reason}")]
pub struct DecodeError {
    /// Size of the rejected message.
    pub len: usize,
    /// What the validator found.
    pub reason: String,
}

/// Encodes a message into an aligned byte buffer.
pub fn encode<T>(value: &T) -> AlignedVec
where
    T: for<'a> Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, rancor::Error>>,
{
    rkyv::to_bytes::<rancor::Error>(value)
        .expect("serializing into a growable in-memory buffer cannot fail")
}

/// Validates and decodes a message from untrusted bytes. The input is always copied into an
/// aligned private buffer first: it may live in memory another process can still write, and
/// validation must see the same bytes as deserialization. Any structural error is reported,
/// never trusted.
pub fn decode<T>(bytes: &[u8]) -> Result<T, DecodeError>
where
    T: Archive,
    T::Archived: for<'a> CheckBytes<HighValidator<'a, rancor::Error>>
        + Deserialize<T, HighDeserializer<rancor::Error>>,
{
    let fail = |e: rancor::Error| DecodeError { len: bytes.len(), reason: e.to_string() };
    let mut aligned = AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    rkyv::from_bytes::<T, rancor::Error>(&aligned).map_err(fail)
}

/// Largest bootstrap frame accepted on the Unix socket.
pub const MAX_FRAME: usize = 64 << 10;

/// Writes one bootstrap frame: u32 little-endian length, then the bytes.
pub fn write_frame(w: &mut impl std::io::Write, bytes: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(4 + bytes.len());
    buf.extend_from_slice(&frame_header(bytes.len())?);
    buf.extend_from_slice(bytes);
    w.write_all(&buf)
}

/// The 4-byte header of a frame of `len` bytes.
pub fn frame_header(len: usize) -> std::io::Result<[u8; 4]> {
    if len > MAX_FRAME {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "frame too large"));
    }
    Ok((len as u32).to_le_bytes())
}

/// Reads one bootstrap frame (at most [`MAX_FRAME`] bytes); `prefix` holds bytes of it that
/// were already received.
pub fn read_frame(r: &mut impl std::io::Read, mut prefix: Vec<u8>) -> std::io::Result<Vec<u8>> {
    while prefix.len() < 4 {
        let mut b = [0u8; 4];
        let n = r.read(&mut b[..4 - prefix.len()])?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        prefix.extend_from_slice(&b[..n]);
    }
    let len = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the {MAX_FRAME}-byte limit"),
        ));
    }
    let mut body = prefix.split_off(4);
    if body.len() > len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "trailing bytes after frame",
        ));
    }
    let have = body.len();
    body.resize(len, 0);
    r.read_exact(&mut body[have..])?;
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ChunkKey, Request, Response};
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let req = Request::Lookup { keys: vec![ChunkKey::new(1, [2; 32])], lease: true };
        let bytes = encode(&req);
        assert_eq!(decode::<Request>(&bytes).unwrap(), req);
        let mut shifted = vec![0u8];
        shifted.extend_from_slice(&bytes);
        assert_eq!(decode::<Request>(&shifted[1..]).unwrap(), req);
    }

    #[test]
    fn frames() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b"hello").unwrap();
        assert_eq!(read_frame(&mut &buf[..], Vec::new()).unwrap(), b"hello");
        assert_eq!(read_frame(&mut &buf[3..], buf[..3].to_vec()).unwrap(), b"hello");
        let huge = (MAX_FRAME as u32 + 1).to_le_bytes();
        assert!(read_frame(&mut &huge[..], Vec::new()).is_err());
        assert!(read_frame(&mut &buf[..6], Vec::new()).is_err(), "truncated");
    }

    #[test]
    fn empty_and_garbage_are_rejected() {
        assert!(decode::<Request>(&[]).is_err());
        assert!(decode::<Request>(&[0xff; 64]).is_err());
    }

    fn arb_key() -> impl Strategy<Value = ChunkKey> {
        (any::<u64>(), any::<[u8; 32]>()).prop_map(|(n, d)| ChunkKey::new(n, d))
    }

    fn arb_request() -> impl Strategy<Value = Request> {
        prop_oneof![
            Just(Request::Ping),
            (prop::collection::vec(arb_key(), 0..20), any::<bool>())
                .prop_map(|(keys, lease)| Request::Lookup { keys, lease }),
            (prop::collection::vec(arb_key(), 0..20), prop::collection::vec(any::<u64>(), 0..20))
                .prop_map(|(keys, lens)| Request::Reserve { keys, lens }),
            prop::collection::vec(arb_key(), 0..20).prop_map(|keys| Request::Evict { keys }),
            (
                prop::collection::vec((arb_key(), any::<u64>()), 0..20),
                prop::collection::vec(any::<u64>(), 0..20)
            )
                .prop_map(|(slots, checksums)| Request::CommitChecked {
                    slots: slots
                        .into_iter()
                        .map(|(key, generation)| crate::SlotRef { key, generation })
                        .collect(),
                    checksums,
                }),
        ]
    }

    proptest! {
        #[test]
        fn any_request_round_trips(req in arb_request()) {
            prop_assert_eq!(decode::<Request>(&encode(&req)).unwrap(), req);
        }

        /// Mutated, truncated or random bytes decode to an error or to some valid message:
        /// never a panic, never undefined behaviour.
        #[test]
        fn corrupted_requests_never_panic(
            req in arb_request(),
            flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8),
            cut in any::<prop::sample::Index>(),
        ) {
            let mut bytes = encode(&req).to_vec();
            for (i, v) in flips {
                let i = i.index(bytes.len());
                bytes[i] ^= v;
            }
            let cut = cut.index(bytes.len() + 1);
            let _ = decode::<Request>(&bytes[..cut]);
        }

        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode::<Request>(&bytes);
            let _ = decode::<Response>(&bytes);
        }
    }
}
