//! `NativeClient`: one session with the local `orbitkv-server`, the `orbitkv-client` library's
//! `Client` behind a lock. Every call that can block releases the GIL. Buffers arrive as
//! Python objects with the buffer protocol, held exported for the whole call (see `raw`).

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use orbitkv_client as okv;
use pyo3::prelude::*;

use crate::arena::ArenaMapping;
use crate::errors::{invalid, to_py};
use crate::raw::{Access, Held};
use crate::types::{
    outcome_name, put_outcome_name, ChunkKey, GpuRegistration, Hit, KvLayout, Lease,
    NamespaceDescriptor, Reserved, Transfer,
};

#[pyclass(module = "orbitkv._native")]
pub(crate) struct NativeClient {
    inner: Mutex<okv::Client>,
}

fn seconds(name: &str, v: f64) -> PyResult<Duration> {
    if !v.is_finite() || v <= 0.0 || v > 86_400.0 {
        return Err(invalid(format!("{name} = {v}: seconds, above 0 and at most a day")));
    }
    Ok(Duration::from_secs_f64(v))
}

fn keys(ks: &[ChunkKey]) -> Vec<okv::ChunkKey> {
    ks.iter().map(|k| k.0).collect()
}

/// One of the client's GPU calls: save, load, start_save, start_load.
type GpuCall<T> =
    fn(&mut okv::Client, &okv::GpuRegistration, &[okv::ChunkKey], &[u64]) -> Result<T, okv::Error>;

/// A region of blocks: (buffer, block bytes, block stride).
type RegionArg<'py> = (Bound<'py, PyAny>, usize, usize);

/// How an error names region `i`.
fn region_name(i: usize) -> String {
    format!("region {i}")
}

/// The regions' buffers, held for `access`, and their block layouts.
fn regions(rs: &[RegionArg<'_>], access: Access) -> PyResult<(Vec<Held>, Vec<okv::BlockLayout>)> {
    let mut held = Vec::with_capacity(rs.len());
    let mut layouts = Vec::with_capacity(rs.len());
    for (i, (buf, block_bytes, block_stride)) in rs.iter().enumerate() {
        held.push(Held::get(buf, access, &region_name(i))?);
        layouts.push(okv::BlockLayout { block_bytes: *block_bytes, block_stride: *block_stride });
    }
    Ok((held, layouts))
}

impl NativeClient {
    fn lock(&self) -> MutexGuard<'_, okv::Client> {
        // A panic inside a call leaves the client as consistent as any failed call does.
        self.inner.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Runs one GPU save or load call (`f`) for a registration's blocks.
    fn gpu<T: Send>(
        &self,
        py: Python<'_>,
        reg: &GpuRegistration,
        ks: Vec<ChunkKey>,
        blocks: Vec<u64>,
        f: GpuCall<T>,
    ) -> PyResult<T> {
        let (r, ks) = (reg.0, keys(&ks));
        self.run(py, move |c| f(c, &r, &ks, &blocks))
    }

    /// Runs `f` on the client with the GIL released.
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut okv::Client) -> Result<T, okv::Error> + Send,
    ) -> PyResult<T> {
        py.detach(|| f(&mut self.lock())).map_err(to_py)
    }
}

