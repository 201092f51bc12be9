//! The device: probe, context, the compiled module, memory and launches.
//!
//! Thin on purpose: raw device pointers (`u64`) are what kernels take and what the expert address
//! table holds, so buffers are plain allocations with an owner ([`DevBuf`]) and launches pass
//! arguments by value ([`Arg`]). All work goes on one compute stream in issue order.

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use cudarc::driver::CudaContext;
use cudarc::driver::result as cu;
use cudarc::driver::sys;

use crate::compile;

/// What the device is.
#[derive(Clone, Debug)]
pub struct GpuInfo {
    pub name: String,
    pub total_bytes: usize,
    pub free_bytes: usize,
    pub compute_capability: (i32, i32),
}

/// Whether the NVIDIA driver library can be loaded (checked before cudarc touches it: a missing
/// library would otherwise end the process).
pub fn driver_present() -> bool {
    // SAFETY: loading libcuda runs its initialisers only; it is unloaded at once.
    unsafe { libloading::Library::new("libcuda.so.1") }.is_ok()
}

/// Describes GPU 0, or says why there is none.
pub fn probe() -> Result<GpuInfo> {
    if !driver_present() {
        bail!("no NVIDIA driver found (libcuda.so.1 cannot be loaded): this machine has no usable GPU");
    }
    cu::init().map_err(|e| anyhow::anyhow!("the CUDA driver failed to initialise: {e}"))?;
    let n = cu::device::get_count().map_err(|e| anyhow::anyhow!("cannot count CUDA devices: {e}"))?;
    if n == 0 {
        bail!("the NVIDIA driver reports no CUDA device");
    }
    let ctx = CudaContext::new(0).map_err(|e| anyhow::anyhow!("cannot create a context on GPU 0: {e}"))?;
    let (free, total) = cu::mem_get_info().map_err(|e| anyhow::anyhow!("cannot read GPU memory: {e}"))?;
    Ok(GpuInfo {
        name: ctx.name().unwrap_or_else(|_| "unknown GPU".into()),
        total_bytes: total,
        free_bytes: free,
        compute_capability: ctx.compute_capability().map_err(|e| anyhow::anyhow!("{e}"))?,
    })
}

fn gib(b: usize) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// A device allocation; freed on drop (unless it is a view of another: [`DevBuf::view`]).
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    ctx: Arc<CudaContext>,
    owned: bool,
}

impl DevBuf {
    /// Address `off` bytes in.
    pub fn at(&self, off: usize) -> u64 {
        self.ptr + off as u64
    }

    /// `bytes` bytes of this allocation from `off`, as a buffer that frees nothing: the caller
    /// keeps this one alive as long as the view (a verifying pass's rows share one allocation).
    pub fn view(&self, off: usize, bytes: usize) -> Result<DevBuf> {
        if off.checked_add(bytes).is_none_or(|end| end > self.bytes) {
            bail!("a view of {bytes} bytes at {off} does not fit an allocation of {} bytes", self.bytes);
        }
        Ok(DevBuf { ptr: self.ptr + off as u64, bytes, ctx: self.ctx.clone(), owned: false })
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.owned && self.ptr != 0 {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: ptr came from cuMemAlloc in this context and is freed once.
            unsafe {
                let _ = cu::free_sync(self.ptr);
            }
        }
    }
}

/// Rows per block for a kernel that stages its input: one row per warp (8 per block of 256 threads)
/// while that leaves fewer than about 4 blocks per multiprocessor, more as matrices grow (up to 64),
/// so staging stays small next to the weights without starving the GPU of blocks.
pub fn rows_per_block(rows: usize, blocks_wanted: usize) -> usize {
    (rows / blocks_wanted.max(1)).clamp(8, 64)
}

/// Blocks that fill an H200-class GPU a few times over (132 multiprocessors).
pub const BLOCKS_WANTED: usize = 528;

/// Largest input vector (bytes) a kernel stages in shared memory.
pub const MAX_STAGED_X: usize = 160 << 10;

/// Bytes of the zeroed scratch the split matvecs use (`matvec_many` in linear.cu: 64 floats of
/// counters, then 4 parts of 16384 partial sums, then 4 parts of 32 slices' sums of squares).
pub const SPLIT_SCRATCH_BYTES: usize = (64 + 4 * 16384 + 4 * 32) * 4;

