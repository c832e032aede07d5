//! An engine's KV memory as the copy engines see it: one device address per tensor of its
//! layout, either imported from the engine process by CUDA IPC handles, or allocated here
//! (benchmarks and tests acting as the engine).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::CudaContext;

use super::ffi::{self, DeviceBuffer, IpcMapping};
use super::plan::{chunk_pieces, BlockJob, Piece};
use super::DmaError;
use crate::layout::LayoutGeometry;
use orbitkv_proto::KvLayoutSpec;

/// One engine tensor exported with CUDA IPC: the allocation's handle, where the tensor
/// starts in that allocation, and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorExport {
    /// `cuIpcGetMemHandle` of the allocation holding the tensor.
    pub handle: [u8; 64],
    /// Byte offset of the tensor in that allocation.
    pub offset: u64,
    /// Bytes of the tensor.
    pub len: u64,
}

enum Backing {
    /// Opened IPC mappings (one per distinct allocation), closed when the last user is gone.
    Imported(#[allow(dead_code)] Vec<Arc<IpcMapping>>),
    /// Allocated here, one buffer per tensor.
    Owned(Vec<DeviceBuffer>),
}

/// The tensors of one engine rank on one device.
pub struct EngineMemory {
    /// The device's ordinal (copies of this memory go through engines of that device only).
    ordinal: usize,
    layout: KvLayoutSpec,
    tensors: Vec<u64>,
    /// Device address of part `p` of block 0, per part (`KvLayoutSpec::part_bases`).
    bases: Vec<u64>,
    /// Bytes from a block's part to the next block's.
    stride: u64,
    /// `bases` on the device, for the block copy and checksum table kernels.
    parts: DeviceBuffer,
    backing: Backing,
}

impl std::fmt::Debug for EngineMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineMemory")
            .field("layout", &self.layout)
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

/// Allocations opened in this process, per device: a handle can be opened only once per
/// process, so a second registration of the same allocation (an engine registering again
/// before its old session is gone, two ranks sharing a pool) shares the first mapping; it
/// closes when the last registration using it is gone.
type OpenMappings = HashMap<(usize, [u8; 64]), Weak<IpcMapping>>;
static OPEN_MAPPINGS: Mutex<Option<OpenMappings>> = Mutex::new(None);

fn shared_mapping(ctx: &Arc<CudaContext>, handle: &[u8; 64]) -> Result<Arc<IpcMapping>, DmaError> {
    let mut guard = OPEN_MAPPINGS.lock().unwrap_or_else(|p| p.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    let key = (ctx.ordinal(), *handle);
    if let Some(m) = map.get(&key).and_then(Weak::upgrade) {
        return Ok(m);
    }
    map.retain(|_, w| w.strong_count() > 0);
    let m = Arc::new(IpcMapping::open(ctx, handle)?);
    map.insert(key, Arc::downgrade(&m));
    Ok(m)
}

fn invalid(msg: String) -> DmaError {
    DmaError::Invalid(msg)
}

/// The checks of [`EngineMemory::import`] that need no device: the layout, one export per
/// tensor, each at least a tensor long. Returns the bytes of a tensor.
fn check_exports(layout: &KvLayoutSpec, exports: &[TensorExport]) -> Result<u64, DmaError> {
    layout.validate().map_err(|e| invalid(e.to_string()))?;
    let want = layout.tensor_count() as usize;
    if exports.len() != want {
        return Err(invalid(format!(
            "tensors: the {:?} layout with {} layers has {want} tensors, {} were given",
            layout.kind,
            layout.num_layers,
            exports.len()
        )));
    }
    let need = layout.tensor_bytes().expect("validated: the size fits u64");
    if let Some((i, e)) = exports.iter().enumerate().find(|(_, e)| e.len < need) {
        return Err(invalid(format!("tensors[{i}].len: {} bytes, the layout needs {need}", e.len)));
    }
    Ok(need)
}

/// Tensor `i` at `offset`, `need` bytes long, inside its `alloc`-byte allocation.
fn check_offset(i: usize, offset: u64, need: u64, alloc: u64) -> Result<(), DmaError> {
    if offset.checked_add(need).is_none_or(|end| end > alloc) {
        return Err(invalid(format!(
            "tensors[{i}].offset: {offset} + {need} bytes exceeds the {alloc}-byte allocation"
        )));
    }
    Ok(())
}

impl EngineMemory {
    /// Opens an engine's tensors from their IPC exports after checking them against `layout`:
    /// one export per tensor, each at least the layout's tensor size and inside its
    /// allocation. Errors name the field.
    pub fn import(
        ctx: &Arc<CudaContext>,
        layout: KvLayoutSpec,
        exports: &[TensorExport],
    ) -> Result<Self, DmaError> {
        let need = check_exports(&layout, exports)?;
        let mut open: HashMap<[u8; 64], Arc<IpcMapping>> = HashMap::new();
        let mut tensors = Vec::with_capacity(exports.len());
        for (i, e) in exports.iter().enumerate() {
            let mapping = match open.get(&e.handle) {
                Some(m) => Arc::clone(m),
                None => {
                    let m = shared_mapping(ctx, &e.handle).map_err(|err| {
                        invalid(format!(
                            "tensors[{i}].handle: cannot be opened on this device ({err})"
                        ))
                    })?;
                    open.insert(e.handle, Arc::clone(&m));
                    m
                }
            };
            check_offset(i, e.offset, need, mapping.allocation_len()?)?;
            tensors.push(mapping.base() + e.offset);
        }
        Self::with_parts(ctx, layout, tensors, Backing::Imported(open.into_values().collect()))
    }

    /// Allocates the layout's tensors on `ctx`'s device (a stand-in engine).
    pub fn allocate(ctx: &Arc<CudaContext>, layout: KvLayoutSpec) -> Result<Self, DmaError> {
        layout.validate().map_err(|e| invalid(e.to_string()))?;
        let bytes = layout.tensor_bytes().expect("validated") as usize;
        let bufs = (0..layout.tensor_count())
            .map(|_| DeviceBuffer::new(ctx, bytes))
            .collect::<Result<Vec<_>, _>>()?;
        let tensors = bufs.iter().map(DeviceBuffer::ptr).collect();
        Self::with_parts(ctx, layout, tensors, Backing::Owned(bufs))
    }

    /// The memory with its part table uploaded (once, at registration: the layout and the
    /// tensors' addresses never change for it).
    fn with_parts(
        ctx: &Arc<CudaContext>,
        layout: KvLayoutSpec,
        tensors: Vec<u64>,
        backing: Backing,
    ) -> Result<Self, DmaError> {
        let (bases, stride) = layout.part_bases(&tensors);
        let image: Vec<u8> = bases.iter().flat_map(|b| b.to_le_bytes()).collect();
        let parts = DeviceBuffer::new(ctx, image.len())?;
        ffi::copy_sync_to_device(&parts, 0, &image)?;
        Ok(Self { ordinal: ctx.ordinal(), layout, tensors, bases, stride, parts, backing })
    }

    /// `chunks` (host offsets from `host_base`, block ids) in block form, with this
    /// memory's part table; block ids are checked.
    pub fn block_job<'a>(
        &'a self,
        host_base: u64,
        chunks: &'a [(u64, Vec<u64>)],
    ) -> Result<BlockJob<'a>, DmaError> {
        let num_blocks = self.layout.num_blocks;
        if let Some(b) = chunks.iter().flat_map(|(_, ids)| ids).find(|&&b| b >= num_blocks) {
            return Err(invalid(format!(
                "block_ids: {b} is out of range (the engine has {num_blocks} blocks)"
            )));
        }
        Ok(BlockJob {
            parts: self.parts.ptr(),
            bases: &self.bases,
            part_len: self.layout.part_len(),
            stride: self.stride,
            host_base,
            chunks,
        })
    }

