//! The raw CUDA driver calls of the crate, each wrapped so that memory handed to the GPU is
//! owned by a type whose drop cannot free it early, or stated as the contract of an `unsafe fn`
//! that the copy engine, the checksum kernels and the arena registration uphold (their
//! `SAFETY` comments say how).

#![allow(unsafe_code)]

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream};

use crate::dma::DmaError;

/// Whether libcuda (the NVIDIA driver library) can be loaded; nothing else is called.
pub(crate) fn driver_library_present() -> bool {
    // SAFETY: only tries to load the shared library; no CUDA call is made before it says yes.
    unsafe { sys::is_culib_present() }
}

/// Milliseconds between two events of one context, both completed (an error otherwise, as
/// the driver reports it).
/// The PCI address of device `dev` as sysfs names it (`0000:3b:00.0`), from its PCI domain,
/// bus and device attributes.
pub(crate) fn pci_address(dev: sys::CUdevice) -> Result<String, cudarc::driver::DriverError> {
    use sys::CUdevice_attribute as A;
    let attribute = |a: A| {
        // SAFETY: `dev` is a device handle the driver gave (`cuDeviceGet`); the attribute is
        // an integer the call writes.
        unsafe { result::device::get_attribute(dev, a) }
    };
    let domain = attribute(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?;
    let bus = attribute(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?;
    let device = attribute(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?;
    Ok(format!("{domain:04x}:{bus:02x}:{device:02x}.0"))
}

pub(crate) fn elapsed_ms(
    start: &cudarc::driver::CudaEvent,
    end: &cudarc::driver::CudaEvent,
) -> Result<f32, DmaError> {
    // SAFETY: both handles are live while the borrowed events are; the driver checks that
    // they were recorded and have completed, and reports it otherwise.
    unsafe { result::event::elapsed(start.cu_event(), end.cu_event()) }
        .map_err(|e| driver("cuEventElapsedTime", e))
}

/// Registers `len` bytes of host memory at `base` with the current context (portable: usable
/// from every context).
///
/// # Safety
/// `base..base + len` must be a live mapping of this process that stays mapped until
/// [`host_unregister`] of `base` has returned.
pub(crate) unsafe fn host_register(base: usize, len: usize) -> Result<(), DmaError> {
    let flags = sys::CU_MEMHOSTREGISTER_PORTABLE;
    // SAFETY: a live mapping of `len` bytes at `base` (the caller's contract).
    check("cuMemHostRegister", unsafe {
        sys::cuMemHostRegister_v2(base as *mut c_void, len, flags)
    })
}

/// Unregisters the range registered at `base` ([`host_register`]) from the current context.
///
/// # Safety
/// `base` must have been registered by [`host_register`] and be mapped still.
pub(crate) unsafe fn host_unregister(base: usize) -> Result<(), DmaError> {
    // SAFETY: a range registered earlier and still mapped (the caller's contract).
    check("cuMemHostUnregister", unsafe { sys::cuMemHostUnregister(base as *mut c_void) })
}

fn check(what: &'static str, status: sys::CUresult) -> Result<(), DmaError> {
    if status == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DmaError::Cuda { op: what, detail: format!("{status:?}") })
    }
}

fn driver(what: &'static str, e: result::DriverError) -> DmaError {
    DmaError::Cuda { op: what, detail: e.to_string() }
}

/// Device memory from `cuMemAlloc`, freed on drop (after the context has finished with it:
/// owners drop buffers only after synchronizing the streams that use them).
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceBuffer {
    /// Allocates `len` bytes on `ctx`'s device.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, DmaError> {
        ctx.bind_to_thread().map_err(|e| driver("cuCtxSetCurrent", e))?;
        // SAFETY: allocates `len` bytes in the bound context; the pointer is owned by the
        // returned value and freed once, in drop.
        let ptr =
            unsafe { result::malloc_sync(len.max(1)) }.map_err(|e| driver("cuMemAlloc", e))?;
        Ok(Self { ptr, len, ctx: Arc::clone(ctx) })
    }

    /// Allocates `len` bytes on `ctx`'s device and zeroes them on `stream`: the zeros are in
    /// place for whatever `stream` runs next (not for other streams: ours do not wait for the
    /// legacy default stream, where a plain memset would run).
    pub fn zeroed_on(
        ctx: &Arc<CudaContext>,
        len: usize,
        stream: &CudaStream,
    ) -> Result<Self, DmaError> {
        let buf = Self::new(ctx, len)?;
        // SAFETY: sets the bytes of the allocation just made (at least `len` of them), which
        // nothing else uses before `stream` passes the memset.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(buf.ptr, 0, len.max(1), stream.cu_stream())
        })?;
        Ok(buf)
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The ordinal of its device.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// True for a zero-byte request (one byte is allocated anyway).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The CUDA IPC handle of this allocation, for another process to open (an engine
    /// sharing its KV tensors with the server).
    pub fn ipc_handle(&self) -> Result<[u8; 64], DmaError> {
        self.ctx.bind_to_thread().map_err(|e| driver("cuCtxSetCurrent", e))?;
        let mut raw = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: queries the handle of a live allocation owned by self.
        check("cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&raw mut raw, self.ptr) })?;
        let mut out = [0u8; 64];
        for (d, s) in out.iter_mut().zip(raw.reserved) {
            *d = s as u8;
        }
        Ok(out)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemAlloc in `new`, freed exactly once here; owners synchronize
        // every stream that used it before dropping it.
        if let Err(e) = unsafe { result::free_sync(self.ptr) } {
            tracing::warn!(error = %e, "cuMemFree failed");
        }
    }
}

// SAFETY: a device address is usable from any thread that binds the context.
unsafe impl Send for DeviceBuffer {}
// SAFETY: `&self` methods read the address and length or make driver calls that are
// thread-safe (the context is bound on the calling thread first); nothing is mutated.
unsafe impl Sync for DeviceBuffer {}