/// A kernel argument, passed by value.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    Ptr(u64),
    U64(u64),
    I32(i32),
    F32(f32),
}

thread_local! {
    /// Whether this thread's kernel launches go to the side stream ([`Gpu::on_side`]).
    static ON_SIDE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// Whether this thread is capturing the compute stream into a graph ([`Gpu::capture`]).
    static CAPTURING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The split matvecs' scratch for this thread's launches where not the GPU's own
    /// ([`Gpu::with_split_scratch`]; 0: the GPU's).
    static SPLIT_AT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    /// The rows this thread's launches serve and the bytes between two rows' vectors
    /// ([`Gpu::with_rows`]; 1 row: a plain launch).
    static ROWS: std::cell::Cell<(u32, u64)> = const { std::cell::Cell::new((1, 0)) };
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: sys::CUstream,
    /// A second compute stream for work that may run beside the compute stream's (see
    /// [`Gpu::fork`]), and the events that fork it from and join it to the compute stream.
    side: sys::CUstream,
    fork_ev: sys::CUevent,
    join_ev: sys::CUevent,
    pub info: GpuInfo,
    funcs: HashMap<&'static str, sys::CUfunction>,
    _module: sys::CUmodule,
    /// Whether kernels are launched with programmatic stream serialization (compute capability 9.0
    /// and newer, unless `CHERENKOV_NO_PDL` is set): a kernel's blocks may be scheduled while the
    /// previous kernel runs, and wait for it in `grid_wait` (common.cuh).
    pub pdl: bool,
    /// Zeroed scratch of the split matvecs ([`SPLIT_SCRATCH_BYTES`]): their counters are back to
    /// zero after every launch, and launches on the one compute stream never overlap.
    split_scratch: DevBuf,
    /// Kernels launched twice in a row (`CHERENKOV_TWICE`, comma-separated names): a measurement
    /// of what one launch of a kernel costs where it stands in a step (replayed from a graph, with
    /// its neighbours overlapping it): the step's time with the kernel doubled, less the step's
    /// time. The second launch repeats the first's work, so results change only where a kernel
    /// updates in place (the GDN state, injections into the residual); the timing does not.
    twice: Vec<String>,
    /// The kernel timeline (`CHERENKOV_TIMELINE`), a measurement.
    pub timeline: Option<crate::timeline::Timeline>,
}