    /// The ordinal of the device the tensors are on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayoutSpec {
        &self.layout
    }

    /// Device address of each tensor.
    pub fn tensor_addrs(&self) -> &[u64] {
        &self.tensors
    }

    /// Appends the pieces that move `blocks` (one chunk, packed block after block) to or from
    /// host memory at `host`; returns the chunk length. Block ids are checked.
    pub fn chunk_pieces(
        &self,
        blocks: &[u64],
        host: u64,
        out: &mut Vec<Piece>,
    ) -> Result<u64, DmaError> {
        if let Some(b) = blocks.iter().find(|&&b| b >= self.layout.num_blocks) {
            return Err(invalid(format!(
                "block_ids: {b} is out of range (the engine has {} blocks)",
                self.layout.num_blocks
            )));
        }
        Ok(chunk_pieces(&self.layout, &self.tensors, blocks, host, out))
    }

    /// IPC exports of an allocated engine's tensors (one allocation each, offset 0), as an
    /// engine process would send them to the server.
    pub fn exports(&self) -> Result<Vec<TensorExport>, DmaError> {
        match &self.backing {
            Backing::Owned(b) => b
                .iter()
                .map(|buf| {
                    Ok(TensorExport { handle: buf.ipc_handle()?, offset: 0, len: buf.len() as u64 })
                })
                .collect(),
            Backing::Imported(_) => {
                Err(invalid("imported tensors are exported by their engine".into()))
            }
        }
    }

    /// Overwrites tensor `i` of an allocated engine with `data` from offset 0.
    pub fn write_tensor(&self, i: usize, data: &[u8]) -> Result<(), DmaError> {
        match &self.backing {
            Backing::Owned(b) => ffi::copy_sync_to_device(&b[i], 0, data),
            Backing::Imported(_) => Err(invalid("imported tensors belong to the engine".into())),
        }
    }

    /// Reads tensor `i` of an allocated engine from offset 0 into `out`.
    pub fn read_tensor(&self, i: usize, out: &mut [u8]) -> Result<(), DmaError> {
        match &self.backing {
            Backing::Owned(b) => ffi::copy_sync_from_device(&b[i], 0, out),
            Backing::Imported(_) => Err(invalid("imported tensors belong to the engine".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{check_exports, check_offset, TensorExport};
    use crate::layout::LayoutGeometry;
    use orbitkv_proto::{KvLayoutKind, KvLayoutSpec};

    fn flash(layers: u32) -> KvLayoutSpec {
        KvLayoutSpec {
            kind: KvLayoutKind::FlashAttnNhd,
            num_layers: layers,
            num_blocks: 16,
            block_size: 16,
            kv_heads: 8,
            head_dim: 128,
            elem_bytes: 2,
        }
    }

    fn exports(n: usize, len: u64) -> Vec<TensorExport> {
        (0..n).map(|_| TensorExport { handle: [7; 64], offset: 0, len }).collect()
    }

    #[test]
    fn exports_are_checked_against_the_layout_naming_the_field() {
        let l = flash(2);
        let need = l.tensor_bytes().unwrap();
        let n = l.tensor_count() as usize;
        assert_eq!(check_exports(&l, &exports(n, need)).unwrap(), need);
        // Longer tensors than the layout needs are fine (an engine may pad).
        assert_eq!(check_exports(&l, &exports(n, need + 4096)).unwrap(), need);
        let e = check_exports(&l, &exports(n - 1, need)).unwrap_err().to_string();
        assert!(e.contains("tensors:") && e.contains(&format!("{} were given", n - 1)), "{e}");
        let e = check_exports(&l, &exports(n + 1, need)).unwrap_err().to_string();
        assert!(e.contains("tensors:"), "{e}");
        let mut short = exports(n, need);
        short[1].len = need - 1;
        let e = check_exports(&l, &short).unwrap_err().to_string();
        assert!(e.contains("tensors[1].len") && e.contains(&need.to_string()), "{e}");
        // A layout wrong in itself is refused before its tensors are looked at.
        let e = check_exports(&flash(0), &exports(n, need)).unwrap_err().to_string();
        assert!(e.contains("num_layers"), "{e}");
    }

    #[test]
    fn a_tensor_must_lie_inside_its_allocation() {
        assert!(check_offset(0, 0, 1 << 20, 1 << 20).is_ok());
        assert!(check_offset(0, 4096, 1 << 20, (1 << 20) + 4096).is_ok());
        let e = check_offset(3, 4096, 1 << 20, 1 << 20).unwrap_err().to_string();
        assert!(e.contains("tensors[3].offset") && e.contains("4096"), "{e}");
        // No overflow: an offset near the top of u64 is refused, not wrapped.
        let e = check_offset(0, u64::MAX - 10, 1 << 20, u64::MAX).unwrap_err().to_string();
        assert!(e.contains("tensors[0].offset"), "{e}");
    }
}