/// Page-locked host memory from `cuMemHostAlloc` (descriptor tables), freed on drop.
pub(crate) struct PinnedHost {
    ptr: *mut u8,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl PinnedHost {
    pub(crate) fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, DmaError> {
        ctx.bind_to_thread().map_err(|e| driver("cuCtxSetCurrent", e))?;
        // Mapped too: kernels may write results straight into it (under unified addressing,
        // at the host address).
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: allocates `len` bytes of pinned host memory, owned by the returned value.
        let ptr = unsafe { result::malloc_host(len.max(1), flags) }
            .map_err(|e| driver("cuMemHostAlloc", e))?;
        Ok(Self { ptr: ptr.cast(), len, ctx: Arc::clone(ctx) })
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr as u64
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The bytes, for writing (the caller has waited for the GPU to finish reading them).
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the allocation is `len` bytes, owned by self; exclusive through &mut self;
        // the GPU no longer reads it (callers wait on the event that follows its last use).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once.
        if let Err(e) = unsafe { result::free_host(self.ptr.cast()) } {
            tracing::warn!(error = %e, "cuMemFreeHost failed");
        }
    }
}

// SAFETY: plain pinned memory owned by this value.
unsafe impl Send for PinnedHost {}

/// A PTX module of ours loaded into a context; unloaded on drop.
struct PtxModule {
    module: sys::CUmodule,
    ctx: Arc<CudaContext>,
}

/// The PTX to load: `embedded`, or in builds with the `kernel-dev` feature the file named by
/// the environment variable `override_var` (a rebuilt `.cu` tried without rebuilding the
/// binary). Release builds never read kernels from outside the binary.
#[cfg(feature = "kernel-dev")]
fn ptx_text(embedded: &str, override_var: &str, what: &str) -> Result<String, DmaError> {
    match std::env::var_os(override_var) {
        Some(path) => {
            tracing::warn!(path = ?path, "{what} loaded from {override_var} instead of the embedded PTX");
            std::fs::read_to_string(&path)
                .map_err(|e| DmaError::Invalid(format!("{override_var} {path:?}: {e}")))
        }
        None => Ok(embedded.to_owned()),
    }
}

/// The PTX to load: `embedded` (builds without the `kernel-dev` feature take no override).
#[cfg(not(feature = "kernel-dev"))]
fn ptx_text(embedded: &str, _override_var: &str, _what: &str) -> Result<String, DmaError> {
    Ok(embedded.to_owned())
}

impl PtxModule {
    /// Loads `embedded`, or in builds with the `kernel-dev` feature the PTX file named by the
    /// environment variable `override_var` (see [`ptx_text`]). `what` names the kernels in
    /// errors.
    fn load(
        ctx: &Arc<CudaContext>,
        embedded: &str,
        override_var: &str,
        what: &'static str,
    ) -> Result<Self, DmaError> {
        ctx.bind_to_thread().map_err(|e| driver("cuCtxSetCurrent", e))?;
        let text = ptx_text(embedded, override_var, what)?;
        let image = CString::new(text)
            .map_err(|_| DmaError::Invalid(format!("the {what} PTX contains a NUL byte")))?;
        // SAFETY: `image` is a NUL-terminated PTX text that lives through the call.
        let module = unsafe { result::module::load_data(image.as_ptr().cast()) }.map_err(|e| {
            DmaError::Cuda { op: "cuModuleLoadData", detail: format!("{what}: {e}") }
        })?;
        Ok(Self { module, ctx: Arc::clone(ctx) })
    }

    /// A kernel of the module.
    fn function(&self, name: &str) -> Result<sys::CUfunction, DmaError> {
        let c = CString::new(name).expect("kernel names have no NUL");
        // SAFETY: the module is loaded until drop; the function handle lives as long.
        unsafe { result::module::get_function(self.module, c) }.map_err(|e| DmaError::Cuda {
            op: "cuModuleGetFunction",
            detail: format!("{name}: {e}"),
        })
    }
}

impl Drop for PtxModule {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: loaded in `load`, unloaded once; no launch is pending (owners synchronize
        // their streams before dropping their kernels).
        unsafe {
            let _ = result::module::unload(self.module);
        }
    }
}

/// Launches `func` with `params` (pointers to each argument, in the kernel's order).
///
/// # Safety
/// `params` must match the kernel's signature, and the memory the arguments name must be valid
/// for the kernel as the caller's contract says.
unsafe fn launch(
    func: sys::CUfunction,
    stream: &CudaStream,
    grid: u32,
    threads: u32,
    params: &mut [*mut c_void],
    what: &'static str,
) -> Result<(), DmaError> {
    // SAFETY: per this function's contract.
    unsafe {
        result::launch_kernel(
            func,
            (grid.max(1), 1, 1),
            (threads, 1, 1),
            0,
            stream.cu_stream(),
            params,
        )
    }
    .map_err(|e| DmaError::Cuda { op: "cuLaunchKernel", detail: format!("{what}: {e}") })
}

/// The segment copy kernel, loaded from its embedded PTX.
pub(crate) struct CopyKernel {
    func: sys::CUfunction,
    _module: PtxModule,
}

/// The PTX of `gpu/kernels/copy_segments.cu` (built by `gpu/kernels/build-ptx-nvrtc.py`).
const COPY_SEGMENTS_PTX: &str = include_str!("../../kernels/copy_segments.ptx");

/// Most descriptors one warp of the segment copy kernel reads together and copies in turn
/// (`MAX_GROUP` in `copy_segments.cu`).
pub(crate) const MAX_COPY_GROUP: u32 = 8;

impl CopyKernel {
    /// Descriptors per warp for `count` descriptors moving `bytes` in all: eight while they
    /// average 2 KiB or less (their table is read in fewer requests), fewer as they grow, one
    /// from 16 KiB (a warp keeps 2 KiB of loads in flight: few long descriptors need a warp
    /// each).
    pub(crate) fn group(bytes: u64, count: usize) -> u32 {
        let mean = bytes / (count as u64).max(1);
        u32::try_from((16 << 10) / mean.max(1)).unwrap_or(u32::MAX).clamp(1, MAX_COPY_GROUP)
    }