// SAFETY: the raw handles are only used with the context bound; the driver API is thread-safe.
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Opens GPU 0 and compiles the kernels for it.
    pub fn new() -> Result<Arc<Gpu>> {
        let info = probe()?;
        let ctx = CudaContext::new(0).map_err(|e| anyhow::anyhow!("cannot create a context on GPU 0: {e}"))?;
        let (maj, min) = info.compute_capability;
        let timeline = crate::timeline::Timeline::requested();
        let defines: &[&str] = if timeline.is_some() { &["TIMELINE"] } else { &[] };
        let ptx = compile::compile_with(compile::arch_name(maj, min)?, defines)?;
        let cptx = CString::new(ptx).context("PTX holds a NUL byte")?;
        // SAFETY: cptx is a NUL-terminated PTX image that outlives the call.
        let module = unsafe { cu::module::load_data(cptx.as_ptr() as *const c_void) }
            .map_err(|e| anyhow::anyhow!("the driver cannot load the compiled kernels: {e}"))?;
        let mut funcs = HashMap::new();
        for &k in compile::KERNELS {
            let name = CString::new(k).unwrap();
            // SAFETY: module is loaded; name is NUL-terminated.
            let f = unsafe { cu::module::get_function(module, name) }
                .map_err(|e| anyhow::anyhow!("kernel {k} missing from the module: {e}"))?;
            if compile::STAGES_X.contains(&k) {
                // These stage their input vector in dynamic shared memory: allow up to 160 KiB
                // (40960 floats; Hopper allows 227 KiB per block).
                // SAFETY: f is a kernel of the loaded module.
                unsafe {
                    cu::function::set_function_attribute(
                        f,
                        sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        MAX_STAGED_X as i32,
                    )
                }
                .map_err(|e| anyhow::anyhow!("cannot raise the shared-memory limit of {k}: {e}"))?;
            }
            funcs.insert(k, f);
        }
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| anyhow::anyhow!("cannot create a CUDA stream: {e}"))?;
        ctx.bind_to_thread().map_err(|e| anyhow::anyhow!("cannot bind the CUDA context: {e}"))?;
        // SAFETY: plain allocation in the bound context, zeroed before any kernel runs.
        let split_scratch = unsafe {
            let ptr = cu::malloc_sync(SPLIT_SCRATCH_BYTES)
                .map_err(|e| anyhow::anyhow!("cannot allocate the matvec scratch: {e}"))?;
            let buf = DevBuf { ptr, bytes: SPLIT_SCRATCH_BYTES, ctx: ctx.clone(), owned: true };
            cu::memset_d8_sync(ptr, 0, SPLIT_SCRATCH_BYTES).map_err(|e| anyhow::anyhow!("memset failed: {e}"))?;
            buf
        };
        let timeline = match timeline {
            Some((path, steps)) => {
                let alloc = |bytes: usize| {
                    // SAFETY: plain allocation in the bound context.
                    let ptr = unsafe { cu::malloc_sync(bytes) }
                        .map_err(|e| anyhow::anyhow!("cannot allocate the kernel timeline: {e}"))?;
                    Ok(DevBuf { ptr, bytes, ctx: ctx.clone(), owned: true })
                };
                Some(crate::timeline::Timeline::new(module, alloc, compile::KERNELS, path, steps)?)
            }
            None => None,
        };
        let pdl = maj >= 9 && std::env::var_os("CHERENKOV_NO_PDL").is_none();
        let side = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| anyhow::anyhow!("cannot create a CUDA stream: {e}"))?;
        let event = || {
            cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| anyhow::anyhow!("cannot create a CUDA event: {e}"))
        };
        let (fork_ev, join_ev) = (event()?, event()?);
        let twice = std::env::var("CHERENKOV_TWICE")
            .map(|v| v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect())
            .unwrap_or_default();
        Ok(Arc::new(Gpu {
            ctx,
            stream,
            side,
            fork_ev,
            join_ev,
            info,
            funcs,
            _module: module,
            pdl,
            split_scratch,
            twice,
            timeline,
        }))
    }

    /// The stream kernels are launched on: the compute stream, or the side stream inside
    /// [`Gpu::on_side`].
    fn launch_stream(&self) -> sys::CUstream {
        if ON_SIDE.get() { self.side } else { self.stream }
    }

    /// The split matvecs' scratch for a launch queued now by this thread: the GPU's own, or the one
    /// [`Gpu::with_split_scratch`] names.
    pub fn split_scratch_ptr(&self) -> u64 {
        match SPLIT_AT.get() {
            0 => self.split_scratch.ptr,
            at => at,
        }
    }

    /// Runs `f` with this thread's launches using the split scratch at `at` (zeroed,
    /// [`SPLIT_SCRATCH_BYTES`]) instead of the GPU's own: a verifying pass gives each row its own,
    /// at the same distance from the row's other scratch as every other buffer, so that one launch
    /// may serve both rows.
    pub fn with_split_scratch<R>(&self, at: u64, f: impl FnOnce() -> R) -> R {
        let before = SPLIT_AT.replace(at);
        let r = f();
        SPLIT_AT.set(before);
        r
    }

    /// Runs `f` with this thread's launches serving `rows` rows of a verifying pass whose vectors
    /// lie `stride` bytes apart ([`Gpu::rows`]). Inside, only launches that serve the rows (their
    /// grid's z is `rows`: the `*_rows` kernels) are accepted; any other fails, naming the kernel,
    /// so that no row is left out unnoticed.
    pub fn with_rows<R>(&self, rows: u32, stride: u64, f: impl FnOnce() -> R) -> R {
        let before = ROWS.replace((rows.max(1), stride));
        let r = f();
        ROWS.set(before);
        r
    }

    /// The rows this thread's launches serve and the bytes from one row's vectors to the next's
    /// ((1, 0) outside [`Gpu::with_rows`]).
    pub fn rows(&self) -> (u32, u64) {
        ROWS.get()
    }

    /// Forks the side stream from the compute stream: work queued by a later [`Gpu::on_side`] runs
    /// after everything queued on the compute stream so far, beside what is queued there next.
    /// Also inside a graph capture (the side stream joins the capture).
    pub fn fork(&self) -> Result<()> {
        // SAFETY: an event and streams of this context.
        unsafe {
            cu::event::record(self.fork_ev, self.stream).and_then(|()| {
                cu::stream::wait_event(self.side, self.fork_ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
            })
        }
        .map_err(|e| anyhow::anyhow!("cannot fork the side stream: {e}"))
    }

    /// Launches the kernels `work` queues on the side stream (forked by [`Gpu::fork`]); the compute
    /// stream waits for them at the next [`Gpu::join`]. Only kernel launches move: copies and
    /// events stay on the compute stream.
    pub fn on_side(&self, work: impl FnOnce() -> Result<()>) -> Result<()> {
        /// Sends launches back to the compute stream however `work` ends.
        struct Back;
        impl Drop for Back {
            fn drop(&mut self) {
                ON_SIDE.set(false);
            }
        }
        ON_SIDE.set(true);
        let back = Back;
        let done = work();
        drop(back);
        done?;
        // SAFETY: an event and a stream of this context.
        unsafe { cu::event::record(self.join_ev, self.side) }
            .map_err(|e| anyhow::anyhow!("cannot record the side stream's end: {e}"))
    }

    /// Records `ev` once the compute stream's work queued so far is done, on the side stream
    /// (forked here), so that no record sits between the compute stream's kernels: inside a graph
    /// the next kernel keeps its programmatic edge (its early launch), where a record node between
    /// them cost it about 4-5 us on the H200. A capture must [`Gpu::join`] the side stream before
    /// it ends.
    pub fn record_beside(&self, ev: &Event) -> Result<()> {
        self.fork()?;
        let flags = if CAPTURING.get() { sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32 } else { 0 };
        // SAFETY: events and the side stream of this context.
        unsafe {
            sys::cuEventRecordWithFlags(ev.raw, self.side, flags)
                .result()
                .and_then(|()| cu::event::record(self.join_ev, self.side))
        }
        .map_err(|e| anyhow::anyhow!("cannot record a CUDA event beside the compute stream: {e}"))
    }

    /// Whether this thread is capturing the compute stream into a graph ([`Gpu::capture`]).
    pub fn capturing(&self) -> bool {
        CAPTURING.get()
    }

    /// Makes the compute stream's later work wait for the side stream's ([`Gpu::on_side`]).
    pub fn join(&self) -> Result<()> {
        // SAFETY: an event and a stream of this context.
        unsafe { cu::stream::wait_event(self.stream, self.join_ev, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(|e| anyhow::anyhow!("cannot join the side stream: {e}"))
    }

    pub fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| anyhow::anyhow!("cannot bind the CUDA context: {e}"))
    }

    /// Free and total device memory now.
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        cu::mem_get_info().map_err(|e| anyhow::anyhow!("cannot read GPU memory: {e}"))
    }

    /// Allocates `bytes` (at least 1); an out-of-memory error names the sizes.
    pub fn alloc(&self, bytes: usize, what: &str) -> Result<DevBuf> {
        self.bind()?;
        // SAFETY: plain allocation in the bound context.
        match unsafe { cu::malloc_sync(bytes.max(1)) } {
            Ok(ptr) => Ok(DevBuf { ptr, bytes, ctx: self.ctx.clone(), owned: true }),
            Err(e) => {
                let (free, total) = cu::mem_get_info().unwrap_or((0, 0));
                bail!(
                    "cannot allocate {} for {what} on the GPU ({} free of {}): {e}",
                    gib(bytes),
                    gib(free),
                    gib(total)
                )
            }
        }
    }

    /// Allocates and zeroes.
    pub fn zeros(&self, bytes: usize, what: &str) -> Result<DevBuf> {
        let b = self.alloc(bytes, what)?;
        // SAFETY: b is a live allocation of `bytes` bytes.
        unsafe { cu::memset_d8_sync(b.ptr, 0, bytes.max(1)) }.map_err(|e| anyhow::anyhow!("memset failed: {e}"))?;
        Ok(b)
    }

    /// Copies host bytes to the device (ordered on the compute stream; waits for the copy).
    pub fn htod<T: Copy>(&self, dst: u64, src: &[T]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: dst has room for src (callers size buffers from the same numbers); synchronous.
        unsafe {
            cu::memcpy_htod_async(dst, src, self.stream)
                .map_err(|e| anyhow::anyhow!("host-to-device copy failed: {e}"))?;
        }
        self.sync()
    }

    /// Copies device memory to the host, after the work queued before it.
    pub fn dtoh<T: Copy>(&self, src: u64, dst: &mut [T]) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: src holds dst.len() elements; the stream is synchronised before dst is read.
        unsafe {
            cu::memcpy_dtoh_async(dst, src, self.stream)
                .map_err(|e| anyhow::anyhow!("device-to-host copy failed: {e}"))?;
        }
        self.sync()
    }

    /// Device-to-device copy on the compute stream.
    pub fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are live allocations of at least `bytes`.
        unsafe { cu::memcpy_dtod_async(dst, src, bytes, self.stream) }
            .map_err(|e| anyhow::anyhow!("device-to-device copy failed: {e}"))
    }

    /// Sets `n` u32 words `pitch` bytes apart, from `dst`, to `value`, on the compute stream (a
    /// memset node when captured).
    pub fn fill_u32_strided(&self, dst: u64, pitch: usize, value: u32, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the caller's allocation holds `n` rows of `pitch` bytes from `dst`.
        unsafe { sys::cuMemsetD2D32Async(dst, pitch, value, 1, n, self.stream) }
            .result()
            .map_err(|e| anyhow::anyhow!("device memset failed: {e}"))
    }

    pub fn sync(&self) -> Result<()> {
        // SAFETY: the stream belongs to this context.
        unsafe { cu::stream::synchronize(self.stream) }.map_err(|e| anyhow::anyhow!("a CUDA kernel failed: {e}"))
    }

    /// Launches kernel `name` on the compute stream.
    pub fn launch(&self, name: &str, grid: (u32, u32, u32), block: u32, shmem: u32, args: &[Arg]) -> Result<()> {
        self.launch_clustered(name, grid, block, shmem, args, 1)
    }

    /// [`Gpu::launch`] in thread block clusters of `cluster` blocks along x (1: none; above 1,
    /// compute capability 9.0, `cluster` at most 8 and dividing `grid.0`).
    pub fn launch_clustered(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shmem: u32,
        args: &[Arg],
        cluster: u32,
    ) -> Result<()> {
        if cluster > 8 || !grid.0.is_multiple_of(cluster) {
            bail!("{name}: clusters of {cluster} blocks for a grid of {} along x", grid.0);
        }
        let (rows, _) = ROWS.get();
        if rows > 1 && grid.2 != rows {
            bail!("{name} was launched for a verifying pass's {rows} rows, and it serves one row a launch");
        }
        let f = *self.funcs.get(name).with_context(|| format!("no kernel named {name}"))?;
        // SAFETY: f is a kernel of the loaded module, and every caller passes the arguments its
        // CUDA declaration takes; with PDL every kernel waits for its predecessor (grid_wait).
        // Clusters of at most 8 need no attribute on the kernel.
        unsafe {
            if self.twice.iter().any(|k| k == name) {
                self.launch_function_clustered(f, name, grid, block, shmem, args, self.pdl, cluster)?;
            }
            self.launch_function_clustered(f, name, grid, block, shmem, args, self.pdl, cluster)
        }
    }

    /// Launches kernel `f` (named `name` in errors) on the compute stream (the side stream inside
    /// [`Gpu::on_side`]), with programmatic stream serialization when `pdl`.
    ///
    /// # Safety
    /// `f` must be a kernel of a module loaded in this context whose parameters are `args` in order
    /// (pointers and u64 as 8 bytes, int and float as 4); with `pdl`, the kernel must wait for its
    /// predecessor (`griddepcontrol.wait`) before it reads what earlier work writes.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_function(
        &self,
        f: sys::CUfunction,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shmem: u32,
        args: &[Arg],
        pdl: bool,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.launch_function_clustered(f, name, grid, block, shmem, args, pdl, 1) }
    }

    /// [`Gpu::launch_function`] in thread block clusters of `cluster` blocks along x (1: none;
    /// compute capability 9.0, and `cluster` divides `grid.0`).
    ///
    /// # Safety
    /// As [`Gpu::launch_function`]; with `cluster` above 8 the kernel must allow that
    /// cluster size (`CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED`).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_function_clustered(
        &self,
        f: sys::CUfunction,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shmem: u32,
        args: &[Arg],
        pdl: bool,
        cluster: u32,
    ) -> Result<()> {
        let mut vals: Vec<[u8; 8]> = args
            .iter()
            .map(|a| {
                let mut v = [0u8; 8];
                match *a {
                    Arg::Ptr(p) | Arg::U64(p) => v.copy_from_slice(&p.to_ne_bytes()),
                    Arg::I32(i) => v[..4].copy_from_slice(&i.to_ne_bytes()),
                    Arg::F32(x) => v[..4].copy_from_slice(&x.to_ne_bytes()),
                }
                v
            })
            .collect();
        let mut ptrs: Vec<*mut c_void> = vals.iter_mut().map(|v| v.as_mut_ptr() as *mut c_void).collect();
        if !pdl && cluster <= 1 {
            // SAFETY: f is a kernel of a loaded module (the caller's contract); every argument is
            // passed by value with the size the kernel declares (8 bytes for pointers/u64, 4 for
            // int/float; the kernel reads only the first 4 bytes of those).
            return unsafe { cu::launch_kernel(f, grid, (block, 1, 1), shmem, self.launch_stream(), &mut ptrs) }
                .map_err(|e| anyhow::anyhow!("launch of {name} failed: {e}"));
        }
        // SAFETY: zeroed attributes are valid values of this plain C struct.
        let mut attrs: [sys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        if pdl {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if cluster > 1 {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim.x = cluster;
            attrs[n].value.clusterDim.y = 1;
            attrs[n].value.clusterDim.z = 1;
            n += 1;
        }
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shmem,
            hStream: self.launch_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: n as u32,
        };
        // SAFETY: as above; `config` and `attrs` outlive the call; the kernel waits for its
        // predecessor before touching memory earlier work writes (the caller's contract).
        unsafe { sys::cuLaunchKernelEx(&config, f, ptrs.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| anyhow::anyhow!("launch of {name} failed: {e}"))
    }
}

/// Page-locked host memory mapped into the device's address space: the copy engine reads and
/// writes it directly, so copies from and to it are truly asynchronous (a copy from pageable
/// memory synchronises the stream first), and kernels may read or write it over the bus.
pub struct Pinned {
    pub host: *mut u8,
    /// The same bytes as seen from the device.
    pub dev: u64,
    pub bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: plain memory; callers order host and device accesses (events or stream syncs).
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

impl Pinned {
    /// The buffer as host values of type `T` (`bytes / size_of::<T>()` of them).
    ///
    /// # Safety
    /// No device work may be writing these bytes while the slice lives.
    pub unsafe fn as_slice<T: Copy>(&self) -> &[T] {
        // SAFETY: the allocation holds `bytes` bytes, page aligned; the caller excludes writers.
        unsafe { std::slice::from_raw_parts(self.host as *const T, self.bytes / std::mem::size_of::<T>()) }
    }

    /// The buffer as mutable host values of type `T`.
    ///
    /// # Safety
    /// No device work may be reading or writing these bytes while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice<T: Copy>(&self) -> &mut [T] {
        // SAFETY: as above; the caller excludes every other access.
        unsafe { std::slice::from_raw_parts_mut(self.host as *mut T, self.bytes / std::mem::size_of::<T>()) }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by cuMemHostAlloc in this context, freed once.
        unsafe {
            let _ = cu::free_host(self.host as *mut c_void);
        }
    }
}

/// A CUDA event on the compute stream: a point in its work the host can wait for, and (when made
/// with timing) a clock reading.
pub struct Event {
    raw: sys::CUevent,
    ctx: Arc<CudaContext>,
}

// SAFETY: event handles are used with the context bound; the driver API is thread-safe.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    /// Waits until the work recorded before this event has finished (not the whole stream).
    pub fn wait(&self) -> Result<()> {
        // SAFETY: raw is a live event of this context.
        unsafe { cu::event::synchronize(self.raw) }.map_err(|e| anyhow::anyhow!("a CUDA kernel failed: {e}"))
    }

    /// The driver's handle (for timing against events of other streams).
    pub(crate) fn raw(&self) -> sys::CUevent {
        self.raw
    }

    /// Whether the work recorded before this event has finished (without waiting).
    pub fn done(&self) -> Result<bool> {
        // SAFETY: raw is a live event of this context.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => bail!("a CUDA kernel failed: {e:?}"),
        }
    }

    /// Milliseconds from `start` to this event (both recorded with timing and completed).
    pub fn since(&self, start: &Event) -> Result<f32> {
        // SAFETY: both are live timing events of this context.
        unsafe { cu::event::elapsed(start.raw, self.raw) }.map_err(|e| anyhow::anyhow!("cannot time CUDA events: {e}"))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: created in this context, destroyed once.
        unsafe {
            let _ = cu::event::destroy(self.raw);
        }
    }
}

