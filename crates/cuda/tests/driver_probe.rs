//! What does each driver call of a streamed MoE block's handshake cost on the host, and how fast
//! can the host and the GPU signal each other? A measurement for the design of the next handshake
//! (ignored by default; needs a GPU):
//!
//!     cargo test --release -p cherenkov-cuda --test driver_probe --no-run   # prints the binary
//!     <binary> --ignored --nocapture        (on the GPU machine, with NVRTC on LD_LIBRARY_PATH)
//!
//! A streamed block waits for its router on the host, then makes a dozen driver calls (copies,
//! table uploads, events, launches) while the GPU has little to do. The probe prints the median
//! host time of each kind of call, and three round trips: an event recorded and synchronized; a
//! kernel launched and its write to host-mapped memory seen by the host; and a host write to
//! mapped memory that a stream waits for (`cuStreamWaitValue32`), answered by a stream write
//! (`cuStreamWriteValue32`) the host sees, with no driver call between the two.

use std::ffi::{CString, c_void};
use std::time::Instant;

use cherenkov_cuda::gpu::{Arg, Gpu};
use cudarc::driver::result as cu;
use cudarc::driver::sys;

const SOURCE: &str = r#"
extern "C" __global__ void nop(int* out, int v) {
    if (out && threadIdx.x == 0 && blockIdx.x == 0) *(volatile int*)out = v;
}
"#;

fn ptx(arch: &'static str) -> String {
    let opts = cudarc::nvrtc::CompileOptions { arch: Some(arch), ..Default::default() };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).unwrap_or_else(|e| panic!("{e:?}")).to_src()
}

/// The probe's kernel compiles (so the measurement does not fail on the GPU machine for a typo).
#[test]
fn driver_probe_kernel_compiles() {
    if !cherenkov_cuda::compile::nvrtc_available() {
        eprintln!("skipped: NVRTC not found");
        return;
    }
    assert!(ptx("sm_90").contains(".entry nop("));
}