    /// Blocks of `threads` threads that give each group of `group` descriptors of `count` its
    /// own warp, between 1 and `max` (the kernel strides over the rest).
    pub(crate) fn grid(count: u32, group: u32, threads: u32, max: u32) -> u32 {
        count.div_ceil((threads / 32).max(1) * group.clamp(1, MAX_COPY_GROUP)).clamp(1, max)
    }

    /// Loads the embedded kernel, or the PTX file named by `ORBITKV_COPY_KERNEL_PTX`.
    pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<Self, DmaError> {
        let module = PtxModule::load(
            ctx,
            COPY_SEGMENTS_PTX,
            "ORBITKV_COPY_KERNEL_PTX",
            "segment copy kernel",
        )?;
        Ok(Self { func: module.function("orbitkv_copy_segments")?, _module: module })
    }

    /// Launches the kernel on `stream` over `count` descriptors at device address `descs`,
    /// `group` per warp ([`CopyKernel::group`]).
    ///
    /// # Safety
    /// `descs` must hold `count` valid descriptors on this context's device when the kernel
    /// runs, and every range they name must be device memory that nothing else writes until
    /// the stream passes this launch.
    pub(crate) unsafe fn launch(
        &self,
        stream: &CudaStream,
        descs: u64,
        count: u32,
        group: u32,
        grid: u32,
        threads: u32,
    ) -> Result<(), DmaError> {
        let (mut descs, mut count, mut group) = (descs, count, group);
        let mut params: [*mut c_void; 3] = [
            (&raw mut descs).cast::<c_void>(),
            (&raw mut count).cast::<c_void>(),
            (&raw mut group).cast::<c_void>(),
        ];
        // SAFETY: parameters match `orbitkv_copy_segments(const CopyDesc*, unsigned int,
        // unsigned int)`; the caller guarantees the memory they name.
        unsafe { launch(self.func, stream, grid, threads, &mut params, "segment copy") }
    }
}

// SAFETY: module and function handles are usable from any thread bound to the context.
unsafe impl Send for CopyKernel {}

/// The block copy kernel (`gpu/kernels/copy_blocks.cu`): a batch given as block ids and the
/// layout's part bases.
pub(crate) struct BlockKernel {
    func: sys::CUfunction,
    _module: PtxModule,
}

/// The PTX of `gpu/kernels/copy_blocks.cu` (built by `gpu/kernels/build-ptx-nvrtc.py`).
const COPY_BLOCKS_PTX: &str = include_str!("../../kernels/copy_blocks.ptx");

/// Where one block-copy launch works: the batch and the layout's arithmetic.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockLaunch {
    /// Device address of the part bases.
    pub parts: u64,
    /// Address of the batch's block ids (device memory, or mapped pinned host memory).
    pub blocks: u64,
    pub stride: u64,
    pub part_len: u64,
    pub staging: u64,
    pub part_count: u32,
    /// Units per part (parts longer than `plan::BLOCK_UNIT` are several).
    pub subs: u32,
    /// Units of the batch: blocks x part_count x subs.
    pub count: u32,
    /// Units per warp (`CopyKernel::group` of the unit length).
    pub group: u32,
    /// Engine -> staging (save), else staging -> engine.
    pub gather: bool,
}

impl BlockKernel {
    /// Loads the embedded kernel, or the PTX file named by `ORBITKV_BLOCK_KERNEL_PTX`.
    pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<Self, DmaError> {
        let module =
            PtxModule::load(ctx, COPY_BLOCKS_PTX, "ORBITKV_BLOCK_KERNEL_PTX", "block copy kernel")?;
        Ok(Self { func: module.function("orbitkv_copy_blocks")?, _module: module })
    }

    /// Launches the kernel on `stream` over `l`'s units.
    ///
    /// # Safety
    /// `l.parts` must hold `l.part_count` bases and `l.blocks` the batch's block ids when the
    /// kernel runs, every part they name must be engine memory of this context's device and
    /// the staging range device memory, none of it written by anyone else until the stream
    /// passes this launch.
    pub(crate) unsafe fn launch(
        &self,
        stream: &CudaStream,
        l: BlockLaunch,
        grid: u32,
        threads: u32,
    ) -> Result<(), DmaError> {
        let (mut parts, mut blocks, mut stride, mut part_len, mut staging) =
            (l.parts, l.blocks, l.stride, l.part_len, l.staging);
        let (mut part_count, mut subs, mut count, mut group, mut gather) =
            (l.part_count, l.subs, l.count, l.group, u32::from(l.gather));
        let mut params: [*mut c_void; 10] = [
            (&raw mut parts).cast::<c_void>(),
            (&raw mut blocks).cast::<c_void>(),
            (&raw mut stride).cast::<c_void>(),
            (&raw mut part_len).cast::<c_void>(),
            (&raw mut staging).cast::<c_void>(),
            (&raw mut part_count).cast::<c_void>(),
            (&raw mut subs).cast::<c_void>(),
            (&raw mut count).cast::<c_void>(),
            (&raw mut group).cast::<c_void>(),
            (&raw mut gather).cast::<c_void>(),
        ];
        // SAFETY: parameters match `orbitkv_copy_blocks` (five u64, five u32, in this order);
        // the caller guarantees the memory they name.
        unsafe { launch(self.func, stream, grid, threads, &mut params, "block copy") }
    }
}