#[pymethods]
impl NativeClient {
    #[new]
    #[pyo3(signature = (socket = None, name = "orbitkv-py".to_owned(), request_timeout = 10.0,
        connect = true, prefault_arena = true, reconnect_backoff = 0.05,
        reconnect_backoff_max = 2.0, copy_threads = 1, client_checksums = true,
        start_wait = 600.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        socket: Option<std::path::PathBuf>,
        name: String,
        request_timeout: f64,
        connect: bool,
        prefault_arena: bool,
        reconnect_backoff: f64,
        reconnect_backoff_max: f64,
        copy_threads: usize,
        client_checksums: bool,
        start_wait: f64,
    ) -> PyResult<Self> {
        let mut opts = okv::ClientOptions::default();
        if let Some(s) = socket {
            opts.socket = s;
        }
        opts.name = name;
        opts.request_timeout = seconds("request_timeout", request_timeout)?;
        opts.prefault_arena = prefault_arena;
        opts.reconnect_backoff = seconds("reconnect_backoff", reconnect_backoff)?;
        opts.reconnect_backoff_max = seconds("reconnect_backoff_max", reconnect_backoff_max)?;
        opts.copy_threads = copy_threads;
        opts.client_checksums = client_checksums;
        // 0 is allowed here: no wait for a starting server.
        opts.start_wait =
            if start_wait == 0.0 { Duration::ZERO } else { seconds("start_wait", start_wait)? };
        let client = if connect {
            py.detach(|| okv::Client::connect(opts)).map_err(to_py)?
        } else {
            okv::Client::new(opts)
        };
        Ok(Self { inner: Mutex::new(client) })
    }

    #[getter]
    fn socket(&self) -> std::path::PathBuf {
        self.lock().options().socket.clone()
    }

    #[getter]
    fn session_id(&self) -> Option<u64> {
        self.lock().session_id()
    }

    #[getter]
    fn connection(&self) -> Option<u64> {
        self.lock().connection()
    }

    #[getter]
    fn is_connected(&self) -> bool {
        self.lock().is_connected()
    }

    #[getter]
    fn connect_attempts(&self) -> u64 {
        self.lock().connect_attempts()
    }

    #[getter]
    fn deferred_failures(&self) -> u64 {
        self.lock().deferred_failures()
    }

    fn ping(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |c| c.ping())
    }

    fn register_namespace(
        &self,
        py: Python<'_>,
        descriptor: &NamespaceDescriptor,
    ) -> PyResult<(u64, u64)> {
        let d = descriptor.0.clone();
        let info = self.run(py, move |c| c.register_namespace(&d))?;
        Ok((info.id, info.max_chunk_bytes))
    }

    fn lookup(&self, py: Python<'_>, ks: Vec<ChunkKey>) -> PyResult<Vec<Hit>> {
        let ks = keys(&ks);
        Ok(self.run(py, |c| c.lookup(&ks))?.into_iter().map(Hit::from).collect())
    }

    fn lookup_leased(&self, py: Python<'_>, ks: Vec<ChunkKey>) -> PyResult<Vec<Lease>> {
        let ks = keys(&ks);
        Ok(self.run(py, |c| c.lookup_leased(&ks))?.into_iter().map(Lease).collect())
    }

    fn lookup_group(
        &self,
        py: Python<'_>,
        ranks: Vec<Vec<ChunkKey>>,
    ) -> PyResult<(usize, Vec<usize>)> {
        let ranks: Vec<Vec<okv::ChunkKey>> = ranks.iter().map(|r| keys(r)).collect();
        let g = self.run(py, |c| {
            let views: Vec<&[okv::ChunkKey]> = ranks.iter().map(Vec::as_slice).collect();
            c.lookup_group(&views)
        })?;
        Ok((g.chunks, g.per_rank))
    }

    fn release(&self, py: Python<'_>, leases: Vec<Lease>) -> PyResult<Vec<&'static str>> {
        let ls: Vec<okv::Lease> = leases.iter().map(|l| l.0).collect();
        Ok(self.run(py, |c| c.release(&ls))?.into_iter().map(outcome_name).collect())
    }

    fn release_deferred(&self, py: Python<'_>, leases: Vec<Lease>) -> PyResult<()> {
        let ls: Vec<okv::Lease> = leases.iter().map(|l| l.0).collect();
        self.run(py, |c| c.release_deferred(&ls))
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        self.run(py, |c| c.flush())
    }

    /// Copies a leased chunk into `out` (a writable buffer of at least the chunk's length);
    /// returns the length.
    fn read_lease(&self, py: Python<'_>, lease: &Lease, out: Bound<'_, PyAny>) -> PyResult<usize> {
        let (lease, mut held) = (lease.0, Held::get(&out, Access::Write, "out")?);
        let dst = held.bytes_mut();
        self.run(py, move |c| {
            let bytes = c.chunk(&lease)?;
            if dst.len() < bytes.len() {
                return Err(okv::Error::BufferTooSmall {
                    needed: bytes.len() as u64,
                    got: dst.len(),
                });
            }
            okv::copy_chunk(&mut dst[..bytes.len()], bytes);
            Ok(bytes.len())
        })
    }

    fn get_into(
        &self,
        py: Python<'_>,
        ks: Vec<ChunkKey>,
        buffers: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<usize>> {
        let name = |i| format!("buffers[{i}]");
        let ks = keys(&ks);
        let mut held = Held::get_all(&buffers, Access::Write, name)?;
        let mut views = Held::views_mut(&mut held, name)?;
        self.run(py, move |c| c.get_into(&ks, &mut views))
    }

    fn put(
        &self,
        py: Python<'_>,
        ks: Vec<ChunkKey>,
        buffers: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<&'static str>> {
        if ks.len() != buffers.len() {
            return Err(invalid(format!("{} keys but {} values", ks.len(), buffers.len())));
        }
        let ks = keys(&ks);
        let held = Held::get_all(&buffers, Access::Read, |i| format!("value {i}"))?;
        let items: Vec<(okv::ChunkKey, &[u8])> =
            ks.iter().copied().zip(held.iter().map(Held::bytes)).collect();
        let out = self.run(py, move |c| c.put(&items))?;
        Ok(out.into_iter().map(put_outcome_name).collect())
    }

    /// Reserves slots: a `Reserved` per key, or the name of why not (`already_present`, ...).
    fn reserve(
        &self,
        py: Python<'_>,
        ks: Vec<ChunkKey>,
        lens: Vec<u64>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let ks = keys(&ks);
        let out = self.run(py, move |c| c.reserve(&ks, &lens))?;
        out.into_iter()
            .map(|r| match r {
                Ok(slot) => Ok(Py::new(py, Reserved(slot))?.into_any()),
                Err(code) => Ok(pyo3::types::PyString::new(py, code.as_str()).into_any().unbind()),
            })
            .collect()
    }

    /// Writes the bytes of `data` (a buffer) into a reservation at `offset`.
    #[pyo3(signature = (reserved, data, offset = 0))]
    fn write_reserved(
        &self,
        py: Python<'_>,
        reserved: &Reserved,
        data: Bound<'_, PyAny>,
        offset: u64,
    ) -> PyResult<()> {
        let (r, held) = (reserved.0, Held::get(&data, Access::Read, "data")?);
        let (src, len) = (held.bytes(), held.len());
        self.run(py, move |c| {
            let slot = c.slot_mut(&r)?;
            let end = offset
                .checked_add(len as u64)
                .filter(|&e| e <= slot.len() as u64)
                .ok_or_else(|| {
                    okv::Error::InvalidArgument(format!(
                        "{len} bytes at offset {offset} do not fit the {}-byte reservation",
                        slot.len()
                    ))
                })?;
            okv::copy_chunk(&mut slot[offset as usize..end as usize], src);
            Ok(())
        })
    }

    fn commit(&self, py: Python<'_>, slots: Vec<Reserved>) -> PyResult<Vec<&'static str>> {
        let rs: Vec<okv::Reserved> = slots.iter().map(|r| r.0).collect();
        Ok(self.run(py, |c| c.commit(&rs))?.into_iter().map(outcome_name).collect())
    }

    fn abort(&self, py: Python<'_>, slots: Vec<Reserved>) -> PyResult<Vec<&'static str>> {
        let rs: Vec<okv::Reserved> = slots.iter().map(|r| r.0).collect();
        Ok(self.run(py, |c| c.abort(&rs))?.into_iter().map(outcome_name).collect())
    }

    fn evict(&self, py: Python<'_>, ks: Vec<ChunkKey>) -> PyResult<Vec<&'static str>> {
        let ks = keys(&ks);
        Ok(self.run(py, |c| c.evict(&ks))?.into_iter().map(outcome_name).collect())
    }

    /// Gathers engine blocks into chunks (see `orbitkv_client::BlockLayout`).
    fn save_blocks(
        &self,
        py: Python<'_>,
        regs: Vec<RegionArg<'_>>,
        ks: Vec<ChunkKey>,
        blocks: Vec<u64>,
    ) -> PyResult<Vec<&'static str>> {
        let ((held, layouts), ks) = (regions(&regs, Access::Read)?, keys(&ks));
        let views: Vec<(&[u8], okv::BlockLayout)> =
            held.iter().map(Held::bytes).zip(layouts).collect();
        let out = self.run(py, move |c| c.save_blocks(&views, &ks, &blocks))?;
        Ok(out.into_iter().map(put_outcome_name).collect())
    }

    /// Scatters the longest present prefix of chunks into engine blocks.
    fn load_blocks(
        &self,
        py: Python<'_>,
        regs: Vec<RegionArg<'_>>,
        ks: Vec<ChunkKey>,
        blocks: Vec<u64>,
    ) -> PyResult<Vec<&'static str>> {
        let ((mut held, layouts), ks) = (regions(&regs, Access::Write)?, keys(&ks));
        let mut views: Vec<(&mut [u8], okv::BlockLayout)> =
            Held::views_mut(&mut held, region_name)?.into_iter().zip(layouts).collect();
        let out = self.run(py, move |c| c.load_blocks(&mut views, &ks, &blocks))?;
        Ok(out.into_iter().map(outcome_name).collect())
    }

    /// This connection's arena: (length, connection number, each memfd's (offset, length)
    /// in it), or None while disconnected.
    #[allow(clippy::type_complexity)]
    fn arena(&self) -> Option<(usize, u64, Vec<(u64, u64)>)> {
        let c = self.lock();
        let (_, len) = c.arena_range()?;
        Some((len, c.connection()?, c.arena_files()?))
    }

    /// The arena mapped anew by this process; connects first when disconnected.
    fn host_arena(&self, py: Python<'_>) -> PyResult<ArenaMapping> {
        Ok(ArenaMapping::host(self.run(py, |c| c.map_arena())?))
    }

    /// The arena mapped anew and registered with CUDA device `device` (the process's
    /// numbering, as torch's), for an engine's own copies; connects first when disconnected.
    fn cuda_arena(&self, py: Python<'_>, device: usize) -> PyResult<ArenaMapping> {
        let arena = self.run(py, |c| c.map_arena())?;
        ArenaMapping::cuda(py, arena, device)
    }

    /// Registers GPU KV tensors of `layout`, `tensors` as (64-byte IPC handle, offset,
    /// length).
    fn register_gpu(
        &self,
        py: Python<'_>,
        device_uuid: String,
        layout: &KvLayout,
        tensors: Vec<(Vec<u8>, u64, u64)>,
    ) -> PyResult<GpuRegistration> {
        let spec = layout.0;
        let ts = tensors
            .into_iter()
            .enumerate()
            .map(|(i, (handle, offset, len))| {
                let handle: [u8; 64] = handle.as_slice().try_into().map_err(|_| {
                    invalid(format!("tensor {i}: an IPC handle is 64 bytes, not {}", handle.len()))
                })?;
                Ok(okv::GpuTensor { handle, offset, len })
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(GpuRegistration(self.run(py, move |c| c.register_gpu(&device_uuid, spec, &ts))?))
    }

    fn unregister_gpu(&self, py: Python<'_>, reg: &GpuRegistration) -> PyResult<()> {
        let r = reg.0;
        self.run(py, move |c| c.unregister_gpu(&r))
    }

    fn save(
        &self,
        py: Python<'_>,
        reg: &GpuRegistration,
        ks: Vec<ChunkKey>,
        blocks: Vec<u64>,
    ) -> PyResult<Vec<&'static str>> {
        let out = self.gpu(py, reg, ks, blocks, okv::Client::save)?;
        Ok(out.into_iter().map(outcome_name).collect())
    }

    fn load(
        &self,
        py: Python<'_>,
        reg: &GpuRegistration,
        ks: Vec<ChunkKey>,
        blocks: Vec<u64>,
    ) -> PyResult<Vec<&'static str>> {
        let out = self.gpu(py, reg, ks, blocks, okv::Client::load)?;
        Ok(out.into_iter().map(outcome_name).collect())
    }

    fn start_save(
        &self,
        py: Python<'_>,
        reg: &GpuRegistration,
        ks: Vec<ChunkKey>,
        blocks: Vec<u64>,
    ) -> PyResult<Transfer> {
        let t = self.gpu(py, reg, ks, blocks, okv::Client::start_save)?;
        Ok(Transfer(Mutex::new(Some(t))))
    }

    fn start_load(
        &self,
        py: Python<'_>,
        reg: &GpuRegistration,
        ks: Vec<ChunkKey>,
        blocks: Vec<u64>,
    ) -> PyResult<Transfer> {
        let t = self.gpu(py, reg, ks, blocks, okv::Client::start_load)?;
        Ok(Transfer(Mutex::new(Some(t))))
    }

    /// The outcomes of a started transfer once complete, None while it runs.
    fn poll_transfer(&self, py: Python<'_>, t: &Transfer) -> PyResult<Option<Vec<&'static str>>> {
        let mut held = t.0.lock().unwrap_or_else(|p| p.into_inner());
        let transfer =
            held.take().ok_or_else(|| invalid("this transfer's outcomes were already taken"))?;
        let (transfer, out) = py.detach(|| {
            let out = self.lock().poll_transfer(&transfer);
            (transfer, out)
        });
        let out = out.map_err(to_py)?;
        if out.is_none() {
            *held = Some(transfer);
        }
        Ok(out.map(|o| o.into_iter().map(outcome_name).collect()))
    }

    /// Waits for a started transfer (up to the request timeout; after a `Timeout` it may
    /// still run: wait or poll again).
    fn wait_transfer(&self, py: Python<'_>, t: &Transfer) -> PyResult<Vec<&'static str>> {
        let mut held = t.0.lock().unwrap_or_else(|p| p.into_inner());
        let transfer =
            held.take().ok_or_else(|| invalid("this transfer's outcomes were already taken"))?;
        let (transfer, out) = py.detach(|| {
            let out = self.lock().wait_transfer(&transfer);
            (transfer, out)
        });
        match out {
            Ok(o) => Ok(o.into_iter().map(outcome_name).collect()),
            Err(e) => {
                // Not answered: the transfer stays to be waited for again.
                *held = Some(transfer);
                Err(to_py(e))
            }
        }
    }
}