impl Gpu {
    /// Allocates `bytes` of mapped, page-locked host memory (zeroed).
    pub fn pinned(&self, bytes: usize, what: &str) -> Result<Pinned> {
        self.bind()?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: plain pinned allocation in the bound context.
        let host = unsafe { cu::malloc_host(bytes.max(1), flags) }
            .map_err(|e| anyhow::anyhow!("cannot allocate {bytes} bytes of pinned host memory for {what}: {e}"))?
            as *mut u8;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: host was just allocated with DEVICEMAP in this context.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut c_void, 0) };
        let p = Pinned { host, dev, bytes: bytes.max(1), ctx: self.ctx.clone() };
        r.result().map_err(|e| anyhow::anyhow!("cannot map pinned host memory for {what} into the GPU: {e}"))?;
        // SAFETY: nothing else uses the fresh buffer.
        unsafe { p.as_mut_slice::<u8>() }.fill(0);
        Ok(p)
    }

    /// Queues a copy of `bytes` from `src` (offset `off`) to device address `dst`; returns at once.
    /// The host must not change those bytes until the stream has passed the copy.
    pub fn upload(&self, dst: u64, src: &Pinned, off: usize, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        if off + bytes > src.bytes {
            bail!("upload of {bytes} bytes at {off} overruns a pinned buffer of {}", src.bytes);
        }
        // SAFETY: the range lies inside the pinned buffer; dst has room (callers size both).
        let r = unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.host.add(off) as *const c_void, bytes, self.stream) };
        r.result().map_err(|e| anyhow::anyhow!("host-to-device copy failed: {e}"))
    }

    /// Queues a copy of `bytes` from device address `src` into `dst` (offset `off`); returns at once.
    /// The host may read those bytes once the stream has passed the copy (an event or a sync).
    pub fn download(&self, dst: &Pinned, off: usize, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        if off + bytes > dst.bytes {
            bail!("download of {bytes} bytes at {off} overruns a pinned buffer of {}", dst.bytes);
        }
        // SAFETY: the range lies inside the pinned buffer; src holds `bytes` (callers size both).
        let r = unsafe { sys::cuMemcpyDtoHAsync_v2(dst.host.add(off) as *mut c_void, src, bytes, self.stream) };
        r.result().map_err(|e| anyhow::anyhow!("device-to-host copy failed: {e}"))
    }

    /// A new event; `timing` events can also be read as clocks ([`Event::since`]).
    pub fn event(&self, timing: bool) -> Result<Event> {
        self.bind()?;
        let flags =
            if timing { sys::CUevent_flags::CU_EVENT_DEFAULT } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING };
        let raw = cu::event::create(flags).map_err(|e| anyhow::anyhow!("cannot create a CUDA event: {e}"))?;
        Ok(Event { raw, ctx: self.ctx.clone() })
    }

    /// Records `ev` at the current end of the compute stream. Inside a capture ([`Gpu::capture`])
    /// the record becomes a node of the graph, recorded at each replay when the work before it
    /// is done, so the host can wait for a point inside a replayed graph.
    pub fn record(&self, ev: &Event) -> Result<()> {
        let flags = if CAPTURING.get() { sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32 } else { 0 };
        // SAFETY: ev is a live event of this context; the stream belongs to it.
        unsafe { sys::cuEventRecordWithFlags(ev.raw, self.stream, flags) }
            .result()
            .map_err(|e| anyhow::anyhow!("cannot record a CUDA event: {e}"))
    }
}