/// Launches the fused gather `g` on `stream` over `l`'s units (a save: `l.gather` is ignored),
/// the batch's first block being the job's block `first_block`.
///
/// # Safety
/// As [`BlockKernel::launch`], and `g.scratch` must hold the job's rows in device memory that
/// nothing else uses until the stream passes the launch.
pub(crate) unsafe fn launch_summed(
    stream: &CudaStream,
    l: BlockLaunch,
    g: &SummedGather,
    first_block: u32,
    (grid, threads): (u32, u32),
) -> Result<(), DmaError> {
    let (mut parts, mut blocks, mut stride, mut part_len, mut staging) =
        (l.parts, l.blocks, l.stride, l.part_len, l.staging);
    let (mut scratch, mut rows_per_chunk) = (g.scratch, g.rows_per_chunk);
    let (mut part_count, mut subs, mut count, mut group) = (l.part_count, l.subs, l.count, l.group);
    let (mut first_block, mut per_chunk) = (first_block, g.per_chunk);
    let mut params: [*mut c_void; 13] = [
        (&raw mut parts).cast::<c_void>(),
        (&raw mut blocks).cast::<c_void>(),
        (&raw mut stride).cast::<c_void>(),
        (&raw mut part_len).cast::<c_void>(),
        (&raw mut staging).cast::<c_void>(),
        (&raw mut scratch).cast::<c_void>(),
        (&raw mut rows_per_chunk).cast::<c_void>(),
        (&raw mut part_count).cast::<c_void>(),
        (&raw mut subs).cast::<c_void>(),
        (&raw mut count).cast::<c_void>(),
        (&raw mut group).cast::<c_void>(),
        (&raw mut first_block).cast::<c_void>(),
        (&raw mut per_chunk).cast::<c_void>(),
    ];
    // SAFETY: parameters match `orbitkv_copy_blocks_summed` (seven u64, six u32, in this
    // order); the caller guarantees the memory they name.
    unsafe { launch(g.func, stream, grid, threads, &mut params, "summed block gather") }
}

// SAFETY: module and function handles are usable from any thread bound to the context.
unsafe impl Send for BlockKernel {}

/// The uniform scatter kernel (`gpu/kernels/scatter_uniform.cu`): a load batch whose segments
/// share one length, from a table of destination addresses only.
pub(crate) struct ScatterUniformKernel {
    func: sys::CUfunction,
    _module: PtxModule,
}

/// The PTX of `gpu/kernels/scatter_uniform.cu` (built by `gpu/kernels/build-ptx-nvrtc.py`).
const SCATTER_UNIFORM_PTX: &str = include_str!("../../kernels/scatter_uniform.ptx");

impl ScatterUniformKernel {
    /// Loads the embedded kernel, or the PTX file named by `ORBITKV_SCATTER_KERNEL_PTX`.
    pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<Self, DmaError> {
        let module = PtxModule::load(
            ctx,
            SCATTER_UNIFORM_PTX,
            "ORBITKV_SCATTER_KERNEL_PTX",
            "uniform scatter kernel",
        )?;
        Ok(Self { func: module.function("orbitkv_scatter_uniform")?, _module: module })
    }

    /// Launches the kernel on `stream`: segment `d < count` is the `len` bytes at device
    /// address `src + d * len`, copied to the device address in `dsts[d]` (a table of
    /// little-endian u64 at device address `dsts`).
    ///
    /// # Safety
    /// `dsts` must hold `count` addresses on this context's device when the kernel runs, and
    /// every range named must be device memory that nothing else writes until the stream
    /// passes this launch.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn launch(
        &self,
        stream: &CudaStream,
        dsts: u64,
        count: u32,
        src: u64,
        len: u64,
        grid: u32,
        threads: u32,
    ) -> Result<(), DmaError> {
        let (mut dsts, mut count, mut src, mut len) = (dsts, count, src, len);
        let mut params: [*mut c_void; 4] = [
            (&raw mut dsts).cast::<c_void>(),
            (&raw mut count).cast::<c_void>(),
            (&raw mut src).cast::<c_void>(),
            (&raw mut len).cast::<c_void>(),
        ];
        // SAFETY: parameters match `orbitkv_scatter_uniform(const unsigned long long*,
        // unsigned int, unsigned long long, unsigned long long)`; the caller guarantees the
        // memory they name.
        unsafe { launch(self.func, stream, grid, threads, &mut params, "uniform scatter") }
    }
}

// SAFETY: module and function handles are usable from any thread bound to the context.
unsafe impl Send for ScatterUniformKernel {}

/// Rows (1 KiB blocks of chunks) each run of the row kernel sums: its eight threads look up
/// eight rows' addresses at a time, then sum them. On the H200 (ncu, 64 MiB of 2 KiB pages):
/// runs of 4 rows 42 us, of 8 40-41.5 us, of 16 50 us; 8 holds the fewest blocks for its time.
const ROWS_PER_RUN: u64 = 8;

/// Most blocks (of 256 threads) the block row sums run in: as many as the table-driven row
/// kernel held, each warp with four 16-byte loads in flight per thread rather than table
/// lookups before its loads (beside an engine's kernels, the blocks held are what it loses).
const BLOCK_ROWS_GRID: u32 = 256;

/// The chunk checksum kernels (`gpu/kernels/chunk_checksum.cu`).
pub(crate) struct ChecksumKernels {
    rows: sys::CUfunction,
    fold: sys::CUfunction,
    expand: sys::CUfunction,
    /// The fused form's gather and fold (`--gpu-checksums fused`); None when the PTX lacks
    /// them (one loaded from `ORBITKV_CHECKSUM_KERNEL_PTX` before they existed).
    fused: Option<(sys::CUfunction, sys::CUfunction)>,
    /// The block row sums (`orbitkv_xxh3_block_rows`), None when the PTX lacks them.
    block_rows: Option<sys::CUfunction>,
    _module: PtxModule,
}

/// A block-form save's row sums read from the engine's pages by
/// [`ChecksumKernels::launch_block_rows`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockRowsLaunch {
    /// The layout's part bases (device memory) and how many.
    pub parts: (u64, u32),
    /// The job's block ids, in chunk order (mapped pinned host memory, read in place).
    pub blocks: u64,
    pub stride: u64,
    pub part_len: u64,
    /// Scratch rows (64 bytes each, device memory), and rows per chunk (chunk length / 1 KiB).
    pub scratch: (u64, u64),
    /// Blocks of the job, and per chunk.
    pub nblocks: u32,
    pub per_chunk: u32,
}