/// Median and 90th percentile of `n` timings of `f` (host microseconds).
fn time(n: usize, mut f: impl FnMut()) -> (f64, f64) {
    let mut v: Vec<f64> = (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    v.sort_by(f64::total_cmp);
    (v[n / 2], v[n * 9 / 10])
}

fn report(what: &str, (median, p90): (f64, f64)) {
    println!("{what:72} {median:8.2} us  (p90 {p90:.2})");
}

#[test]
#[ignore = "a measurement on the GPU machine; see the file's header"]
fn driver_probe() {
    let gpu = Gpu::new().unwrap();
    let (maj, min) = gpu.info.compute_capability;
    let arch = cherenkov_cuda::compile::arch_name(maj, min).unwrap();
    let cptx = CString::new(ptx(arch)).unwrap();
    gpu.bind().unwrap();
    // SAFETY: a NUL-terminated PTX image holding `nop`.
    let nop = unsafe {
        let m = cu::module::load_data(cptx.as_ptr() as *const c_void).unwrap();
        cu::module::get_function(m, CString::new("nop").unwrap()).unwrap()
    };
    let s = gpu.stream;
    let n = 2000;
    println!("# driver probe on {}: host time per call, median of {n}", gpu.info.name);
    let timing = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).unwrap();
    let plain = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).unwrap();
    // SAFETY (the calls below): events, streams and buffers of this context, sized for the copies.
    report("cuEventRecord (timing event)", time(n, || unsafe { cu::event::record(timing, s).unwrap() }));
    report("cuEventRecord (no timing)", time(n, || unsafe { cu::event::record(plain, s).unwrap() }));
    gpu.sync().unwrap();
    report("cuEventQuery (completed)", time(n, || unsafe { cu::event::query(plain).unwrap() }));
    report(
        "cuStreamWaitEvent (completed event)",
        time(n, || unsafe {
            cu::stream::wait_event(s, plain, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT).unwrap()
        }),
    );
    let small = gpu.pinned(4096, "probe").unwrap();
    let dev = gpu.zeros(3 << 20, "probe").unwrap();
    report("cuMemcpyHtoDAsync, 120 bytes from pinned memory", time(n, || gpu.upload(dev.ptr, &small, 0, 120).unwrap()));
    gpu.sync().unwrap();
    let rec = gpu.pinned(2_768_896, "probe").unwrap();
    report(
        "cuMemcpyHtoDAsync, 2.64 MiB from pinned memory (queueing only)",
        time(200, || {
            gpu.upload(dev.ptr, &rec, 0, rec.bytes).unwrap();
        }),
    );
    gpu.sync().unwrap();
    // The same from a registered read-only file mapping (a pinned expert file).
    let mut file = tempfile::tempfile().unwrap();
    std::io::Write::write_all(&mut file, &vec![7u8; 64 << 20]).unwrap();
    // SAFETY: a private temporary file nothing else writes; unregistered before the map drops.
    let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
    let reg =
        unsafe { sys::cuMemHostRegister_v2(map.as_ptr() as *mut c_void, map.len(), sys::CU_MEMHOSTREGISTER_READ_ONLY) };
    if reg == sys::CUresult::CUDA_SUCCESS {
        report(
            "cuMemcpyHtoDAsync, 2.64 MiB from a registered file mapping (queueing only)",
            time(200, || unsafe {
                cu::memcpy_htod_async(dev.ptr, &map[(4 << 20)..(4 << 20) + 2_768_896], s).unwrap();
            }),
        );
        gpu.sync().unwrap();
        unsafe { sys::cuMemHostUnregister(map.as_ptr() as *mut c_void) };
    } else {
        println!("registering a file mapping failed: {reg:?}");
    }
    let launch = |pdl: bool, out: u64, v: i32| {
        // SAFETY: `nop` takes (int*, int); one block.
        unsafe { gpu.launch_function(nop, "nop", (1, 1, 1), 32, 0, &[Arg::Ptr(out), Arg::I32(v)], pdl).unwrap() }
    };
    report("cuLaunchKernel, 1 block, no PDL", time(n, || launch(false, 0, 0)));
    gpu.sync().unwrap();
    report("cuLaunchKernel, 1 block, with PDL", time(n, || launch(true, 0, 0)));
    gpu.sync().unwrap();
    let flags = gpu.pinned(4096, "flags").unwrap();
    // SAFETY: mapped pinned memory, zeroed before use.
    let host = unsafe { flags.as_mut_slice::<u32>() };
    host.iter_mut().for_each(|v| *v = 0);
    let (flag, answer) = (flags.dev, flags.dev + 64);
    let wait_ok = unsafe { sys::cuStreamWaitValue32_v2(s, flag, 0, 0) };
    println!("cuStreamWaitValue32 on host-mapped memory: {wait_ok:?}");
    report(
        "cuStreamWriteValue32 (queueing)",
        time(n, || unsafe { sys::cuStreamWriteValue32_v2(s, answer, 0, 0).result().unwrap() }),
    );
    gpu.sync().unwrap();
    // Round trips.
    report(
        "round trip: cuEventRecord + cuEventSynchronize on an idle stream",
        time(n, || unsafe {
            cu::event::record(plain, s).unwrap();
            cu::event::synchronize(plain).unwrap();
        }),
    );
    let seen = |i: usize, v: u32| {
        // SAFETY: the device writes this word; read volatile.
        while unsafe { std::ptr::read_volatile(flags.host.add(i * 4) as *const u32) } != v {
            std::hint::spin_loop();
        }
    };
    let mut v = 0u32;
    report(
        "round trip: kernel launch, its write to mapped memory seen by the host",
        time(n, || {
            v += 1;
            launch(true, answer, v as i32);
            seen(16, v);
        }),
    );
    gpu.sync().unwrap();
    // The stream waits for the host's flag, then writes the answer; queued ahead, one per round.
    let rounds = 500;
    for r in 1..=rounds {
        // SAFETY: mapped memory of this context; flags default (wait: >=, as a 32-bit value).
        unsafe {
            sys::cuStreamWaitValue32_v2(s, flag, r, 0).result().unwrap();
            sys::cuStreamWriteValue32_v2(s, answer, 1_000_000 + r, 0).result().unwrap();
        }
    }
    let mut r = 0u32;
    report(
        "round trip: host writes a flag, the stream (queued ahead) answers",
        time(rounds as usize, || {
            r += 1;
            // SAFETY: the flag word of the mapped buffer; the device only reads it.
            unsafe { std::ptr::write_volatile(flags.host as *mut u32, r) };
            seen(16, 1_000_000 + r);
        }),
    );
    gpu.sync().unwrap();
}