/// A captured and instantiated sequence of the compute stream's work, replayed as one launch.
pub struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    ctx: Arc<CudaContext>,
}

// SAFETY: graph handles are used with the context bound; the driver API is thread-safe.
unsafe impl Send for Graph {}
unsafe impl Sync for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: both were created in this context and are destroyed once.
        unsafe {
            let _ = cu::graph::exec_destroy(self.exec);
            let _ = cu::graph::destroy(self.graph);
        }
    }
}

impl Gpu {
    /// Records instead of running: the work `queue` puts on the compute stream becomes a [`Graph`].
    /// Nothing in `queue` may wait for the stream or allocate. On error the capture is ended and
    /// discarded, so the stream is usable again.
    pub fn capture(&self, queue: impl FnOnce() -> Result<()>) -> Result<Graph> {
        self.bind()?;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: the stream belongs to this context and is not being captured.
        unsafe { cu::stream::begin_capture(self.stream, mode) }
            .map_err(|e| anyhow::anyhow!("cannot start capturing a CUDA graph: {e}"))?;
        CAPTURING.set(true);
        let queued = queue();
        CAPTURING.set(false);
        // SAFETY: the capture begun above, on this thread.
        let ended = unsafe { cu::stream::end_capture(self.stream) };
        let graph = match (queued, ended) {
            (Ok(()), Ok(g)) => g,
            (Err(e), ended) => {
                if let Ok(g) = ended {
                    // SAFETY: a graph the capture just returned.
                    unsafe {
                        let _ = cu::graph::destroy(g);
                    }
                }
                return Err(e.context("while capturing a CUDA graph"));
            }
            (Ok(()), Err(e)) => bail!("capturing a CUDA graph failed: {e}"),
        };
        // SAFETY: a complete graph of this context.
        match unsafe { cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
            Ok(exec) => Ok(Graph { graph, exec, ctx: self.ctx.clone() }),
            Err(e) => {
                // SAFETY: as above.
                unsafe {
                    let _ = cu::graph::destroy(graph);
                }
                bail!("cannot instantiate a CUDA graph: {e}")
            }
        }
    }