/// The fused form's part of a block-form save's gather ([`ChecksumKernels::summed_gather`]):
/// the kernel, and where the job's row sums go.
#[derive(Clone, Copy, Debug)]
pub struct SummedGather {
    func: sys::CUfunction,
    /// Scratch rows of the job (64 bytes each, device memory).
    pub(crate) scratch: u64,
    /// Rows per chunk (the chunk length / 1 KiB).
    pub(crate) rows_per_chunk: u64,
    /// Blocks per chunk.
    pub(crate) per_chunk: u32,
}

/// A save in block form, for the kernel that writes its checksum tables on the device
/// ([`ChecksumKernels::launch_expand`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ExpandLaunch {
    /// The chunks' block ids, `per_chunk` per chunk (mapped pinned host memory, read in
    /// place, or device memory).
    pub ids: u64,
    /// The layout's part bases (device memory) and how many.
    pub bases: (u64, u32),
    pub stride: u64,
    pub part_len: u64,
    pub per_chunk: u32,
    pub nchunks: u32,
    /// Where the chunk records go (`nchunks`).
    pub chunks: u64,
    /// Where the segment records go (`per_chunk * parts * nchunks` of them).
    pub segs: u64,
    /// Where the row records go (one per 1 KiB row of every chunk).
    pub row_segs: u64,
}

/// The PTX of `gpu/kernels/chunk_checksum.cu` (built by `gpu/kernels/build-ptx-nvrtc.py`).
const CHUNK_CHECKSUM_PTX: &str = include_str!("../../kernels/chunk_checksum.ptx");

/// Where one checksum submission's tables and buffers lie on the device (see
/// [`ChecksumKernels::launch`]).
pub(crate) struct ChecksumLaunch {
    /// The chunk records and how many.
    pub chunks: (u64, u32),
    /// The segment records.
    pub segs: u64,
    /// The row records (one u32 per row).
    pub row_segs: u64,
    /// Scratch rows (64 bytes each) and how many.
    pub scratch: (u64, u64),
    /// `checksum::COUNTERS_PER_CHUNK` u32 counters per chunk, all zero.
    pub counters: u64,
    /// One u64 per chunk for the checksums.
    pub out: u64,
}

impl ChecksumKernels {
    /// Loads the embedded kernels, or the PTX file named by `ORBITKV_CHECKSUM_KERNEL_PTX`.
    pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<Self, DmaError> {
        let module = PtxModule::load(
            ctx,
            CHUNK_CHECKSUM_PTX,
            "ORBITKV_CHECKSUM_KERNEL_PTX",
            "chunk checksum kernels",
        )?;
        Ok(Self {
            rows: module.function("orbitkv_xxh3_row_runs")?,
            fold: module.function("orbitkv_xxh3_fold_merge")?,
            expand: module.function("orbitkv_xxh3_expand_blocks")?,
            fused: module
                .function("orbitkv_copy_blocks_summed")
                .and_then(|g| Ok((g, module.function("orbitkv_xxh3_fold_uniform")?)))
                .ok(),
            block_rows: module.function("orbitkv_xxh3_block_rows").ok(),
            _module: module,
        })
    }

    /// The fused gather for a job whose row sums go to `scratch` (None without the kernels).
    pub(crate) fn summed_gather(
        &self,
        scratch: u64,
        rows_per_chunk: u64,
        per_chunk: u32,
    ) -> Option<SummedGather> {
        let (func, _) = self.fused?;
        Some(SummedGather { func, scratch, rows_per_chunk, per_chunk })
    }

    /// Whether the block row sums and the uniform fold are in the PTX.
    pub(crate) fn has_block_rows(&self) -> bool {
        self.block_rows.is_some() && self.fused.is_some()
    }

    /// Launches the block row sums on `stream` (a warp per group of up to eight units of at most
    /// 64 KiB, as the block gather; `BLOCK_ROWS_GRID` blocks at most, the warps striding over
    /// the rest).
    ///
    /// # Safety
    /// Every part of every block named must be device memory of this context that stays
    /// unchanged until the stream passes the launch, the ids readable there, and the scratch
    /// rows device memory nothing else uses meanwhile.
    pub(crate) unsafe fn launch_block_rows(
        &self,
        stream: &CudaStream,
        l: &BlockRowsLaunch,
    ) -> Result<(), DmaError> {
        const THREADS: u32 = 256;
        let func = self.block_rows.ok_or_else(|| {
            DmaError::Invalid("the block row-sum kernel is not in this PTX".into())
        })?;
        let subs = l.part_len.div_ceil(super::plan::BLOCK_UNIT).max(1);
        let units = u64::from(l.nblocks) * u64::from(l.parts.1) * subs;
        let count = u32::try_from(units)
            .map_err(|_| DmaError::Invalid(format!("{units} units in one checksum submission")))?;
        let bytes = u64::from(l.nblocks) * u64::from(l.parts.1) * l.part_len;
        let group = CopyKernel::group(bytes, units as usize);
        let grid = CopyKernel::grid(count, group, THREADS, BLOCK_ROWS_GRID);
        let (mut parts, mut blocks, mut stride, mut part_len) =
            (l.parts.0, l.blocks, l.stride, l.part_len);
        let (mut scratch, mut rows_per_chunk) = l.scratch;
        let (mut part_count, mut subs, mut count, mut group, mut per_chunk) =
            (l.parts.1, subs as u32, count, group, l.per_chunk);
        let mut params: [*mut c_void; 11] = [
            (&raw mut parts).cast(),
            (&raw mut blocks).cast(),
            (&raw mut stride).cast(),
            (&raw mut part_len).cast(),
            (&raw mut scratch).cast(),
            (&raw mut rows_per_chunk).cast(),
            (&raw mut part_count).cast(),
            (&raw mut subs).cast(),
            (&raw mut count).cast(),
            (&raw mut group).cast(),
            (&raw mut per_chunk).cast(),
        ];
        // SAFETY: matches `orbitkv_xxh3_block_rows` (six u64, five u32, in this order); memory
        // per this function's contract.
        unsafe { launch(func, stream, grid, THREADS, &mut params, "checksum block rows") }
    }

    /// Launches the uniform fold on `stream`: `nchunks` chunks of `len` bytes whose row sums
    /// are in `scratch`, one checksum each into `out`; `counters` zero, and zero again after.
    ///
    /// # Safety
    /// As [`ChecksumKernels::launch`] for the scratch rows (all written before the stream
    /// reaches this launch), the counters and `out`.
    pub(crate) unsafe fn launch_fold_uniform(
        &self,
        stream: &CudaStream,
        (len, nchunks): (u64, u32),
        scratch: u64,
        counters: u64,
        out: u64,
    ) -> Result<(), DmaError> {
        const THREADS: u32 = 256;
        let (_, fold) = self.fused.ok_or_else(|| {
            DmaError::Invalid("the fused checksum kernels are not in this PTX".into())
        })?;
        let (mut len, mut n, mut sc, mut co, mut o) = (len, nchunks, scratch, counters, out);
        let mut params: [*mut c_void; 5] = [
            (&raw mut len).cast(),
            (&raw mut n).cast(),
            (&raw mut sc).cast(),
            (&raw mut co).cast(),
            (&raw mut o).cast(),
        ];
        let grid = (u64::from(nchunks) * 8).div_ceil(u64::from(THREADS)).max(1);
        let grid = u32::try_from(grid)
            .map_err(|_| DmaError::Invalid(format!("{nchunks} chunks exceed a CUDA grid")))?;
        // SAFETY: matches `orbitkv_xxh3_fold_uniform(u64, u32, u64*, u32*, u64*)`, eight
        // threads per chunk; memory per this function's contract.
        unsafe { launch(fold, stream, grid, THREADS, &mut params, "checksum uniform fold") }
    }

    /// Launches the kernel that writes a block-form save's segment and row records on the
    /// device, on `stream` (before [`ChecksumKernels::launch`] on the same stream).
    ///
    /// # Safety
    /// `l.ids` and `l.bases` must hold the ids and bases where this context's device reads
    /// them when the kernel runs, and `l.chunks`, `l.segs` and `l.row_segs` room for the
    /// records in device memory that nothing else uses until the stream passes the launch.
    pub(crate) unsafe fn launch_expand(
        &self,
        stream: &CudaStream,
        l: &ExpandLaunch,
    ) -> Result<(), DmaError> {
        const THREADS: u32 = 256;
        let (mut ids, (mut bases, mut parts)) = (l.ids, l.bases);
        let (mut stride, mut part_len, mut per_chunk, mut nchunks) =
            (l.stride, l.part_len, l.per_chunk, l.nchunks);
        let (mut chunks, mut segs, mut row_segs) = (l.chunks, l.segs, l.row_segs);
        let mut params: [*mut c_void; 10] = [
            (&raw mut ids).cast(),
            (&raw mut bases).cast(),
            (&raw mut parts).cast(),
            (&raw mut stride).cast(),
            (&raw mut part_len).cast(),
            (&raw mut per_chunk).cast(),
            (&raw mut nchunks).cast(),
            (&raw mut chunks).cast(),
            (&raw mut segs).cast(),
            (&raw mut row_segs).cast(),
        ];
        // A thread per segment or row, whichever are more: a 64 MiB job of 2 KiB pages is
        // 32,768 segments and 65,536 rows, 256 blocks; the kernel strides past the grid's cap.
        let nsegs = u64::from(l.per_chunk) * u64::from(parts) * u64::from(l.nchunks);
        let chunk_len = u64::from(l.per_chunk) * u64::from(parts) * l.part_len;
        let rows = super::checksum::rows_of(chunk_len.max(1)) * u64::from(l.nchunks);
        let grid = nsegs.max(rows).div_ceil(u64::from(THREADS)).clamp(1, 1024) as u32;
        // SAFETY: matches `orbitkv_xxh3_expand_blocks(const u64*, const u64*, u32, u64, u64,
        // u32, u32, HashChunk*, HashSeg*, u32*)`, any grid; memory per this function's
        // contract.
        unsafe { launch(self.expand, stream, grid, THREADS, &mut params, "checksum tables") }
    }

    /// Launches the two kernels on `stream`: the lane sums of every row into the scratch rows,
    /// then each chunk's lanes folded there and one checksum per chunk into `out`; the
    /// counters are zero again once the fold has finished.
    ///
    /// # Safety
    /// `chunks`, `segs` and `row_segs` must hold the tables (`checksum::write_tables`)
    /// on this context's device, `scratch` `rows` x 64 bytes of device memory, `counters` the
    /// chunks' zeroed counters in device memory and `out` `nchunks` x 8 bytes the device can
    /// write (device memory, or pinned host memory at its address under unified addressing),
    /// nothing else using any of them until the stream passes the launch, and every segment
    /// must name device memory that stays valid until then.
    pub(crate) unsafe fn launch(
        &self,
        stream: &CudaStream,
        l: &ChecksumLaunch,
    ) -> Result<(), DmaError> {
        const THREADS: u32 = 256;
        let (chunks, nchunks) = l.chunks;
        let (scratch, rows) = l.scratch;
        // Every run of rows and every chunk lane has its thread: a grid past CUDA's limit
        // (2^31 - 1 blocks) is refused, and the shards compute those checksums.
        let grid = |threads: u64| {
            u32::try_from(threads.div_ceil(u64::from(THREADS)))
                .ok()
                .filter(|g| *g <= i32::MAX as u32)
                .ok_or_else(|| {
                    DmaError::Invalid(format!("{threads} checksum threads exceed a CUDA grid"))
                })
        };
        let (mut c, mut n, mut s, mut rs, mut sc, mut r, mut co, mut o) =
            (chunks, nchunks, l.segs, l.row_segs, scratch, rows, l.counters, l.out);
        let mut blocks: [*mut c_void; 6] = [
            (&raw mut c).cast(),
            (&raw mut n).cast(),
            (&raw mut s).cast(),
            (&raw mut rs).cast(),
            (&raw mut sc).cast(),
            (&raw mut r).cast(),
        ];
        // Eight threads per run of rows; the kernel splits the rows evenly over the grid's
        // runs, so the grid alone sets the run length.
        let runs = rows.div_ceil(ROWS_PER_RUN);
        // SAFETY: matches `orbitkv_xxh3_row_runs(const HashChunk*, u32, const HashSeg*, const
        // u32*, u64*, u64)`, any grid; memory per this function's contract.
        unsafe {
            launch(self.rows, stream, grid(runs * 8)?, THREADS, &mut blocks, "checksum rows")?
        };
        // The fold's chains (eight per chunk) in blocks of 256 threads: a 64 MiB job of 2 MiB
        // chunks folds on one SM; the chains are latency-bound, and share it without waiting
        // for each other.
        let mut fold: [*mut c_void; 5] = [
            (&raw mut c).cast(),
            (&raw mut n).cast(),
            (&raw mut sc).cast(),
            (&raw mut co).cast(),
            (&raw mut o).cast(),
        ];
        // SAFETY: matches `orbitkv_xxh3_fold_merge(const HashChunk*, u32, u64*, u32*, u64*)`, eight
        // threads per chunk; memory per this function's contract.
        unsafe {
            launch(
                self.fold,
                stream,
                grid(u64::from(nchunks) * 8)?,
                THREADS,
                &mut fold,
                "checksum fold",
            )
        }
    }
}