    /// Queues a replay of `graph` on the compute stream.
    pub fn replay(&self, graph: &Graph) -> Result<()> {
        // SAFETY: graph was instantiated in this context; the stream belongs to it.
        unsafe { cu::graph::launch(graph.exec, self.stream) }
            .map_err(|e| anyhow::anyhow!("cannot launch a CUDA graph: {e}"))
    }
}

/// Blocks of `threads` needed for `n` items.
pub fn blocks(n: usize, threads: usize) -> u32 {
    n.div_ceil(threads).max(1) as u32
}

/// Measured copy bandwidths, bytes per second: device memory (bytes read plus bytes written by a
/// large device-to-device copy) and pinned host to device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bandwidth {
    pub device: f64,
    pub host_to_device: f64,
}

/// Measures [`Bandwidth`] with `bytes`-sized buffers (median of several copies after a warm-up).
pub fn measure_bandwidth(gpu: &Gpu, bytes: usize) -> Result<Bandwidth> {
    let a = gpu.alloc(bytes, "the bandwidth test")?;
    let b = gpu.alloc(bytes, "the bandwidth test")?;
    gpu.bind()?;
    let time = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
        f()?;
        gpu.sync()?;
        let mut v = Vec::new();
        for _ in 0..7 {
            let t = std::time::Instant::now();
            f()?;
            gpu.sync()?;
            v.push(t.elapsed().as_secs_f64());
        }
        v.sort_by(|x, y| x.total_cmp(y));
        Ok(v[v.len() / 2])
    };
    let d = time(&|| gpu.dtod(b.ptr, a.ptr, bytes))?;
    // SAFETY: a plain pinned allocation of `bytes`, freed below.
    let host = unsafe { cu::malloc_host(bytes, 0) }.map_err(|e| anyhow::anyhow!("cannot pin {bytes} bytes: {e}"))?;
    let h = time(&|| {
        // SAFETY: host holds `bytes` pinned bytes; a holds `bytes`; the copy is waited for.
        let src = unsafe { std::slice::from_raw_parts(host as *const u8, bytes) };
        unsafe { cu::memcpy_htod_async(a.ptr, src, gpu.stream) }.map_err(|e| anyhow::anyhow!("copy failed: {e}"))
    });
    // SAFETY: allocated above, freed once.
    unsafe {
        let _ = cu::free_host(host);
    }
    Ok(Bandwidth { device: 2.0 * bytes as f64 / d, host_to_device: bytes as f64 / h? })
}