// SAFETY: module and function handles are usable from any thread bound to the context.
unsafe impl Send for ChecksumKernels {}

/// Which way bytes cross the bus.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Way {
    /// GPU -> host.
    DeviceToHost,
    /// Host -> GPU.
    HostToDevice,
}

/// One asynchronous contiguous copy.
///
/// # Safety
/// Both ranges must stay valid (device memory of this context, registered or pinned host
/// memory) and untouched by anything else until `stream` passes the copy.
pub(crate) unsafe fn copy_async(
    way: Way,
    device: u64,
    host: u64,
    len: usize,
    stream: &CudaStream,
) -> Result<(), DmaError> {
    // SAFETY: forwarded from the caller.
    let status = unsafe {
        match way {
            Way::DeviceToHost => {
                sys::cuMemcpyDtoHAsync_v2(host as *mut c_void, device, len, stream.cu_stream())
            }
            Way::HostToDevice => {
                sys::cuMemcpyHtoDAsync_v2(device, host as *const c_void, len, stream.cu_stream())
            }
        }
    };
    check(if way == Way::DeviceToHost { "cuMemcpyDtoHAsync" } else { "cuMemcpyHtoDAsync" }, status)
}

/// A synchronous copy between device memory and any host memory (filling and reading back
/// tensors in benchmarks and tests; not on the data path).
pub(crate) fn copy_sync_to_device(
    device: &DeviceBuffer,
    offset: usize,
    data: &[u8],
) -> Result<(), DmaError> {
    assert!(offset + data.len() <= device.len, "copy inside the buffer");
    device.ctx.bind_to_thread().map_err(|e| driver("cuCtxSetCurrent", e))?;
    // SAFETY: the destination range lies inside the live buffer (checked); the source is a
    // borrowed slice that outlives this synchronous call.
    check("cuMemcpyHtoD", unsafe {
        sys::cuMemcpyHtoD_v2(device.ptr + offset as u64, data.as_ptr().cast(), data.len())
    })
}

/// Reads device memory into `out` synchronously (see [`copy_sync_to_device`]).
pub(crate) fn copy_sync_from_device(
    device: &DeviceBuffer,
    offset: usize,
    out: &mut [u8],
) -> Result<(), DmaError> {
    assert!(offset + out.len() <= device.len, "copy inside the buffer");
    device.ctx.bind_to_thread().map_err(|e| driver("cuCtxSetCurrent", e))?;
    // SAFETY: the source range lies inside the live buffer (checked); `out` is exclusively
    // borrowed for this synchronous call.
    check("cuMemcpyDtoH", unsafe {
        sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), device.ptr + offset as u64, out.len())
    })
}

/// Many copies in one call (`cuMemcpyBatchAsync`): the copy engines walk the list, no SM is
/// used. `dsts`, `srcs` and `sizes` have one entry per copy.
///
/// # Safety
/// As [`copy_async`] for every range.
pub(crate) unsafe fn copy_batch_async(
    dsts: &mut [u64],
    srcs: &mut [u64],
    sizes: &mut [usize],
    stream: &CudaStream,
) -> Result<(), DmaError> {
    assert!(dsts.len() == srcs.len() && srcs.len() == sizes.len(), "one entry per copy");
    if dsts.is_empty() {
        return Ok(());
    }
    let mut attrs = sys::CUmemcpyAttributes {
        srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        srcLocHint: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID,
            id: 0,
        },
        dstLocHint: sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_INVALID,
            id: 0,
        },
        flags: 0,
    };
    let mut attr_idx: usize = 0;
    let mut fail_idx: usize = usize::MAX;
    // SAFETY: the arrays have `dsts.len()` entries each and outlive the call (the driver
    // copies the descriptors before returning); one attribute applies to every copy.
    let status = unsafe {
        sys::cuMemcpyBatchAsync(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            dsts.len(),
            &raw mut attrs,
            &raw mut attr_idx,
            1,
            &raw mut fail_idx,
            stream.cu_stream(),
        )
    };
    check("cuMemcpyBatchAsync", status)
}

/// An engine allocation opened from its CUDA IPC handle; closed on drop.
pub(crate) struct IpcMapping {
    base: u64,
    ctx: Arc<CudaContext>,
}

impl IpcMapping {
    pub(crate) fn open(ctx: &Arc<CudaContext>, handle: &[u8; 64]) -> Result<Self, DmaError> {
        ctx.bind_to_thread().map_err(|e| driver("cuCtxSetCurrent", e))?;
        let mut raw = sys::CUipcMemHandle { reserved: [0; 64] };
        for (d, s) in raw.reserved.iter_mut().zip(handle) {
            *d = *s as _;
        }
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: `raw` is a 64-byte handle by value; the driver validates it and fails on
        // garbage; the mapping is owned by the returned value and closed once in drop.
        let status = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &raw mut base,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        };
        check("cuIpcOpenMemHandle", status)?;
        Ok(Self { base, ctx: Arc::clone(ctx) })
    }

    pub(crate) fn base(&self) -> u64 {
        self.base
    }

    /// Size of the allocation the handle names. Binds the mapping's context first: a mapping
    /// shared by registrations is queried from whichever thread registers next, whose current
    /// context may be another device's.
    pub(crate) fn allocation_len(&self) -> Result<u64, DmaError> {
        self.ctx.bind_to_thread().map_err(|e| driver("cuCtxSetCurrent", e))?;
        let mut start: sys::CUdeviceptr = 0;
        let mut len: usize = 0;
        // SAFETY: queries the range of a live mapping owned by self.
        let status =
            unsafe { sys::cuMemGetAddressRange_v2(&raw mut start, &raw mut len, self.base) };
        check("cuMemGetAddressRange", status)?;
        Ok(len as u64 - (self.base - start))
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: closes the mapping opened in `open`, once; owners drop it only after every
        // copy that touched it has completed.
        let status = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        if status != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?status, "cuIpcCloseMemHandle failed");
        }
    }
}

// SAFETY: a device address usable from any thread bound to the context.
unsafe impl Send for IpcMapping {}
// SAFETY: shared use only reads the address.
unsafe impl Sync for IpcMapping {}

#[cfg(test)]
mod tests {
    /// The parameters a kernel's PTX entry declares, in order (`.u64`, `.u32`, ...).
    fn entry_params(ptx: &str, name: &str) -> Vec<String> {
        let start = ptx.find(&format!(".entry {name}(")).expect("the kernel is in the PTX");
        let end = start + ptx[start..].find(')').expect("a closed parameter list");
        ptx[start..end]
            .lines()
            .filter_map(|l| {
                l.trim()
                    .strip_prefix(".param ")
                    .map(|p| p.split(' ').next().unwrap_or("").to_string())
            })
            .collect()
    }

    #[test]
    fn segment_kernel_groups_and_grids() {
        use super::CopyKernel;
        const MIB: u64 = 1 << 20;
        // A 32 MiB batch: 2 KiB pages in groups of eight, 8 KiB in pairs, 16 KiB and longer
        // one per warp.
        assert_eq!(CopyKernel::group(32 * MIB, 16384), 8);
        assert_eq!(CopyKernel::group(32 * MIB, 8192), 4);
        assert_eq!(CopyKernel::group(32 * MIB, 4096), 2);
        assert_eq!(CopyKernel::group(32 * MIB, 2048), 1);
        assert_eq!(CopyKernel::group(32 * MIB, 512), 1);
        // Tiny descriptors stay at eight; nothing divides by zero.
        assert_eq!(CopyKernel::group(4096, 64), 8);
        assert_eq!(CopyKernel::group(0, 0), 8);
        // 256 threads: 8 warps per block, one group each.
        assert_eq!(CopyKernel::grid(1, 8, 256, 4096), 1);
        assert_eq!(CopyKernel::grid(64, 8, 256, 4096), 1);
        assert_eq!(CopyKernel::grid(65, 8, 256, 4096), 2);
        assert_eq!(CopyKernel::grid(16384, 8, 256, 4096), 256);
        assert_eq!(CopyKernel::grid(512, 1, 256, 4096), 64);
        assert_eq!(CopyKernel::grid(u32::MAX, 1, 256, 4096), 4096);
        assert_eq!(CopyKernel::grid(0, 8, 256, 4096), 1);
        // The kernel's bound is the one the groups assume.
        for (name, src) in [
            ("copy_segments.cu", include_str!("../../kernels/copy_segments.cu")),
            ("copy_blocks.cu", include_str!("../../kernels/copy_blocks.cu")),
        ] {
            assert!(
                src.contains(&format!("#define MAX_GROUP {}u", super::MAX_COPY_GROUP)),
                "MAX_GROUP in {name}"
            );
        }
        // The block kernel's unit is the planner's.
        let src = include_str!("../../kernels/copy_blocks.cu");
        let unit = crate::dma::plan::BLOCK_UNIT >> 10;
        assert!(src.contains(&format!("#define UNIT ({unit}ull << 10)")), "UNIT in copy_blocks.cu");
    }

    #[test]
    fn embedded_kernels_take_the_parameters_their_launches_pass() {
        assert_eq!(
            entry_params(super::COPY_SEGMENTS_PTX, "orbitkv_copy_segments"),
            [".u64", ".u32", ".u32"]
        );
        // Five addresses and lengths, then five counts, as BlockKernel::launch passes them.
        assert_eq!(
            entry_params(super::COPY_BLOCKS_PTX, "orbitkv_copy_blocks"),
            [".u64", ".u64", ".u64", ".u64", ".u64", ".u32", ".u32", ".u32", ".u32", ".u32"]
        );
        // As launch_summed and ChecksumKernels::launch_fold_uniform pass them.
        assert_eq!(
            entry_params(super::CHUNK_CHECKSUM_PTX, "orbitkv_copy_blocks_summed"),
            [
                ".u64", ".u64", ".u64", ".u64", ".u64", ".u64", ".u64", ".u32", ".u32", ".u32",
                ".u32", ".u32", ".u32"
            ]
        );
        assert_eq!(
            entry_params(super::CHUNK_CHECKSUM_PTX, "orbitkv_xxh3_fold_uniform"),
            [".u64", ".u32", ".u64", ".u64", ".u64"]
        );
        // As ChecksumKernels::launch_expand passes them.
        assert_eq!(
            entry_params(super::CHUNK_CHECKSUM_PTX, "orbitkv_xxh3_expand_blocks"),
            [".u64", ".u64", ".u32", ".u64", ".u64", ".u32", ".u32", ".u64", ".u64", ".u64"]
        );
        // (dsts, count, src, len), as ScatterUniformKernel::launch passes them.
        assert_eq!(
            entry_params(super::SCATTER_UNIFORM_PTX, "orbitkv_scatter_uniform"),
            [".u64", ".u32", ".u64", ".u64"]
        );
    }
}
